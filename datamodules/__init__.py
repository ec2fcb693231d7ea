"""DataModules: named training views, evaluation view, kNN bank; datasets and augmentation presets.

Configs refer to a DataModule by its short name, e.g. `class_path: datamodules.DigitsDataModule`.
"""

from datamodules.base import ContrastiveDataModule
from datamodules.cifar import CIFAR10DataModule, CIFAR100DataModule
from datamodules.digits import DigitsDataModule
from datamodules.folders import ImageFolderDataModule, SplitFileDataModule, UnlabeledFolderDataModule
from datamodules.imagenet import ImageNet100DataModule, ImageNetDataModule, TinyImageNetDataModule
from datamodules.torchvision_datasets import FashionMNISTDataModule, STL10DataModule, SVHNDataModule

__all__ = [
    "CIFAR100DataModule",
    "CIFAR10DataModule",
    "ContrastiveDataModule",
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "ImageFolderDataModule",
    "ImageNet100DataModule",
    "ImageNetDataModule",
    "STL10DataModule",
    "SVHNDataModule",
    "SplitFileDataModule",
    "TinyImageNetDataModule",
    "UnlabeledFolderDataModule",
]
