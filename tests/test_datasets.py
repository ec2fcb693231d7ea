"""Every dataset read from tiny fake files in its real on-disk format, through its DataModule, and the
errors a broken or missing dataset produces."""

import copy
import functools
import gzip
import hashlib
import logging
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
import torchvision
import yaml
from PIL import Image
from torch.utils.data import DataLoader

import datamodules
import main_linear
import main_pretrain
from datamodules import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    FashionMNISTDataModule,
    ImageFolderDataModule,
    ImageNet100DataModule,
    ImageNetDataModule,
    SplitFileDataModule,
    STL10DataModule,
    SVHNDataModule,
    TinyImageNetDataModule,
    UnlabeledFolderDataModule,
)
from datamodules.image_files import TooManyUnreadableImages
from datamodules.imagenet import IMAGENET100_WNIDS
from datamodules.paco_autoaugment import PacoAutoAugment
from datamodules.tcl_autoaugment import TCLAutoAugment
from datamodules.transforms import MultipleViews, build_view
from engine.config import load_yaml

ROOT = Path(__file__).parents[1]
# Wang & Liu (CVPR 2021) supplementary, Table 3, as printed (sorted, ten per row): the same CMC classes as SCE
# supplementary, Table 1, which datamodules/imagenet.py transcribes in that table's order.
WANG_LIU_TABLE_3 = """
n01558993 n01692333 n01729322 n01735189 n01749939 n01773797 n01820546 n01855672 n01978455 n01980166
n01983481 n02009229 n02018207 n02085620 n02086240 n02086910 n02087046 n02089867 n02089973 n02090622
n02091831 n02093428 n02099849 n02100583 n02104029 n02105505 n02106550 n02107142 n02108089 n02109047
n02113799 n02113978 n02114855 n02116738 n02119022 n02123045 n02138441 n02172182 n02231487 n02259212
n02326432 n02396427 n02483362 n02488291 n02701002 n02788148 n02804414 n02859443 n02869837 n02877765
n02974003 n03017168 n03032252 n03062245 n03085013 n03259280 n03379051 n03424325 n03492542 n03494278
n03530642 n03584829 n03594734 n03637318 n03642806 n03764736 n03775546 n03777754 n03785016 n03787032
n03794056 n03837869 n03891251 n03903868 n03930630 n03947888 n04026417 n04067472 n04099969 n04111531
n04127249 n04136333 n04229816 n04238763 n04336792 n04418357 n04429376 n04435653 n04485082 n04493381
n04517823 n04589890 n04592741 n07714571 n07715103 n07753275 n07831146 n07836838 n13037406 n13040303
"""
VIEWS = {"query": {"preset": "mocov2"}, "key": {"preset": "crop_flip", "count": 2}}
RNG = np.random.default_rng(0)


def pixels(*shape: int) -> np.ndarray:
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def save_image(path: Path, size: tuple[int, int] = (12, 10)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels(size[1], size[0], 3)).save(path)
    return str(path)


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def stand_in_checksums(monkeypatch, dataset_class, folder: Path) -> None:
    """The fake files replace the official ones, so their checksums replace the official checksums."""
    for attribute in ("train_list", "test_list"):
        entries = [[name, md5(folder / name)] for name, _ in getattr(dataset_class, attribute)]
        monkeypatch.setattr(dataset_class, attribute, entries)
    if hasattr(dataset_class, "meta"):
        monkeypatch.setattr(dataset_class, "meta", dataset_class.meta | {"md5": md5(folder / dataset_class.meta["filename"])})


def check_batches(datamodule, size: int, num_classes: int, batch_size: int = 4, unlabelled: bool = False) -> None:
    """One training batch (named views, count dimension, labels in range) and one evaluation batch."""
    batch = next(iter(datamodule.train_dataloader()))
    assert set(batch["views"]) == {"query", "key"}
    assert batch["views"]["query"].shape == (batch_size, 3, size, size)
    assert batch["views"]["key"].shape == (batch_size, 2, 3, size, size)
    low = -1 if unlabelled else 0
    assert batch["label"].shape == (batch_size,) and low <= batch["label"].min() and batch["label"].max() < num_classes
    evaluation = next(iter(datamodule.val_dataloader()[0]))
    assert evaluation["image"].shape[1:] == (3, size, size)
    assert 0 <= evaluation["label"].min() and evaluation["label"].max() < num_classes


