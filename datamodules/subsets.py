"""Labelled subsets of a training split: the published ImageNet 1% / 10% lists, and a stratified fraction of any
labelled dataset (the label fractions of semi-supervised evaluation).

- `read_subset_list`: SimCLR's `1percent.txt` / `10percent.txt` (google-research/simclr, `imagenet_subsets/`), one
  training image file name per line (`n01440764_10026.JPEG`), the subsets SimCLR, BYOL and SwAV fine-tune on. The
  names are looked up among the file names of an ImageFolder-style listing (`ImageFiles.paths`,
  `<root>/train/<wnid>/<name>`), which gives the dataset indices. The lists cannot be downloaded here: the user
  gives their path.
- `stratified_fraction`: the same share of every class, drawn from a seed.

One seed draws one random order of each class's images (`class_orders`); a subset takes the first images of each
order, so the subsets of one seed are nested (the 1% within the 10%) and the same at every call.

`LabelSubset` is the DataModules' `data.label_subset`, the labelled part of the training split that a stage trains
on (the fine-tuning configs); `labelled_subset` applies it to a training split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from torch.utils.data import Dataset, Subset

from datamodules.image_files import listing, subset

__all__ = ["LabelSubset", "class_orders", "labelled_subset", "read_subset_list", "stratified_fraction"]


@dataclass(frozen=True)
class LabelSubset:
    """The labelled images a run trains on (`data.label_subset`): either `fraction` of every class, drawn from `seed`
    (`stratified_fraction`), or the images `list_file` names (SimCLR's `1percent.txt` / `10percent.txt`, a path the
    user gives; `read_subset_list`), for datasets of image files. Checked when the DataModule is built."""

    fraction: float | None = None
    list_file: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.list_file == "None":  # jsonargparse 4.53 gives a command line's `list_file=null` here as the text 'None'
            object.__setattr__(self, "list_file", None)
        if (self.fraction is None) == (self.list_file is None):
            raise ValueError("data.label_subset needs exactly one of fraction (a share of every class) or list_file "
                             f"(a subset list such as SimCLR's 1percent.txt), got fraction={self.fraction}, list_file={self.list_file!r}")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"data.label_subset.fraction must lie in (0, 1], got {self.fraction}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"data.label_subset.seed must be in [0, 2**32), got {self.seed}")
        if self.list_file is not None and not Path(self.list_file).expanduser().is_file():
            raise ValueError(f"data.label_subset.list_file {self.list_file!r} is not an existing file "
                             "(one training image file name per line, as SimCLR's imagenet_subsets/1percent.txt)")


def labelled_subset(train: Dataset, labels: np.ndarray, spec: LabelSubset, description: str) -> Subset:
    """The images of the training split `train` (with its `labels`) that `spec` keeps. A subset list is read
    against the split's file names (`ImageFiles.paths`); a split that is not a listing of image files has none and
    is refused, naming `description`."""
    if spec.fraction is not None:
        if not (np.asarray(labels) >= 0).any():
            raise ValueError(f"data.label_subset.fraction {spec.fraction}: {description} has no labelled images (every label is -1)")
        return subset(train, stratified_fraction(labels, spec.fraction, spec.seed).tolist())
    paths = getattr(train, "paths", None)
    if paths is None:
        raise ValueError(f"data.label_subset.list_file names image files, but {description} is not a listing of image files: "
                         "give data.label_subset.fraction instead")
    return subset(train, read_subset_list(Path(spec.list_file).expanduser(), paths, description).tolist())


def class_orders(labels: np.ndarray, seed: int) -> list[np.ndarray]:
    """For each class of `labels` in increasing label order (label -1, unlabelled, left out), the indices of its
    images in a random order drawn from `seed` (one generator, one permutation per class in that order)."""
    generator = np.random.default_rng(seed)
    labels = np.asarray(labels)
    return [generator.permutation(np.flatnonzero(labels == label)) for label in np.unique(labels[labels >= 0])]


def stratified_fraction(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of `fraction` of the labelled images of every class: round(fraction * n_c) of a class of n_c
    images, and at least one, so that every class keeps a labelled image. The same for the same seed, nested over
    fractions (module docstring)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    kept = [order[: max(1, round(fraction * len(order)))] for order in class_orders(labels, seed)]
    return np.sort(np.concatenate(kept))


def read_subset_list(list_file: str | Path, paths: Sequence[str], description: str = "the training split") -> np.ndarray:
    """The indices into `paths` (a listing of image files, e.g. `ImageFiles.paths`) of the file names listed in
    `list_file`, one per line (blank lines skipped), in the order listed. A name that is not the file name of exactly
    one of `paths`, or that is listed twice, is a ValueError naming the file and the line."""
    list_file = Path(list_file)
    if not list_file.is_file():
        raise ValueError(f"subset list {str(list_file)!r} is not an existing file")
    by_name: dict[str, list[int]] = {}
    for index, path in enumerate(paths):
        by_name.setdefault(Path(path).name, []).append(index)
    indices, listed_at, missing = [], {}, []
    for number, line in enumerate(list_file.read_text().splitlines(), start=1):
        name = line.strip()
        if not name:
            continue
        if name in listed_at:
            raise ValueError(f"{list_file}:{number}: {name!r} is listed a second time (first at line {listed_at[name]})")
        listed_at[name] = number
        found = by_name.get(name, [])
        if len(found) > 1:
            raise ValueError(f"{list_file}:{number}: {name!r} is the file name of {len(found)} images of {description}: "
                             f"{listing([paths[index] for index in found])}")
        if found:
            indices.append(found[0])
        else:
            missing.append((number, name))
    if missing:
        (number, name), more = missing[0], [name for _, name in missing[1:]]
        others = f"; {len(more)} more listed names are missing too: {listing(more)}" if more else ""
        raise ValueError(f"{list_file}:{number}: {name!r} is not the file name of an image of {description} ({len(paths)} images){others}")
    if not indices:
        raise ValueError(f"subset list {str(list_file)!r} names no image")
    return np.asarray(indices, dtype=np.int64)
