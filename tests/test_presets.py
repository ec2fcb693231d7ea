"""The named augmentation presets: the papers' parameters, both pipelines, the per-image policies."""

import re

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.auto_augment import RandAugment
from torchvision.transforms import v2 as T

from datamodules.transforms import Cutout, build_view
from datamodules.view_spec import CONTRASTIVE_PRESETS, ViewSpec

DEFAULTS = {"size": 16, "mean": (0.5, 0.4, 0.3), "std": (0.2, 0.25, 0.3)}
IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8))


def test_both_pipelines_of_a_view_run_one_spec_of_the_presets_fields_then_the_views_own():
    view = {"preset": "simclr", "strength": 1.0, "blur_prob": 0.5, "scale": [0.5, 1.0]}
    spec = ViewSpec(16, DEFAULTS["mean"], DEFAULTS["std"], scale=(0.5, 1.0), jitter=(0.8, 0.8, 0.8, 0.2), blur_prob=0.5)
    assert build_view("v", view, DEFAULTS, pipeline="gpu").spec == spec
    crop, jitter, _, blur = build_view("v", view, DEFAULTS).transforms[:4]
    assert crop.scale == spec.scale and jitter.transforms[0].brightness == pytest.approx((0.2, 1.8)) and blur.p == 0.5
    explicit = build_view("v", view | {"jitter": [0.1, 0.1, 0.1, 0.1]}, DEFAULTS, pipeline="gpu").spec
    assert explicit.jitter == (0.1, 0.1, 0.1, 0.1)  # the view's own jitter wins over its strength


@pytest.mark.parametrize("preset", sorted(CONTRASTIVE_PRESETS))
def test_every_contrastive_preset_runs_per_image_and_on_a_batch(preset):
    assert build_view("v", {"preset": preset}, DEFAULTS)(IMAGE).shape == (3, 16, 16)
    batch = torch.from_numpy(np.asarray(IMAGE)).permute(2, 0, 1).expand(4, 3, 20, 24)
    assert build_view("v", {"preset": preset}, DEFAULTS, pipeline="gpu")(batch).shape == (4, 3, 16, 16)


def test_byol_pair_is_sces_asymmetric_imagenet_views():
    first, second = (build_view(name, {"preset": name}, DEFAULTS) for name in ("byol1", "byol2"))
    for view in (first, second):
        crop, jitter, gray = view.transforms[:3]
        assert crop.scale == (0.2, 1.0) and jitter.p == 0.8 and gray.p == 0.2
        assert jitter.transforms[0].saturation == (0.8, 1.2) and jitter.transforms[0].hue == (-0.1, 0.1)
    assert (first.transforms[3].p, first.transforms[4].p) == (1.0, 0.0)  # blur, solarisation
    assert (second.transforms[3].p, second.transforms[4].p) == (0.1, 0.2)
    assert second.transforms[4].threshold == 128


def test_simaugment_is_simclr_at_strength_one_with_blur_and_paco_sim_is_pacos_key_view():
    simaugment = build_view("v", {"preset": "simaugment"}, DEFAULTS).transforms
    assert simaugment[0].scale == (0.08, 1.0) and simaugment[1].p == 0.8 and simaugment[3].p == 0.5
    assert simaugment[1].transforms[0].brightness == pytest.approx((0.2, 1.8)) and simaugment[1].transforms[0].hue == (-0.2, 0.2)
    paco = build_view("v", {"preset": "paco_sim"}, DEFAULTS).transforms
    assert paco[0].scale == (0.08, 1.0) and paco[1].p == 1.0 and paco[1].transforms[0].hue is None
    assert paco[2].p == 0.2 and paco[3].p == 0.5