# ---------------------------------------------------------------- torchvision formats
def write_cifar(root: Path, dataset_class, monkeypatch) -> Path:
    folder = root / dataset_class.base_folder
    folder.mkdir(parents=True)
    label_key = "labels" if dataset_class is torchvision.datasets.CIFAR10 else "fine_labels"
    classes = 10 if dataset_class is torchvision.datasets.CIFAR10 else 100
    for name, _ in dataset_class.train_list + dataset_class.test_list:
        batch = {"data": pixels(6, 3 * 32 * 32), label_key: RNG.integers(0, classes, 6).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    meta = {dataset_class.meta["key"]: [f"class{index}" for index in range(classes)]}
    (folder / dataset_class.meta["filename"]).write_bytes(pickle.dumps(meta))
    stand_in_checksums(monkeypatch, dataset_class, folder)
    return root


@pytest.mark.parametrize("datamodule_class", [CIFAR10DataModule, CIFAR100DataModule])
def test_cifar_loads_from_python_pickle_batches(datamodule_class, tmp_path, monkeypatch):
    write_cifar(tmp_path, datamodule_class.dataset_class, monkeypatch)
    datamodule = datamodule_class(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS)
    check_batches(datamodule, 32, datamodule.num_classes)
    assert len(datamodule.splits["train"]) == 6 * len(datamodule.dataset_class.train_list)


def write_svhn(root: Path, monkeypatch) -> Path:
    split_list = {}
    for split, (url, filename, _) in torchvision.datasets.SVHN.split_list.items():
        # the test split of other images and labels than the training split's: a split served for another shows
        labels = np.array([[3], [10], [7], [1]] if split == "test" else [[10], [1], [5], [10], [9], [2]], dtype=np.uint8)
        scipy.io.savemat(root / filename, {"X": pixels(32, 32, 3, len(labels)), "y": labels})
        split_list[split] = [url, filename, md5(root / filename)]
    monkeypatch.setattr(torchvision.datasets.SVHN, "split_list", split_list)
    return root


def test_svhn_loads_from_mat_files_with_label_10_meaning_digit_0(tmp_path, monkeypatch):
    datamodule = SVHNDataModule(root=str(write_svhn(tmp_path, monkeypatch)), batch_size=4, num_workers=0, views=VIEWS)
    check_batches(datamodule, 32, 10)
    assert [datamodule.splits["train"][index][1] for index in range(6)] == [0, 1, 5, 0, 9, 2] and len(datamodule.splits["train"]) == 6
    assert [datamodule.splits["test"][index][1] for index in range(4)] == [3, 0, 7, 1] and len(datamodule.splits["test"]) == 4
    assert datamodule.splits["val"] is datamodule.splits["test"]  # validation and test on `test`, as Wang & Liu


def write_idx(path: Path, array: np.ndarray) -> None:
    """IDX: magic (0, 0, type 0x08 = uint8, number of dimensions), the sizes as big-endian int32, the data."""
    header = bytes([0, 0, 8, array.ndim]) + np.array(array.shape, dtype=">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_fashion_mnist(root: Path, monkeypatch=None) -> Path:
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, count in (("train", 8), ("t10k", 4)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", pixels(count, 28, 28))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", RNG.integers(0, 10, count))
    return root


def test_fashion_mnist_loads_from_idx_files_as_three_channel_images(tmp_path):
    write_fashion_mnist(tmp_path)
    datamodule = FashionMNISTDataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS)
    check_batches(datamodule, 28, 10)
    image, _ = datamodule.splits["train"][0]
    channels = np.asarray(image)
    assert channels.shape == (28, 28, 3) and (channels[..., 0] == channels[..., 2]).all()  # gray, replicated
    assert [len(datamodule.splits[split]) for split in ("train", "val", "test")] == [8, 4, 4]  # train, then t10k twice


def write_stl10(root: Path, monkeypatch) -> Path:
    folder = root / torchvision.datasets.STL10.base_folder
    folder.mkdir(parents=True)
    for split, count in (("train", 6), ("test", 4), ("unlabeled", 10)):
        pixels(count, 3, 96, 96).tofile(folder / f"{split}_X.bin")
        if split != "unlabeled":
            RNG.integers(1, 11, count).astype(np.uint8).tofile(folder / f"{split}_y.bin")  # STL labels are 1..10
    stand_in_checksums(monkeypatch, torchvision.datasets.STL10, folder)
    return root


def test_stl10_pretrains_on_train_and_unlabeled_and_banks_only_the_labelled_images(tmp_path, monkeypatch):
    write_stl10(tmp_path, monkeypatch)
    datamodule = STL10DataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS)
    check_batches(datamodule, 96, 10, unlabelled=True)
    train_labels = [datamodule.splits["train"][index][1] for index in range(16)]
    assert train_labels.count(-1) == 10 and all(0 <= label < 10 for label in train_labels[:6])
    val, bank = datamodule.val_dataloader()
    assert len(val.dataset) == 4 and len(bank.dataset) == 6
    linear = STL10DataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS, train_split="train")
    linear.setup()
    assert len(linear.splits["train"]) == 6
    assert datamodule.training_labels and linear.training_labels


def test_stl10_pretraining_on_the_unlabeled_split_alone_has_no_online_probe_and_a_misspelt_split_is_refused(tmp_path, monkeypatch):
    write_stl10(tmp_path, monkeypatch)
    unlabeled = STL10DataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS, train_split="unlabeled")
    unlabeled.setup()
    assert {unlabeled.splits["train"][index][1] for index in range(10)} == {-1} and not unlabeled.training_labels  # a probe would stay at chance
    with pytest.raises(ValueError, match=r"^data.train_split 'unlabelled' is not one of STL-10's training splits train\+unlabeled, train, unlabeled$"):
        STL10DataModule(root=str(tmp_path), views=VIEWS, train_split="unlabelled")


