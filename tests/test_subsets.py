"""Tests of datamodules/subsets.py: SimCLR's ImageNet subset lists read against an ImageFolder-style listing, and
the stratified, seeded fraction of a labelled dataset."""

from pathlib import Path

import numpy as np
import pytest

from datamodules.folders import class_folder_samples, folder_classes
from datamodules.subsets import read_subset_list, stratified_fraction

WNIDS = ("n01440764", "n01443537", "n01484850")


@pytest.fixture
def imagenet_listing(tmp_path) -> list[str]:
    """The training listing the ImageNet DataModules keep (`ImageFiles.paths`): `train/<wnid>/<wnid>_<n>.JPEG`,
    classes and files in sorted order; the files are empty, no image is decoded."""
    for wnid in WNIDS:
        folder = tmp_path / "imagenet" / "train" / wnid
        folder.mkdir(parents=True)
        for number in (10026, 1177, 2, 309):
            (folder / f"{wnid}_{number}.JPEG").touch()
    train = tmp_path / "imagenet" / "train"
    return [path for path, _ in class_folder_samples(train, folder_classes(train))]


def simclr_list(path: Path, names: list[str]) -> Path:
    """A subset list in SimCLR's format (its `1percent.txt`): one file name per line."""
    path.write_text("".join(f"{name}\n" for name in names))
    return path


def test_a_simclr_list_gives_the_indices_of_its_file_names_in_the_order_listed(imagenet_listing, tmp_path):
    names = ["n01443537_2.JPEG", "n01440764_10026.JPEG", "n01484850_309.JPEG", "n01440764_1177.JPEG"]
    indices = read_subset_list(simclr_list(tmp_path / "1percent.txt", names), imagenet_listing)
    assert [Path(imagenet_listing[index]).name for index in indices] == names
    assert Path(imagenet_listing[indices[0]]).parent.name == "n01443537"  # its class folder


def test_blank_lines_and_surrounding_spaces_are_ignored(imagenet_listing, tmp_path):
    listed = tmp_path / "10percent.txt"
    listed.write_text("n01440764_2.JPEG\n\n  n01484850_1177.JPEG \n")
    assert len(read_subset_list(listed, imagenet_listing)) == 2


def test_a_name_not_in_the_dataset_is_one_error_naming_the_file_and_the_line(imagenet_listing, tmp_path):
    listed = simclr_list(tmp_path / "1percent.txt", ["n01440764_2.JPEG", "n01440764_99.JPEG", "n09999999_1.JPEG"])
    with pytest.raises(ValueError) as error:
        read_subset_list(listed, imagenet_listing, "the ImageNet training split")
    assert str(error.value) == (f"{listed}:2: 'n01440764_99.JPEG' is not the file name of an image of the ImageNet training split "
                                "(12 images); 1 more listed names are missing too: n09999999_1.JPEG")


@pytest.mark.parametrize(
    "lines, message",
    [
        (["n01440764_2.JPEG", "n01443537_2.JPEG", "n01440764_2.JPEG"], r"1percent.txt:3: 'n01440764_2.JPEG' is listed a second time \(first at line 1\)"),
        ([], "names no image"),
    ],
)
def test_a_name_listed_twice_or_an_empty_list_is_an_error(lines, message, imagenet_listing, tmp_path):
    with pytest.raises(ValueError, match=message):
        read_subset_list(simclr_list(tmp_path / "1percent.txt", lines), imagenet_listing)


def test_a_name_of_two_images_and_a_missing_list_are_errors(imagenet_listing, tmp_path):
    listing = [*imagenet_listing, str(tmp_path / "elsewhere" / "n01440764_2.JPEG")]
    with pytest.raises(ValueError, match=r"1percent.txt:1: 'n01440764_2.JPEG' is the file name of 2 images of the training split"):
        read_subset_list(simclr_list(tmp_path / "1percent.txt", ["n01440764_2.JPEG"]), listing)
    with pytest.raises(ValueError, match=r"subset list '.*absent.txt' is not an existing file"):
        read_subset_list(tmp_path / "absent.txt", imagenet_listing)


LABELS = np.repeat(np.arange(4), [200, 50, 7, 1])
LABELS_WITH_UNLABELLED = np.concatenate([LABELS, np.full(30, -1)])


def test_a_stratified_fraction_keeps_the_share_of_every_class_and_at_least_one_image():
    chosen = stratified_fraction(LABELS_WITH_UNLABELLED, 0.1, seed=0)
    assert np.bincount(LABELS_WITH_UNLABELLED[chosen], minlength=4).tolist() == [20, 5, 1, 1]  # 0.7 rounds to 1; never -1
    assert np.array_equal(chosen, np.unique(chosen))
    assert len(stratified_fraction(LABELS, 1.0, seed=0)) == len(LABELS)


def test_a_stratified_fraction_is_the_same_for_a_seed_and_nested_over_fractions():
    tenth = stratified_fraction(LABELS, 0.1, seed=7)
    assert np.array_equal(tenth, stratified_fraction(LABELS, 0.1, seed=7))
    assert not np.array_equal(tenth, stratified_fraction(LABELS, 0.1, seed=8))
    assert set(stratified_fraction(LABELS, 0.01, seed=7)) <= set(tenth) <= set(stratified_fraction(LABELS, 0.5, seed=7))


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_zero_to_one_is_an_error(fraction):
    with pytest.raises(ValueError, match=rf"fraction must lie in \(0, 1\], got {fraction}"):
        stratified_fraction(LABELS, fraction, seed=0)
