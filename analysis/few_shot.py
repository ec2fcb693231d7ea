"""Few-shot linear probes: k labelled training images per class and a logistic regression on frozen features.

For each number of shots k (default 1, 5 and 10) and each of `draws` seeded draws (seeds seed, seed + 1, ...),
k images per class are drawn from the labelled training images (the kNN bank where the DataModule has one, as
STL-10's labelled training set). One seed draws one random order of each class's images and every k takes its
first k, so the draws are nested (the 1-shot image is among the 5 shots of that seed) and the same for the same
seed. The features of the drawn images under the evaluation view from the trunk the method's paper evaluates (DINO's
teacher, every other method's online trunk; eval mode, L2-normalised: as the kNN monitor's) train a multinomial logistic regression (scikit-learn, L-BFGS, inverse regularisation C), which then
classifies every labelled image of the evaluation split. Per k it reports each draw's top-1, their mean and the
95% interval of the mean over the n draws, mean ± t(0.975, n - 1) · s / sqrt(n) with s the draws' sample standard
deviation (Student's t: the draws are few and their spread is estimated).

    uv run python -m analysis few-shot runs/moco_digits/checkpoints/last.ckpt --config configs/moco_digits.yaml \\
        --shots 1 5 10 --draws 5

writes OUT/few_shot.json (OUT: `<run>/analysis/<checkpoint>-<split>` unless `--out` says otherwise) and prints one line per k.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Sequence

import numpy as np
import scipy.stats
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from torch.utils.data import Subset

from analysis.loading import add_checkpoint_arguments, default_out, load_checkpoint_and_data, measured_on, non_negative_int
from analysis.representation import eval_mode, evaluated_features, split_dataset
from datamodules.base import ContrastiveDataModule, dataset_labels
from datamodules.subsets import class_orders
from engine.arguments import ScriptArgumentParser
from engine.config import split_overrides
from engine.files import WriteFailed, write_atomically

__all__ = ["draw_shots", "few_shot", "mean_interval", "probe_top1"]


def draw_shots(labels: np.ndarray, shots: Sequence[int], seed: int) -> dict[int, np.ndarray]:
    """For each k of `shots`, the sorted indices of k images of every class of `labels` (label -1, unlabelled,
    is never drawn): the first k of each class's order of `datamodules.subsets.class_orders`, so nested over k and
    the same for the same seed."""
    if not shots or min(shots) < 1:
        raise ValueError(f"shots must be one or more numbers of images per class >= 1, got {list(shots)}")
    most, orders = max(shots), class_orders(labels, seed)
    for order in orders:
        if len(order) < most:
            raise ValueError(f"class {labels[order[0]]} has {len(order)} labelled training images, fewer than the {most} shots asked for")
    return {k: np.sort(np.concatenate([order[:k] for order in orders])) for k in shots}


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The mean of `values` and the half-width of its `confidence` interval from Student's t over len(values) - 1
    degrees of freedom: t_{(1 + confidence) / 2, n - 1} * s / sqrt(n), s the sample standard deviation."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        raise ValueError(f"an interval needs 2 or more draws, got {len(values)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    quantile = scipy.stats.t.ppf((1 + confidence) / 2, df=len(values) - 1)
    return float(values.mean()), float(quantile * values.std(ddof=1) / math.sqrt(len(values)))


def probe_top1(train_features: np.ndarray, train_labels: np.ndarray, eval_features: np.ndarray, eval_labels: np.ndarray,
               regularisation: float = 1.0) -> float:
    """Top-1 on the evaluation features of a multinomial logistic regression fitted to the training features."""
    classifier = LogisticRegression(C=regularisation, max_iter=1000).fit(train_features, train_labels)
    return float((classifier.predict(eval_features) == eval_labels).mean())


def few_shot(model, datamodule: ContrastiveDataModule, shots: Sequence[int] = (1, 5, 10), draws: int = 5, seed: int = 0,
             split: str = "val", regularisation: float = 1.0) -> dict:
    """The few-shot probes of the module docstring: `{"shots": {k: {"top1": [per draw], "mean", "interval95"}}, ...}`."""
    if draws < 2:
        raise ValueError(f"draws must be >= 2 (the interval is over the draws), got {draws}")
    datamodule.setup()
    training_split = "bank" if "bank" in datamodule.splits else "train"
    training = split_dataset(datamodule, training_split)
    seeds = list(range(seed, seed + draws))
    drawn = {draw_seed: draw_shots(dataset_labels(training), shots, draw_seed) for draw_seed in seeds}
    embedded = np.unique(np.concatenate([indices for per_k in drawn.values() for indices in per_k.values()]))  # each image once
    with eval_mode(model):
        train_features = evaluated_features(model, datamodule, Subset(training, embedded.tolist()))[0]
        eval_features, eval_labels = evaluated_features(model, datamodule, split_dataset(datamodule, split))
    train_features = F.normalize(train_features, dim=1).cpu().numpy()
    train_labels = dataset_labels(training)
    labelled = (eval_labels >= 0).cpu()
    eval_features, eval_labels = F.normalize(eval_features, dim=1).cpu()[labelled].numpy(), eval_labels.cpu()[labelled].numpy()
    results = {}
    for k in shots:
        top1 = []
        for draw_seed in seeds:
            rows = np.searchsorted(embedded, drawn[draw_seed][k])
            top1.append(probe_top1(train_features[rows], train_labels[drawn[draw_seed][k]], eval_features, eval_labels, regularisation))
        mean, half_width = mean_interval(top1)
        results[k] = {"top1": top1, "mean": mean, "interval95": [mean - half_width, mean + half_width]}
    return {"training_split": training_split, "eval_split": split, "eval_images": len(eval_labels), "seeds": seeds,
            "C": regularisation, "shots": results}


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(prog="python -m analysis few-shot", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10], help="images per class (several: one probe each)")
    parser.add_argument("--draws", type=int, default=5, help="seeded draws per number of shots (>= 2)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the first draw's seed (then seed + 1, ...)")
    parser.add_argument("--C", type=float, default=1.0, dest="regularisation", help="the logistic regression's inverse regularisation")
    args = parser.parse_args(own)
    try:
        out = default_out(args)
        model, datamodule, checkpoint_format = load_checkpoint_and_data(args, overrides)
        record = {**measured_on(args, overrides, checkpoint_format, datamodule),
                  **few_shot(model, datamodule, args.shots, args.draws, args.seed, args.split, args.regularisation)}
        write_atomically(out / "few_shot.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    for k, result in record["shots"].items():
        low, high = result["interval95"]
        print(f"{k:>3}-shot top-1 {100 * result['mean']:.2f}%  95% interval [{100 * low:.2f}, {100 * high:.2f}]  over {args.draws} draws")
    print(f"written: {out / 'few_shot.json'}")
    return 0