def test_a_missing_torchvision_dataset_says_where_the_files_go_and_how_to_fetch_them(tmp_path):
    with pytest.raises(ValueError, match=r"data.root '/no/such/cifar' is not an existing directory: CIFAR10DataModule expects cifar-10-batches-py/"):
        CIFAR10DataModule(root="/no/such/cifar", views=VIEWS)  # download is off by default
    (tmp_path / "stl10_binary").mkdir()
    (tmp_path / "stl10_binary" / "train_X.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"4 files of STL10DataModule are missing under data.root: .*stl10_binary/train_y.bin, .*\(set data.download: true"):
        STL10DataModule(root=str(tmp_path), views=VIEWS)
    assert CIFAR10DataModule(root="/no/such/cifar", download=True, views=VIEWS).root == Path("/no/such/cifar")  # fetched there at setup


def test_a_corrupt_torchvision_file_is_reported_with_the_expected_layout(tmp_path, monkeypatch):
    write_cifar(tmp_path, torchvision.datasets.CIFAR10, monkeypatch)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"truncated")
    datamodule = CIFAR10DataModule(root=str(tmp_path), num_workers=0, views=VIEWS)
    with pytest.raises(ValueError, match=r"CIFAR10 files not found or corrupt under data.root '[^']*' \(cifar-10-batches-py/data_batch_3: not the "
                                         r"official file, by its MD5\): expected cifar-10-batches-py/\{data_batch_1..5"):
        datamodule.setup()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("gzipped", r"FashionMNIST files not found or corrupt under data.root '[^']*': expected FashionMNIST/raw/"),  # an AssertionError there
        ("fewer-labels", r"FashionMNIST files under data.root '[^']*' \(\{'train': True\}\) hold 8 images and 6 labels: expected"),
        ("label-out-of-range", r"hold 8 images and 8 labels, labels outside 0..9 such as 12: expected FashionMNIST/raw/"),
    ],
)
def test_a_damaged_fashion_mnist_file_is_one_error_naming_the_layout(damage, message, tmp_path):
    """Fashion-MNIST's reader checks the IDX headers with assertions and no checksum: a file still gzipped under the
    unpacked name raised a bare AssertionError, and images and labels of other counts or classes were accepted."""
    raw = write_fashion_mnist(tmp_path) / "FashionMNIST" / "raw"
    if damage == "gzipped":
        images = raw / "train-images-idx3-ubyte"
        images.write_bytes(gzip.compress(images.read_bytes()))
    else:
        labels = np.array([0, 1, 2, 3, 4, 5]) if damage == "fewer-labels" else np.array([0, 1, 2, 12, 4, 5, 6, 7])
        write_idx(raw / "train-labels-idx1-ubyte", labels)
    with pytest.raises(ValueError, match=message):
        FashionMNISTDataModule(root=str(tmp_path), num_workers=0, views=VIEWS).setup()


def test_the_cli_reports_a_corrupt_torchvision_file_in_one_line_before_training(tmp_path, monkeypatch, capsys):
    write_cifar(tmp_path, torchvision.datasets.CIFAR10, monkeypatch)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"truncated")
    with pytest.raises(SystemExit) as exit_info:
        main_pretrain.cli_main(["fit", "--config", str(ROOT / "configs/moco_cifar10.yaml"), f"--data.init_args.root={tmp_path}",
                                "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: CIFAR10 files not found or corrupt under data.root")
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------- folder formats
def write_imagenet_tree(root: Path, monkeypatch=None) -> Path:
    """An ImageNet tree with one tiny image per ImageNet-100 class and split, plus a class outside ImageNet-100."""
    for wnid in (*IMAGENET100_WNIDS, "n99999999"):
        for split in ("train", "val"):
            save_image(root / split / wnid / f"{wnid}_{split}.JPEG")
    return root


@pytest.fixture(scope="session")
def imagenet_tree(tmp_path_factory) -> Path:
    return write_imagenet_tree(tmp_path_factory.mktemp("imagenet"))


def test_imagenet100_class_list_is_table_1_of_the_sce_supplement():
    printed = WANG_LIU_TABLE_3.split()
    assert len(IMAGENET100_WNIDS) == len(set(IMAGENET100_WNIDS)) == 100
    assert sorted(IMAGENET100_WNIDS) == printed


def test_imagenet100_reads_its_classes_from_an_imagenet_tree_and_ignores_the_others(imagenet_tree):
    datamodule = ImageNet100DataModule(root=str(imagenet_tree), batch_size=4, num_workers=0, views=VIEWS, image_size=32)
    assert datamodule.num_classes == 100
    check_batches(datamodule, 32, 100)
    assert len(datamodule.splits["train"]) == len(datamodule.splits["val"]) == 100
    assert not any("n99999999" in path for path in datamodule.splits["train"].paths)
    first_path, first_label = datamodule.splits["train"].paths[0], datamodule.splits["train"].labels[0]
    assert sorted(IMAGENET100_WNIDS)[first_label] in first_path


def test_imagenet_evaluates_at_224_after_resizing_to_256(imagenet_tree):
    datamodule = ImageNetDataModule(root=str(imagenet_tree), batch_size=2, num_workers=0, views=VIEWS, knn_bank=False)
    assert datamodule.num_classes == 101  # every class folder of the tree
    assert datamodule.eval_transform.transforms[0].size == [256]
    assert next(iter(datamodule.val_dataloader()[0]))["image"].shape == (2, 3, 224, 224)


def test_a_missing_imagenet_root_says_what_belongs_there_and_where_it_comes_from():
    with pytest.raises(ValueError, match=r"data.root '/no/such/imagenet' is not an existing directory: ImageNet100DataModule expects train/<wnid>/\*.JPEG .*image-net.org"):
        ImageNet100DataModule(root="/no/such/imagenet", views=VIEWS)
    with pytest.raises(ValueError, match=r"data.root is required for TinyImageNetDataModule: the folder that holds wnids.txt"):
        TinyImageNetDataModule(views=VIEWS)


def test_a_missing_imagenet100_class_folder_is_reported_with_its_path(tmp_path):
    for wnid in IMAGENET100_WNIDS[1:]:
        (tmp_path / "train" / wnid).mkdir(parents=True)
        (tmp_path / "val" / wnid).mkdir(parents=True)
    (tmp_path / "val" / IMAGENET100_WNIDS[5]).rmdir()
    missing = ([tmp_path / "train" / IMAGENET100_WNIDS[0], tmp_path / "val" / IMAGENET100_WNIDS[0], tmp_path / "val" / IMAGENET100_WNIDS[5]])
    with pytest.raises(ValueError, match="3 class folders of ImageNet100DataModule are missing") as error:
        ImageNet100DataModule(root=str(tmp_path), views=VIEWS)
    assert all(str(path) in str(error.value) for path in missing)


def write_tiny_imagenet(root: Path, monkeypatch=None) -> Path:
    wnids = [f"n{index:08d}" for index in range(200)]
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid in wnids:
        save_image(root / "train" / wnid / "images" / f"{wnid}_0.JPEG", (64, 64))
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t63\t63\n")
    lines = []
    for index, wnid in enumerate(wnids[:8]):
        save_image(root / "val" / "images" / f"val_{index}.JPEG", (64, 64))
        lines.append(f"val_{index}.JPEG\t{wnid}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def test_tiny_imagenet_reads_the_original_layout_as_is(tmp_path):
    write_tiny_imagenet(tmp_path)
    datamodule = TinyImageNetDataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS)
    check_batches(datamodule, 64, 200)
    assert len(datamodule.splits["train"]) == 200 and len(datamodule.splits["val"]) == 8
    assert datamodule.splits["val"].labels == list(range(8))
    device = TinyImageNetDataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS, pipeline="gpu")
    assert device.resident and device.images_on_device(next(iter(device.train_dataloader())))[0].shape == (4, 3, 64, 64)  # one size: resident
    streamed = TinyImageNetDataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS, pipeline="gpu", resident=False)
    assert next(iter(streamed.train_dataloader()))["image"].shape == (4, 3, 64, 64)  # one size: raw batches work


