"""The official codes' AutoAugment operations: TCL's (chaitanyaanimesh/Tuned-Contrastive-Learning
data_augmentation/auto_augment.py: each level a bin of its operation's scale, the strength drawn within it) and PaCo's
(PaCo/LT/autoaug.py CIFAR10Policy: grey fill, counter-clockwise rotations), both on AutoAugment's CIFAR-10 sub-policies.
Both were run side by side with the official files (same Python RNG seed, 2,000 images): identical outputs."""

import random

import numpy as np
import pytest
import torchvision.transforms.v2 as T
from PIL import Image
from scipy import ndimage

import datamodules.paco_autoaugment as paco
from datamodules.tcl_autoaugment import POLICIES, TCLAutoAugment, apply
from datamodules.transforms import build_view

VIEW_DEFAULTS = {"size": 32, "mean": (0.5,) * 3, "std": (0.5,) * 3}


def test_the_sub_policies_and_probabilities_are_autoaugment_s_cifar10_ones():
    torchvision_policy = T.AutoAugment(T.AutoAugmentPolicy.CIFAR10)._policies
    ours = [((first, p1, level1), (second, p2, level2)) for first, p1, level1, second, p2, level2 in POLICIES]
    for (first, second), (expected_first, expected_second) in zip(ours, torchvision_policy, strict=True):
        for (name, probability, level), (expected_name, expected_probability, expected_level) in ((first, expected_first), (second, expected_second)):
            assert (name, probability) == (expected_name, expected_probability)
            assert expected_level is None or level == expected_level  # torchvision gives the magnitude-free ones none


def test_a_level_is_a_bin_the_strength_is_drawn_in(monkeypatch):
    """Solarize level 2 inverts every pixel from a threshold in [51.2, 76.8] up; torchvision's level 2 threshold is
    about 198. Rotate level 2 turns by -18 to -12 degrees, whichever the draw."""
    image = Image.fromarray(np.array([[[40] * 3, [100] * 3, [200] * 3]], dtype=np.uint8))
    for draw in (0.0, 1.0):
        monkeypatch.setattr(random, "uniform", lambda low, high: low + draw * (high - low))
        assert np.array(apply(image, "Solarize", 2))[0, :, 0].tolist() == [40, 155, 55]
    dot = np.zeros((33, 33, 3), dtype=np.uint8)
    dot[4, 16] = 255
    centre = 33 / 2 + 0.5  # auto_augment.py's transform_matrix_offset_center: x / 2 + 0.5
    before = np.degrees(np.arctan2(16 - centre, 4 - centre))
    for draw, degrees in ((0.0, -18.0), (1.0, -12.0)):
        monkeypatch.setattr(random, "uniform", lambda low, high: low + draw * (high - low))
        turned = np.array(apply(Image.fromarray(dot), "Rotate", 2))[:, :, 0].astype(float)
        row, column = ndimage.center_of_mass(turned)
        # the output samples the input at R(theta) (o - c) + c: the content turns by -theta in (row, column) axes
        assert np.degrees(np.arctan2(column - centre, row - centre)) - before == pytest.approx(-degrees, abs=1.0)


def test_one_sub_policy_per_image_each_operation_with_its_probability(monkeypatch):
    applied = []
    monkeypatch.setattr("datamodules.tcl_autoaugment.apply", lambda image, operation, level: applied.append((operation, level)) or image)
    monkeypatch.setattr(random, "randrange", lambda count: 14)  # ("Solarize", 0.5, 2, "Invert", 0.0, 0)
    draws = iter([0.4, 0.0])
    monkeypatch.setattr(random, "random", lambda: next(draws))
    TCLAutoAugment()(Image.new("RGB", (8, 8)))
    assert applied == [("Solarize", 2)]  # an Invert of probability 0 never applies


def test_paco_s_rotation_turns_counter_clockwise_onto_grey_and_its_levels_are_fixed_strengths(monkeypatch):
    monkeypatch.setattr(random, "choice", lambda options: options[0])  # a sign of -1 where an operation draws one
    dot = np.zeros((33, 33, 3), dtype=np.uint8)
    dot[4, 16] = 255  # above the centre
    turned = np.array(paco.apply(Image.fromarray(dot), "Rotate", 9))  # 30 degrees, whatever the draws
    row, column = ndimage.center_of_mass(turned[:, :, 0] == 255)
    assert np.degrees(np.arctan2(16 - column, 16 - row)) == pytest.approx(30, abs=3)  # towards the left: counter-clockwise
    assert tuple(turned[0, 0]) == (128, 128, 128)  # a corner the rotation uncovered
    image = Image.fromarray(np.array([[[40] * 3, [100] * 3, [200] * 3]], dtype=np.uint8))
    assert np.array(paco.apply(image, "Solarize", 2))[0, :, 0].tolist() == [40, 100, 55]  # threshold 256 - 2 x 256/9 = 199.1


def test_the_view_runs_the_official_operations_and_refuses_them_with_another_policy_or_a_fill():
    for operations, kind in (("tcl", TCLAutoAugment), ("paco", paco.PacoAutoAugment)):
        view = build_view("crops", {"preset": "autoaugment", "policy": "cifar10", "operations": operations}, VIEW_DEFAULTS)
        assert any(isinstance(step, kind) for step in view.transforms)
        assert view(Image.new("RGB", (32, 32), (90, 30, 200))).shape == (3, 32, 32)
    for bad in ({"policy": "imagenet"}, {"policy": "cifar10", "fill": 128}, {"policy": "cifar10", "operations": "pil"}):
        with pytest.raises(ValueError, match="autoaugment operations must be 'torchvision', 'tcl' or 'paco'"):
            build_view("crops", {"preset": "autoaugment", "operations": "tcl"} | bad, VIEW_DEFAULTS)
