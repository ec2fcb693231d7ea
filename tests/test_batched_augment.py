"""The batched (device) pipeline draws its parameters per sample and matches the per-image pipeline."""

import math

import pytest
import torch
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from datamodules.batched import BatchedAugment, adjust_hue, crop_boxes, gaussian_blur, rgb_to_gray
from helpers import TINY_BACKBONE, TINY_PROJECTOR, digits

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def unnormalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


def test_identical_images_in_one_batch_get_different_augmentations():
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    out = BatchedAugment(32, MEAN, STD, blur_prob=0.5, solarize_prob=0.2)(image.repeat(8, 1, 1, 1))
    assert all(not torch.allclose(out[0], out[i]) for i in range(1, 8))


def test_outputs_stay_in_the_normalised_unit_range():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    out = unnormalize(BatchedAugment(24, MEAN, STD, jitter=(0.8, 0.8, 0.8, 0.5), blur_prob=0.5, solarize_prob=0.5)(images))
    assert out.shape == (64, 3, 24, 24)
    assert out.min() >= -1e-5 and out.max() <= 1 + 1e-5


def test_crop_area_and_aspect_statistics_match_torchvision_random_resized_crop():
    torch.manual_seed(0)
    height, width, count, scale, ratio = 40, 48, 4000, (0.2, 1.0), (3 / 4, 4 / 3)
    boxes = crop_boxes(count, height, width, scale, ratio, "cpu")
    ours_area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / (height * width))
    ours_aspect = ((boxes[:, 2] - boxes[:, 0]) / (boxes[:, 3] - boxes[:, 1])).log()
    reference = [T.RandomResizedCrop.get_params(torch.empty(3, height, width), scale, ratio) for _ in range(count)]
    ref_area = torch.tensor([h * w / (height * width) for _, _, h, w in reference])
    ref_aspect = torch.tensor([math.log(w / h) for _, _, h, w in reference])
    for ours, ref in ((ours_area, ref_area), (ours_aspect, ref_aspect)):
        assert abs(ours.mean() - ref.mean()) < 0.02 and abs(ours.std() - ref.std()) < 0.02
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()


def test_crop_falls_back_to_the_centred_image_when_no_draw_fits():
    boxes = crop_boxes(3, 10, 100, scale=(0.99, 1.0), ratio=(1.0, 1.0), device="cpu")  # a square of 99% never fits
    assert boxes.tolist() == [[45.0, 0.0, 55.0, 10.0]] * 3  # torchvision: width narrowed to height * max ratio


def test_colour_primitives_equal_torchvision_per_sample():
    torch.manual_seed(0)
    images, factors = torch.rand(6, 3, 9, 9), torch.rand(6) - 0.5
    expected = torch.stack([TF.adjust_hue(images[i], float(factors[i])) for i in range(6)])
    torch.testing.assert_close(adjust_hue(images, factors), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(rgb_to_gray(images), TF.rgb_to_grayscale(images))


def test_colour_jitter_is_the_torchvision_formula_for_a_single_active_operation():
    torch.manual_seed(0)
    images = torch.rand(16, 3, 8, 8)
    jitter = BatchedAugment(8, MEAN, STD, jitter=(0.0, 0.6, 0.0, 0.0), jitter_prob=1.0)
    torch.manual_seed(1)
    out = jitter.color_jitter(images)
    torch.manual_seed(1)
    jitter._chance(1.0, 16, "cpu")  # replay the same random stream: the gate, then the contrast factors
    _brightness = torch.empty(16).uniform_(1.0, 1.0)
    contrast = torch.empty(16).uniform_(0.4, 1.6)
    expected = torch.stack([TF.adjust_contrast(images[i], float(contrast[i])) for i in range(16)])
    torch.testing.assert_close(out, expected, atol=3e-6, rtol=0)


def test_jitter_order_is_drawn_per_sample():
    """Brightness then saturation differs from saturation then brightness once clamping bites; with
    both active, identical images must show both orders within one batch."""
    torch.manual_seed(0)
    image = torch.tensor([0.9, 0.5, 0.1]).view(1, 3, 1, 1).expand(256, 3, 4, 4).contiguous()
    out = BatchedAugment(4, MEAN, STD, jitter=(0.0, 0.0, 0.0, 0.0), jitter_prob=1.0)
    out.jitter_ranges = ((1.5, 1.5), (1.0, 1.0), (2.0, 2.0), (0.0, 0.0))  # fixed factors, only the order varies
    result = out.color_jitter(image)[:, :, 0, 0]
    distinct = torch.unique(result.round(decimals=5), dim=0)
    assert len(distinct) == 2


def test_gaussian_blur_keeps_constants_and_small_sigma_is_identity():
    constant = torch.full((2, 3, 12, 12), 0.3)
    torch.testing.assert_close(gaussian_blur(constant, torch.tensor([0.5, 2.0]), 2.0), constant)
    images = torch.rand(2, 3, 12, 12)
    torch.testing.assert_close(gaussian_blur(images, torch.tensor([1e-3, 1e-3]), 2.0), images)


@pytest.mark.parametrize("preset", ["mocov2", "crop_flip", "npid", "simclr"])
def test_a_moco_step_runs_with_the_device_pipeline(preset):
    from methods import MoCoV2
    from methods.momentum import MomentumSpec

    datamodule = digits({"query": {"preset": preset}, "key": {"preset": preset}}, batch_size=16, pipeline="device")
    batch = datamodule.augment_on_device(next(iter(datamodule.train_dataloader())))
    assert batch["views"]["query"].shape == (16, 3, 32, 32) and batch["views"]["query"].dtype == torch.float32
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)
    loss, _ = model.contrastive_step(batch)
    assert torch.isfinite(loss)


def test_evaluation_presets_refuse_the_device_pipeline():
    with pytest.raises(ValueError, match="runs per image only"):
        digits({"image": {"preset": "crop_pad_flip"}}, pipeline="device")