@pytest.mark.parametrize("resident", [True, False])
def test_an_unreadable_training_image_is_replaced_with_the_label_of_its_replacement_on_the_device_too(resident, tmp_path):
    """Class 5's one image is broken: the next readable image (class 6's) takes its place with its own label, as the
    per-image pipeline serves it; the resident split once paired class 6's pixels with label 5."""
    write_tiny_imagenet(tmp_path)
    (tmp_path / "train" / "n00000005" / "images" / "n00000005_0.JPEG").write_bytes(b"not a jpeg")
    replacement = torch.from_numpy(np.array(Image.open(tmp_path / "train" / "n00000006" / "images" / "n00000006_0.JPEG").convert("RGB"))).permute(2, 0, 1)
    datamodule = TinyImageNetDataModule(root=str(tmp_path), batch_size=200, num_workers=0, views=VIEWS, pipeline="gpu", resident=resident)
    batch = next(iter(datamodule.train_dataloader()))
    images, labels, _ = datamodule.images_on_device(batch)
    position = (batch["index"] == 5).nonzero().item()
    assert labels[position].item() == 6 and torch.equal(images[position], replacement)


def test_a_missing_tiny_imagenet_validation_image_is_reported_with_its_path(tmp_path):
    write_tiny_imagenet(tmp_path)
    (tmp_path / "val" / "images" / "val_3.JPEG").unlink()
    with pytest.raises(ValueError, match=r"1 validation images listed in .*val_annotations.txt do not exist: .*val_3.JPEG"):
        TinyImageNetDataModule(root=str(tmp_path), views=VIEWS)


def test_image_folder_and_unlabeled_folder_serve_users_own_images(tmp_path):
    for split in ("train", "val"):
        for name in ("cat", "dog", "owl"):
            for index in range(2):
                save_image(tmp_path / "labelled" / split / name / f"{index}.png")
    for index in range(4):
        save_image(tmp_path / "raw" / f"batch{index % 2}" / f"{index}.jpg")
    for split in ("train", "val"):
        (tmp_path / "labelled" / split / ".ipynb_checkpoints").mkdir()  # a hidden folder is no class folder
    labelled = ImageFolderDataModule(root=str(tmp_path / "labelled"), batch_size=4, num_workers=0, views=VIEWS, image_size=24)
    assert labelled.classes == ["cat", "dog", "owl"] and labelled.num_classes == 3
    check_batches(labelled, 24, 3)
    save_image(tmp_path / "labelled" / "val" / "fox" / "0.png")  # a class the training folder lacks
    fox = rf"^1 class folders are not among the training folder's classes: {re.escape(str(tmp_path / 'labelled' / 'val' / 'fox'))}"
    with pytest.raises(ValueError, match=fox):
        ImageFolderDataModule(root=str(tmp_path / "labelled"), views=VIEWS)
    with pytest.raises(ValueError, match=fox):  # the evaluation folder of unlabelled images: its fox images were left out
        UnlabeledFolderDataModule(root=str(tmp_path / "raw"), eval_root=str(tmp_path / "labelled"), views=VIEWS)
    (tmp_path / "labelled" / "val" / "fox" / "0.png").unlink()
    (tmp_path / "labelled" / "val" / "fox").rmdir()
    unlabelled = UnlabeledFolderDataModule(root=str(tmp_path / "raw"), batch_size=4, num_workers=0, views=VIEWS, image_size=24)
    assert next(iter(unlabelled.train_dataloader()))["label"].tolist() == [-1] * 4
    without_labels = UnlabeledFolderDataModule(root=str(tmp_path / "raw"), num_workers=0, views=VIEWS, label_subset={"fraction": 0.5})
    with pytest.raises(ValueError, match=r"^data.label_subset.fraction 0.5: .* has no labelled images \(every label is -1\)$"):
        without_labels.setup()
    assert unlabelled.val_dataloader() == []
    monitored = UnlabeledFolderDataModule(
        root=str(tmp_path / "raw"), eval_root=str(tmp_path / "labelled"), batch_size=4, num_workers=0, views=VIEWS, image_size=24
    )
    check_batches(monitored, 24, 3, unlabelled=True)
    assert len(monitored.val_dataloader()[1].dataset) == 6  # the labelled training images are the kNN bank


