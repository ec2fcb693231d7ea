"""Digits-M's arrays kept on disk (issue 37: their generation was 13-21% of a run's start) and the resident
pipeline's copy of an in-memory array: both must give the bytes that generating and decoding give."""

import numpy as np
import pytest
import torch
import torchvision
from torch.utils.data import Subset

from datamodules.base import RawImageDataset, decode_all
from datamodules.digits import ArrayImageDataset, DigitsStyle, cache_path, composite_digits, generate_digits


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CONTRASTLAB_CACHE", str(tmp_path))
    composite_digits.cache_clear()
    yield tmp_path / "digits"
    composite_digits.cache_clear()


def test_a_cached_split_is_the_generated_one_and_is_read_back_from_its_file(cache, monkeypatch):
    generated = generate_digits("test", 1, DigitsStyle())
    first = composite_digits("test", 1)
    assert cache_path("test", 1, DigitsStyle()).is_file()
    composite_digits.cache_clear()
    monkeypatch.setattr("datamodules.digits.generate_digits", lambda *args: pytest.fail("generated again despite the cache"))
    again = composite_digits("test", 1)
    for arrays in (first, again):
        assert np.array_equal(arrays[0], generated[0]) and np.array_equal(arrays[1], generated[1])
        assert arrays[0].dtype == np.uint8 and arrays[1].dtype == np.int64


def test_another_style_or_library_version_is_another_file(cache, monkeypatch):
    assert cache_path("val", 2, DigitsStyle()) != cache_path("val", 2, DigitsStyle(opacity=(0.5, 1.0)))
    assert cache_path("val", 2, DigitsStyle()) != cache_path("val", 3, DigitsStyle())
    before = cache_path("val", 2, DigitsStyle())
    monkeypatch.setattr("importlib.metadata.version", lambda package: "0.0")
    assert cache_path("val", 2, DigitsStyle()) != before


def test_an_unreadable_cache_file_is_generated_again_and_replaced(cache):
    path = cache_path("test", 1, DigitsStyle())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"<html>not an npz</html>")
    images, _ = composite_digits("test", 1)
    assert np.array_equal(images, generate_digits("test", 1, DigitsStyle())[0])
    with np.load(path) as stored:
        assert np.array_equal(stored["images"], images)
    assert list(path.parent.iterdir()) == [path]  # no partial file left


def test_an_unwritable_cache_still_gives_the_images(monkeypatch, tmp_path):
    occupied = tmp_path / "a-file"  # a cache under a file: nothing can be written there, whoever runs
    occupied.write_text("")
    monkeypatch.setenv("CONTRASTLAB_CACHE", str(occupied / "cache"))
    composite_digits.cache_clear()
    images, _ = composite_digits("test", 1)
    composite_digits.cache_clear()
    assert np.array_equal(images, generate_digits("test", 1, DigitsStyle())[0])


def decoded_image_by_image(dataset) -> torch.Tensor:
    return torch.stack([RawImageDataset(dataset)[index]["image"] for index in range(len(dataset))])


def test_the_resident_copy_of_an_array_dataset_is_the_decoded_bytes():
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, size=(20, 8, 8, 3), dtype=np.uint8), np.arange(20)
    digits = ArrayImageDataset(images, labels)
    cifar = torchvision.datasets.CIFAR10.__new__(torchvision.datasets.CIFAR10)  # torchvision's CIFAR without its files
    cifar.data, cifar.targets, cifar.transform, cifar.target_transform = images, labels.tolist(), None, None
    for dataset in (digits, Subset(digits, [5, 3, 17]), cifar, Subset(cifar, [0, 19])):
        resident, labels = decode_all(dataset, num_workers=0)
        assert resident.is_contiguous() and torch.equal(resident, decoded_image_by_image(dataset))
        assert labels.tolist() == [dataset[index][1] for index in range(len(dataset))]
