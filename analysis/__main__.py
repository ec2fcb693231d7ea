"""Analyse a pretraining checkpoint: uniformity, tolerance, entropy over negatives, local separation.

    uv run python -m analysis runs/npid_digits/checkpoints/last.ckpt --config configs/npid_digits.yaml
    uv run python -m analysis CKPT --config configs/npid_cifar10.yaml --split test --out runs/analysis/npid \\
        -- --data.init_args.root /datasets/cifar10
    uv run python -m analysis moco_v2_800ep_pretrain.pth.tar --format moco --config configs/moco_imagenet100.yaml ...

The method (class and hyperparameters, hence its temperature) comes from the checkpoint, which
`main_pretrain.py` wrote; the data (split, views, evaluation view) from the pretraining config, with
the CLI overrides given after `--`. A published checkpoint (`--format`, `interop.official`) gives the
trunk and projection head of the config's method, which must be built as the official code builds them
(overrides after `--`). Writes OUT/metrics.json, OUT/local_separation.png and OUT/negative_entropy.png,
OUT being `<run>/analysis` unless `--out` says otherwise.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from analysis.representation import analyse
from engine.cli import instantiate_config
from engine.config import split_overrides
from engine.files import read_checkpoint, write_atomically
from interop import FORMATS, load_official_encoder
from methods import PretrainMethod
from methods.checkpoints import require_method


def load_method(checkpoint_path: Path, checkpoint: dict | None = None) -> PretrainMethod:
    """The pretraining method saved in a checkpoint (read here unless given), as the class the CLI instantiated."""
    source = str(checkpoint_path)
    checkpoint = read_checkpoint(checkpoint_path, source) if checkpoint is None else checkpoint
    method_class = require_method(checkpoint, source, PretrainMethod, "analyse the checkpoint of a pretraining method (main_pretrain.py)")
    return method_class.load_from_checkpoint(checkpoint_path, map_location="cpu")


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a main_pretrain.py checkpoint, or a published one (--format)")
    parser.add_argument("--format", choices=FORMATS, help="the checkpoint's layout (default: read from its keys)")
    parser.add_argument("--config", required=True, help="the pretraining config (for the data)")
    parser.add_argument("--split", default="val", help="the DataModule split to analyse")
    parser.add_argument("--max-samples", type=int, default=2048, help="images analysed (a fixed random subset)")
    parser.add_argument("--view", help="the training view of the anchors (default: the method's first)")
    parser.add_argument("--temperature", type=float, help="of the entropy over negatives (default: the method's)")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/analysis)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(own)
    if not args.checkpoint.is_file():
        raise SystemExit(f"error: checkpoint {str(args.checkpoint)!r} is not an existing file")
    try:
        cli = instantiate_config(args.config, overrides)
        source = f"checkpoint {str(args.checkpoint)!r}"
        checkpoint = read_checkpoint(args.checkpoint, source)
        official = load_official_encoder(cli.model, checkpoint, args.format, source)  # None: a contrastlab checkpoint
        model = (cli.model if official else load_method(args.checkpoint, checkpoint)).to(args.device)
        datamodule = cli.datamodule
        report = analyse(model, datamodule, args.split, args.view, args.temperature, args.max_samples)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None

    out = args.out or args.checkpoint.resolve().parent.parent / "analysis"
    title = f"{type(model).__name__}, {Path(args.config).stem}, {args.split}"
    figures = report.write_figures(out, title=title)
    record = {"checkpoint": str(args.checkpoint), "format": official or "contrastlab", "split": args.split, "samples": len(report.positive), **report.scalars()}
    write_atomically(out / "metrics.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    print(json.dumps(record, indent=1))
    print("figures: " + ", ".join(str(path) for path in figures.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
