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
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from datamodules.image_files import listing

__all__ = ["class_orders", "read_subset_list", "stratified_fraction"]


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
