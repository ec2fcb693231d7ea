"""Image files on disk: labelled class folders, unlabelled folders, and split files.

Every folder-based dataset reads its images through `datamodules.image_files.ImageFiles`, which survives
broken files (default: up to 1% of a split unreadable, each logged and replaced). What can be checked
without decoding (the class folders, the files a split file names, the labels it gives) is checked
when the DataModule is built, so a missing folder or file is reported with its path before training.
A class without images is an error too: a label that no line of a training list gives when the
DataModule is built, an empty class folder when the folders are listed (`setup`, which the CLI runs
before anything is written).
With `data.pipeline: gpu`, images of varying sizes reach the training device as encoded files and are
decoded there (`datamodules.encoded`), under the same handling of unreadable files.
"""

import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from datamodules.base import ContrastiveDataModule
from datamodules.image_files import IMAGE_EXTENSIONS, ImageFiles, TooManyUnreadableImages, listing

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def file_size(path: str) -> int | None:
    """The size of a regular file, None where there is none."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def image_paths(folder: Path) -> list[str]:
    """Every image file under `folder` (recursively, following links), in sorted order."""
    found = []
    for directory, _, names in os.walk(folder, followlinks=True):
        found.extend(os.path.join(directory, name) for name in names if name.lower().endswith(IMAGE_EXTENSIONS))
    return sorted(found)


def missing_class_folders(split_dir: Path, classes: list[str]) -> list[Path]:
    return [split_dir / name for name in classes if not (split_dir / name).is_dir()]


def class_folder_samples(split_dir: Path, classes: list[str]) -> list[tuple[str, int]]:
    """`(path, class index)` for every image under `split_dir/<class>/`, classes in the given order."""
    return [(path, label) for label, name in enumerate(classes) for path in image_paths(split_dir / name)]


def folder_classes(train_dir: Path) -> list[str]:
    """The class names of a labelled folder: its sub-folders in sorted order (torchvision's ImageFolder), except hidden
    ones such as .ipynb_checkpoints, which ImageFolder would count as a class (the validation folders leave them out too)."""
    if not train_dir.is_dir():
        raise ValueError(f"the labelled training folder {train_dir} does not exist (expected <class>/<images> in it)")
    classes = sorted(entry.name for entry in os.scandir(train_dir) if entry.is_dir() and not entry.name.startswith("."))
    if len(classes) < 2:
        raise ValueError(f"{train_dir} must hold one folder per class (at least two), found {classes}")
    return classes


class FolderDataModule(ContrastiveDataModule):
    """Base of the DataModules that read image files (any size; resized by the views)."""

    uniform_image_size = False
    classes: list[str]  # class names, in label order

    def __init__(self, max_corrupt_fraction: float = 0.01, **kwargs):
        """
        Args:
            max_corrupt_fraction: the share of a split's images that may be unreadable (each one is
                logged and replaced by another sample); beyond it, reading fails with a ValueError.
            **kwargs: the ContrastiveDataModule arguments (root, batch_size, num_workers, views, ...).
        """
        if not 0 <= max_corrupt_fraction < 1:
            raise ValueError(f"data.max_corrupt_fraction must be in [0, 1), got {max_corrupt_fraction}")
        self.max_corrupt_fraction = max_corrupt_fraction
        super().__init__(**kwargs)

    def default_eval_view(self) -> dict[str, Any]:
        """Large-image protocol (SCE supplementary, Sec. D): resize the short side to size / 0.875 (256 for 224), center crop."""
        return {"preset": "center", "resize": round(self.image_size * 256 / 224)}

    def image_files(self, samples: list[tuple[str, int]], description: str) -> ImageFiles:
        return ImageFiles(samples, self.max_corrupt_fraction, description)

    def check_class_folders(self, split_dirs: list[Path]) -> None:
        """Every class of `self.classes` must have its folder in each split (an existence check, fast)."""
        missing = [path for split_dir in split_dirs for path in missing_class_folders(split_dir, self.classes)]
        if missing:
            raise ValueError(f"{len(missing)} class folders of {type(self).__name__} are missing: {listing(missing)}")

    def refuse_other_class_folders(self, split_dirs) -> None:
        """An evaluation folder's class folder that the training folder lacks is an error: its images would silently be
        left out of the evaluation (hidden folders such as .ipynb_checkpoints are no class)."""
        extra = sorted(Path(entry.path) for folder in dict.fromkeys(split_dirs) if folder.is_dir() for entry in os.scandir(folder)
                       if entry.is_dir() and entry.name not in self.classes and not entry.name.startswith("."))
        if extra:
            raise ValueError(f"{len(extra)} class folders are not among the training folder's classes: {listing(extra)}")

    def labelled_images(self, split_dir: Path) -> ImageFiles:
        """The images of `split_dir/<class>/` for the classes of `self.classes`; a class folder without an image is a
        ValueError naming it (a class with no training image would still be a class of the probe and the metrics)."""
        samples = class_folder_samples(split_dir, self.classes)
        found = {label for _, label in samples}
        empty = [split_dir / name for label, name in enumerate(self.classes) if label not in found]
        if empty and len(empty) < len(self.classes):  # none at all: ImageFiles names the split folder
            raise ValueError(
                f"{len(empty)} of the {len(self.classes)} class folders of {type(self).__name__} hold no image "
                f"(extensions {', '.join(IMAGE_EXTENSIONS)}): {listing(empty)}"
            )
        return self.image_files(samples, str(split_dir))


class ImageFolderDataModule(FolderDataModule):
    """A labelled image folder: `<root>/<train_dir>/<class>/*.jpg`, `<root>/<val_dir>/<class>/*.jpg` (and
    optionally a test folder; validation is reused for test otherwise). The classes are the sub-folders
    of the training folder in sorted order (torchvision's ImageFolder convention); each must also exist
    in the evaluation folders."""

    expected_layout = "train/<class>/<images> and val/<class>/<images>"

    def __init__(
        self,
        train_dir: str = "train",
        val_dir: str = "val",
        test_dir: str | None = None,
        image_size: int = 224,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        **kwargs,
    ):
        """
        Args:
            train_dir, val_dir, test_dir: the split folders under `root` (test: `val_dir` if not given).
            image_size: the side of the training and evaluation crops.
            mean, std: per-channel normalisation.
            **kwargs: the FolderDataModule arguments (root, max_corrupt_fraction, batch_size, views, ...).
        """
        self.image_size, self.mean, self.std = image_size, tuple(mean), tuple(std)
        super().__init__(**kwargs)
        self.split_dirs = {"train": self.root / train_dir, "val": self.root / val_dir, "test": self.root / (test_dir or val_dir)}
        self.classes = self.find_classes()
        self.num_classes = len(self.classes)
        self.check_class_folders(list(dict.fromkeys(self.split_dirs.values())))  # test may be val
        if not self.other_class_folders_ignored:
            self.refuse_other_class_folders([self.split_dirs["val"], self.split_dirs["test"]])  # test may be val

    other_class_folders_ignored = False  # True where the classes are a fixed list read from a larger tree (ImageNet-100)

    def find_classes(self) -> list[str]:
        return folder_classes(self.split_dirs["train"])

    def build_splits(self) -> dict[str, Dataset]:
        train, val = self.labelled_images(self.split_dirs["train"]), self.labelled_images(self.split_dirs["val"])
        test = val if self.split_dirs["test"] == self.split_dirs["val"] else self.labelled_images(self.split_dirs["test"])
        return {"train": train, "val": val, "test": test}


class UnlabeledFolderDataModule(FolderDataModule):
    """Pretraining on every image under `root` (any sub-folder structure; label -1). The kNN monitor needs
    labels: give `eval_root`, a labelled folder with `train/<class>/` (the kNN bank) and `val/<class>/`; without it
    there is nothing to validate (no validation batches) and `num_classes` is 2, the smallest the probe accepts. The
    online probe learns from the training batches' labels, so it reports nothing here (`training_labels`): probe these
    runs with the linear stage on a labelled dataset."""

    expected_layout = "image files (any sub-folders)"
    training_labels = False

    def __init__(
        self,
        eval_root: str | None = None,
        image_size: int = 224,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        **kwargs,
    ):
        """
        Args:
            eval_root: a labelled folder (`train/<class>/`, `val/<class>/`) for the kNN monitor and probe.
            image_size, mean, std: crop side and normalisation.
            **kwargs: the FolderDataModule arguments (root, max_corrupt_fraction, batch_size, views, ...).
        """
        self.image_size, self.mean, self.std = image_size, tuple(mean), tuple(std)
        super().__init__(**kwargs)
        self.eval_root = Path(eval_root).expanduser() if eval_root is not None else None
        self.classes = folder_classes(self.eval_root / "train") if self.eval_root else []
        if self.eval_root:
            self.check_class_folders([self.eval_root / "val"])
            self.refuse_other_class_folders([self.eval_root / "val"])
        self.num_classes = max(len(self.classes), 2)

    def build_splits(self) -> dict[str, Dataset]:
        train = self.image_files([(path, -1) for path in image_paths(self.root)], f"data.root {str(self.root)!r}")
        if not self.eval_root:
            return {"train": train}
        val = self.labelled_images(self.eval_root / "val")
        return {"train": train, "bank": self.labelled_images(self.eval_root / "train"), "val": val, "test": val}

    def _eval_loaders(self, split: str) -> list:
        return super()._eval_loaders(split) if self.eval_root else []


class SplitFileDataModule(FolderDataModule):
    """Images listed in split files, one `<path relative to root> <integer label>` per line (the format of
    the ImageNet-LT, iNaturalist 2018 and Places-LT lists, PaCo's dataset lists). Every line is checked
    when the DataModule is built: a label outside [0, num_classes) or a malformed line is a ValueError
    naming the file and line, images that do not exist are listed with their paths, and a class of
    [0, num_classes) without a training image is named."""

    expected_layout = "the images named in the split files, at their relative paths"

    def __init__(
        self,
        train_file: str,
        val_file: str,
        test_file: str | None = None,
        num_classes: int | None = None,
        image_size: int = 224,
        mean: tuple[float, float, float] = IMAGENET_MEAN,
        std: tuple[float, float, float] = IMAGENET_STD,
        **kwargs,
    ):
        """
        Args:
            train_file, val_file, test_file: the split files (test: `val_file` if not given).
            num_classes: the number of classes; by default the largest training label + 1.
            image_size, mean, std: crop side and normalisation.
            **kwargs: the FolderDataModule arguments (root, max_corrupt_fraction, batch_size, views, ...).
        """
        self.image_size, self.mean, self.std = image_size, tuple(mean), tuple(std)
        super().__init__(**kwargs)
        files = {"train": train_file, "val": val_file, "test": test_file or val_file}
        self.split_files = {split: Path(path).expanduser() for split, path in files.items()}
        lines = {split: self.read_split_file(split, path) for split, path in self.split_files.items()}
        self.num_classes = num_classes or max(label for _, label, _ in lines["train"]) + 1
        for split, entries in lines.items():
            for _, label, where in entries:
                if not 0 <= label < self.num_classes:
                    raise ValueError(f"{where}: label {label} is outside [0, {self.num_classes}) (data.num_classes {self.num_classes})")
        self.samples = {split: [(str(self.root / relative), label) for relative, label, _ in entries] for split, entries in lines.items()}
        sizes = {path: file_size(path) for samples in self.samples.values() for path, _ in samples}
        named_at = {str(self.root / relative): where for entries in reversed(lines.values()) for relative, _, where in reversed(entries)}  # first line naming it
        missing = [f"{path} ({named_at[path]})" for path, size in sizes.items() if size is None]
        if missing:
            raise ValueError(f"{len(missing)} images named in the split files do not exist under data.root {str(self.root)!r}: {listing(missing)}")
        for split, samples in self.samples.items():  # empty files, counted up front: the listed files are looked up anyway
            empty, limit = [path for path, _ in samples if sizes[path] == 0], math.floor(self.max_corrupt_fraction * len(samples))
            if len(empty) > limit:
                raise TooManyUnreadableImages(
                    f"{len(empty)} of {len(samples)} images of {self.split_files[split]} are empty files, more than "
                    f"data.max_corrupt_fraction={self.max_corrupt_fraction} allows ({limit}): {listing(empty)}"
                )
        without_images = sorted(set(range(self.num_classes)) - {label for _, label in self.samples["train"]})
        if without_images:  # a class of the probe and the metrics that training never sees
            raise ValueError(
                f"data.train_file {str(self.split_files['train'])!r} has images of {self.num_classes - len(without_images)} classes, but "
                f"data.num_classes is {self.num_classes}: every class needs training images, none of label {listing(without_images)}"
            )

    @staticmethod
    def read_split_file(split: str, path: Path) -> list[tuple[str, int, str]]:
        """`(relative path, label, "file:line")` for every non-empty line."""
        if not path.is_file():
            raise ValueError(f"data.{split}_file {str(path)!r} is not an existing file")
        entries, first_named = [], {}
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            fields = line.rsplit(maxsplit=1)
            where = f"{path}:{number}"
            if len(fields) != 2 or not re.fullmatch(r"-?[0-9]+", fields[1]):
                raise ValueError(f"{where}: expected '<relative path> <integer label>', got {line!r}")
            if fields[0] in first_named:  # seen twice an epoch, or under two labels
                raise ValueError(f"{where}: {fields[0]} is listed again (first at line {first_named[fields[0]]})")
            first_named[fields[0]] = number
            entries.append((fields[0], int(fields[1]), where))
        if not entries:
            raise ValueError(f"data.{split}_file {str(path)!r} lists no images")
        return entries

    def build_splits(self) -> dict[str, Dataset]:
        return {split: self.image_files(samples, str(self.split_files[split])) for split, samples in self.samples.items()}
