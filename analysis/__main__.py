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
OUT being `<run>/analysis/<checkpoint>-<split>` (e.g. `last-val`) unless `--out` says otherwise.

Four more commands take the same checkpoint, --format, --config, --split, --out and overrides:

    uv run python -m analysis embedding-map CKPT --config CONFIG   # OUT/embedding_map.png, a t-SNE map by class
    uv run python -m analysis few-shot CKPT --config CONFIG        # OUT/few_shot.json, k-shot linear probes
    uv run python -m analysis knn CKPT --config CONFIG             # OUT/knn.json, the kNN for several k and temperatures
    uv run python -m analysis features CKPT --config CONFIG        # OUT/features-trunk.pt, every image's features and label

(`python -m analysis embedding-map --help`, and so on for each.)
"""

import argparse
import json
import sys
from pathlib import Path

from analysis import embedding_map, features, few_shot, knn
from analysis.embedding_map import MAX_LEGEND_CLASSES, write_embedding_map
from analysis.loading import add_checkpoint_arguments, default_out, load_checkpoint_and_data, load_method, measured_on, non_negative_int, positive_float, positive_int
from analysis.representation import analyse
from engine.arguments import ScriptArgumentParser
from engine.config import split_overrides
from engine.files import WriteFailed, write_atomically

__all__ = ["load_method", "main"]


def embedding_map_command(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(prog="python -m analysis embedding-map", description=embedding_map.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--space", choices=("trunk", "embedding"), default="trunk", help="which embeddings to map")
    parser.add_argument("--max-samples", type=positive_int, default=2048, help="images mapped (a fixed random subset)")
    parser.add_argument("--max-classes", type=int, default=10, help=f"map the images of the first classes only (at most {MAX_LEGEND_CLASSES})")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="of the subset and of t-SNE")
    args = parser.parse_args(own)
    try:
        out = default_out(args)
        model, datamodule, _ = load_checkpoint_and_data(args, overrides)
        title = f"{type(model).__name__}, {Path(args.config).stem}, {args.split}, {args.space}"
        path = write_embedding_map(model, datamodule, out / "embedding_map.png", args.split, args.space,
                                   args.max_samples, args.max_classes, args.seed, title)
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"figure: {path}")
    return 0


COMMANDS = {"embedding-map": embedding_map_command, "features": features.main, "few-shot": few_shot.main, "knn": knn.main}


def main(argv: list[str]) -> int:
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(prog="python -m analysis", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_arguments(parser)
    parser.add_argument("--max-samples", type=positive_int, default=2048, help="images analysed (a fixed random subset)")
    parser.add_argument("--view", help="the training view of the anchors (default: the method's first)")
    parser.add_argument("--temperature", type=positive_float, help="of the entropy over negatives, > 0 (default: the method's)")
    args = parser.parse_args(own)
    try:
        out = default_out(args)
        model, datamodule, checkpoint_format = load_checkpoint_and_data(args, overrides)
        report = analyse(model, datamodule, args.split, args.view, args.temperature, args.max_samples)
        figures = report.write_figures(out, title=f"{type(model).__name__}, {Path(args.config).stem}, {args.split}")
        record = {**measured_on(args, overrides, checkpoint_format, datamodule), "split": args.split, "samples": len(report.positive),
                  "view": report.view, "temperature": report.temperature, **report.scalars()}
        write_atomically(out / "metrics.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    print(json.dumps(record, indent=1))
    print("figures: " + ", ".join(str(path) for path in figures.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
