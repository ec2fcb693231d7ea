"""`data.pipeline: gpu` on folders of images of varying sizes: encoded files from the workers, decoded on the
training device (here the CPU), with the handling of unreadable files of the CPU pipeline."""

import logging
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Subset, TensorDataset

from analysis.representation import analyse
from backbones import BackboneSpec
from datamodules import ImageFolderDataModule
from datamodules.encoded import collate_encoded
from datamodules.folders import IMAGENET_MEAN, IMAGENET_STD
from helpers import TINY_PROJECTOR, cpu_trainer

VIEWS = {"query": {"preset": "mocov2"}, "key": {"preset": "crop_flip"}}
SIZE = 16
RNG = np.random.default_rng(0)
TRAIN_FILES = {  # name under train/: (width, height), PIL mode, format
    "a/wide.jpg": ((40, 24), "RGB", "JPEG"),
    "a/tall.jpg": ((24, 40), "RGB", "JPEG"),
    "a/small.jpeg": ((17, 29), "RGB", "JPEG"),
    "b/gray.jpg": ((30, 22), "L", "JPEG"),
    "b/cmyk.jpg": ((26, 34), "CMYK", "JPEG"),
    "b/lossless.png": ((21, 27), "RGB", "PNG"),
}


def save_image(path: Path, size: tuple[int, int] = (20, 14), mode: str = "RGB", image_format: str = "JPEG") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(RNG.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).convert(mode).save(path, image_format)
    return path


def write_folder(root: Path, train_files: dict = TRAIN_FILES) -> Path:
    for name, (size, mode, image_format) in train_files.items():
        save_image(root / "train" / name, size, mode, image_format)
        save_image(root / "val" / Path(name).parent / "0.jpg")
    return root


@pytest.fixture
def folder(tmp_path) -> Path:
    return write_folder(tmp_path)


def gpu_folder(root: Path, **kwargs) -> ImageFolderDataModule:
    options = dict(root=str(root), batch_size=len(TRAIN_FILES), num_workers=0, views=VIEWS, image_size=SIZE, pipeline="gpu")
    return ImageFolderDataModule(**(options | kwargs))


def pil_pixels(path: str) -> torch.Tensor:
    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB"))).permute(2, 0, 1)


def test_rgb_and_gray_jpegs_travel_encoded_and_other_files_as_pixels_decoded_by_the_worker(folder):
    datamodule = gpu_folder(folder)
    batch = next(iter(datamodule.train_dataloader()))
    paths = datamodule.splits["train"].paths
    dimensions = {Path(paths[file]).name: image.ndim for image, file in zip(batch["image"].images, batch["image"].files)}
    assert dimensions == {"wide.jpg": 1, "tall.jpg": 1, "small.jpeg": 1, "gray.jpg": 1, "cmyk.jpg": 3, "lossless.png": 3}
    assert batch["label"].tolist() == [datamodule.splits["train"].labels[file] for file in batch["image"].files]


def test_images_decoded_on_the_device_equal_their_pil_decodes(folder):
    datamodule = gpu_folder(folder)
    batch = next(iter(datamodule.train_dataloader()))
    images, labels, _ = datamodule.images_on_device(batch)
    assert len(images) == len(TRAIN_FILES) and torch.equal(labels, batch["label"])
    for image, sent, file in zip(images, batch["image"].images, batch["image"].files):
        expected = pil_pixels(datamodule.splits["train"].paths[file])
        # PIL and decode_jpeg on the CPU share libjpeg-turbo; another decoder (nvjpeg) may round differently
        torch.testing.assert_close(image, expected, atol=2 if sent.ndim == 1 else 0, rtol=0)


def test_views_of_images_of_several_sizes_come_out_at_the_configured_size_and_range(folder):
    datamodule = gpu_folder(folder)
    batch = datamodule.augment_on_device(next(iter(datamodule.train_dataloader())))
    for view in batch["views"].values():
        assert view.shape == (len(TRAIN_FILES), 3, SIZE, SIZE) and view.dtype == torch.float32
        pixels = view * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
        assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
        # normalised: un-normalised, the views reach the images' dark and bright pixels (0.04-0.12 to 0.99 here;
        # views left in [0, 1] would come out between 0.41 and 0.71)
        assert pixels.min() < 0.25 and pixels.max() > 0.85


def test_the_transfer_to_the_device_moves_labels_and_indices_and_leaves_the_image_bytes_on_the_host(folder):
    batch = next(iter(gpu_folder(folder).train_dataloader()))
    moved = L.LightningModule().transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved["label"].is_meta and moved["index"].is_meta
    assert moved["image"] is batch["image"] and not any(image.is_meta for image in moved["image"].images)


