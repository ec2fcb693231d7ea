"""Long-tailed data: LDAM-DRW's class profile and kept images, the LT DataModules (CIFAR on fake pickle
batches, Digits-M, split files on fake trees), training class counts and Kang et al.'s samplers."""

import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torchvision
from torch.utils.data import DistributedSampler, Subset

from datamodules import (
    CIFAR10LTDataModule,
    CIFAR100LTDataModule,
    DigitsDataModule,
    DigitsLTDataModule,
    ImageNetLTDataModule,
    INaturalist2018DataModule,
    PlacesLTDataModule,
)
from datamodules.digits import ArrayImageDataset
from datamodules.longtail import long_tail_counts, long_tail_indices
from datamodules.samplers import ClassPrioritySampler, EpochSampler, class_sampling_probabilities
from datamodules.torchvision_datasets import RGBImages
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer
from methods import MoCoV2
from methods.momentum import MomentumSpec
from test_datasets import save_image, stand_in_checksums

VIEWS = {"query": {"preset": "crop_flip"}, "key": {"preset": "crop_flip"}}
RNG = np.random.default_rng(0)


# ---------------------------------------------------------------- the class profile
@pytest.mark.parametrize("ratio, total", [(100, 10_847), (50, 12_608), (10, 19_573)])
def test_cifar100_lt_totals_are_those_of_ldam_drw_and_paco(ratio, total):
    counts = long_tail_counts(100, 500, ratio)
    assert sum(counts) == total
    assert counts[0] == 500 and counts[-1] == 500 // ratio
    assert all(head >= tail for head, tail in zip(counts, counts[1:]))


def test_the_profile_truncates_float_powers_in_natural_class_order():
    assert long_tail_counts(100, 500, 100)[:5] == [500, 477, 455, 434, 415]
    assert long_tail_counts(10, 5000, 100) == [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]  # CIFAR-10-LT (kaidic/LDAM-DRW imbalance_cifar.py at ratio 100)
    assert long_tail_counts(4, 7, 1) == [7, 7, 7, 7]