def test_image_folders_of_varying_sizes_draw_their_views_on_the_device(tmp_path):
    for split in ("train", "val"):
        for index, name in enumerate(("cat", "dog", "owl", "emu")):
            save_image(tmp_path / split / name / f"{index}.jpg", (12 + 9 * index, 30 - 5 * index))
    datamodule = ImageFolderDataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS, image_size=24, pipeline="gpu")
    batch = datamodule.augment_on_device(next(iter(datamodule.train_dataloader())))
    assert batch["views"]["query"].shape == (4, 3, 24, 24) and batch["views"]["key"].shape == (4, 2, 3, 24, 24)
    assert sorted(batch["label"].tolist()) == [0, 1, 2, 3]


def write_split_files(root: Path, train_labels: list[int], val_labels: list[int]) -> tuple[Path, Path]:
    files = []
    for split, labels in (("train", train_labels), ("val", val_labels)):
        lines = [f"{split}/{label}/{split}_{index}.jpg {label}" for index, label in enumerate(labels)]
        for line in lines:
            save_image(root / line.split()[0])
        files.append(root / f"{split}.txt")
        files[-1].write_text("\n".join(lines) + "\n")
    return files[0], files[1]


def test_split_files_list_images_relative_to_the_root(tmp_path):
    train_file, val_file = write_split_files(tmp_path, [0, 0, 0, 1, 2, 2], [0, 1, 2])
    datamodule = SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), batch_size=4, num_workers=0, views=VIEWS, image_size=24)
    assert datamodule.num_classes == 3  # the largest training label + 1
    check_batches(datamodule, 24, 3)
    assert datamodule.splits["train"].labels == [0, 0, 0, 1, 2, 2] and len(datamodule.splits["test"]) == 3


def test_a_split_file_label_out_of_range_names_the_file_and_line(tmp_path):
    train_file, val_file = write_split_files(tmp_path, [0, 1, 2], [0, 7, 1])
    with pytest.raises(ValueError, match=rf"{re.escape(str(val_file))}:2: label 7 is outside \[0, 3\)"):
        SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), views=VIEWS)
    with pytest.raises(ValueError, match=rf"{re.escape(str(train_file))}:3: label 2 is outside \[0, 2\)"):
        SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), num_classes=2, views=VIEWS)


@pytest.mark.parametrize("label", ["dog", "--1", "1\u00b2", "+3"])  # '--1' and a superscript passed a digit test, then failed in int()
def test_a_malformed_split_file_line_is_named(label, tmp_path):
    train_file, val_file = write_split_files(tmp_path, [0, 1], [0, 1])
    train_file.write_text(train_file.read_text() + f"train/0/extra.jpg {label}\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(train_file))}:3: expected '<relative path> <integer label>'"):
        SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), views=VIEWS)


def test_an_image_listed_twice_in_a_split_file_is_named_with_both_lines(tmp_path):
    """Listed twice it would be trained on twice an epoch, or under two labels."""
    train_file, val_file = write_split_files(tmp_path, [0, 1], [0, 1])
    first = train_file.read_text().splitlines()[0].rsplit(maxsplit=1)[0]
    train_file.write_text(train_file.read_text() + f"{first} 1\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(train_file))}:3: {re.escape(first)} is listed again \(first at line 1\)$"):
        SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), views=VIEWS)


def test_split_file_images_that_do_not_exist_are_listed_before_training(tmp_path):
    train_file, val_file = write_split_files(tmp_path, [0, 1, 1], [0, 1])
    (tmp_path / "train/1/train_2.jpg").unlink()
    with pytest.raises(ValueError, match=r"1 images named in the split files do not exist .*train/1/train_2.jpg " + re.escape(f"({train_file}:3)")):
        SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), views=VIEWS)


def empty_class(dataset: str, root: Path) -> tuple:
    """A dataset of the given format with one class that has no image: how to build it and the path or label the error names."""
    if dataset == "image_folder":
        for name in ("cat", "dog", "owl"):
            for split in ("train", "val"):
                save_image(root / split / name / "0.png")
        (root / "train" / "dog" / "0.png").unlink()
        return lambda: ImageFolderDataModule(root=str(root), views=VIEWS), str(root / "train" / "dog")
    if dataset == "tiny_imagenet":
        write_tiny_imagenet(root)
        (root / "train" / "n00000007" / "images" / "n00000007_0.JPEG").unlink()  # its boxes file stays
        return lambda: TinyImageNetDataModule(root=str(root), views=VIEWS), str(root / "train" / "n00000007")
    if dataset == "unlabeled_folder_eval_root":
        for path in ("labelled/train/cat/0.png", "labelled/train/dog/0.png", "labelled/val/cat/0.png", "raw/0.jpg"):
            save_image(root / path)
        (root / "labelled" / "val" / "dog").mkdir(parents=True)
        return lambda: UnlabeledFolderDataModule(root=str(root / "raw"), eval_root=str(root / "labelled"), views=VIEWS), str(root / "labelled" / "val" / "dog")
    train_file, val_file = write_split_files(root, [0, 0, 2], [0, 1, 2])  # split_file: label 1 has no training image
    return lambda: SplitFileDataModule(root=str(root), train_file=str(train_file), val_file=str(val_file), views=VIEWS), "none of label 1"


