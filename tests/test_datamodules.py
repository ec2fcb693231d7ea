import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2 as T

from datamodules.base import EvalDataset
from datamodules.digits import SPLIT_SIZES, ArrayImageDataset, DigitsStyle, composite_digits, generate_digits, source_digit_splits
from datamodules.samplers import EvaluationShard
from datamodules.transforms import ToNormalizedTensor, build_view
from helpers import digits

DEFAULTS = {"size": 32, "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3)}


def test_digit_splits_are_disjoint_by_source_digit_and_cover_all_of_them():
    splits = source_digit_splits()
    assert {name: len(indices) for name, indices in splits.items()} == SPLIT_SIZES
    assert len(np.unique(np.concatenate(list(splits.values())))) == 1797
    assert np.array_equal(source_digit_splits()["val"], splits["val"])  # fixed permutation


def test_digits_are_generated_deterministically_as_32px_rgb_with_balanced_labels():
    images, labels = generate_digits("val", 2, DigitsStyle())
    again, _ = generate_digits("val", 2, DigitsStyle())
    assert images.shape == (600, 32, 32, 3) and images.dtype == np.uint8
    assert np.array_equal(images, again)
    assert set(labels.tolist()) == set(range(10)) and np.bincount(labels).min() >= 40
    assert not np.array_equal(images[:300], images[300:])  # two different composites of each digit


def test_training_batches_carry_named_views_labels_and_indices():
    datamodule = digits({"weak": {"preset": "crop_flip"}, "keys": {"preset": "mocov2", "count": 3}}, batch_size=8)
    batch = next(iter(datamodule.train_dataloader()))
    assert set(batch["views"]) == {"weak", "keys"}
    assert batch["views"]["weak"].shape == (8, 3, 32, 32)
    assert batch["views"]["keys"].shape == (8, 3, 3, 32, 32)
    assert not torch.equal(batch["views"]["keys"][:, 0], batch["views"]["keys"][:, 1])  # independent draws
    assert batch["label"].shape == (8,) and batch["index"].shape == (8,)


def test_validation_serves_the_eval_split_and_the_training_split_as_knn_bank():
    datamodule = digits({"weak": {"preset": "crop_flip"}}, batch_size=64)
    val, bank = datamodule.val_dataloader()
    assert len(val.dataset) == 300 and len(bank.dataset) == 1197
    first = next(iter(bank))
    assert set(first) == {"image", "label", "index"}
    torch.testing.assert_close(first["image"], next(iter(bank))["image"])  # no augmentation
    assert len(digits({"weak": {"preset": "crop_flip"}}, knn_bank=False).val_dataloader()) == 1


@pytest.mark.parametrize("knn_k, loaders", [(0, 1), (5, 2)])
def test_a_model_without_a_knn_monitor_is_served_no_bank(knn_k, loaders, tmp_path):
    """A model of knn_k 0 (a long-tail classifier, a monitor turned off) would decode the whole training split at every
    validation for nothing."""
    import lightning as L

    from helpers import TINY_BACKBONE, TINY_PROJECTOR
    from methods import MoCoV2

    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=128, knn_k=knn_k)
    datamodule = digits({"query": {"preset": "crop_flip"}, "key": {"preset": "crop_flip"}}, batch_size=64)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1, default_root_dir=tmp_path)
    trainer.validate(model, datamodule=datamodule, verbose=False)
    assert len(trainer.val_dataloaders if isinstance(trainer.val_dataloaders, list) else [trainer.val_dataloaders]) == loaders


