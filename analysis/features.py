"""Export a checkpoint's features of every image of a split, with their labels, for work outside the project (a
probe of one's own, a UMAP, retrieval).

    uv run python -m analysis features runs/moco_digits/checkpoints/last.ckpt --config configs/moco_digits.yaml --split val

writes OUT/features-<space>.pt (OUT: `<run>/analysis/<checkpoint>-<split>` unless `--out` says otherwise), a dict that
`torch.load` reads: `features` (N, D) float32, `labels` (N,) int64 (-1 for an unlabelled image) and `index` (N,), the
images' positions in the split, in order, plus the record of what was measured (checkpoint, config, overrides,
dataset, split, space). The images are seen under the evaluation view, the model in eval mode, in fp32. `--space
trunk` (the default) gives the features of the trunk the kNN monitor and the linear probe read (DINO's teacher, every
other method's online trunk), as they are, not normalised; `--space embedding` gives the L2-normalised projections
the method's loss compares (`embed`).
"""

from __future__ import annotations

import argparse

import torch

from analysis.loading import add_checkpoint_arguments, default_out, load_checkpoint_and_data, measured_on
from analysis.representation import eval_embeddings, eval_mode, evaluated_features, split_dataset
from datamodules.base import ContrastiveDataModule
from engine.arguments import ScriptArgumentParser
from engine.config import split_overrides
from engine.files import WriteFailed, write_atomically

__all__ = ["split_features"]

SPACES = ("trunk", "embedding")


def split_features(model, datamodule: ContrastiveDataModule, split: str = "val", space: str = "trunk") -> dict[str, torch.Tensor]:
    """`{"features", "labels", "index"}` of every image of `split`, on the CPU (module docstring)."""
    if space not in SPACES:
        raise ValueError(f"space must be one of {SPACES}, got {space!r}")
    dataset = split_dataset(datamodule, split)
    with eval_mode(model):
        if space == "trunk":
            features, labels = evaluated_features(model, datamodule, dataset)
        else:
            _, features, labels = eval_embeddings(model, datamodule, dataset)
    return {"features": features.cpu(), "labels": labels.cpu(), "index": torch.arange(len(dataset))}


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(prog="python -m analysis features", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--space", choices=SPACES, default="trunk", help="the trunk's features or the normalised projections")
    args = parser.parse_args(own)
    try:
        out = default_out(args)
        model, datamodule, checkpoint_format = load_checkpoint_and_data(args, overrides)
        exported = split_features(model, datamodule, args.split, args.space)
        record = {**measured_on(args, overrides, checkpoint_format, datamodule), "split": args.split, "space": args.space}
        path = out / f"features-{args.space}.pt"
        write_atomically(path, lambda partial: torch.save({**exported, "record": record}, partial))
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    count, dimension = exported["features"].shape
    print(f"{count} images x {dimension} features ({args.space}, {args.split}): {path}")
    return 0
