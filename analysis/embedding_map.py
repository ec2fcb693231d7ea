"""Embedding maps: a 2-D map of the validation embeddings of a pretrained encoder, one colour per class.

The images are a fixed random subset of a split (the same at every call), restricted to its first `max_classes`
classes in label order (a legend of more colours cannot be read), under the evaluation view, embedded in eval
mode: `trunk`, the L2-normalised features of the trunk the method's paper evaluates (`evaluated_trunk`: DINO's
teacher, else the online trunk; what the linear probe and the kNN monitor see), or `embedding`, the L2-normalised
output of the online branch (projector, and predictor where the method has one). The 2-D
points are scikit-learn's t-SNE (van der Maaten & Hinton 2008; PCA initialisation, perplexity 30 or (N - 1) / 3
for small N, seeded): UMAP's package, umap-learn, is not part of the locked environment. t-SNE keeps
neighbourhoods, not distances: tight same-colour islands mean classes separate locally; the sizes of and the gaps
between islands mean little.

    uv run python -m analysis embedding-map runs/moco_digits/checkpoints/last.ckpt --config configs/moco_digits.yaml

writes OUT/embedding_map.png (OUT: `<run>/analysis/<checkpoint>-<split>` unless `--out` says otherwise); the command is in
`analysis.__main__`, so that the callbacks import no command-line code. At the end of a pretraining run the
`analysis.EmbeddingMap` callback draws the same map (`analysis.monitors`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch.nn.functional as F
from matplotlib import colormaps
from matplotlib.figure import Figure
from threadpoolctl import threadpool_limits  # a dependency of scikit-learn
from torch import Tensor
from torch.utils.data import Subset

from analysis.figures import save_figure
from analysis.representation import eval_embeddings, eval_mode, evaluated_features, fixed_choice, split_dataset
from datamodules.base import ContrastiveDataModule, dataset_labels

__all__ = ["embedding_map_figure", "map_embeddings", "tsne", "write_embedding_map"]

MAX_LEGEND_CLASSES = 20  # the colours of matplotlib's tab20, each told apart in the legend
Space = Literal["trunk", "embedding"]


def class_subset(datamodule: ContrastiveDataModule, split: str, max_samples: int, max_classes: int, seed: int) -> Subset:
    """A fixed random subset of up to `max_samples` labelled images of `split` whose label is below `max_classes`."""
    if not 1 <= max_classes <= MAX_LEGEND_CLASSES:
        raise ValueError(f"max_classes must lie in [1, {MAX_LEGEND_CLASSES}] (one legend colour each), got {max_classes}")
    dataset = split_dataset(datamodule, split)
    labels = dataset_labels(dataset)
    candidates = np.flatnonzero((labels >= 0) & (labels < max_classes))
    if len(candidates) < 2:
        raise ValueError(f"split {split!r} has {len(candidates)} labelled images of the first {max_classes} classes; a map needs 2 or more")
    return Subset(dataset, fixed_choice(candidates, max_samples, seed))


def map_embeddings(model, datamodule: ContrastiveDataModule, split: str = "val", space: Space = "trunk",
                   max_samples: int = 2048, max_classes: int = 10, seed: int = 0) -> tuple[Tensor, Tensor]:
    """The L2-normalised `space` embeddings (N, D) of the map's images (module docstring), in eval mode, and their
    labels, on the CPU."""
    if space not in ("trunk", "embedding"):
        raise ValueError(f"space must be 'trunk' or 'embedding', got {space!r}")
    subset = class_subset(datamodule, split, max_samples, max_classes, seed)
    with eval_mode(model):
        if space == "trunk":
            features, labels = evaluated_features(model, datamodule, subset)
            return F.normalize(features, dim=1).cpu(), labels.cpu()
        _, projections, labels = eval_embeddings(model, datamodule, subset)
    return projections.cpu(), labels.cpu()


def tsne(embeddings: Tensor, seed: int = 0) -> np.ndarray:
    """(N, 2) t-SNE coordinates of (N, D) embeddings (module docstring); the same for the same input and seed."""
    perplexity = min(30.0, (len(embeddings) - 1) / 3)  # scikit-learn's default, lowered below N for small maps
    # One thread: where the cores are shared, t-SNE's OpenMP threads wait on each other (600 Digits-M points took
    # 78 s on 2 threads and 7 s on 1 on this project's 2-core machine, busy with other work).
    from sklearn.manifold import TSNE  # here, not at import: 0.3 s of every run's start-up, and most runs draw no map

    with threadpool_limits(1):
        return TSNE(n_components=2, perplexity=perplexity, init="pca", learning_rate="auto", random_state=seed).fit_transform(embeddings.double().numpy())


def embedding_map_figure(points: np.ndarray, labels: Tensor, class_names: list[str], title: str = "") -> Figure:
    """A scatter of the 2-D points, one colour and one legend entry per class present (in label order)."""
    figure = Figure(figsize=(7.5, 6), layout="constrained")
    axes = figure.add_subplot()
    labels = labels.numpy()
    palette = colormaps["tab10" if len(class_names) <= 10 else "tab20"]
    for label in np.unique(labels):
        chosen = labels == label
        axes.scatter(points[chosen, 0], points[chosen, 1], s=8, color=palette(int(label)), label=class_names[label])
    axes.set(title=title, xticks=[], yticks=[])
    axes.legend(title="class", loc="center left", bbox_to_anchor=(1.0, 0.5), markerscale=2, fontsize="small")
    return figure


def class_names(datamodule: ContrastiveDataModule) -> list[str]:
    """The DataModule's class names where it has them (folders: the folder names), else the labels."""
    return [str(name) for name in getattr(datamodule, "classes", None) or range(datamodule.num_classes)]


def write_embedding_map(model, datamodule: ContrastiveDataModule, path: str | Path, split: str = "val", space: Space = "trunk",
                        max_samples: int = 2048, max_classes: int = 10, seed: int = 0, title: str = "") -> Path:
    """Embed, map and draw (module docstring); write the PNG to `path` and return it."""
    embeddings, labels = map_embeddings(model, datamodule, split, space, max_samples, max_classes, seed)
    figure = embedding_map_figure(tsne(embeddings, seed), labels, class_names(datamodule), title)
    return save_figure(figure, path)