@pytest.mark.parametrize("images, processes", [(7, 2), (8, 2), (10, 4), (3, 3), (1, 2)])
def test_evaluation_shards_are_as_long_take_every_image_once_and_pad_with_images_labelled_minus_one(images, processes):
    arrays, labels = composite_digits("val", 1)
    dataset = EvalDataset(ArrayImageDataset(arrays[:images], labels[:images]), lambda image: image)
    samplers = [EvaluationShard(dataset, num_replicas=processes, rank=rank) for rank in range(processes)]
    shards = [list(sampler) for sampler in samplers]
    assert [len(sampler) for sampler in samplers] == [len(shard) for shard in shards]
    assert {len(shard) for shard in shards} == {-(-images // processes)}  # as many batches on every process
    assert sorted(index for shard in shards for index in shard if index < images) == list(range(images))
    padding = [dataset[index] for shard in shards for index in shard if index >= images]
    assert len(padding) == len(shards[0]) * processes - images
    assert all(item["label"] == -1 and item["index"] == -1 for item in padding)
    assert all(dataset[index]["label"] >= 0 for index in range(images))


def test_fused_tensor_conversion_matches_torchvision():
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    reference = T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(DEFAULTS["mean"], DEFAULTS["std"])])
    torch.testing.assert_close(ToNormalizedTensor(DEFAULTS["mean"], DEFAULTS["std"])(image), reference(image))


def test_presets_carry_the_papers_parameters_and_accept_overrides():
    mocov2 = build_view("strong", {"preset": "mocov2"}, DEFAULTS)
    jitter = mocov2.transforms[1]
    assert jitter.p == 0.8 and jitter.transforms[0].hue == (-0.1, 0.1)
    assert mocov2.transforms[3].p == 0.5  # blur
    npid = build_view("npid", {"preset": "npid"}, DEFAULTS)
    assert npid.transforms[1].p == 1.0 and npid.transforms[1].transforms[0].hue == (-0.4, 0.4)
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in npid.transforms)
    stronger = build_view("strong", {"preset": "mocov2", "jitter": [0.4, 0.4, 0.4, 0.5], "blur_prob": 0.0}, DEFAULTS)
    assert stronger.transforms[1].transforms[0].hue == (-0.5, 0.5) and stronger.transforms[3].p == 0.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"preset": "mocov3"}, "view 'v': unknown preset 'mocov3'"),
        ({"preset": "mocov2", "strength": 1.0}, "view 'v': preset 'mocov2' does not accept \\['strength'\\]"),
        ({"size": 32}, "view 'v' must be a mapping with a 'preset' key .*, got {'size': 32}; a key of a view given on the command line replaces "
                       "the config's whole view: give the view whole, as --data.init_args.views.v '{preset: ..., size: ...}'"),
        ({"preset": "mocov2", "count": 0}, "view 'v': count must be an integer >= 1"),
        ({"preset": "mocov2", "scale": [1.0, 0.2]}, r"view 'v': scale must be \(min, max\) with 0 < min <= max <= 1, got \[1.0, 0.2\]"),
        ({"preset": "mocov2", "jitter": [0.4, 0.4]}, r"view 'v': jitter must have 4 values, got \[0.4, 0.4\]"),
        ({"preset": "mocov2", "blur_sigma": [2.0, 0.1]}, r"view 'v': blur_sigma must be \(min, max\) with 0 <= min <= max, got \[2.0, 0.1\]"),
        ({"preset": "mocov2", "blur_prob": 1.5}, r"view 'v': blur_prob must be a probability in \[0, 1\], got 1.5"),
        ({"preset": "mocov2", "flip": 0.3}, r"view 'v': flip must be true or false \(a horizontal flip with probability 0.5\), got 0.3"),
        ({"preset": "simclr", "strength": 3.0}, r"view 'v': jitter must be \(brightness, contrast, saturation, hue\) >= 0, hue <= 0.5, got \[2.4"),
    ],
)
def test_bad_view_specs_name_the_view_and_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        build_view("v", spec, DEFAULTS)


def test_a_missing_root_is_refused_with_its_path():
    with pytest.raises(ValueError, match="data.root '/no/such/dir' is not an existing directory"):
        digits({"weak": {"preset": "crop_flip"}}, root="/no/such/dir")