@pytest.mark.parametrize(
    "args, message",
    [
        ((100, 500, 0.5), "data.imbalance_ratio (head / tail images) must be >= 1, got 0.5"),
        ((100, 0, 100), "data.max_count must be >= 1, got 0"),
        ((1, 500, 100), "at least 2 classes (data.num_classes), got 1"),
        ((100, 500, float("nan")), "data.imbalance_ratio (head / tail images) must be >= 1, got nan"),
        ((10, 5000, 10000), "data.imbalance_ratio 10000 with data.max_count 5000 keeps no image of class 9 (int(5000 / 10000^(9 / 9)) = 0): "
                            "lower the ratio or raise max_count"),
    ],
)
def test_bad_profile_values_name_their_config_key(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        long_tail_counts(*args)


def test_the_long_tail_seed_draws_which_images_each_class_keeps():
    labels = np.repeat(np.arange(3), 50)
    kept = {seed: long_tail_indices(labels, [40, 10, 3], seed=seed) for seed in (0, 0, 1)}
    assert [int((labels[kept[0]] == c).sum()) for c in range(3)] == [40, 10, 3]
    assert np.array_equal(long_tail_indices(labels, [40, 10, 3], seed=0), kept[0]) and not np.array_equal(kept[0], kept[1])
    assert np.array_equal(np.sort(labels[kept[1]]), np.sort(labels[kept[0]]))  # the same counts, other images


def test_a_negative_long_tail_seed_names_its_config_key():
    with pytest.raises(ValueError, match=re.escape("data.long_tail_seed must be in [0, 2**32), got -1")):
        long_tail_indices(np.array([0, 1, 1]), [1, 1], seed=-1)


# ---------------------------------------------------------------- CIFAR-LT from the balanced pickle batches
def write_cifar_batches(root: Path, dataset_class, train_labels: np.ndarray, monkeypatch) -> np.ndarray:
    """The official pickle batches holding `train_labels` (split over the training batches) and 10 test
    images per class; returns the training pixels."""
    folder = root / dataset_class.base_folder
    folder.mkdir(parents=True)
    cifar10 = dataset_class is torchvision.datasets.CIFAR10
    label_key, classes = ("labels", 10) if cifar10 else ("fine_labels", 100)
    train_pixels = RNG.integers(0, 256, (len(train_labels), 3 * 32 * 32), dtype=np.uint8)
    train_parts = zip(np.array_split(train_pixels, len(dataset_class.train_list)), np.array_split(train_labels, len(dataset_class.train_list)))
    test_labels = np.repeat(np.arange(classes), 10)
    batches = [*train_parts, (RNG.integers(0, 256, (len(test_labels), 3 * 32 * 32), dtype=np.uint8), test_labels)]
    for (name, _), (data, labels) in zip(dataset_class.train_list + dataset_class.test_list, batches):
        (folder / name).write_bytes(pickle.dumps({"data": data, label_key: labels.tolist()}))
    meta = {dataset_class.meta["key"]: [f"class{index}" for index in range(classes)]}
    (folder / dataset_class.meta["filename"]).write_bytes(pickle.dumps(meta))
    stand_in_checksums(monkeypatch, dataset_class, folder)
    return train_pixels


def ldam_drw_selection(targets: list[int], img_num_per_cls: list[int]) -> np.ndarray:
    """`IMBALANCECIFAR10.gen_imbalanced_data` of kaidic/LDAM-DRW `imbalance_cifar.py`, transcribed."""
    np.random.seed(0)
    targets_np = np.array(targets, dtype=np.int64)
    selected = []
    for the_class, the_img_num in zip(np.unique(targets_np), img_num_per_cls):
        idx = np.where(targets_np == the_class)[0]
        np.random.shuffle(idx)
        selected.append(idx[:the_img_num])
    return np.concatenate(selected)


@pytest.mark.parametrize("datamodule_class", [CIFAR10LTDataModule, CIFAR100LTDataModule])
def test_cifar_lt_keeps_the_images_ldam_drw_keeps_and_evaluates_on_the_balanced_test_set(datamodule_class, tmp_path, monkeypatch):
    classes = datamodule_class.num_classes
    train_labels = RNG.permutation(np.repeat(np.arange(classes), 12))
    train_pixels = write_cifar_batches(tmp_path, datamodule_class.dataset_class, train_labels, monkeypatch)
    datamodule = datamodule_class(root=str(tmp_path), imbalance_ratio=10, max_count=12, batch_size=4, num_workers=0, views=VIEWS)
    expected_counts = long_tail_counts(classes, 12, 10)
    assert datamodule.train_class_counts() == expected_counts
    train = datamodule.splits["train"]
    assert np.array_equal(train.indices, ldam_drw_selection(train_labels.tolist(), expected_counts))
    first_image, first_label = train[0]
    assert np.array_equal(np.asarray(first_image).transpose(2, 0, 1).ravel(), train_pixels[train.indices[0]]) and first_label == 0
    assert len(datamodule.splits["test"]) == 10 * classes  # evaluation stays balanced
    validation, bank = datamodule.val_dataloader()
    assert len(validation.dataset) == 10 * classes and len(bank.dataset) == sum(expected_counts)  # the kNN bank is long-tailed


def test_a_class_with_fewer_images_than_requested_is_named_with_both_counts(tmp_path, monkeypatch):
    write_cifar_batches(tmp_path, torchvision.datasets.CIFAR100, np.repeat(np.arange(100), 12), monkeypatch)
    datamodule = CIFAR100LTDataModule(root=str(tmp_path), batch_size=4, num_workers=0, views=VIEWS)
    assert datamodule.kept_per_class[:2] == [500, 477]  # by default every image of the head class of the real set
    with pytest.raises(ValueError, match="class 0 has 12 training images, fewer than the 500 the long-tailed split requests; lower data.max_count"):
        datamodule.setup()


# ---------------------------------------------------------------- Digits-M-LT and the class counts
def test_digits_lt_cuts_the_training_split_and_keeps_validation_and_test():
    options = dict(num_workers=0, views=VIEWS, train_variants=1, eval_variants=1)
    datamodule = DigitsLTDataModule(imbalance_ratio=10, max_count=100, **options)
    balanced = DigitsDataModule(**options)
    assert datamodule.train_class_counts() == long_tail_counts(10, 100, 10) == [100, 77, 59, 46, 35, 27, 21, 16, 12, 10]
    assert balanced.train_class_counts() == [117, 120, 109, 130, 116, 119, 118, 130, 120, 118]
    for split in ("val", "test"):
        assert np.array_equal(datamodule.splits[split].labels, balanced.splits[split].labels)
    assert DigitsLTDataModule(views=VIEWS).kept_per_class == [400, 239, 143, 86, 51, 30, 18, 11, 6, 4]


def test_train_class_counts_read_labels_through_wrappers_and_skip_unlabelled_images():
    datamodule = DigitsDataModule(num_workers=0, views=VIEWS, train_variants=1, eval_variants=1)
    labels = np.array([0, 2, -1, 2, 9, -1, 2])
    images = np.zeros((len(labels), 4, 4, 3), dtype=np.uint8)
    datamodule.splits = {"train": RGBImages(Subset(ArrayImageDataset(images, labels), [1, 2, 3, 4, 5]))}
    assert datamodule.train_class_counts() == [0, 0, 2, 0, 0, 0, 0, 0, 0, 1]


# ---------------------------------------------------------------- split-file LT datasets
def write_lists(root: Path, names: dict[str, str], labels: dict[str, list[int]], list_dir: Path | None = None) -> None:
    """Split files named `names[split]` in `list_dir` (default: `root`), listing one tiny image under
    `root` per label."""
    for split, name in names.items():
        lines = [f"{split}/{label}/{index}.jpg {label}" for index, label in enumerate(labels[split])]
        for line in lines:
            save_image(root / line.split()[0])
        (list_dir or root).joinpath(name).write_text("\n".join(lines) + "\n")


def test_imagenet_lt_reads_its_lists_under_the_root_and_evaluates_at_224_after_resizing_to_256(tmp_path):
    names = {split: f"ImageNet_LT_{split}.txt" for split in ("train", "val", "test")}
    write_lists(tmp_path, names, {"train": [0, 0, 0, 0, 1, 1, 2], "val": [0, 1, 2], "test": [0, 1, 2, 2]})
    datamodule = ImageNetLTDataModule(root=str(tmp_path), num_classes=3, batch_size=2, num_workers=0, views=VIEWS, knn_bank=False)
    assert datamodule.train_class_counts() == [4, 2, 1]
    assert len(datamodule.splits["val"]) == 3 and len(datamodule.splits["test"]) == 4
    assert datamodule.eval_transform.transforms[0].size == [256]
    assert next(iter(datamodule.val_dataloader()[0]))["image"].shape == (2, 3, 224, 224)


def test_inaturalist_tests_on_its_validation_list_with_its_own_normalisation(tmp_path):
    names = {"train": "iNaturalist18_train.txt", "val": "iNaturalist18_val.txt"}
    write_lists(tmp_path, names, {"train": [0, 1, 1, 1], "val": [0, 1]})
    datamodule = INaturalist2018DataModule(root=str(tmp_path), num_classes=2, num_workers=0, views=VIEWS)
    assert datamodule.split_files["test"] == datamodule.split_files["val"] == tmp_path / "iNaturalist18_val.txt"
    assert datamodule.mean == (0.466, 0.471, 0.380) and datamodule.std == (0.195, 0.194, 0.192)
    assert datamodule.train_class_counts() == [1, 3]


def test_places_lt_accepts_lists_outside_the_root_and_refuses_a_training_list_missing_classes(tmp_path):
    root, lists = tmp_path / "places365", tmp_path / "lists"
    root.mkdir(), lists.mkdir()
    names = {split: f"Places_LT_{split}.txt" for split in ("train", "val", "test")}
    write_lists(root, names, {"train": [0, 1, 1, 2], "val": [0, 1, 2, 2], "test": [0, 1, 2, 2]}, list_dir=lists)
    absolute = {f"{split}_file": str(lists / name) for split, name in names.items()}
    assert PlacesLTDataModule(root=str(root), num_classes=3, num_workers=0, views=VIEWS, **absolute).train_class_counts() == [1, 2, 1]
    with pytest.raises(ValueError, match=re.escape(f"data.train_file {absolute['train_file']!r} has images of 3 classes, but data.num_classes is 4")):
        PlacesLTDataModule(root=str(root), num_classes=4, views=VIEWS, **absolute)
    with pytest.raises(ValueError, match=re.escape(f"data.train_file {str(root / 'Places_LT_train.txt')!r} is not an existing file")):
        PlacesLTDataModule(root=str(root), views=VIEWS)  # the default names are under data.root


# ---------------------------------------------------------------- samplers (Kang et al. 2020)
CLASS_SIZES = [5000, 1000, 200, 50, 0]  # the last class has no image: it is never drawn


def sampler_labels(sizes=CLASS_SIZES) -> np.ndarray:
    return RNG.permutation(np.repeat(np.arange(len(sizes)), sizes))


def drawn_class_frequencies(sampler: ClassPrioritySampler, labels: np.ndarray) -> np.ndarray:
    return np.bincount(labels[list(sampler)], minlength=len(CLASS_SIZES)) / len(sampler)


def test_class_probabilities_are_proportional_to_the_power_q_of_the_class_sizes():
    sizes = np.array(CLASS_SIZES, dtype=float)
    for policy, q in (("instance", 1.0), ("square_root", 0.5), ("class_balanced", 0.0)):
        expected = np.append(sizes[:-1] ** q, 0) / (sizes[:-1] ** q).sum()
        assert np.allclose(class_sampling_probabilities(sizes, policy), expected), policy
    assert np.allclose(class_sampling_probabilities(sizes, "class_balanced"), [0.25, 0.25, 0.25, 0.25, 0])


def test_square_root_draws_classes_by_the_root_of_their_size_with_replacement_over_an_epoch_of_the_split():
    labels = sampler_labels()
    sampler = ClassPrioritySampler(labels, len(CLASS_SIZES), "square_root")
    drawn = np.array(list(sampler))
    assert len(drawn) == len(sampler) == len(labels)
    assert np.allclose(np.bincount(labels[drawn], minlength=len(CLASS_SIZES)) / len(drawn), class_sampling_probabilities(CLASS_SIZES, "square_root"), atol=0.01)
    assert len(set(drawn[labels[drawn] == 3][:50].tolist())) < 50  # with replacement: the first 50 draws of class 3's 50 images repeat some


def class_runs(labels: np.ndarray, drawn: np.ndarray, length: int) -> np.ndarray:
    """The drawn classes in consecutive runs of `length` (one row per run)."""
    return labels[drawn].reshape(-1, length)


def test_class_balanced_visits_every_class_once_per_round_four_images_a_visit_over_the_largest_class_times_the_classes():
    """classifier-balancing data/ClassAwareSampler.py with num_samples_cls 4 (its ImageNet-LT configs)."""
    labels = sampler_labels()
    sampler = ClassPrioritySampler(labels, len(CLASS_SIZES), "class_balanced", seed=1)
    drawn = np.array(list(sampler))
    assert len(drawn) == len(sampler) == 5000 * 4  # the 4 classes with images; class 4 has none
    visits = class_runs(labels, drawn, 4)
    assert (visits == visits[:, :1]).all()  # each visit: 4 images of one class
    rounds = visits[:, 0].reshape(-1, 4)
    assert (np.sort(rounds, axis=1) == [0, 1, 2, 3]).all()  # each round: every class once
    assert len({tuple(order) for order in rounds.tolist()}) > 1  # in shuffled orders


@pytest.mark.parametrize("policy", ["class_balanced", "progressive"])
def test_a_class_draws_each_of_its_images_once_before_any_twice(policy):
    labels = sampler_labels()
    sampler = ClassPrioritySampler(labels, len(CLASS_SIZES), policy, total_epochs=3)
    sampler.set_epoch(2)  # progressive: class-balanced, so the small classes come round several times
    drawn = np.array(list(sampler))
    for label, size in ((2, 200), (3, 50)):
        of_class = drawn[labels[drawn] == label]
        assert len(of_class) >= 2 * size
        cycles = of_class[: len(of_class) // size * size].reshape(-1, size)
        assert all(sorted(cycle) == sorted(np.flatnonzero(labels == label).tolist()) for cycle in cycles.tolist())
        assert not (cycles[0] == cycles[1]).all()  # each cycle reshuffled


def test_progressive_sampling_moves_from_instance_to_class_balanced_reaching_it_in_the_last_epoch():
    """classifier-balancing data/ClassPrioritySampler.py: lam = np.linspace(0, 1, epochs)[epoch]."""
    labels = sampler_labels()
    sampler = ClassPrioritySampler(labels, len(CLASS_SIZES), "progressive", total_epochs=11)
    instance, balanced = (class_sampling_probabilities(CLASS_SIZES, policy) for policy in ("instance", "class_balanced"))
    for epoch, expected in ((0, instance), (5, (instance + balanced) / 2), (10, balanced), (12, balanced)):
        sampler.set_epoch(epoch)
        assert np.allclose(sampler.class_probabilities(), expected)
        assert np.allclose(drawn_class_frequencies(sampler, labels), expected, atol=0.01), epoch
        assert len(sampler) == len(labels)
    assert np.allclose(ClassPrioritySampler(labels, len(CLASS_SIZES), "progressive", total_epochs=1).class_probabilities(), instance)


def test_images_are_drawn_uniformly_within_their_class():
    labels = sampler_labels([2000, 4])
    sampler, epochs = ClassPrioritySampler(labels, 2, "square_root"), []
    for epoch in range(10):  # ~920 draws of the tail class
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    drawn = np.concatenate(epochs)
    tail_draws = np.bincount(drawn[labels[drawn] == 1], minlength=len(labels))[np.flatnonzero(labels == 1)]
    assert np.allclose(tail_draws / tail_draws.sum(), 0.25, atol=0.05)


@pytest.mark.parametrize("policy", ["class_balanced", "square_root", "progressive"])
def test_two_ranks_partition_the_draws_of_one_process(policy):
    labels = sampler_labels()
    whole = list(ClassPrioritySampler(labels, len(CLASS_SIZES), policy, total_epochs=4, seed=3))
    ranks = [list(ClassPrioritySampler(labels, len(CLASS_SIZES), policy, total_epochs=4, seed=3, num_replicas=2, rank=rank)) for rank in (0, 1)]
    assert ranks[0] == whole[0::2] and ranks[1] == whole[1::2]


def test_each_epoch_draws_a_new_sequence_and_the_same_epoch_the_same_one():
    labels = sampler_labels()
    sampler = ClassPrioritySampler(labels, len(CLASS_SIZES), "class_balanced")
    first = list(sampler)
    assert list(ClassPrioritySampler(labels, len(CLASS_SIZES), "class_balanced", seed=1)) != first
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_class_sampling_needs_labels_and_progressive_needs_the_number_of_epochs():
    with pytest.raises(ValueError, match=r"data.sampler: square_root draws by class, but 1 training images are unlabelled"):
        ClassPrioritySampler(np.array([0, 1, -1]), 2, "square_root")
    with pytest.raises(ValueError, match=r"progressive needs the number of epochs from trainer.max_epochs \(>= 1\), got None"):
        ClassPrioritySampler(np.array([0, 1]), 2, "progressive")


# ---------------------------------------------------------------- the samplers in a DataModule and a fit
def digits_lt(**kwargs) -> DigitsLTDataModule:
    return DigitsLTDataModule(imbalance_ratio=10, max_count=100, batch_size=16, num_workers=0, views=VIEWS, train_variants=1, eval_variants=1, **kwargs)


def test_a_misspelt_sampler_is_refused_when_the_datamodule_is_built():
    """The CLI checks the name against its choices; built from Python, the first batch failed with a KeyError."""
    with pytest.raises(ValueError, match="^data.sampler 'class-balanced' is not one of instance, class_balanced, square_root, progressive$"):
        DigitsLTDataModule(sampler="class-balanced")


def test_instance_sampling_is_ordinary_shuffling_and_progressive_takes_its_epochs_from_the_trainer(tmp_path):
    assert type(digits_lt().train_dataloader().sampler) is EpochSampler  # every image once per epoch, in an order from (seed, epoch)
    datamodule = digits_lt(sampler="progressive")
    datamodule.trainer = cpu_trainer(tmp_path, max_epochs=8)
    sampler = datamodule.train_dataloader().sampler
    assert isinstance(sampler, ClassPrioritySampler) and sampler.total_epochs == 8
    assert np.array_equal(sampler.class_counts, datamodule.train_class_counts())


def test_a_class_balanced_digits_lt_datamodule_feeds_a_moco_fit_that_sets_the_sampler_epoch(tmp_path):
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(base=0.99, shuffle_bn=False), knn_k=0)
    trainer = cpu_trainer(tmp_path, max_epochs=2, limit_train_batches=1, limit_val_batches=0)
    trainer.fit(model, digits_lt(sampler="class_balanced"))
    sampler = trainer.train_dataloader.sampler
    assert isinstance(sampler, ClassPrioritySampler) and isinstance(sampler, DistributedSampler)  # which Lightning keeps under DDP
    assert sampler.epoch == 1 and trainer.global_step == 2
