"""DataModules: named training views, evaluation view, kNN bank; datasets and augmentation presets.

Configs refer to a DataModule by its short name, e.g. `class_path: datamodules.DigitsDataModule`.
"""

from datamodules.base import ContrastiveDataModule
from datamodules.cifar import CIFAR10DataModule, CIFAR100DataModule
from datamodules.digits import DigitsDataModule
from datamodules.folders import ImageFolderDataModule, SplitFileDataModule, UnlabeledFolderDataModule
from datamodules.imagenet import ImageNet100DataModule, ImageNetDataModule, TinyImageNetDataModule
from datamodules.longtail import (
    CIFAR10LTDataModule,
    CIFAR100LTDataModule,
    DigitsLTDataModule,
    ImageNetLTDataModule,
    INaturalist2018DataModule,
    PlacesLTDataModule,
)
from datamodules.torchvision_datasets import FashionMNISTDataModule, STL10DataModule, SVHNDataModule

__all__ = [
    "CIFAR100DataModule",
    "CIFAR100LTDataModule",
    "CIFAR10DataModule",
    "CIFAR10LTDataModule",
    "ContrastiveDataModule",
    "DigitsDataModule",
    "DigitsLTDataModule",
    "FashionMNISTDataModule",
    "ImageFolderDataModule",
    "INaturalist2018DataModule",
    "ImageNet100DataModule",
    "ImageNetDataModule",
    "ImageNetLTDataModule",
    "PlacesLTDataModule",
    "STL10DataModule",
    "SVHNDataModule",
    "SplitFileDataModule",
    "TinyImageNetDataModule",
    "UnlabeledFolderDataModule",
]
