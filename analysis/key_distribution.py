"""JCL's Fig. M.3: how tightly an encoder maps the augmentations of one image (JCL supplement section 5).

For each image of a fixed random subset, `views_per_image` (32 in the paper) augmentations are drawn from a
training view and embedded by the online branch in eval mode, L2-normalised. Per image:

- similarity: the mean cosine similarity over all V x V pairs of its embeddings (Fig. M.3(a));
- variance: the mean of the diagonal of their covariance (biased, 1/V) (Fig. M.3(b)).

For unit vectors both are functions of the mean embedding mu: similarity = |mu|^2 and
trace(Sigma) = 1 - |mu|^2, so variance = (1 - similarity) / D; the paper draws both. JCL's claim is that its
histograms sit at higher similarity and lower variance than MoCo v2's.

    uv run python -m analysis.key_distribution \\
        --run runs/jcl_digits/checkpoints/last.ckpt configs/jcl_digits.yaml \\
        --run runs/moco_digits/checkpoints/last.ckpt configs/moco_digits.yaml --out runs/analysis/key_distribution

Writes OUT/key_distribution.png (both histograms, one colour per run) and OUT/key_distribution.json.
Arguments after `--` are passed to every config (e.g. `--data.init_args.root ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from analysis.figures import save_figure
from analysis.loading import load_method, positive_int, usable_device
from analysis.representation import embed, eval_mode, fixed_subset, isolated_randomness
from datamodules.base import ContrastiveDataModule
from engine.arguments import ScriptArgumentParser
from engine.cli import instantiate_config
from engine.config import split_overrides
from engine.files import WriteFailed, check_folder, write_atomically

__all__ = ["augmentation_statistics", "key_distribution", "plot_key_distributions"]


def augmentation_statistics(embeddings: Tensor) -> tuple[Tensor, Tensor]:
    """(N, V, D) L2-normalised embeddings of V augmentations of N images -> per image (N,) the mean
    cosine similarity over all V x V pairs and the mean diagonal of the (1/V) covariance."""
    embeddings = embeddings.double()
    similarity = (embeddings @ embeddings.transpose(1, 2)).mean(dim=(1, 2))
    variance = embeddings.var(dim=1, unbiased=False).mean(dim=1)
    return similarity.float(), variance.float()


@torch.no_grad()
def key_distribution(
    model,
    datamodule: ContrastiveDataModule,
    split: str = "val",
    view: str | None = None,
    views_per_image: int = 32,
    max_samples: int = 2048,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Per-image (similarity, variance) of `model` (a `PretrainMethod`) on up to `max_samples` images of
    `split`, each augmented `views_per_image` times by training view `view` (default: the method's first)."""
    if views_per_image < 2:
        raise ValueError(f"views_per_image must be >= 2, got {views_per_image}")
    view, subset = fixed_subset(model, datamodule, split, view, max_samples, seed)
    with eval_mode(model), isolated_randomness(seed, model.device):
        passes = [torch.cat([embed(model, images) for images in datamodule.view_batches(subset, view, model.device)])
                  for _ in range(views_per_image)]
    return augmentation_statistics(torch.stack(passes, dim=1))


def plot_key_distributions(runs: dict[str, tuple[Tensor, Tensor]], path: str | Path, title: str = "") -> Path:
    """Fig. M.3: histograms of the per-image similarity (left) and variance (right), one colour per run."""
    figure = Figure(figsize=(10, 4), layout="constrained")
    similarity_axes, variance_axes = figure.subplots(1, 2)
    for axes, index in ((similarity_axes, 0), (variance_axes, 1)):
        values = {name: statistics[index].cpu().numpy() for name, statistics in runs.items()}
        bins = np.histogram_bin_edges(np.concatenate(list(values.values())), bins=50)  # shared, so the runs compare
        for name, run_values in values.items():
            axes.hist(run_values, bins=bins, alpha=0.5, label=name)
    similarity_axes.set(xlabel="mean cosine similarity of the augmentations of an image", ylabel="images")
    variance_axes.set(xlabel="mean diagonal of their covariance", ylabel="images")
    similarity_axes.legend(fontsize="small")
    figure.suptitle(title)
    return save_figure(figure, path)


def summary(similarity: Tensor, variance: Tensor) -> dict[str, float]:
    return {"images": len(similarity), "similarity_mean": similarity.mean().item(), "similarity_median": similarity.median().item(),
            "variance_mean": variance.mean().item(), "variance_median": variance.median().item()}


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", nargs="+", action="append", required=True, metavar="CHECKPOINT CONFIG [LABEL]",
                        help="a main_pretrain.py checkpoint, its pretraining config (for the data) and optionally the "
                        "label of its histogram; repeat to overlay")
    parser.add_argument("--split", default="val")
    parser.add_argument("--views-per-image", type=positive_int, default=32)
    parser.add_argument("--max-samples", type=positive_int, default=2048, help="images (the paper: 32,768)")
    parser.add_argument("--view", help="the training view to augment with (default: each method's first)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", type=usable_device, default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(own)
    runs, record = {}, {}
    try:
        check_folder(args.out, "--out")  # before any run is analysed
        if model_overrides := [argument for argument in overrides if argument.startswith("--model")]:  # the data's only: each method is its checkpoint's
            raise ValueError(f"{model_overrides[0]}: each run analyses the method its checkpoint was trained with; overrides set its config's data")
        for run in args.run:
            if len(run) not in (2, 3):
                raise ValueError(f"--run takes CHECKPOINT CONFIG [LABEL], got {run}")
            checkpoint, config = run[:2]
            if not Path(checkpoint).is_file():
                raise ValueError(f"checkpoint {checkpoint!r} is not an existing file")
            model = load_method(Path(checkpoint)).to(args.device)
            datamodule = instantiate_config(config, overrides).datamodule
            name = run[2] if len(run) == 3 else f"{type(model).__name__} ({Path(config).stem})"
            if name in runs:  # one histogram, one entry of the record per label
                raise ValueError(f"--run {checkpoint}: its label {name!r} is another run's too; give each run a LABEL of its own")
            runs[name] = key_distribution(model, datamodule, args.split, args.view, args.views_per_image, args.max_samples)
            record[name] = {"checkpoint": checkpoint, **summary(*runs[name])}
        figure = plot_key_distributions(runs, args.out / "key_distribution.png", f"{args.views_per_image} augmentations per image, {args.split}")
        write_atomically(args.out / "key_distribution.json", lambda partial: partial.write_text(json.dumps(record, indent=1)))
    except (ValueError, WriteFailed) as error:
        raise SystemExit(f"error: {error}") from None
    print(json.dumps(record, indent=1))
    print(f"figure: {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
