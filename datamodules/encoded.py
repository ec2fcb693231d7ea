"""`data.pipeline: gpu` for folders of images of any size: the DataLoader workers read the files, the training
device decodes them.

A worker reads a file's bytes and looks at its header only (PIL, no pixel decoded): a JPEG in RGB or grayscale
goes on encoded, as a 1-D uint8 tensor of its bytes, for `torchvision.io.decode_jpeg` on the training device
(nvjpeg on a GPU, one call per batch); anything else (PNG, BMP, CMYK JPEGs, ImageNet's PNG named .JPEG) is
decoded in the worker with PIL and goes on as uint8 (3, H, W) pixels. A file whose header cannot be read is
handled by `datamodules.image_files.ImageFiles` as on the CPU pipeline (logged, counted, replaced by the next
readable sample). Data broken beyond the header shows only when the device decodes it: the file is then recorded
by `ImageFiles` the same way and replaced by another image of its batch, so that the batch keeps its size.
"""

import bisect
import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules.image_files import ImageFiles, as_rgb

DEVICE_DECODABLE_MODES = ("RGB", "L")  # CMYK and YCCK JPEGs go through PIL: GPU decoders (nvjpeg) mishandle them


def read_for_device(path: str) -> torch.Tensor:
    """The file as the device takes it: its bytes (1-D uint8) if it is a JPEG the device can decode, else its
    RGB pixels (uint8 (3, H, W)) decoded here. Raises what PIL raises for a file it cannot read."""
    data = Path(path).read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        if image.format == "JPEG" and image.mode in DEVICE_DECODABLE_MODES:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return torch.from_numpy(np.array(as_rgb(image))).permute(2, 0, 1).contiguous()


class EncodedBatch:
    """The images of a training batch (each 1-D JPEG bytes or (3, H, W) pixels, uint8) and the index in
    `ImageFiles` of the file each was read from. A plain object on purpose: Lightning's transfer to the device
    moves tensors and collections of tensors but leaves other objects on the host, where `decode_jpeg` wants
    its input bytes whatever the device it decodes on."""

    def __init__(self, images: list[torch.Tensor], files: list[int]):
        self.images, self.files = images, files


def collate_encoded(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A training batch of `EncodedImages` samples: the images in one `EncodedBatch`, labels and indices as tensors."""
    return {
        "image": EncodedBatch([sample["image"] for sample in samples], [sample["file"] for sample in samples]),
        "label": torch.tensor([sample["label"] for sample in samples]),
        "index": torch.tensor([sample["index"] for sample in samples]),
    }


class EncodedImages(Dataset):
    """Samples `indices` of an `ImageFiles`, read for decoding on the device (module docstring)."""

    def __init__(self, files: ImageFiles, indices: Sequence[int]):
        self.files, self.indices = files, indices

    @classmethod
    def of(cls, dataset: Dataset, owner: str) -> "EncodedImages":
        """`dataset` (an `ImageFiles`, or a Subset-like of one) read for decoding on the device; `owner` names
        the DataModule in the error for any other dataset."""
        files, indices = _files_and_indices(dataset, owner)
        return cls(files, indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        found, image = self.files.first_readable(index, read_for_device, among=self.indices)
        return {"image": image, "file": found, "label": self.files.labels[found], "index": index}

    def decode(self, batch: EncodedBatch, device: torch.device) -> tuple[list[torch.Tensor], list[int]]:
        """The images of `batch` as uint8 (3, H_i, W_i) tensors on `device`, in batch order, and for each the
        position in the batch of the image it shows: its own, or for a JPEG the device cannot decode (recorded
        as unreadable) the next decodable one's."""
        pixels = {position: image.to(device, non_blocking=True) for position, image in enumerate(batch.images) if image.ndim == 3}
        pixels |= self._decode_jpegs(batch, [position for position, image in enumerate(batch.images) if image.ndim == 1], device)
        decodable = sorted(pixels)
        if not decodable:
            raise ValueError(f"none of the {len(batch.images)} images of a batch can be decoded, e.g. {self.files.paths[batch.files[0]]}")
        shown = [decodable[bisect.bisect_left(decodable, position) % len(decodable)] for position in range(len(batch.images))]
        return [pixels[position] for position in shown], shown

    def _decode_jpegs(self, batch: EncodedBatch, positions: list[int], device: torch.device) -> dict[int, torch.Tensor]:
        """The JPEGs at `positions` of `batch`, by position, decoded in one call; if that fails (one broken file
        fails the whole call), one at a time, leaving out the broken ones, each recorded as unreadable."""
        if not positions:
            return {}
        try:
            return dict(zip(positions, decode_jpeg([batch.images[position] for position in positions], mode=ImageReadMode.RGB, device=device)))
        except RuntimeError:
            decoded = {}
            for position in positions:
                try:
                    decoded[position] = decode_jpeg(batch.images[position], mode=ImageReadMode.RGB, device=device)
                except RuntimeError as error:
                    self.files.record_corrupt(batch.files[position], error)
            return decoded


def _files_and_indices(dataset: Dataset, owner: str) -> tuple[ImageFiles, Sequence[int]]:
    if isinstance(dataset, ImageFiles):
        return dataset, range(len(dataset))
    if hasattr(dataset, "dataset") and hasattr(dataset, "indices"):
        files, indices = _files_and_indices(dataset.dataset, owner)
        return files, [indices[index] for index in dataset.indices]
    raise ValueError(
        f"data.pipeline: gpu decodes the image files of {owner} on the device, which needs its "
        f"images as an ImageFiles (or a Subset of one), not a {type(dataset).__name__}"
    )
