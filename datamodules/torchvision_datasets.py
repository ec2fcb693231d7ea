"""Datasets read by torchvision's dataset classes from their official files: SVHN (`.mat`),
Fashion-MNIST (IDX), STL-10 (binary); CIFAR lives in `datamodules.cifar` on the same base.

Nothing is downloaded unless `data.download: true` (off by default). Missing files are a ValueError
naming them when the DataModule is built; corrupt files are a ValueError that says what is expected under
`data.root` and how to fetch it, naming the files whose MD5 is not the official one where torchvision knows it
(CIFAR, SVHN, STL-10; Fashion-MNIST's reader checks only the headers), and files whose images and labels disagree
in number or hold a label outside the classes.
"""

import pickle
from pathlib import Path
from typing import Literal

import numpy as np
import torchvision
from torch.utils.data import Dataset
from torchvision.datasets.utils import check_integrity

from datamodules.base import ContrastiveDataModule
from datamodules.image_files import as_rgb


class TorchvisionDataModule(ContrastiveDataModule):
    """Base of the DataModules on a torchvision dataset class (`dataset_class`)."""

    dataset_class: type
    required_files: tuple[str, ...]  # relative to data.root
    how_to_get = "set data.download: true to fetch them from the official site"

    def __init__(self, download: bool = False, **kwargs):
        """
        Args:
            download: fetch the official files into `root` when they are missing (off by default: the
                files are expected to be there already).
            **kwargs: the ContrastiveDataModule arguments (root, batch_size, num_workers, views, ...).
        """
        self.download = download
        super().__init__(**kwargs)
        missing = [] if download else [self.root / name for name in self.required_files if not (self.root / name).is_file()]
        if missing:
            raise ValueError(f"{len(missing)} files of {type(self).__name__} are missing under data.root: {', '.join(map(str, missing))} ({self.how_to_get})")

    def _checked_root(self, root: str | None):
        if self.download and root is not None:
            return Path(root).expanduser()  # torchvision creates it when it fetches the files
        return super()._checked_root(root)

    def open_split(self, **split) -> Dataset:
        """The torchvision dataset of one split (`train=...` or `split=...`), with a clear error."""
        try:
            dataset = self.dataset_class(str(self.root), download=self.download, **split)
        except (RuntimeError, OSError, ValueError, EOFError, AssertionError, TypeError, pickle.UnpicklingError) as error:
            corrupt = self.corrupt_files()
            raise ValueError(
                f"{self.dataset_class.__name__} files not found or corrupt under data.root {str(self.root)!r}"
                + (f" ({', '.join(corrupt)}: not the official file, by its MD5)" if corrupt else "")
                + f": expected {self.expected_layout} as extracted from the official archive ({self.how_to_get}) [{error}]"
            ) from None
        labels = np.asarray(getattr(dataset, "targets", getattr(dataset, "labels", [])))
        wrong = labels[(labels != -1) & ((labels < 0) | (labels >= self.num_classes))]  # -1: STL-10's unlabelled images
        if len(labels) != len(dataset.data) or len(wrong):
            raise ValueError(
                f"{self.dataset_class.__name__} files under data.root {str(self.root)!r} ({split}) hold {len(dataset.data)} images and "
                f"{len(labels)} labels" + (f", labels outside 0..{self.num_classes - 1} such as {int(wrong[0])}" if len(wrong) else "")
                + f": expected {self.expected_layout} as extracted from the official archive ({self.how_to_get})"
            )
        return dataset

    def corrupt_files(self) -> list[str]:
        """The files whose MD5 differs from the official one that torchvision's class lists (CIFAR, STL-10: train_list and
        test_list; SVHN: split_list), relative to data.root; missing ones are left to the missing-file error."""
        known = [*getattr(self.dataset_class, "train_list", []), *getattr(self.dataset_class, "test_list", [])]
        known += [(name, md5) for _, name, md5 in getattr(self.dataset_class, "split_list", {}).values()]
        meta = getattr(self.dataset_class, "meta", None)  # CIFAR's batches.meta / meta
        known += [(meta["filename"], meta["md5"])] if isinstance(meta, dict) and "md5" in meta else []
        folder = Path(getattr(self.dataset_class, "base_folder", ""))
        return [str(folder / name) for name, md5 in known if (self.root / folder / name).is_file() and not check_integrity(str(self.root / folder / name), md5)]


