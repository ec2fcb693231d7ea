"""Digits-M: the embedded default dataset (no download; built from data shipped in scikit-learn).

Each image is one of scikit-learn's 1,797 handwritten 8x8 digits, upscaled to a random size, given a
random colour and pasted at a random position onto a random crop of one of the two photographs that
scikit-learn ships (`china.jpg`, `flower.jpg`), in the spirit of MNIST-M, at 32x32 RGB.

Splits are drawn by source digit with a fixed permutation (seed 0): 1,197 digits for train, 300 for
val, 300 for test, so no handwritten digit appears in two splits. Each source digit is composited
`variants` times per split (different background, colour, size and position each time). Generation is
deterministic; it costs seconds of every start (a Python loop of PIL resizes), so the arrays are kept in
`<cache>/digits/` (`CONTRASTLAB_CACHE`, else `$XDG_CACHE_HOME/contrastlab`, else `~/.cache/contrastlab`) under a
key of the split, the variants, the style, the generating code and the versions of NumPy, Pillow and
scikit-learn, whose outputs they are.
"""

import hashlib
import importlib.metadata
import inspect
import os
import zipfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from datamodules.base import ContrastiveDataModule
from engine.files import write_atomically

SPLIT_SIZES = {"train": 1197, "val": 300, "test": 300}
SPLIT_SEEDS = {"train": 1, "val": 2, "test": 3}


@dataclass(frozen=True)
class DigitsStyle:
    """Difficulty knobs of the composite (defaults calibrated in benchmarks/calibrate_digits.py)."""

    image_size: int = 32
    digit_size: tuple[int, int] = (14, 26)  # side of the pasted digit, pixels
    background_crop: tuple[int, int] = (24, 96)  # side of the photo crop resized to the image, pixels
    opacity: tuple[float, float] = (0.6, 1.0)  # how strongly the digit colour covers the background
    background_gain: tuple[float, float] = (0.2, 0.6)  # per-image brightness factor of the photo crop


def source_digit_splits() -> dict[str, np.ndarray]:
    """Indices into scikit-learn's digits for each split, disjoint by construction."""
    order = np.random.default_rng(0).permutation(sum(SPLIT_SIZES.values()))
    bounds = np.cumsum([0, *SPLIT_SIZES.values()])
    return {name: order[start:stop] for name, start, stop in zip(SPLIT_SIZES, bounds[:-1], bounds[1:])}


def cache_directory() -> Path:
    """Where contrastlab keeps what it can recompute: CONTRASTLAB_CACHE, else the XDG cache directory."""
    if configured := os.environ.get("CONTRASTLAB_CACHE"):
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contrastlab"


def cache_path(split: str, variants: int, style: DigitsStyle) -> Path:
    """The file of one split: a changed style, generating code or library version is another file."""
    versions = [importlib.metadata.version(package) for package in ("numpy", "pillow", "scikit-learn")]
    key = repr((sorted(asdict(style).items()), GENERATOR_SOURCE, versions))
    return cache_directory() / "digits" / f"{split}-{variants}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"


@lru_cache(maxsize=8)  # repeated DataModules of one process (tests, sweeps) share the arrays
def composite_digits(split: str, variants: int, style: DigitsStyle = DigitsStyle()) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, H, W, 3) uint8 and labels (N,) int64 of one split, N = variants x split size, from the cache
    when it holds them (an unreadable cache file is generated again; an unwritable cache is skipped)."""
    path = cache_path(split, variants, style)
    try:
        with np.load(path) as stored:
            return stored["images"], stored["labels"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        pass
    images, labels = generate_digits(split, variants, style)
    try:
        write_atomically(path, lambda partial: save_arrays(partial, images=images, labels=labels))
    except OSError:
        pass  # a read-only home: generated again next time
    return images, labels


def save_arrays(path: Path, **arrays: np.ndarray) -> None:
    with path.open("wb") as stream:  # a file object: np.savez would append ".npz" to the partial file's name
        np.savez(stream, **arrays)


def generate_digits(split: str, variants: int, style: DigitsStyle) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of `composite_digits`, computed."""
    from sklearn.datasets import load_digits, load_sample_images

    digits = load_digits()
    photos = [np.asarray(photo) for photo in load_sample_images().images]
    sources = np.tile(source_digit_splits()[split], variants)
    rng = np.random.default_rng([SPLIT_SEEDS[split], variants])
    size = style.image_size
    images = np.empty((len(sources), size, size, 3), dtype=np.uint8)
    for position, source in enumerate(sources):
        photo = photos[rng.integers(len(photos))]
        crop = rng.integers(style.background_crop[0], style.background_crop[1] + 1)
        top = rng.integers(photo.shape[0] - crop + 1)
        left = rng.integers(photo.shape[1] - crop + 1)
        background = Image.fromarray(photo[top : top + crop, left : left + crop]).resize((size, size), Image.BILINEAR)
        gain = rng.uniform(*style.background_gain)
        side = rng.integers(style.digit_size[0], style.digit_size[1] + 1)
        stroke = Image.fromarray(np.uint8(digits.images[source] * (255 / 16))).resize((side, side), Image.BICUBIC)
        alpha = np.zeros((size, size, 1), dtype=np.float32)
        row, col = rng.integers(size - side + 1, size=2)
        alpha[row : row + side, col : col + side, 0] = np.asarray(stroke, dtype=np.float32) / 255
        alpha *= rng.uniform(*style.opacity)
        colour = rng.uniform(0, 255, size=3).astype(np.float32)
        mixed = np.asarray(background, dtype=np.float32) * gain * (1 - alpha) + colour * alpha
        images[position] = np.clip(np.rint(mixed), 0, 255).astype(np.uint8)
    return images, digits.target[sources].astype(np.int64)


GENERATOR_SOURCE = inspect.getsource(generate_digits)  # part of the cache key: changed code, other arrays


class ArrayImageDataset(Dataset):
    """`(PIL image, label)` pairs from a uint8 (N, H, W, 3) array."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[index]), int(self.labels[index])

    def uint8_images(self) -> np.ndarray:
        """All images as one array (`datamodules.base.decode_all` copies it instead of decoding each image)."""
        return self.images


class DigitsDataModule(ContrastiveDataModule):
    """Digits-M (see the module docstring): 10 classes, 32x32 RGB, no download.

    `root` is accepted for a uniform interface but not needed: the images are generated in memory.
    """

    num_classes = 10
    image_size = 32
    # Per-channel statistics of the training split (train_variants=4), see benchmarks/calibrate_digits.py.
    mean = (0.1950, 0.2033, 0.1866)
    std = (0.1783, 0.1546, 0.1607)

    def __init__(self, train_variants: int = 4, eval_variants: int = 2, **kwargs):
        """
        Args:
            train_variants: composites per source digit in the training split (1,197 digits each).
            eval_variants: composites per source digit in the val and test splits (300 digits each).
            **kwargs: the ContrastiveDataModule arguments (root, batch_size, num_workers, views, ...).
        """
        if train_variants < 1 or eval_variants < 1:
            raise ValueError(f"train_variants and eval_variants must be >= 1, got {train_variants}, {eval_variants}")
        super().__init__(**kwargs)
        self.variants = {"train": train_variants, "val": eval_variants, "test": eval_variants}

    def build_splits(self) -> dict[str, Dataset]:
        return {split: ArrayImageDataset(*composite_digits(split, count)) for split, count in self.variants.items()}