@pytest.mark.parametrize("dataset", ["image_folder", "tiny_imagenet", "unlabeled_folder_eval_root", "split_file"])
def test_a_class_without_images_is_refused_naming_it_in_every_folder_based_format(dataset, tmp_path):
    build, named = empty_class(dataset, tmp_path)
    with pytest.raises(ValueError) as error:
        build().setup()
    assert named in str(error.value) and str(error.value).count("\n") == 0


def test_an_emptied_imagenet100_class_folder_is_one_error_line_before_anything_is_written(tmp_path, capsys):
    tree = write_imagenet_tree(tmp_path / "imagenet")
    (tree / "train" / "n01558993" / "n01558993_train.JPEG").unlink()
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main_pretrain.cli_main(["fit", "--config", str(ROOT / "configs/sce_imagenet100.yaml"), f"--data.init_args.root={tree}", "--data.init_args.batch_size=8",
                                "--data.init_args.num_workers=0", "--data.init_args.image_size=32", "--model.init_args.backbone.name=timm:test_resnet",
                                "--model.init_args.queue_size=16", "--model.init_args.projector.hidden_dim=32", "--trainer.fast_dev_run=1",
                                "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.sync_batchnorm=false",
                                "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: 1 of the 100 class folders of ImageNet100DataModule hold no image "
        f"(extensions .jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp): {tree / 'train' / 'n01558993'}")
    assert not run_dir.exists()


# ---------------------------------------------------------------- unreadable images
def folder_with_corrupt_images(root: Path, corrupt: int) -> ImageFolderDataModule:
    for name in ("a", "b"):
        for index in range(5):
            save_image(root / "train" / name / f"{index}.jpg")
            save_image(root / "val" / name / f"{index}.jpg")
    for index in range(corrupt):
        (root / "train" / "a" / f"{index}.jpg").write_bytes(b"not a jpeg")
    return root


def test_an_unreadable_image_is_logged_counted_and_replaced_by_the_next_one(tmp_path, caplog):
    folder_with_corrupt_images(tmp_path, corrupt=2)
    datamodule = ImageFolderDataModule(root=str(tmp_path), batch_size=2, num_workers=0, views=VIEWS, max_corrupt_fraction=0.2)
    datamodule.setup()
    train = datamodule.splits["train"]
    with caplog.at_level(logging.WARNING, logger="datamodules.image_files"):
        replacement, label = train[0]
    assert train.corrupt_count == 2 and str(tmp_path / "train/a/0.jpg") in caplog.text
    assert np.array_equal(np.asarray(replacement), np.asarray(train[2][0])) and label == train.labels[2]
    for index in range(2):  # readable now, and of another size: a worker that read them again would serve them
        save_image(tmp_path / "train" / "a" / f"{index}.jpg", size=(9, 7))
    served = [image for batch in DataLoader(train, batch_size=5, num_workers=2, collate_fn=list) for image, _ in batch]
    assert len(served) == 10 and all(np.array_equal(np.asarray(served[index]), np.asarray(replacement)) for index in range(2))  # skipped by the workers too


def test_an_unreadable_image_of_a_labelled_subset_is_replaced_from_the_subset(tmp_path):
    """A labelled fraction or a long-tailed cut (`datamodules.image_files.subset`) trains on its own images only."""
    from datamodules.encoded import EncodedImages
    from datamodules.image_files import FilesSubset, subset

    folder_with_corrupt_images(tmp_path, corrupt=2)  # train/a/0.jpg and 1.jpg
    datamodule = ImageFolderDataModule(root=str(tmp_path), batch_size=2, num_workers=0, views=VIEWS, max_corrupt_fraction=0.2)
    datamodule.setup()
    files = datamodule.splits["train"]
    part = subset(files, [1, 4, 7])  # a/1 (unreadable), a/4, b/2
    assert isinstance(part, FilesSubset)
    replacement, label = part[0]
    assert np.array_equal(np.asarray(replacement), np.asarray(files[4][0])) and label == files.labels[4]  # not a/2, outside it
    assert EncodedImages.of(part, "test")[0]["file"] == 4  # the same on the device pipeline's reads


def test_unreadable_images_beyond_the_limit_stop_with_a_clear_error(tmp_path):
    folder_with_corrupt_images(tmp_path, corrupt=1)
    datamodule = ImageFolderDataModule(root=str(tmp_path), batch_size=10, num_workers=0, views=VIEWS)
    with pytest.raises(ValueError, match=r"1 of 10 images of .*train are unreadable, more than data.max_corrupt_fraction=0.01 allows \(0\); the latest: .*a/0.jpg"):
        next(iter(datamodule.train_dataloader()))


@pytest.mark.parametrize("pipeline, workers", [("cpu", 2), ("gpu", 0)], ids=["decoded-in-dataloader-workers", "decoded-on-the-device"])
def test_more_unreadable_images_than_allowed_end_the_cli_run_with_one_error_line(pipeline, workers, tmp_path, capsys):
    folder_with_corrupt_images(tmp_path / "images", corrupt=5)
    config = yaml.safe_load((ROOT / "configs/moco_digits.yaml").read_text())
    config["data"] = {"class_path": "datamodules.ImageFolderDataModule", "init_args": {
        "root": str(tmp_path / "images"), "image_size": 24, "batch_size": 8, "num_workers": workers, "pipeline": pipeline,
        "max_corrupt_fraction": 0.2, "views": config["data"]["init_args"]["views"]}}
    (tmp_path / "folder.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main_pretrain.cli_main(["fit", "--config", str(tmp_path / "folder.yaml"), "--trainer.fast_dev_run=1", "--trainer.precision=32-true",
                                "--model.init_args.momentum.split_bn=2", f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"error: \d+ of 10 images of {re.escape(str(tmp_path / 'images' / 'train'))} are unreadable, more than "
                        r"data.max_corrupt_fraction=0.2 allows \(2\); the latest: .*\.jpg \(.+\)", lines[-1])
    assert not any("Traceback" in line for line in lines)


def test_empty_files_named_by_a_split_file_beyond_the_limit_are_counted_before_training(tmp_path):
    train_file, val_file = write_split_files(tmp_path, [0, 0, 1, 1], [0, 1])
    for name in ("train/0/train_0.jpg", "train/1/train_3.jpg"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(TooManyUnreadableImages, match=rf"^2 of 4 images of {re.escape(str(train_file))} are empty files, more than "
                                                      r"data.max_corrupt_fraction=0.25 allows \(1\): .*train_0.jpg, .*train_3.jpg$"):
        SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), views=VIEWS, max_corrupt_fraction=0.25)
    SplitFileDataModule(root=str(tmp_path), train_file=str(train_file), val_file=str(val_file), views=VIEWS, max_corrupt_fraction=0.5)


