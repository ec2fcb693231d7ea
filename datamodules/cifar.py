"""CIFAR-10 and CIFAR-100 from torchvision's python-pickle batches.

Layout: `<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}` and
`<root>/cifar-100-python/{train,test,meta}`. CIFAR has no validation split: as in the papers' CIFAR
protocols, validation (kNN monitor, online probe) and test both use the official test set.
"""

import torchvision
from torch.utils.data import Dataset

from datamodules.base import ContrastiveDataModule


class CIFAR10DataModule(ContrastiveDataModule):
    num_classes = 10
    image_size = 32
    # The CIFAR constants of the MoCo CIFAR recipe, ReSSL and SCE (spec_selfsup 4, ReSSL issue #5).
    mean = (0.4914, 0.4822, 0.4465)
    std = (0.2023, 0.1994, 0.2010)
    dataset_class = torchvision.datasets.CIFAR10
    folder = "cifar-10-batches-py"

    def __init__(self, download: bool = False, **kwargs):
        """
        Args:
            download: fetch the archive from the official site into `root` if it is missing (off by
                default: the files are expected to be there already).
            **kwargs: the ContrastiveDataModule arguments (root, batch_size, num_workers, views, ...).
        """
        super().__init__(**kwargs)
        if self.root is None:
            raise ValueError(f"data.root is required for {type(self).__name__}: the folder that contains {self.folder}/")
        self.download = download

    def build_splits(self) -> dict[str, Dataset]:
        try:
            train = self.dataset_class(self.root, train=True, download=self.download)
            test = self.dataset_class(self.root, train=False, download=self.download)
        except RuntimeError as error:
            raise ValueError(
                f"{self.dataset_class.__name__} files not found or corrupt under data.root {str(self.root)!r}: expected "
                f"{self.root / self.folder}/ as extracted from the official archive (set data.download: true to fetch it) [{error}]"
            ) from None
        return {"train": train, "val": test, "test": test}


class CIFAR100DataModule(CIFAR10DataModule):
    num_classes = 100
    mean = (0.5071, 0.4865, 0.4409)
    std = (0.2673, 0.2564, 0.2762)
    dataset_class = torchvision.datasets.CIFAR100
    folder = "cifar-100-python"