class RGBImages(Dataset):
    """Grayscale images replicated to three channels, so that every pipeline (per image or on the
    device) and every trunk sees RGB."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, label = self.base[index]
        return as_rgb(image), label


class SVHNDataModule(TorchvisionDataModule):
    """SVHN (cropped digits): pretraining on `train` (73,257 images), validation and test on `test`."""

    num_classes = 10
    image_size = 32
    mean = (0.4377, 0.4438, 0.4728)  # training-split statistics; Wang & Liu normalise with CIFAR's (set per view)
    std = (0.1980, 0.2010, 0.1970)
    dataset_class = torchvision.datasets.SVHN
    expected_layout = "train_32x32.mat and test_32x32.mat"
    required_files = ("train_32x32.mat", "test_32x32.mat")

    def build_splits(self) -> dict[str, Dataset]:
        test = self.open_split(split="test")
        return {"train": self.open_split(split="train"), "val": test, "test": test}


class FashionMNISTDataModule(TorchvisionDataModule):
    """Fashion-MNIST, 28x28 grayscale, served as RGB (the gray channel replicated): training on `train`
    (60,000), validation and test on `test` (10,000)."""

    num_classes = 10
    image_size = 28
    mean = (0.2860,) * 3  # training-split statistics, the same for the three replicated channels
    std = (0.3530,) * 3
    dataset_class = torchvision.datasets.FashionMNIST
    expected_layout = "FashionMNIST/raw/{train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte}"
    required_files = tuple(f"FashionMNIST/raw/{prefix}-{kind}-ubyte" for prefix in ("train", "t10k") for kind in ("images-idx3", "labels-idx1"))

    def build_splits(self) -> dict[str, Dataset]:
        test = RGBImages(self.open_split(train=False))
        return {"train": RGBImages(self.open_split(train=True)), "val": test, "test": test}


STL10_TRAIN_SPLITS = ("train+unlabeled", "train", "unlabeled")


class STL10DataModule(TorchvisionDataModule):
    """STL-10 at 96x96: pretraining on `train+unlabeled` (105,000 images, the unlabelled ones with label
    -1, which the online probe and the kNN monitor leave out), the kNN bank on the labelled `train`
    (5,000), validation and test on `test` (8,000). The linear stage sets `train_split: train`."""

    num_classes = 10
    image_size = 96
    mean = (0.4408, 0.4279, 0.3867)  # ReSSL's STL-10 constants (KyleZheng1997/ReSSL)
    std = (0.2682, 0.2610, 0.2686)
    dataset_class = torchvision.datasets.STL10
    expected_layout = "stl10_binary/{train_X.bin, train_y.bin, test_X.bin, test_y.bin, unlabeled_X.bin}"
    required_files = tuple(f"stl10_binary/{name}.bin" for name in ("train_X", "train_y", "test_X", "test_y", "unlabeled_X"))

    def __init__(self, train_split: Literal["train+unlabeled", "train", "unlabeled"] = "train+unlabeled", **kwargs):
        """
        Args:
            train_split: the training split: `train+unlabeled` for pretraining, `train` for the linear stage.
            **kwargs: the TorchvisionDataModule arguments (root, download, batch_size, views, ...).
        """
        if train_split not in STL10_TRAIN_SPLITS:  # the CLI checks the Literal; from Python, torchvision would blame the files
            raise ValueError(f"data.train_split {train_split!r} is not one of STL-10's training splits {', '.join(STL10_TRAIN_SPLITS)}")
        super().__init__(**kwargs)
        self.train_split = train_split
        self.training_labels = train_split != "unlabeled"  # without labels the online probe learns nothing: it reports nothing

    def build_splits(self) -> dict[str, Dataset]:
        test = self.open_split(split="test")
        labelled = self.open_split(split="train")
        train = labelled if self.train_split == "train" else self.open_split(split=self.train_split)
        return {"train": train, "bank": labelled, "val": test, "test": test}
