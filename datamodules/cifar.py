"""CIFAR-10 and CIFAR-100 from torchvision's python-pickle batches.

Layout: `<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}` and
`<root>/cifar-100-python/{train,test,meta}`. CIFAR has no validation split: as in the papers' CIFAR
protocols, validation (kNN monitor, online probe) and test both use the official test set.
"""

import torchvision
from torch.utils.data import Dataset

from datamodules.torchvision_datasets import TorchvisionDataModule


class CIFAR10DataModule(TorchvisionDataModule):
    num_classes = 10
    image_size = 32
    # The CIFAR constants of the MoCo CIFAR recipe, ReSSL and SCE (ReSSL issue #5).
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2023, 0.1994, 0.2010)
    dataset_class = torchvision.datasets.CIFAR10
    expected_layout = "cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}"
    required_files = tuple(f"cifar-10-batches-py/{name}" for name in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"))

    def build_splits(self) -> dict[str, Dataset]:
        test = self.open_split(train=False)
        return {"train": self.open_split(train=True), "val": test, "test": test}


class CIFAR100DataModule(CIFAR10DataModule):
    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
    dataset_class = torchvision.datasets.CIFAR100
    expected_layout = "cifar-100-python/{train, test, meta}"
    required_files = ("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta")
