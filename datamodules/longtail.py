"""Long-tailed data: CIFAR-10/100-LT and Digits-M-LT cut from the balanced sets, ImageNet-LT,
iNaturalist 2018 and Places-LT from their split files (Kang et al.'s class-priority samplers, which
work on any DataModule, are in `datamodules/samplers.py`).

- `long_tail_counts` is the exponential profile of LDAM-DRW's `imbalance_cifar.py` (reused verbatim by
  PaCo): class c keeps floor(max_count * (1/ratio)^(c/(C-1))) images, classes in natural label order,
  so class 0 is the head. For CIFAR-100 and ratio 100 / 50 / 10 that is 10,847 / 12,608 / 19,573
  images (kaidic/LDAM-DRW imbalance_cifar.py, copied as PaCo/LT/dataset/imbalance_cifar.py).
- `long_tail_indices` keeps the same images as LDAM-DRW: numpy's generator seeded once with 0, then for
  each class in label order its indices shuffled and the first n_c kept.
- `LongTailMixin` applies both to the training split of any DataModule whose training dataset exposes
  its labels. Validation and test are left as they are (balanced), and the kNN bank, which is the
  training split, is long-tailed like it.
"""

from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from datamodules.base import dataset_labels
from datamodules.cifar import CIFAR10DataModule, CIFAR100DataModule
from datamodules.digits import DigitsDataModule
from datamodules.folders import SplitFileDataModule
from datamodules.image_files import subset

INATURALIST_MEAN = (0.466, 0.471, 0.380)  # PaCo's iNaturalist 2018 normalisation (PaCo's training scripts)
INATURALIST_STD = (0.195, 0.194, 0.192)


def long_tail_counts(num_classes: int, max_count: int, imbalance_ratio: float) -> list[int]:
    """Images kept per class, class 0 first: `int(max_count * (1/ratio) ** (c / (C - 1)))` (LDAM-DRW)."""
    if num_classes < 2:
        raise ValueError(f"a long-tailed split needs at least 2 classes (data.num_classes), got {num_classes}")
    if max_count < 1:
        raise ValueError(f"data.max_count must be >= 1, got {max_count}")
    if not imbalance_ratio >= 1:  # NaN too
        raise ValueError(f"data.imbalance_ratio (head / tail images) must be >= 1, got {imbalance_ratio}")
    imbalance_factor = 1.0 / imbalance_ratio
    counts = [int(max_count * imbalance_factor ** (label / (num_classes - 1.0))) for label in range(num_classes)]
    if (empty := counts.index(0) if 0 in counts else None) is not None:
        raise ValueError(f"data.imbalance_ratio {imbalance_ratio:g} with data.max_count {max_count} keeps no image of class {empty} "
                         f"(int({max_count} / {imbalance_ratio:g}^({empty} / {num_classes - 1})) = 0): lower the ratio or raise max_count")
    return counts


def long_tail_indices(labels: np.ndarray, counts: list[int], seed: int = 0) -> np.ndarray:
    """Indices of the kept images, class by class: each class's indices shuffled by one generator
    seeded once with `seed` (LDAM-DRW's `np.random.seed(0)`), then the first `counts[c]` of them."""
    if not 0 <= seed < 2**32:
        raise ValueError(f"data.long_tail_seed must be in [0, 2**32), got {seed}")
    rng = np.random.RandomState(seed)
    kept = []
    for label, count in enumerate(counts):
        indices = np.where(labels == label)[0]
        if len(indices) < count:
            raise ValueError(
                f"class {label} has {len(indices)} training images, fewer than the {count} the long-tailed split "
                f"requests; lower data.max_count"
            )
        rng.shuffle(indices)
        kept.append(indices[:count])
    return np.concatenate(kept)


class LongTailMixin:
    """Makes the training split of a DataModule long-tailed (module docstring); goes before the
    DataModule class among the bases."""

    default_max_count: int  # the default of data.max_count

    def __init__(self, imbalance_ratio: float = 100.0, max_count: int | None = None, long_tail_seed: int = 0, **kwargs):
        """
        Args:
            imbalance_ratio: images of the head class over images of the tail class (100, 50, 10 in
                the papers; 1 keeps `max_count` images of every class).
            max_count: images of the head class, class 0 (default: `default_max_count`; for CIFAR every
                image of the class, 5,000 or 500).
            long_tail_seed: seeds which images are kept (0: the images of LDAM-DRW and PaCo).
            **kwargs: the arguments of the balanced DataModule (root, batch_size, views, ...).
        """
        self.kept_per_class = long_tail_counts(self.num_classes, self.default_max_count if max_count is None else max_count, imbalance_ratio)
        self.long_tail_seed = long_tail_seed
        super().__init__(**kwargs)

    def build_splits(self) -> dict[str, Dataset]:
        splits = super().build_splits()
        kept = long_tail_indices(dataset_labels(splits["train"]), self.kept_per_class, self.long_tail_seed)
        return splits | {"train": subset(splits["train"], kept.tolist())}


class CIFAR10LTDataModule(LongTailMixin, CIFAR10DataModule):
    """CIFAR-10-LT: 5,000 head images; 12,406 in all at ratio 100 (kaidic/LDAM-DRW imbalance_cifar.py's profile). Evaluation on the
    balanced 10,000-image test set."""

    default_max_count = 5000


