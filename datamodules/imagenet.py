"""ImageNet, ImageNet-100 and Tiny-ImageNet, read from their usual folder layouts as they are.

- ImageNet: `<root>/train/<wnid>/*.JPEG` and `<root>/val/<wnid>/*.JPEG` (the validation images sorted
  into class folders, as torchvision's ImageFolder and the MoCo / SCE code expect).
- ImageNet-100: the same tree (a full ImageNet works: only the 100 class folders are read, nothing is
  copied or linked); the classes are those of CMC, listed in Table 1 of the SCE supplement (also the
  JCL and Wang & Liu list), labelled by their sorted order.
- Tiny-ImageNet: the extracted `tiny-imagenet-200` folder, `train/<wnid>/images/*.JPEG`,
  `val/images/*.JPEG` labelled by `val/val_annotations.txt`; its test split has no labels, so
  validation and test both use `val` (10,000 images).
"""

from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from datamodules.folders import FolderDataModule, ImageFolderDataModule
from datamodules.image_files import listing

IMAGENET_SOURCE = "ILSVRC-2012 from https://image-net.org, the validation images moved into class folders, e.g. by the widely used valprep.sh"

# SCE supplement, Table 1 (row by row): the 100 classes of ImageNet-100.
IMAGENET100_WNIDS = (
    "n02869837", "n01749939", "n02488291", "n02107142",
    "n13037406", "n02091831", "n04517823", "n04589890",
    "n03062245", "n01773797", "n01735189", "n07831146",
    "n07753275", "n03085013", "n04485082", "n02105505",
    "n01983481", "n02788148", "n03530642", "n04435653",
    "n02086910", "n02859443", "n13040303", "n03594734",
    "n02085620", "n02099849", "n01558993", "n04493381",
    "n02109047", "n04111531", "n02877765", "n04429376",
    "n02009229", "n01978455", "n02106550", "n01820546",
    "n01692333", "n07714571", "n02974003", "n02114855",
    "n03785016", "n03764736", "n03775546", "n02087046",
    "n07836838", "n04099969", "n04592741", "n03891251",
    "n02701002", "n03379051", "n02259212", "n07715103",
    "n03947888", "n04026417", "n02326432", "n03637318",
    "n01980166", "n02113799", "n02086240", "n03903868",
    "n02483362", "n04127249", "n02089973", "n03017168",
    "n02093428", "n02804414", "n02396427", "n04418357",
    "n02172182", "n01729322", "n02113978", "n03787032",
    "n02089867", "n02119022", "n03777754", "n04238763",
    "n02231487", "n03032252", "n02138441", "n02104029",
    "n03837869", "n03494278", "n04136333", "n03794056",
    "n03492542", "n02018207", "n04067472", "n03930630",
    "n03584829", "n02123045", "n04229816", "n02100583",
    "n03642806", "n04336792", "n03259280", "n02116738",
    "n02108089", "n03424325", "n01855672", "n02090622",
)


class ImageNetDataModule(ImageFolderDataModule):
    """ImageNet (ILSVRC-2012): 1,000 class folders, 224 px; evaluation resizes to 256 and center-crops
    224 (SCE supplementary, Sec. D). Pretraining on `train`, validation and test on `val`."""

    expected_layout = "train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (the validation images sorted into class folders)"
    how_to_get = IMAGENET_SOURCE


class ImageNet100DataModule(ImageFolderDataModule):
    """ImageNet-100 (module docstring): the 100 classes of `IMAGENET100_WNIDS`, read from an ImageNet
    tree; a missing class folder is reported with its path when the DataModule is built."""

    expected_layout = "train/<wnid>/*.JPEG and val/<wnid>/*.JPEG for the 100 ImageNet-100 wnids (other class folders are ignored)"
    how_to_get = IMAGENET_SOURCE

    other_class_folders_ignored = True  # the other 900 classes of the ImageNet tree it reads

    def find_classes(self) -> list[str]:
        return sorted(IMAGENET100_WNIDS)


class TinyImageNetDataModule(FolderDataModule):
    """Tiny-ImageNet (module docstring): 200 classes of 64x64 images, 100,000 for training, 10,000 for
    validation and test."""

    num_classes = 200
    image_size = 64
    mean = (0.4802, 0.4481, 0.3975)  # ReSSL's Tiny-ImageNet constants (KyleZheng1997/ReSSL)
    std = (0.2302, 0.2265, 0.2262)
    uniform_image_size = True
    expected_layout = "wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt (the extracted tiny-imagenet-200 folder)"
    how_to_get = "extract http://cs231n.stanford.edu/tiny-imagenet-200.zip and give its tiny-imagenet-200 folder"

    def __init__(self, **kwargs):
        """
        Args:
            **kwargs: the FolderDataModule arguments (root = the `tiny-imagenet-200` folder,
                max_corrupt_fraction, batch_size, num_workers, views, ...).
        """
        super().__init__(**kwargs)
        wnids = self.root / "wnids.txt"
        if not wnids.is_file():
            raise ValueError(f"{wnids} does not exist: data.root must be the tiny-imagenet-200 folder, with {self.expected_layout}")
        self.classes = sorted(wnids.read_text().split())
        if len(self.classes) != self.num_classes:
            raise ValueError(f"{wnids} lists {len(self.classes)} classes, Tiny-ImageNet has {self.num_classes}")
        self.check_class_folders([self.root / "train"])
        self.val_samples = self.read_val_annotations(self.root / "val" / "val_annotations.txt")

    def default_eval_view(self) -> dict[str, Any]:
        return {"preset": "center"}  # a medium dataset: the image itself, at its resolution (SCE supplementary, Sec. D)

    def read_val_annotations(self, annotations: Path) -> list[tuple[str, int]]:
        """`(path, label)` of the validation images, each checked to exist."""
        if not annotations.is_file():
            raise ValueError(f"{annotations} does not exist (expected {self.expected_layout} under data.root)")
        labels = {wnid: label for label, wnid in enumerate(self.classes)}
        samples = []
        for number, line in enumerate(annotations.read_text().splitlines(), start=1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 2 or fields[1] not in labels:
                raise ValueError(f"{annotations}:{number}: expected '<file> <wnid of wnids.txt> ...', got {line!r}")
            samples.append((str(self.root / "val" / "images" / fields[0]), labels[fields[1]]))
        missing = [path for path, _ in samples if not Path(path).is_file()]
        if missing:
            raise ValueError(f"{len(missing)} validation images listed in {annotations} do not exist: {listing(missing)}")
        return samples

    def build_splits(self) -> dict[str, Dataset]:
        val = self.image_files(self.val_samples, str(self.root / "val"))
        return {"train": self.labelled_images(self.root / "train"), "val": val, "test": val}