def test_the_unreadable_count_is_shared_by_the_dataloader_workers(tmp_path):
    folder_with_corrupt_images(tmp_path, corrupt=3)
    datamodule = ImageFolderDataModule(root=str(tmp_path), num_workers=0, views=VIEWS, max_corrupt_fraction=0.5)
    datamodule.setup()
    train = datamodule.splits["train"]
    for _ in DataLoader(train, batch_size=1, num_workers=2, collate_fn=list, sampler=[0, 1, 2, 3]):
        pass
    assert train.corrupt_count == 3


# ---------------------------------------------------------------- the shipped configs on fake copies of their datasets
FAKE_DATASETS = {
    CIFAR10DataModule: lambda root, monkeypatch: write_cifar(root, torchvision.datasets.CIFAR10, monkeypatch),
    CIFAR100DataModule: lambda root, monkeypatch: write_cifar(root, torchvision.datasets.CIFAR100, monkeypatch),
    SVHNDataModule: write_svhn,
    FashionMNISTDataModule: write_fashion_mnist,
    STL10DataModule: write_stl10,
    TinyImageNetDataModule: write_tiny_imagenet,
    ImageNetDataModule: write_imagenet_tree,
    ImageNet100DataModule: write_imagenet_tree,
}


@functools.cache  # each config is read once: collection asks for most of them several times
def read_config(config: Path) -> dict:
    return load_yaml(config.read_text())  # libyaml's parser


def config_data(config: Path) -> tuple[type, dict]:
    data = copy.deepcopy(read_config(config)["data"])  # a copy: a DataModule may change what it is given
    return getattr(datamodules, data["class_path"].rsplit(".", 1)[-1]), data.get("init_args", {})


FILE_CONFIGS = [config for config in sorted(ROOT.glob("configs/*.yaml")) if config_data(config)[0] in FAKE_DATASETS]


@pytest.mark.parametrize("config", FILE_CONFIGS, ids=[config.name for config in FILE_CONFIGS])
@pytest.mark.slow
def test_every_shipped_config_builds_its_views_on_a_fake_copy_of_its_dataset(config, tmp_path, monkeypatch):
    datamodule_class, init_args = config_data(config)
    root = FAKE_DATASETS[datamodule_class](tmp_path, monkeypatch)
    if "list_file" in init_args.get("label_subset", {}):  # a SimCLR subset list (fine-tuning): one naming every fake image
        listed = tmp_path / "subset.txt"
        listed.write_text("".join(f"{image.name}\n" for image in sorted((root / "train").rglob("*.JPEG"))))
        init_args = init_args | {"label_subset": {"list_file": str(listed)}}
    datamodule = datamodule_class(**(init_args | {"root": str(root), "batch_size": 2, "num_workers": 0}))
    batch = datamodule.augment_on_device(next(iter(datamodule.train_dataloader())))
    assert set(batch["views"]) == set(init_args["views"])
    assert all(images.shape[0] == 2 and images.shape[-3] == 3 for images in batch["views"].values())
    evaluation = next(iter(datamodule.val_dataloader()[0]))
    assert evaluation["image"].shape[1] == 3 and evaluation["label"].max() < datamodule.num_classes


TCL_AUTOAUGMENT_CONFIGS = [
    config for config in FILE_CONFIGS
    if config_data(config)[0] in (CIFAR10DataModule, CIFAR100DataModule, ImageNet100DataModule)
    and any(view["preset"] == "autoaugment" for view in config_data(config)[1]["views"].values())
]