class CIFAR100LTDataModule(LongTailMixin, CIFAR100DataModule):
    """CIFAR-100-LT: 500 head images; 10,847 / 12,608 / 19,573 in all at ratio 100 / 50 / 10
    (kaidic/LDAM-DRW imbalance_cifar.py). Evaluation on the balanced 10,000-image test set."""

    default_max_count = 500


class DigitsLTDataModule(LongTailMixin, DigitsDataModule):
    """Digits-M-LT: 400 head images (with `train_variants` 4 every class has 436-520, so any class can
    be cut to it); validation and test are Digits-M's, unchanged."""

    default_max_count = 400


class LongTailSplitFileDataModule(SplitFileDataModule):
    """A long-tailed dataset given by split files (`<relative path> <label>` lines, PaCo's dataset lists).
    A relative split-file name is looked up under `data.root` (absolute names are used as they are).
    Every one of `num_classes` classes must have training images: a training file with fewer classes
    (a truncated or foreign list) is a ValueError (`SplitFileDataModule`)."""

    def __init__(self, train_file: str, val_file: str, test_file: str | None, num_classes: int, root: str | None = None, **kwargs):
        files = [name if root is None or name is None else str(Path(root).expanduser() / name) for name in (train_file, val_file, test_file)]
        super().__init__(*files, num_classes=num_classes, root=root, **kwargs)


class ImageNetLTDataModule(LongTailSplitFileDataModule):
    """ImageNet-LT (Liu et al. 2019, OLTR): 115,846 training images of 1,000 classes (1,280 to 5 each);
    validation 20 per class, drawn from ImageNet's training images; test 50 per class, the ILSVRC-2012
    validation images. `data.root` is the ImageNet folder the listed paths (`train/<wnid>/...`,
    `val/<wnid>/...`) start from. 224 px; evaluation resizes to 256 and center-crops 224."""

    expected_layout = "the ImageNet images named in the ImageNet-LT lists (train/<wnid>/*.JPEG, val/<wnid>/*.JPEG)"
    how_to_get = "the lists are data/ImageNet_LT/*.txt of facebookresearch/classifier-balancing (also in PaCo's LT/imagenet_inat/data)"

    def __init__(
        self,
        train_file: str = "ImageNet_LT_train.txt",
        val_file: str = "ImageNet_LT_val.txt",
        test_file: str = "ImageNet_LT_test.txt",
        num_classes: int = 1000,
        **kwargs,
    ):
        """
        Args:
            train_file, val_file, test_file: the ImageNet-LT lists (a relative name is under data.root).
            num_classes: every one must have training images.
            **kwargs: the SplitFileDataModule arguments (root, image_size, batch_size, views, ...).
        """
        super().__init__(train_file, val_file, test_file, num_classes, **kwargs)


class INaturalist2018DataModule(LongTailSplitFileDataModule):
    """iNaturalist 2018: 437,513 training images of 8,142 classes; the 24,426 validation images (3 per
    class) are also the test set, as in PaCo. `data.root` is the folder the listed paths
    (`train_val2018/<kingdom>/<id>/...`) start from; iNaturalist normalisation."""

    expected_layout = "the iNaturalist 2018 images named in the lists (train_val2018/...)"
    how_to_get = "the lists are data/iNaturalist18/*.txt of facebookresearch/classifier-balancing (also in PaCo's LT/imagenet_inat/data)"

    def __init__(
        self,
        train_file: str = "iNaturalist18_train.txt",
        val_file: str = "iNaturalist18_val.txt",
        num_classes: int = 8142,
        mean: tuple[float, float, float] = INATURALIST_MEAN,
        std: tuple[float, float, float] = INATURALIST_STD,
        **kwargs,
    ):
        """
        Args:
            train_file, val_file: the iNaturalist 2018 lists (a relative name is under data.root).
            num_classes: every one must have training images.
            mean, std: per-channel normalisation.
            **kwargs: the SplitFileDataModule arguments (root, image_size, batch_size, views, ...).
        """
        super().__init__(train_file, val_file, None, num_classes, mean=mean, std=std, **kwargs)


class PlacesLTDataModule(LongTailSplitFileDataModule):
    """Places-LT (OLTR): 62,500 training images of 365 classes (4,980 to 5 each); validation 20 per
    class (7,300), test 100 per class (36,500). PaCo's code evaluates on the validation list
    (PaCo's dataset lists). `data.root` is the Places-365 folder the listed paths start from."""

    expected_layout = "the Places-365 images named in the Places-LT lists (train/<class>/*.jpg, ...)"
    how_to_get = "the lists are data/Places_LT/*.txt of facebookresearch/classifier-balancing"

    def __init__(
        self,
        train_file: str = "Places_LT_train.txt",
        val_file: str = "Places_LT_val.txt",
        test_file: str = "Places_LT_test.txt",
        num_classes: int = 365,
        **kwargs,
    ):
        """
        Args:
            train_file, val_file, test_file: the Places-LT lists (a relative name is under data.root).
            num_classes: every one must have training images.
            **kwargs: the SplitFileDataModule arguments (root, image_size, batch_size, views, ...).
        """
        super().__init__(train_file, val_file, test_file, num_classes, **kwargs)