def test_autoaugment_is_tcls_crop_flip_policy_and_pacos_cifar_view_with_cutout():
    tcl = build_view("v", {"preset": "autoaugment"}, DEFAULTS)
    resize, crop, flip, policy, _ = tcl.transforms
    assert resize.size == [16, 16] and crop.padding == [4, 4, 4, 4] and isinstance(flip, T.RandomHorizontalFlip)
    assert policy.policy == T.AutoAugmentPolicy.IMAGENET and tcl(IMAGE).shape == (3, 16, 16)
    paco = build_view("v", {"preset": "autoaugment", "policy": "cifar10", "cutout": 8}, DEFAULTS)
    assert paco.transforms[3].policy == T.AutoAugmentPolicy.CIFAR10 and paco.transforms[4].length == 8
    with pytest.raises(ValueError, match="view 'v': autoaugment policy must be one of \\['cifar10', 'imagenet', 'svhn'\\], got 'cifar'"):
        build_view("v", {"preset": "autoaugment", "policy": "cifar"}, DEFAULTS)


def test_cutout_blacks_out_one_square_clipped_at_the_border():
    white = Image.new("RGB", (32, 32), (255, 255, 255))
    for _ in range(20):
        black = np.asarray(Cutout(16)(white)).sum(axis=2) == 0
        rows, cols = np.nonzero(black.any(axis=1))[0], np.nonzero(black.any(axis=0))[0]
        assert 8 <= len(rows) <= 16 and 8 <= len(cols) <= 16 and black.sum() == len(rows) * len(cols)
    assert np.asarray(white).min() == 255  # the input is left untouched


def test_randaugment_is_pacos_randcls_view_with_timms_policy():
    view = build_view("v", {"preset": "randaugment"}, DEFAULTS)
    crop, jitter, gray = view.transforms[:3]
    assert crop.scale == (0.08, 1.0) and jitter.p == 1.0 and jitter.transforms[0].hue is None and gray.p == 0.0
    policy = view.transforms[-2]
    assert isinstance(policy, RandAugment) and policy.num_layers == 2
    assert {(op.magnitude, op.magnitude_std) for op in policy.ops} == {(10, 0.5)}
    assert view(IMAGE).shape == (3, 16, 16)
    stack = build_view("v", {"preset": "randaugment", "num_ops": 3, "gray_prob": 0.2, "blur_prob": 0.5}, DEFAULTS)
    assert stack.transforms[-2].num_layers == 3 and stack.transforms[2].p == 0.2 and stack.transforms[3].p == 0.5
    with pytest.raises(ValueError, match="view 'v': preset 'randaugment' does not accept \\['strength'\\]"):
        build_view("v", {"preset": "randaugment", "strength": 1.0}, DEFAULTS)


def test_randaugment_fills_with_the_dataset_mean_unless_a_fill_colour_is_given():
    def fill_colours(view):
        return {op.kwargs["fillcolor"] for op in view.transforms[-2].ops}

    assert fill_colours(build_view("v", {"preset": "randaugment"}, DEFAULTS)) == {(128, 102, 76)}
    imagenet_mean = [0.485, 0.456, 0.406]  # PaCo's rgb_mean, on iNat as well
    assert fill_colours(build_view("v", {"preset": "randaugment", "fill": imagenet_mean}, DEFAULTS)) == {(124, 116, 104)}


@pytest.mark.parametrize("preset", ["autoaugment", "randaugment"])
def test_policy_presets_refuse_the_gpu_pipeline(preset):
    with pytest.raises(ValueError, match=f"view 'v': preset '{preset}' runs per image only; use data.pipeline: cpu"):
        build_view("v", {"preset": preset}, DEFAULTS, pipeline="gpu")


