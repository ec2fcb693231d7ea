"""Tests of analysis/few_shot.py: the seeded draws, the t interval of the mean over draws, the probe, and the
few-shot evaluation of a tiny model on Digits-M."""

import math

import numpy as np
import pytest

import torch
import torch.nn.functional as F

from analysis.few_shot import draw_shots, few_shot, mean_interval, probe_top1
from analysis.representation import evaluated_features, split_dataset
from datamodules.base import dataset_labels
from backbones import BackboneSpec
from methods import DINO, NPID
from helpers import TINY_PROJECTOR, digits, randomised

LABELS = np.array([0, 1, 2, -1] * 6 + [1, 2, 2])  # class 0: 6 images, class 1: 7, class 2: 8, six unlabelled


def test_draws_take_k_images_of_every_class_and_are_the_same_for_the_same_seed():
    drawn = draw_shots(LABELS, (1, 2, 5), seed=3)
    for k, indices in drawn.items():
        assert np.bincount(LABELS[indices], minlength=3).tolist() == [k, k, k]  # never an unlabelled image
        assert len(set(indices.tolist())) == len(indices) and np.array_equal(indices, np.sort(indices))
    assert all(np.array_equal(drawn[k], again) for k, again in draw_shots(LABELS, (1, 2, 5), seed=3).items())
    assert not np.array_equal(drawn[5], draw_shots(LABELS, (1, 2, 5), seed=4)[5])


