"""`ImageFiles`: a dataset of image files that survives broken files.

An image that cannot be decoded is logged with its path, counted, and replaced by the next readable sample, so
one bad JPEG does not end a multi-day run; more than `max_corrupt_fraction` of the dataset unreadable is a
`TooManyUnreadableImages` error, since the dataset itself is then broken. The folder DataModules
(`datamodules.folders`) read their images through it, per image in the workers or encoded for decoding on the
device (`datamodules.encoded`).
"""

import logging
import math
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SHOWN_PATHS = 5  # how many offending paths an error message lists
UNREADABLE = (OSError, ValueError, SyntaxError)  # what PIL raises for truncated or foreign files
T = TypeVar("T")


class TooManyUnreadableImages(ValueError):
    """More of a split's images cannot be read than `data.max_corrupt_fraction` allows: the dataset is broken.
    Raised by a DataLoader worker, it reaches the training process with the worker's traceback in its message,
    whose last line is this message."""


def listing(paths: list) -> str:
    """The first few paths of a list, and how many more there are."""
    shown = ", ".join(str(path) for path in paths[:SHOWN_PATHS])
    more = len(paths) - SHOWN_PATHS
    return shown + (f" and {more} more" if more > 0 else "")


class ImageFiles(Dataset):
    """`(RGB PIL image, label)` pairs read from a list of `(path, label)`; see the module docstring for
    what happens to unreadable files. The count of unreadable files lives in shared memory, so every
    DataLoader worker adds to the same count (`corrupt_count`)."""

    def __init__(self, samples: list[tuple[str, int]], max_corrupt_fraction: float, description: str):
        if not samples:
            raise ValueError(f"{description} holds no images (extensions {', '.join(IMAGE_EXTENSIONS)})")
        self.paths = [path for path, _ in samples]
        self.labels = [label for _, label in samples]
        self.max_corrupt_fraction = max_corrupt_fraction
        self.max_corrupt = math.floor(max_corrupt_fraction * len(samples))
        self.description = description
        self.corrupt = torch.zeros(len(samples), dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def corrupt_count(self) -> int:
        return int(self.corrupt.sum())

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        found, image = self.first_readable(index, read_rgb)
        return image, self.labels[found]

    def first_readable(self, position: int, read: Callable[[str], T], among: Sequence[int] | None = None) -> tuple[int, T]:
        """`read(path)` of the sample at `position` of `among` (the samples a subset serves; default: all), or of the
        next one of them that can be read, with that sample's index: the one loop that skips, records and replaces
        unreadable files, whatever `read` makes of a file. A replacement comes from `among`: an image outside a
        labelled fraction or a long-tailed cut would join the run."""
        among = range(len(self)) if among is None else among
        for step in range(len(among)):
            candidate = among[(position + step) % len(among)]
            if not self.corrupt[candidate]:
                try:
                    return candidate, read(self.paths[candidate])
                except UNREADABLE as error:
                    self.record_corrupt(candidate, error)
        raise TooManyUnreadableImages(f"none of the {len(among)} images served of {self.description} is readable")

    def record_corrupt(self, index: int, error: Exception) -> None:
        """Mark sample `index` unreadable (skipped from now on, in every worker), log it with its path, and
        raise once more than `max_corrupt_fraction` of the dataset is unreadable."""
        self.corrupt[index] = True
        count = self.corrupt_count
        if count > self.max_corrupt:
            raise TooManyUnreadableImages(
                f"{count} of {len(self)} images of {self.description} are unreadable, more than "
                f"data.max_corrupt_fraction={self.max_corrupt_fraction} allows ({self.max_corrupt}); "
                f"the latest: {self.paths[index]} ({error})"
            )
        log.warning("unreadable image %s (%s): replaced by another readable one (%d unreadable so far)", self.paths[index], error, count)


class FilesSubset(Subset):
    """A Subset of an `ImageFiles` whose unreadable images are replaced by readable ones of the subset itself."""

    def __getitem__(self, position: int) -> tuple[Image.Image, int]:
        found, image = self.dataset.first_readable(position, read_rgb, among=self.indices)
        return image, self.dataset.labels[found]

    def __getitems__(self, positions: list[int]) -> list[tuple[Image.Image, int]]:  # what a DataLoader calls
        return [self[position] for position in positions]


def subset(dataset: Dataset, indices: Sequence[int]) -> Subset:
    """The samples `indices` of `dataset` (a labelled fraction, a long-tailed cut); of image files, a `FilesSubset`."""
    return FilesSubset(dataset, indices) if isinstance(dataset, ImageFiles) else Subset(dataset, indices)


WIDE_MODES = {"I;16": 16, "I;16L": 16, "I;16B": 16, "I;16N": 16, "I": 32}  # integer modes wider than 8 bits, their bits
# Formats of at most 16 bits per sample that PIL opens as the 32-bit mode "I": a PGM or PPM whose maxval exceeds 255
# (scaled by PIL to 0..65535), a 16-bit grey PNG in older Pillows
SIXTEEN_BITS_AS_I = ("PPM", "PNG")


def as_rgb(image: Image.Image) -> Image.Image:
    """The image as 8-bit RGB. PIL's `convert("RGB")` clips a 16-bit grey image to 255 instead of scaling it (an
    ordinary 16-bit PNG comes out nearly white); such an image is scaled to 8 bits by its bit depth first."""
    if image.mode in WIDE_MODES:
        bits = 16 if image.mode == "I" and image.format in SIXTEEN_BITS_AS_I else WIDE_MODES[image.mode]
        pixels = np.asarray(image).astype(np.int64) >> (bits - 8)
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="L")
    return image.convert("RGB")


def read_rgb(path: str) -> Image.Image:
    with Image.open(path) as image:
        return as_rgb(image)