@pytest.mark.parametrize(
    "view, message",
    [
        # STL-10's 64 px protocol without its size: the 96 px crop of a 64 px image failed at the first image
        ({"preset": "crop_pad_flip", "resize": 12}, "crop_pad_flip resize 12 is smaller than the 16 px crop: give its size too (size: 12) or an integer >= 16"),
        ({"preset": "crop_pad_flip", "padding": -1}, "crop_pad_flip padding must be an integer >= 0, got -1"),
        ({"preset": "center", "resize": 12}, "center resize must be an integer >= 16, got 12"),  # CenterCrop would pad it with black
        ({"preset": "center", "resize": [16, -3]}, "center resize must be an integer >= 16, got -3"),
        ({"preset": "autoaugment", "cutout": -8}, "autoaugment cutout must be an integer >= 0, got -8"),
        ({"preset": "randaugment", "num_ops": -1}, "randaugment num_ops must be an integer >= 0, got -1"),
        # 0-255 levels read as [0, 1] colours: timm clipped them to a white fill
        ({"preset": "randaugment", "fill": [124, 116, 104]}, "randaugment fill must be an RGB colour of three values in [0, 1] (as the dataset's mean), got [124, 116, 104]"),
        ({"preset": "randaugment", "fill": 0.5}, "randaugment fill must be an RGB colour of three values in [0, 1]"),
        ({"preset": "mocov2", "jitter_prob": "0.8"}, "jitter_prob must be a number, got '0.8'"),  # a TypeError traceback at the first image before
        ({"preset": "mocov2", "scale": [0.2, "1"]}, "scale must be numbers, got [0.2, '1']"),
    ],
)
def test_a_view_parameter_its_transform_would_fail_on_is_refused_when_the_view_is_built(view, message):
    with pytest.raises(ValueError, match="^" + re.escape(f"view 'v': {message}")):
        build_view("v", view, DEFAULTS)


def test_linear_training_view_can_resize_before_its_padded_crop():
    stl_like = Image.fromarray(np.zeros((96, 96, 3), dtype=np.uint8))
    assert build_view("image", {"preset": "crop_pad_flip", "resize": 64}, DEFAULTS | {"size": 64})(stl_like).shape == (3, 64, 64)


def test_evaluation_view_given_a_pair_resizes_the_whole_image_without_cropping():
    squashed = build_view("eval_view", {"preset": "center", "resize": [16, 16]}, DEFAULTS)(IMAGE)  # 20 x 24 image
    whole_image = build_view("eval_view", {"preset": "center"}, DEFAULTS)(IMAGE.resize((16, 16), Image.BILINEAR))
    cropped = build_view("eval_view", {"preset": "center", "resize": 16}, DEFAULTS)(IMAGE)
    torch.testing.assert_close(squashed, whole_image)
    assert not torch.allclose(squashed, cropped)


def test_the_evaluation_view_resizes_bicubically_when_asked_and_names_an_unknown_interpolation():
    """DINO's eval_linear.py resizes with interpolation=3 (PIL's bicubic) before its centre crop."""
    bicubic = build_view("eval_view", {"preset": "center", "resize": 18, "interpolation": "bicubic"}, DEFAULTS)(IMAGE)
    resized = IMAGE.resize((21, 18), Image.BICUBIC)  # the short side (20) to 18, the long one (24) to int(21.6)
    expected = build_view("eval_view", {"preset": "center", "resize": [18, 21]}, DEFAULTS)(resized)
    torch.testing.assert_close(bicubic, expected)
    assert not torch.allclose(bicubic, build_view("eval_view", {"preset": "center", "resize": 18}, DEFAULTS)(IMAGE))
    with pytest.raises(ValueError, match="view 'eval_view': interpolation must be one of bilinear, bicubic, got 'lanczos'"):
        build_view("eval_view", {"preset": "center", "interpolation": "lanczos"}, DEFAULTS)


@pytest.mark.parametrize("pipeline, preset", [("cpu", "center"), ("cpu", "crop_flip"), ("gpu", "crop_flip")])
def test_a_views_own_mean_std_and_size_win_over_the_datasets(pipeline, preset):
    """SVHN's, Fashion-MNIST's and NPID's configs normalise some views with statistics of their own: a gray image of
    level 128 comes out as (128/255 - mean) / std of the view, at the view's size."""
    own = {"preset": preset, "size": 8, "mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 0.125]}
    view = build_view("v", own, DEFAULTS, pipeline=pipeline)
    gray = np.full((20, 20, 3), 128, dtype=np.uint8)
    out = view(torch.from_numpy(gray).permute(2, 0, 1)[None]) if pipeline == "gpu" else view(Image.fromarray(gray))[None]
    assert out.shape[-2:] == (8, 8)
    expected = (128 / 255 - torch.tensor(own["mean"])) / torch.tensor(own["std"])
    torch.testing.assert_close(out.float().mean(dim=(0, 2, 3)), expected, atol=2e-3, rtol=0)