def test_the_draws_of_one_seed_are_nested_over_k():
    drawn = draw_shots(LABELS, (1, 2, 5), seed=0)
    assert set(drawn[1]) < set(drawn[2]) < set(drawn[5])
    assert np.array_equal(draw_shots(LABELS, (2,), seed=0)[2], drawn[2])  # whatever the other k asked for


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: draw_shots(LABELS, (7,), seed=0), "class 0 has 6 labelled training images, fewer than the 7 shots asked for"),
        (lambda: draw_shots(LABELS, (0, 1), seed=0), r"shots must be one or more numbers of images per class >= 1, got \[0, 1\]"),
        (lambda: mean_interval([0.5]), "an interval needs 2 or more draws, got 1"),
        (lambda: mean_interval([0.5, 0.6], confidence=95), r"confidence must lie in \(0, 1\)"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_interval_is_the_student_t_interval_of_the_mean():
    # t quantiles from the tables: t(0.975, 4) = 2.776445105, t(0.975, 9) = 2.262157163, t(0.95, 2) = 2.919985580
    mean, half = mean_interval([0.5, 0.6, 0.7, 0.4, 0.8])
    assert mean == pytest.approx(0.6) and half == pytest.approx(2.776445105 * math.sqrt(0.025) / math.sqrt(5), rel=1e-9)
    values = [0.61, 0.64, 0.58, 0.66, 0.6, 0.63, 0.59, 0.62, 0.65, 0.57]
    assert mean_interval(values)[1] == pytest.approx(2.262157163 * np.std(values, ddof=1) / math.sqrt(10), rel=1e-9)
    assert mean_interval([1.0, 2.0, 4.0], confidence=0.9) == pytest.approx((7 / 3, 2.919985580 * np.std([1, 2, 4], ddof=1) / math.sqrt(3)))
    assert mean_interval([0.3, 0.3, 0.3]) == (pytest.approx(0.3), 0.0)


def test_the_95_percent_interval_covers_the_true_mean_95_percent_of_the_time():
    """Over 1,500 sets of 5 draws from a normal distribution: the t interval covers its mean about 95% of the time
    (a normal quantile, 1.96, would cover it about 88% of the time; the standard error of the rate is 0.006)."""
    samples = np.random.default_rng(0).normal(loc=0.7, scale=0.05, size=(1500, 5))
    covered = [abs(mean - 0.7) <= half for mean, half in map(mean_interval, samples)]
    assert np.mean(covered) == pytest.approx(0.95, abs=0.02)


def test_the_probe_separates_separable_features_and_guesses_on_noise():
    generator = np.random.default_rng(1)
    centres = np.eye(4, 16) * 5
    labels = np.repeat(np.arange(4), 20)
    features = centres[labels] + 0.5 * generator.normal(size=(80, 16))
    assert probe_top1(features[::4], labels[::4], features, labels) == 1.0
    noise = generator.normal(size=(400, 16))
    assert probe_top1(noise[:40], np.arange(40) % 4, noise[40:], generator.integers(0, 4, 360)) < 0.4


@pytest.mark.slow
def test_few_shot_probes_a_tiny_model_on_digits_and_repeats_itself():
    model = NPID(backbone=BackboneSpec(name="timm:test_resnet"), projector=TINY_PROJECTOR, temperature=0.2, knn_k=0).train()
    datamodule = digits({"image": {"preset": "npid"}}, batch_size=64)
    record = few_shot(model, datamodule, shots=(1, 3), draws=3, seed=5)
    assert model.training
    assert {key: record[key] for key in ("training_split", "eval_split", "eval_images", "seeds")} == {
        "training_split": "train", "eval_split": "val", "eval_images": 300, "seeds": [5, 6, 7]}
    assert sorted(record["shots"]) == [1, 3]
    for result in record["shots"].values():
        assert len(result["top1"]) == 3 and all(0 <= top1 <= 1 for top1 in result["top1"])
        mean, half = mean_interval(result["top1"])
        assert result["mean"] == mean and result["interval95"] == [mean - half, mean + half]
    assert few_shot(model, datamodule, shots=(1, 3), draws=3, seed=5) == record
    with pytest.raises(ValueError, match="draws must be >= 2"):
        few_shot(model, datamodule, draws=1)
    # the second draw of 3 shots recomputed on its own: its images, their labels and the L2-normalised features
    training, evaluation = split_dataset(datamodule, "train"), split_dataset(datamodule, "val")
    rows = draw_shots(dataset_labels(training), (3,), 6)[3]
    model.eval()
    with torch.no_grad():
        features, labels = evaluated_features(model, datamodule, torch.utils.data.Subset(training, rows.tolist()))
        eval_features, eval_labels = evaluated_features(model, datamodule, evaluation)
    expected = probe_top1(F.normalize(features, dim=1).numpy(), labels.numpy(), F.normalize(eval_features, dim=1).numpy(), eval_labels.numpy())
    assert record["shots"][3]["top1"][1] == pytest.approx(expected, abs=1e-9)
    assert len(set(record["shots"][1]["top1"])) > 1  # each draw its own shots
    assert few_shot(model, datamodule, shots=(3,), draws=3, seed=5, regularisation=1e-6)["shots"][3]["top1"] != record["shots"][3]["top1"]  # C is used



@pytest.mark.slow
def test_few_shot_reads_the_trunk_the_method_evaluates_dinos_teacher():
    """DINO's evaluations read the teacher (facebookresearch/dino eval_linear.py and eval_knn.py): so do the few-shot
    probes, whatever the student holds."""
    model = DINO(backbone=BackboneSpec(name="timm:test_resnet"), projector=TINY_PROJECTOR, out_dim=10, knn_k=0).eval()
    randomised(model.target_backbone)  # a teacher other than the student
    datamodule = digits({"image": {"preset": "npid"}}, batch_size=64)
    evaluation = split_dataset(datamodule, "val")
    features, labels = evaluated_features(model, datamodule, evaluation)
    record = few_shot(model, datamodule, shots=(1, 3), draws=2)
    assert features.shape == (300, model.feature_dim) and len(labels) == 300
    randomised(model.backbone, seed=5)  # another student: the same features and probes
    assert torch.equal(evaluated_features(model, datamodule, evaluation)[0], features)
    assert few_shot(model, datamodule, shots=(1, 3), draws=2) == record
    randomised(model.target_backbone, seed=5)  # another teacher: other features
    assert not torch.equal(evaluated_features(model, datamodule, evaluation)[0], features)