def test_subsets_of_image_files_are_served_encoded_and_other_datasets_are_refused_by_name(folder):
    datamodule = gpu_folder(folder)
    datamodule.setup()
    nested = Subset(Subset(datamodule.splits["train"], [5, 3, 1, 0]), [2, 0])  # a long-tailed split of a split
    encoded = datamodule.encoded(nested)
    assert len(encoded) == 2 and [encoded[index]["file"] for index in range(2)] == [1, 5]
    with pytest.raises(ValueError, match="ImageFolderDataModule .* not a TensorDataset"):
        datamodule.encoded(TensorDataset(torch.zeros(2)))


def write_broken_folder(root: Path) -> Path:
    """Eight good JPEGs (classes a, b), one cut after its header (class c, alone) and one that is no image."""
    write_folder(root, {f"{name}/{index}.jpg": ((20 + index, 14), "RGB", "JPEG") for name in "ab" for index in range(4)})
    data = save_image(root / "train" / "c" / "truncated.jpg", (48, 40)).read_bytes()
    (root / "train" / "c" / "truncated.jpg").write_bytes(data[: len(data) // 2])
    save_image(root / "val" / "c" / "0.jpg")
    (root / "train" / "b" / "garbage.jpg").write_bytes(b"not a jpeg")
    return root


def test_broken_files_are_logged_counted_and_replaced_so_that_the_batch_keeps_its_size(tmp_path, caplog):
    root = write_broken_folder(tmp_path)
    datamodule = gpu_folder(root, batch_size=10, max_corrupt_fraction=0.2)
    with caplog.at_level(logging.WARNING, logger="datamodules.image_files"):
        batch = next(iter(datamodule.train_dataloader()))
        labels = batch["label"]
        images, shown_labels, shown_index = datamodule.images_on_device(batch)
    train = datamodule.splits["train"]
    assert train.corrupt_count == 2 and len(images) == 10 and shown_labels.shape == (10,)
    assert str(root / "train/c/truncated.jpg") in caplog.text and str(root / "train/b/garbage.jpg") in caplog.text
    truncated = train.paths.index(str(root / "train/c/truncated.jpg"))
    position = batch["image"].files.index(truncated)  # its header passed the worker's check: the device found it
    following = (position + 1) % 10
    assert labels[position] == 2 and shown_labels[position] == labels[following] != 2
    assert shown_index[position] == batch["index"][following] != batch["index"][position]  # the image shown, its bank entry
    assert labels.tolist() == [train.labels[file] for file in batch["image"].files]  # a worker's replacement comes with its label
    assert torch.equal(images[position], images[following])
    assert datamodule.encoded_training[truncated]["file"] != truncated  # the workers skip it from now on


def test_broken_files_beyond_the_limit_stop_with_a_clear_error(tmp_path):
    datamodule = gpu_folder(write_broken_folder(tmp_path), batch_size=10, max_corrupt_fraction=0.1)
    batch = next(iter(datamodule.train_dataloader()))  # the garbage file: 1 of 10, allowed
    with pytest.raises(ValueError, match=r"2 of 10 images of .*train are unreadable, more than data.max_corrupt_fraction=0.1 allows \(1\); the latest: .*truncated.jpg"):
        datamodule.images_on_device(batch)


def test_a_batch_without_a_decodable_image_is_an_error_naming_a_file(tmp_path):
    root = write_broken_folder(tmp_path)
    datamodule = gpu_folder(root, max_corrupt_fraction=0.5)
    datamodule.setup()
    encoded = datamodule.encoded(datamodule.splits["train"])
    truncated = datamodule.splits["train"].paths.index(str(root / "train/c/truncated.jpg"))
    with pytest.raises(ValueError, match="none of the 1 images of a batch can be decoded, e.g. .*truncated.jpg"):
        encoded.decode(collate_encoded([encoded[truncated]])["image"], torch.device("cpu"))


def tiny_moco():
    from methods import MoCoV2
    from methods.momentum import MomentumSpec

    return MoCoV2(backbone=BackboneSpec(name="timm:test_resnet"), projector=TINY_PROJECTOR, queue_size=12, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)


def test_a_moco_step_trains_on_encoded_batches_from_two_workers(folder, tmp_path):
    trainer = cpu_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(tiny_moco(), gpu_folder(folder, num_workers=2))
    assert trainer.global_step == 1 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_the_representation_analysis_draws_training_views_of_a_folder_on_the_device(folder):
    report = analyse(tiny_moco(), gpu_folder(folder), split="train")
    assert report.positive.shape == (len(TRAIN_FILES),) and torch.isfinite(report.positive).all()
