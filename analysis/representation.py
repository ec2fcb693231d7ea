"""Wang & Liu's analysis of a pretrained encoder on one split of a DataModule (uniformity, tolerance and local separation as Wang & Liu define them).

Every image of a fixed random subset is embedded twice by the online branch (trunk, projector, L2
normalisation; the 128-d output in the paper): under the evaluation view (the *targets*, the
"validation embeddings") and under one of the method's training views (the *anchors*). Target i is
anchor i's positive and the other targets are its negatives; in the paper's NPID runs the positive is
the memory-bank entry, the running average of the image's embeddings, which the deterministic
evaluation view stands in for here, so that the same analysis applies to every method.

- uniformity: -L_uniformity (t = 2) of the targets, the quantity the paper plots (higher = more uniform);
- tolerance: mean similarity of same-class targets;
- negative entropy: mean over anchors of H(r_i) at the method's temperature;
- local separation: mean over anchors of s(pos) - s(n1), and the histograms of pos, n1 ... n10.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from analysis.figures import plot_local_separation, plot_negative_entropy
from analysis.metrics import local_separation, negative_entropy, tolerance, uniformity
from datamodules.base import ContrastiveDataModule, EvalDataset

__all__ = ["RepresentationReport", "analyse"]


@dataclass
class RepresentationReport:
    positive: Tensor  # (N,) similarity of each anchor to its positive
    nearest_negatives: Tensor  # (N, 10) its similarities to the 10 nearest negatives, n1 first
    entropy: Tensor  # (N,) entropy of its softmax over the negatives
    uniformity: float  # -L_uniformity of the targets
    tolerance: float
    view: str  # the training view of the anchors, and the entropy's temperature: the numbers depend on both
    temperature: float

    def scalars(self) -> dict[str, float]:
        return {
            "uniformity": self.uniformity,
            "tolerance": self.tolerance,
            "negative_entropy": self.entropy.mean().item(),
            "local_separation": (self.positive - self.nearest_negatives[:, 0]).mean().item(),
        }

    def write_figures(self, directory: str | Path, prefix: str = "", title: str = "") -> dict[str, Path]:
        """Write `<prefix>local_separation.png` and `<prefix>negative_entropy.png`; return them by name."""
        directory = Path(directory)
        return {
            "local_separation": plot_local_separation(
                self.positive, self.nearest_negatives, directory / f"{prefix}local_separation.png", title
            ),
            "negative_entropy": plot_negative_entropy(self.entropy, directory / f"{prefix}negative_entropy.png", title),
        }


@contextmanager
def isolated_randomness(seed: int, device: torch.device) -> Iterator[None]:
    """Draw the analysis augmentations from their own seed and leave the training random streams
    (torch and Python's `random`, which the PIL blur uses) as they were."""
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)


def embed(model, images: Tensor) -> Tensor:
    """The L2-normalised projections of `images`, in fp32; of a view of several crops per image (`count: N`, SupCon's
    and TCL's two, JCL's keys), of its first crop, as the collapse monitor takes it."""
    return model.embed(first_crops(images).to(model.device))[1].float()


def first_crops(images: Tensor) -> Tensor:
    """(B, C, H, W) of a batch of one view: its first crop where the view draws several per image, (B, N, C, H, W)."""
    return images[:, 0] if images.ndim == 5 else images


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode (BatchNorm statistics used, not updated), then back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def eval_batches(datamodule: ContrastiveDataModule, dataset: Dataset) -> DataLoader:
    """`dataset` under the DataModule's evaluation view, in batches `{"image", "label", "index"}`, in order. The
    loader has a generator of its own, so iterating it draws no number from the global one (as the DataModule's
    own loaders)."""
    return DataLoader(EvalDataset(dataset, datamodule.eval_transform), batch_size=datamodule.batch_size,
                      num_workers=datamodule.num_workers, generator=torch.Generator())