@pytest.mark.parametrize("config", TCL_AUTOAUGMENT_CONFIGS, ids=[config.name for config in TCL_AUTOAUGMENT_CONFIGS])
def test_cifar_and_imagenet100_configs_apply_the_cifar10_autoaugment_policy(config, tmp_path, monkeypatch):
    """TCL's data_augmentation/auto_augment.py (the AutoAugment of its CIFAR and ImageNet-100 runs, train.py)
    is the CIFAR-10 policy with its own operations (`operations: tcl`), which its configs and SupCon's use."""
    datamodule_class, init_args = config_data(config)
    root = FAKE_DATASETS[datamodule_class](tmp_path, monkeypatch)
    datamodule = datamodule_class(**(init_args | {"root": str(root), "num_workers": 0}))
    steps = [
        step
        for view in datamodule.views.values()
        for step in (view.transform if isinstance(view, MultipleViews) else view).transforms
        if isinstance(step, (torchvision.transforms.v2.AutoAugment, TCLAutoAugment))
    ]
    assert steps and all(isinstance(step, TCLAutoAugment) for step in steps)


PACO_CIFAR_LT_CONFIGS = [ROOT / "configs" / f"{name}.yaml" for name in ("paco_cifar10_lt", "paco_cifar100_lt", "ce_cifar100_lt", "balanced_softmax_cifar100_lt")]
VIEW_DEFAULTS = {"size": 32, "mean": (0.5,) * 3, "std": (0.5,) * 3}


@pytest.mark.parametrize("config", PACO_CIFAR_LT_CONFIGS, ids=lambda config: config.name)
def test_paco_cifar_lt_configs_run_paco_s_autoaugment_operations(config):
    """PaCo/LT/paco_cifar.py's query view: PaCo/LT/autoaug.py CIFAR10Policy."""
    views = [build_view(name, spec, VIEW_DEFAULTS) for name, spec in config_data(config)[1]["views"].items() if spec["preset"] == "autoaugment"]
    steps = [step for view in views for step in view.transforms if isinstance(step, (torchvision.transforms.v2.AutoAugment, PacoAutoAugment))]
    assert steps and all(isinstance(step, PacoAutoAugment) for step in steps)


def test_an_autoaugment_fill_outside_the_grey_levels_is_refused():
    with pytest.raises(ValueError, match=r"autoaugment fill must lie in \[0, 255\] \(a grey level of the uint8 image\), got 300"):
        build_view("query", {"preset": "autoaugment", "fill": 300}, VIEW_DEFAULTS)


IMAGENET100_CONFIGS = sorted(ROOT.glob("configs/*_imagenet100.yaml"))


def stand_in_config(tmp_path: Path) -> Path:
    """A pretraining config on ImageNet-100 made from the MoCo CIFAR-10 one, for while no
    `configs/*_imagenet100.yaml` is shipped."""
    config = yaml.safe_load((ROOT / "configs/moco_cifar10.yaml").read_text())
    config["data"]["class_path"] = "datamodules.ImageNet100DataModule"
    config["model"]["init_args"]["backbone"] = {"name": "resnet18"}
    path = tmp_path / "moco_imagenet100.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("config", IMAGENET100_CONFIGS or [None], ids=[path.name for path in IMAGENET100_CONFIGS] or ["stand-in"])
@pytest.mark.slow
def test_every_imagenet100_config_runs_a_step_on_a_fake_tree(config, imagenet_tree, tmp_path):
    config = config or stand_in_config(tmp_path)
    linear = config.name.startswith("linear_")
    model_args = yaml.safe_load(config.read_text())["model"]["init_args"]
    small_model = [f"--model.init_args.{key}=16" for key in ("queue_size",) if key in model_args]
    small_model += ["--model.init_args.projector.hidden_dim=32"] if "projector" in model_args else []
    small_model += ["--model.init_args.random_init=true"] if linear else ["--model.init_args.channels_last=false"]
    cli = (main_linear if linear else main_pretrain).cli_main(
        [
            "fit", "--config", str(config),
            f"--data.init_args.root={imagenet_tree}",
            "--data.init_args.batch_size=8",  # split BatchNorm configs need 8 groups
            "--data.init_args.num_workers=0",
            "--data.init_args.image_size=32",
            "--model.init_args.backbone.name=timm:test_resnet",
            *small_model,
            "--trainer.fast_dev_run=1",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            "--trainer.sync_batchnorm=false",
            "--trainer.precision=32-true",  # bf16 autocast is slow on a CPU
            f"--trainer.default_root_dir={tmp_path / 'run'}",
        ]
    )
    assert cli.trainer.global_step == 1 and cli.datamodule.num_classes == 100
    assert all(torch.isfinite(value) for name, value in cli.trainer.callback_metrics.items() if name.startswith("train/"))


def test_a_pretraining_on_unlabelled_images_reports_the_knn_monitor_and_no_online_probe(tmp_path):
    """The online probe learns from the training batches' labels: on unlabelled images it never trained, and its
    chance-level accuracy read as the run's result."""
    from helpers import cpu_trainer
    from test_moco import MOCO_VIEWS, tiny_moco

    for split in ("train", "val"):
        for name in ("cat", "dog", "owl"):
            for index in range(2):
                save_image(tmp_path / "labelled" / split / name / f"{index}.png")
    for index in range(8):
        save_image(tmp_path / "raw" / f"{index}.jpg")
    datamodule = UnlabeledFolderDataModule(root=str(tmp_path / "raw"), eval_root=str(tmp_path / "labelled"), batch_size=4, num_workers=0,
                                           views=MOCO_VIEWS, image_size=24)
    trainer = cpu_trainer(tmp_path, max_steps=2)
    with pytest.warns(UserWarning, match="val/probe_\\* are not reported"):
        trainer.fit(tiny_moco(num_classes=datamodule.num_classes, knn_k=3), datamodule)
    assert "val/knn_top1" in trainer.callback_metrics and not [name for name in trainer.callback_metrics if name.startswith("val/probe_")]
