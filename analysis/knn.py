"""The kNN evaluation of a checkpoint for several k and temperatures at once, from one extraction of the features.

The kNN monitor's vote (NPID's weighted kNN, `methods.evaluation.knn_predict`: each of the k most similar bank images
votes for its class with weight exp(similarity / temperature)) with the monitor's bank, the labelled training images
(the `bank` split where the DataModule has one, as STL-10's labelled training set), scoring the labelled images of
the evaluation split. The features are those the monitor votes with: the trunk the method's paper evaluates (DINO's
teacher, every other method's online trunk), eval mode, the evaluation view, L2-normalised, here in fp32. The k and
temperature the monitor used are one setting of the grid: solo-learn's `main_knn.py` sweeps them the same way.

    uv run python -m analysis knn runs/moco_digits/checkpoints/last.ckpt --config configs/moco_digits.yaml \\
        --k 10 20 100 200 --temperature 0.02 0.07 0.1

writes OUT/knn.json (OUT: `<run>/analysis/<checkpoint>-<split>` unless `--out` says otherwise) and prints one line per
setting.
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

import torch.nn.functional as F

from analysis.loading import add_checkpoint_arguments, default_out, load_checkpoint_and_data, measured_on, positive_float, positive_int
from analysis.representation import eval_mode, evaluated_features, split_dataset
from datamodules.base import ContrastiveDataModule
from engine.arguments import ScriptArgumentParser
from engine.config import split_overrides
from engine.files import WriteFailed, write_atomically
from methods.evaluation import knn_predict, knn_topk_accuracy

__all__ = ["knn_grid"]


def knn_grid(model, datamodule: ContrastiveDataModule, ks: Sequence[int], temperatures: Sequence[float], split: str = "val") -> dict:
    """`{"settings": [{"k", "temperature", "top1", "top5"?}, ...], ...}` of the module docstring, in the order of `ks`
    then `temperatures`; top-5 where there are more than 5 classes, as the monitor reports it."""
    datamodule.setup()
    bank_split = "bank" if "bank" in datamodule.splits else "train"
    evaluated = split_dataset(datamodule, split)  # a misspelt split is refused before the bank is embedded
    if split == bank_split:  # each image would be its own nearest neighbour, at similarity 1
        raise ValueError(f"split {split!r} is the kNN bank itself: give an evaluation split (one of {sorted(set(datamodule.splits) - {bank_split})})")
    with eval_mode(model):
        bank, bank_labels = evaluated_features(model, datamodule, split_dataset(datamodule, bank_split))
        queries, labels = evaluated_features(model, datamodule, evaluated)
    labelled = bank_labels >= 0  # unlabelled images cannot vote
    bank, bank_labels = F.normalize(bank[labelled], dim=1), bank_labels[labelled]
    queries = F.normalize(queries, dim=1)
    tops = (1, 5) if datamodule.num_classes > 5 else (1,)
    settings = []
    for k in ks:
        for temperature in temperatures:
            scores = knn_predict(queries, bank, bank_labels, datamodule.num_classes, k, temperature)
            settings.append({"k": k, "temperature": temperature} | {f"top{top}": float(knn_topk_accuracy(scores, labels, top)) for top in tops})
    return {"bank_split": bank_split, "bank_images": len(bank_labels), "eval_split": split, "eval_images": int((labels >= 0).sum()), "settings": settings}


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(prog="python -m analysis knn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--k", type=positive_int, nargs="+", default=[10, 20, 100, 200], help="numbers of neighbours that vote")
    parser.add_argument("--temperature", type=positive_float, nargs="+", default=[0.02, 0.07, 0.1, 0.2], help="of the votes' weights")
    args = parser.parse_args(own)
    try:
        out = default_out(args)
        model, datamodule, checkpoint_format = load_checkpoint_and_data(args, overrides)
        record = {**measured_on(args, overrides, checkpoint_format, datamodule), **knn_grid(model, datamodule, args.k, args.temperature, args.split)}
        write_atomically(out / "knn.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    for setting in record["settings"]:
        top5 = f"  top-5 {100 * setting['top5']:.2f}%" if "top5" in setting else ""
        print(f"k {setting['k']:>4}  temperature {setting['temperature']:<6}  top-1 {100 * setting['top1']:.2f}%{top5}")
    print(f"written: {out / 'knn.json'}")
    return 0