@torch.no_grad()
def eval_embeddings(model, datamodule: ContrastiveDataModule, dataset: Dataset) -> tuple[Tensor, Tensor, Tensor]:
    """Trunk features, L2-normalised projections (`embed`) and labels of `dataset` under the evaluation view, on
    the model's device in fp32 (the model's mode is the caller's: `eval_mode`)."""
    features, projections, labels = [], [], []
    for batch in eval_batches(datamodule, dataset):
        trunk, projected = model.embed(batch["image"].to(model.device))
        features.append(trunk.float())
        projections.append(projected.float())
        labels.append(batch["label"].to(model.device))
    return torch.cat(features), torch.cat(projections), torch.cat(labels)


@torch.no_grad()
def evaluated_features(model, datamodule: ContrastiveDataModule, dataset: Dataset) -> tuple[Tensor, Tensor]:
    """Features of the trunk the method's paper evaluates (`evaluated_trunk`: DINO's teacher, else the online trunk)
    and labels of `dataset` under the evaluation view, on the model's device in fp32 (the mode is the caller's)."""
    trunk = model.evaluated_trunk()
    batches = [(trunk(batch["image"].to(model.device)).float(), batch["label"].to(model.device)) for batch in eval_batches(datamodule, dataset)]
    return torch.cat([features for features, _ in batches]), torch.cat([labels for _, labels in batches])


def split_dataset(datamodule: ContrastiveDataModule, split: str) -> Dataset:
    datamodule.setup()
    if split not in datamodule.splits:
        raise ValueError(f"split {split!r} is not one of the DataModule's splits {list(datamodule.splits)}")
    return datamodule.splits[split]


def fixed_choice(candidates: Sequence[int], max_samples: int, seed: int) -> list[int]:
    """Up to `max_samples` of `candidates` drawn at random, in sorted order: the same ones at every call with
    the same seed."""
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))[:max_samples]
    return sorted(int(candidates[position]) for position in order.tolist())


def checked_view(model, datamodule: ContrastiveDataModule, view: str | None) -> str:
    """A training view of the DataModule (default: the method's first)."""
    view = view or model.views[0]
    if view not in datamodule.views:
        raise ValueError(f"view {view!r} is not among the DataModule's views {list(datamodule.views)}")
    return view


def fixed_subset(model, datamodule: ContrastiveDataModule, split: str, view: str | None, max_samples: int, seed: int) -> tuple[str, Subset]:
    """The training view to analyse (default: the method's first) and a fixed random subset of up to
    `max_samples` images of `split` (the same images at every call with the same seed)."""
    view = checked_view(model, datamodule, view)
    dataset = split_dataset(datamodule, split)
    return view, Subset(dataset, fixed_choice(range(len(dataset)), max_samples, seed))


@torch.no_grad()
def analyse(
    model,
    datamodule: ContrastiveDataModule,
    split: str = "val",
    view: str | None = None,
    temperature: float | None = None,
    max_samples: int = 2048,
    seed: int = 0,
) -> RepresentationReport:
    """Analyse `model` (a `PretrainMethod`) on up to `max_samples` images of `split`, in eval mode.

    `view` defaults to the method's first view; `temperature` (of the negative entropy) to the method's.
    """
    temperature = temperature if temperature is not None else getattr(model, "temperature", None)
    if temperature is None:
        raise ValueError(f"{type(model).__name__} has no temperature; give the analysis one")
    view, subset = fixed_subset(model, datamodule, split, view, max_samples, seed)

    with eval_mode(model), isolated_randomness(seed, model.device):
        _, targets, labels = eval_embeddings(model, datamodule, subset)
        anchors = torch.cat([embed(model, images) for images in datamodule.view_batches(subset, view, model.device)])

    positive, nearest_negatives = local_separation(anchors, targets, k=min(10, len(targets) - 1))
    return RepresentationReport(
        positive=positive,
        nearest_negatives=nearest_negatives,
        entropy=negative_entropy(anchors, targets, temperature),
        uniformity=-uniformity(targets).item(),
        tolerance=tolerance(targets, labels).item(),
        view=view,
        temperature=float(temperature),
    )
