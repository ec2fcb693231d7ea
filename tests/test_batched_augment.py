"""The batched (device) pipeline draws its parameters per sample and matches the per-image pipeline."""

import colorsys
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from datamodules.batched import BatchedAugment, adjust_hue, by_kind, crop_boxes, filtered_crops, gaussian_blur, rgb_to_gray
from datamodules.transforms import augment
from datamodules.view_spec import CONTRASTIVE_PRESETS, ViewSpec
from helpers import TINY_BACKBONE, TINY_PROJECTOR, digits

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def unnormalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


def test_identical_images_in_one_batch_get_different_augmentations():
    image = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    out = BatchedAugment(ViewSpec(32, MEAN, STD, blur_prob=0.5, solarize_prob=0.2))(image.repeat(8, 1, 1, 1))
    assert all(not torch.allclose(out[0], out[i]) for i in range(1, 8))


def test_outputs_stay_in_the_normalised_unit_range():
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)
    out = unnormalize(BatchedAugment(ViewSpec(24, MEAN, STD, jitter=(0.8, 0.8, 0.8, 0.5), blur_prob=0.5, solarize_prob=0.5))(images))
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
    # the position: uniform over every place the crop fits, its far edges included (each of the W - w + 1 offsets)
    ours_edges = [((boxes[:, 2] == width) & (boxes[:, 0] > 0)).float().mean(), ((boxes[:, 3] == height) & (boxes[:, 1] > 0)).float().mean()]
    ref_edges = [sum(left + w == width and left > 0 for _, left, _, w in reference) / count, sum(top + h == height and top > 0 for top, _, h, _ in reference) / count]
    assert all(abs(ours - ref) < 0.02 for ours, ref in zip(ours_edges, ref_edges)) and min(ref_edges) > 0.05
    slack = boxes[:, 2] - boxes[:, 0] < width
    ref_offsets = torch.tensor([left / (width - w) for _, left, _, w in reference if w < width])
    assert abs((boxes[slack, 0] / (width - (boxes[slack, 2] - boxes[slack, 0]))).mean() - ref_offsets.mean()) < 0.02


def test_crop_falls_back_to_the_centred_image_when_no_draw_fits():
    boxes = crop_boxes(3, 10, 100, scale=(0.99, 1.0), ratio=(1.0, 1.0), device="cpu")  # a square of 99% never fits
    assert boxes.tolist() == [[45.0, 0.0, 55.0, 10.0]] * 3  # torchvision: width narrowed to height * max ratio


def crop_statistics(areas: torch.Tensor, log_aspects: torch.Tensor) -> torch.Tensor:
    """Mean, standard deviation and 10 / 50 / 90% quantiles of the area fraction and of the log aspect ratio."""
    quantiles = torch.tensor([0.1, 0.5, 0.9])
    return torch.cat([torch.cat([values.mean()[None], values.std()[None], values.quantile(quantiles)]) for values in (areas, log_aspects)])


def test_crops_of_a_batch_of_mixed_sizes_follow_torchvision_for_each_image_size():
    torch.manual_seed(0)
    sizes, count, scale, ratio = ((40, 24), (24, 40)), 4000, (0.2, 1.0), (3 / 4, 4 / 3)  # (height, width), wide and tall
    heights, widths = torch.tensor(sizes * (count // 2), dtype=torch.float32).unbind(1)
    boxes = crop_boxes(count, heights, widths, scale, ratio, "cpu")
    crop_w, crop_h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= widths).all() and (boxes[:, 3] <= heights).all()
    for first, (height, width) in enumerate(sizes):
        ours = slice(first, None, 2)
        reference = [T.RandomResizedCrop.get_params(torch.empty(3, height, width), scale, ratio) for _ in range(count // 2)]
        ref_h, ref_w = torch.tensor([[h, w] for _, _, h, w in reference], dtype=torch.float32).unbind(1)
        ours_stats = crop_statistics(crop_w[ours] * crop_h[ours] / (height * width), (crop_w[ours] / crop_h[ours]).log())
        ref_stats = crop_statistics(ref_w * ref_h / (height * width), (ref_w / ref_h).log())
        torch.testing.assert_close(ours_stats, ref_stats, atol=0.03, rtol=0)


def test_crops_that_never_fit_fall_back_as_torchvision_for_each_image_size():
    heights, widths = torch.tensor([10.0, 100.0]), torch.tensor([100.0, 10.0])  # a 99% square fits neither
    boxes = crop_boxes(2, heights, widths, scale=(0.99, 1.0), ratio=(1.0, 1.0), device="cpu")
    for box, height, width in zip(boxes.tolist(), heights.int().tolist(), widths.int().tolist()):
        top, left, h, w = T.RandomResizedCrop.get_params(torch.empty(3, height, width), (0.99, 1.0), (1.0, 1.0))
        assert box == [left, top, left + w, top + h]


def test_a_list_of_images_of_one_size_draws_exactly_what_their_batch_tensor_draws():
    images = torch.randint(0, 256, (8, 3, 20, 28), dtype=torch.uint8)
    batched = BatchedAugment(ViewSpec(12, MEAN, STD, blur_prob=0.5, solarize_prob=0.2))
    torch.manual_seed(1)
    from_tensor = batched(images)
    torch.manual_seed(1)
    torch.testing.assert_close(batched(list(images)), from_tensor, atol=0, rtol=0)


def test_each_image_of_a_list_of_different_sizes_is_cropped_within_itself_and_keeps_its_place():
    sizes = [(40, 24), (24, 40), (9, 50), (33, 33)]
    colours = torch.randint(0, 256, (len(sizes), 3), dtype=torch.uint8)
    images = [colour.view(3, 1, 1).expand(3, height, width) for colour, (height, width) in zip(colours, sizes)]
    out = unnormalize(BatchedAugment(ViewSpec(16, MEAN, STD, jitter=(0.0, 0.0, 0.0, 0.0), gray_prob=0.0))(images))
    assert out.shape == (len(sizes), 3, 16, 16)
    # a box reaching outside its image would blend in zeros at the border
    torch.testing.assert_close(out, (colours.float() / 255).view(-1, 3, 1, 1).expand_as(out), atol=1e-5, rtol=0)


def test_colour_primitives_equal_torchvision_per_sample():
    torch.manual_seed(0)
    images, factors = torch.rand(6, 3, 9, 9), torch.rand(6) - 0.5
    expected = torch.stack([TF.adjust_hue(images[i], float(factors[i])) for i in range(6)])
    torch.testing.assert_close(adjust_hue(images, factors), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(rgb_to_gray(images), TF.rgb_to_grayscale(images))


@pytest.mark.parametrize("operation", ["brightness", "contrast", "saturation"])
def test_colour_jitter_is_the_torchvision_formula_for_a_single_active_operation(operation):
    torch.manual_seed(0)
    images = torch.rand(16, 3, 8, 8)
    strengths = {"brightness": (0.6, 0.0, 0.0, 0.0), "contrast": (0.0, 0.6, 0.0, 0.0), "saturation": (0.0, 0.0, 0.6, 0.0)}
    jitter = BatchedAugment(ViewSpec(8, MEAN, STD, jitter=strengths[operation], jitter_prob=1.0))
    torch.manual_seed(1)
    out = jitter.color_jitter(images)
    torch.manual_seed(1)
    jitter._chance(1.0, 16, "cpu")  # replay the same random stream: the gate, then the factors in jitter order
    factors = {name: torch.empty(16).uniform_(*bounds) for name, bounds in zip(strengths, jitter.jitter_ranges)}
    adjust = {"brightness": TF.adjust_brightness, "contrast": TF.adjust_contrast, "saturation": TF.adjust_saturation}[operation]
    expected = torch.stack([adjust(images[i], float(factors[operation][i])) for i in range(16)])
    torch.testing.assert_close(out, expected, atol=3e-6, rtol=0)


def test_hue_keeps_gray_pixels_bit_for_bit_whatever_the_shift():
    values = torch.tensor([0.0, 1.0, 0.5, 0.2, 1.0 + 2**-23])  # 1 + ulp: a bilinear crop can round above 1
    images = values.view(1, 1, 1, -1).expand(5, 3, 2, -1).contiguous()
    out = adjust_hue(images, torch.tensor([-0.5, -0.1, 0.0, 0.25, 0.5]))
    assert torch.equal(out.view(torch.int32), images.view(torch.int32))


def test_jitter_order_is_drawn_per_sample():
    """Brightness then saturation differs from saturation then brightness once clamping bites; with
    both active, identical images must show both orders within one batch."""
    torch.manual_seed(0)
    image = torch.tensor([0.9, 0.5, 0.1]).view(1, 3, 1, 1).expand(256, 3, 4, 4).contiguous()
    out = BatchedAugment(ViewSpec(4, MEAN, STD, jitter=(0.0, 0.0, 0.0, 0.0), jitter_prob=1.0))
    out.jitter_ranges = ((1.5, 1.5), (1.0, 1.0), (2.0, 2.0), (0.0, 0.0))  # fixed factors, only the order varies
    result = out.color_jitter(image)[:, :, 0, 0]
    distinct = torch.unique(result.round(decimals=5), dim=0)
    assert len(distinct) == 2


def test_gaussian_blur_keeps_constants_and_small_sigma_is_identity():
    constant = torch.full((2, 3, 12, 12), 0.3)
    torch.testing.assert_close(gaussian_blur(constant, torch.tensor([0.5, 2.0]), 2.0), constant)
    images = torch.rand(2, 3, 12, 12)
    torch.testing.assert_close(gaussian_blur(images, torch.tensor([1e-3, 1e-3]), 2.0), images)


def test_blur_is_pils_gaussian_blur_of_the_per_image_pipeline():
    """PIL's blur (MoCo v2's, the `cpu` pipeline's): three box blurs of variance sigma^2 / 3 each way, edge
    pixels repeated. Equal up to PIL's rounding to 8 bits after each pass (a sampled Gaussian kernel would
    miss by 0.04 on average at sigma 0.3, by 0.1 at the borders with reflected edges)."""
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    for sigma in (0.1, 0.3, 0.5, 1.0, 1.5, 2.0):
        expected = torch.from_numpy(np.array(pil.filter(ImageFilter.GaussianBlur(radius=sigma)))).permute(2, 0, 1) / 255
        blurred = gaussian_blur(image[None] / 255, torch.tensor([sigma]), max_sigma=2.0)[0]
        assert (blurred - expected).abs().max() < 3.5 / 255, sigma
        assert (blurred - expected).abs().mean() < 1.2 / 255, sigma


def random_boxes(batch: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """(B, 4) whole-pixel (x1, y1, x2, y2) boxes inside a height x width image, as `crop_boxes` draws them."""
    w = torch.randint(1, width + 1, (batch,), generator=generator)
    h = torch.randint(1, height + 1, (batch,), generator=generator)
    left = (torch.rand(batch, generator=generator) * (width - w + 1)).floor()
    top = (torch.rand(batch, generator=generator) * (height - h + 1)).floor()
    return torch.stack([left, top, left + w, top + h], dim=1).float()


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_filtered_crops_are_torchs_antialiased_resize_of_each_crop(interpolation):
    """Shrinking, enlarging and both at once: each crop as torch's interpolate with antialias (PIL's filter)."""
    generator = torch.Generator().manual_seed(3)
    images = torch.rand(64, 3, 40, 28, generator=generator)
    boxes = random_boxes(64, 40, 28, generator)
    for size in (8, 16, 48):
        crops = filtered_crops(images, boxes, size, interpolation)
        for image, (x1, y1, x2, y2), crop in zip(images, boxes.long().tolist(), crops):
            expected = torch.nn.functional.interpolate(image[None, :, y1:y2, x1:x2], size=(size, size), mode=interpolation, antialias=True, align_corners=False)
            torch.testing.assert_close(crop, expected[0].clamp(0, 1), atol=1e-5, rtol=0)


def smooth_image(height: int, width: int) -> torch.Tensor:
    """A uint8 (3, H, W) image of slow colour waves, like a photograph's (bicubic overshoot stays small)."""
    ys, xs = torch.meshgrid(torch.linspace(0, 6, height), torch.linspace(0, 4, width), indexing="ij")
    return (torch.stack([xs.sin(), (xs * ys / 4).cos(), (ys / 2).sin() * xs.cos()]) * 110 + 128).round().to(torch.uint8)


def test_bicubic_crops_are_pils_bicubic_resize_up_to_its_8_bit_passes():
    """Against PIL's crop-then-resize (torchvision's RandomResizedCrop of a PIL image) of a smooth image: PIL
    rounds to 8 bits after each of its two passes, so they agree to about a level of 255."""
    image = smooth_image(48, 40)
    pil = Image.fromarray(image.permute(1, 2, 0).numpy().copy())
    boxes = random_boxes(32, 48, 40, torch.Generator().manual_seed(4))
    for size in (12, 32, 64):
        crops = filtered_crops(image.expand(32, -1, -1, -1) / 255, boxes, size, "bicubic")
        for (x1, y1, x2, y2), crop in zip(boxes.long().tolist(), crops):
            expected = torch.from_numpy(np.array(pil.crop((x1, y1, x2, y2)).resize((size, size), Image.BICUBIC))).permute(2, 0, 1) / 255
            assert (crop - expected).abs().max() <= 1.5 / 255 and (crop - expected).abs().mean() < 0.5 / 255


def test_bilinear_crops_that_shrink_average_as_pils_bilinear_filter():
    """A view smaller than its images (ImageNet's 224 px crops of larger photographs, STL-10's 64 px crops of 96 px):
    each crop as PIL's crop-then-resize (torchvision's RandomResizedCrop of a PIL image), whose bilinear filter widens
    with the reduction, up to its 8-bit rounding; on noise, where roi_align's grid of samples was up to 0.25 off."""
    image = torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    height, width = image.shape[-2:]
    pil = Image.fromarray(image.permute(1, 2, 0).numpy().copy())
    boxes = random_boxes(32, height, width, torch.Generator().manual_seed(6))
    for size in (8, 12, 20):
        crops = BatchedAugment(ViewSpec(size, MEAN, STD)).resample(image.expand(32, -1, -1, -1) / 255, boxes)
        for (x1, y1, x2, y2), crop in zip(boxes.long().tolist(), crops):
            expected = torch.from_numpy(np.array(pil.crop((x1, y1, x2, y2)).resize((size, size), Image.BILINEAR))).permute(2, 0, 1) / 255
            assert (crop - expected).abs().max() <= 1.5 / 255, (size, x2 - x1, y2 - y1)


def test_the_per_image_pipeline_crops_bicubically_when_asked():
    """torchvision's RandomResizedCrop with bicubic interpolation, drawing what the bilinear one draws."""
    image = Image.fromarray(NOISE.permute(1, 2, 0).numpy())
    spec = dict(scale=(0.2, 1.0), jitter_prob=0.0, gray_prob=0.0, flip=False)
    views = []
    for mode in ("bicubic", "bilinear"):
        torch.manual_seed(0)
        views.append(augment(ViewSpec(24, MEAN, STD, **spec, interpolation=mode))(image))
    torch.manual_seed(0)
    crop = T.RandomResizedCrop(24, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC)(image)
    expected = torch.from_numpy(np.array(crop)).permute(2, 0, 1) / 255
    torch.testing.assert_close(unnormalize(views[0][None])[0], expected, atol=1e-6, rtol=0)
    assert (views[0] - views[1]).abs().max() > 0.1  # the two interpolations do differ on this image


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_both_pipelines_resample_a_whole_image_crop_alike(interpolation):
    """The crop that is the whole image, enlarged 1.5x: the batched view is the per-image pipeline's (PIL's
    bicubic, or bilinear) up to PIL's 8-bit rounding, and the two interpolations differ by far more."""
    image = smooth_image(16, 16)
    batched, per_image = draw_both_pipelines(image, 2, 24, **ALONE, interpolation=interpolation)
    other = draw_both_pipelines(image, 2, 24, **ALONE, interpolation={"bilinear": "bicubic", "bicubic": "bilinear"}[interpolation])[0]
    assert (batched - per_image).abs().max() <= 1.5 / 255 < (batched - other).abs().max()


def test_an_unknown_interpolation_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="interpolation must be one of bilinear, bicubic, got 'nearest'"):
        ViewSpec(32, MEAN, STD, interpolation="nearest")


def draw_both_pipelines(image: torch.Tensor, count: int, size: int, **parameters) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` views of one uint8 (3, H, W) image from the batched pipeline (one batch) and from the
    per-image PIL pipeline of `datamodules.transforms.augment`, from one `ViewSpec` (one call per view), both in [0, 1]."""
    torch.manual_seed(0)
    random.seed(0)
    batched = unnormalize(BatchedAugment(ViewSpec(size, MEAN, STD, **parameters))(image.expand(count, -1, -1, -1)))
    per_image = augment(ViewSpec(size, MEAN, STD, **parameters))
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    return batched, unnormalize(torch.stack([per_image(pil) for _ in range(count)]))


def constant_image(rgb, size: int = 8) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1).expand(3, size, size).contiguous()


def two_tone_image(size: int = 8) -> torch.Tensor:
    """Dark left half, bright right half: its standard deviation measures contrast, its left half the flip."""
    image = constant_image((64, 64, 64), size)
    image[:, :, size // 2:] = 192
    return image


def channel_spread(views: torch.Tensor) -> torch.Tensor:
    return (views.amax(dim=1) - views.amin(dim=1)).mean(dim=(1, 2))


def hue_shift(views: torch.Tensor, base=(200, 100, 50)) -> torch.Tensor:
    """Hue of each view's mean colour minus the base colour's hue, on the circle (-0.5, 0.5]."""
    base_hue = colorsys.rgb_to_hsv(*(value / 255 for value in base))[0]
    hues = torch.tensor([colorsys.rgb_to_hsv(*colour)[0] for colour in views.mean(dim=(2, 3)).tolist()])
    return torch.remainder(hues - base_hue + 0.5, 1.0) - 0.5


NOISE = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
ORANGE, GRAY = constant_image((200, 100, 50)), constant_image((204, 204, 204))
STRENGTHS = {  # image, the operation always applied (nothing else), a per-view statistic that it moves
    "brightness": (constant_image((128, 128, 128)), dict(jitter=(0.4, 0.0, 0.0, 0.0), jitter_prob=1.0), lambda views: views.mean(dim=(1, 2, 3))),
    "contrast": (two_tone_image(), dict(jitter=(0.0, 0.4, 0.0, 0.0), jitter_prob=1.0), lambda views: views.std(dim=(1, 2, 3))),
    "saturation": (ORANGE, dict(jitter=(0.0, 0.0, 0.4, 0.0), jitter_prob=1.0), channel_spread),
    "hue": (ORANGE, dict(jitter=(0.0, 0.0, 0.0, 0.1), jitter_prob=1.0), hue_shift),
    "blur": (NOISE, dict(blur_prob=1.0), lambda views: (views - NOISE / 255).abs().mean(dim=(1, 2, 3))),
}
RATES = {  # image, the operation with its probability, a statistic that changes when it applies
    "jitter": (ORANGE, dict(jitter=(0.4, 0.4, 0.4, 0.1)), lambda views: views.mean(dim=(2, 3))),
    "grayscale": (ORANGE, dict(gray_prob=0.2), lambda views: views.mean(dim=(2, 3))),
    "blur": (NOISE, dict(blur_prob=0.5), lambda views: views),
    "solarisation": (GRAY, dict(solarize_prob=0.2), lambda views: views.mean(dim=(2, 3))),
    "flip": (two_tone_image(), dict(flip=True), lambda views: views[..., 0]),
}
ALONE = dict(scale=(1.0, 1.0), ratio=(1.0, 1.0), jitter=(0.0, 0.0, 0.0, 0.0), gray_prob=0.0, flip=False)  # crop = whole image
QUANTILES = torch.tensor([0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95])


def assert_same_mean(first: torch.Tensor, second: torch.Tensor) -> None:
    """Two-sample test of the means at 4 standard errors: fails for a real difference, not for noise."""
    standard_error = math.sqrt(first.var() / len(first) + second.var() / len(second))
    assert abs(first.mean() - second.mean()) < 4 * standard_error + 1e-6, (first.mean(), second.mean())


@pytest.mark.parametrize("operation", STRENGTHS)
def test_each_operation_draws_its_strength_as_the_per_image_pipeline(operation):
    """How strongly an operation acts, over 2,000 views of one image: the quantiles of a statistic that it
    moves agree with the per-image pipeline's (jitter factors, hue shift, blur sigma)."""
    image, parameters, statistic = STRENGTHS[operation]
    batched, per_image = (statistic(views) for views in draw_both_pipelines(image, 2000, image.shape[-1], **ALONE | parameters))
    assert batched.std() > 0.02  # the statistic does see the operation
    torch.testing.assert_close(batched.quantile(QUANTILES), per_image.quantile(QUANTILES), atol=0.02, rtol=0)


@pytest.mark.parametrize("operation", RATES)
@pytest.mark.slow
def test_each_operation_is_applied_at_the_rate_of_the_per_image_pipeline(operation):
    """How often an operation applies (jitter p=0.8, grayscale p=0.2, blur p=0.5, solarisation p=0.2,
    flip p=0.5): the share of 4,000 views it changed is the per-image pipeline's, within noise."""
    image, parameters, statistic = RATES[operation]
    untouched = statistic(image[None] / 255)
    batched, per_image = (
        ((statistic(views) - untouched).abs().flatten(1).amax(dim=1) > 0.01).float()
        for views in draw_both_pipelines(image, 4000, image.shape[-1], **ALONE | parameters)
    )
    assert 0.1 < batched.mean() < 0.9
    assert_same_mean(batched, per_image)


@pytest.mark.slow
def test_presets_draw_views_distributed_as_the_per_image_pipeline():
    """Whole presets (crop, jitter, grayscale, blur, solarisation, flip together) on a colour gradient with
    a patch: brightness, contrast, saturation, left-right and red-blue balance of 2,000 views agree."""
    ys, xs = torch.meshgrid(torch.linspace(0, 1, 32), torch.linspace(0, 1, 32), indexing="ij")
    image = (torch.stack([xs, ys, 1 - (xs + ys) / 2]) * 255).round().to(torch.uint8)
    image[:, 8:16, 8:16] = torch.tensor([250, 20, 120], dtype=torch.uint8).view(3, 1, 1)

    def statistics(views: torch.Tensor) -> torch.Tensor:
        return torch.stack([
            views.mean(dim=(1, 2, 3)), views.std(dim=(1, 2, 3)), channel_spread(views),
            views[..., :12].mean(dim=(1, 2, 3)) - views[..., 12:].mean(dim=(1, 2, 3)),
            views[:, 0].mean(dim=(1, 2)) - views[:, 2].mean(dim=(1, 2)),
        ], dim=1)

    for preset in ("crop_flip", "mocov2", "simclr", "npid", "byol2", "paco_sim"):
        batched, per_image = (statistics(views) for views in draw_both_pipelines(image, 2000, 24, **CONTRASTIVE_PRESETS[preset]))
        quantile_gap = (batched.quantile(QUANTILES, dim=0) - per_image.quantile(QUANTILES, dim=0)).abs().max()
        assert quantile_gap < 0.04, (preset, quantile_gap)
        assert (batched.mean(dim=0) - per_image.mean(dim=0)).abs().max() < 0.02, preset


@pytest.mark.parametrize("preset", ["mocov2", "crop_flip", "npid", "simclr"])
def test_a_moco_step_runs_with_the_gpu_pipeline(preset):
    from methods import MoCoV2
    from methods.momentum import MomentumSpec

    datamodule = digits({"query": {"preset": preset}, "key": {"preset": preset}}, batch_size=16, pipeline="gpu")
    batch = datamodule.augment_on_device(next(iter(datamodule.train_dataloader())))
    assert batch["views"]["query"].shape == (16, 3, 32, 32) and batch["views"]["query"].dtype == torch.float32
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)
    loss, _ = model.step(batch)
    assert torch.isfinite(loss)


def test_evaluation_presets_refuse_the_gpu_pipeline():
    with pytest.raises(ValueError, match="runs per image only"):
        digits({"image": {"preset": "crop_pad_flip"}}, pipeline="gpu")


@pytest.mark.parametrize("batch, size", [(1, 24), (7, 24), (64, 24), (3, 192)])
def test_the_cpus_row_copies_draw_the_views_of_the_accelerators_whole_batch_selects_bit_for_bit(batch, size, monkeypatch):
    """On the CPU `by_kind` transforms and copies only the samples of each kind; on an accelerator it transforms the
    whole batch and selects with torch.where. Same random draws, same bits, with every per-sample choice on. At 192 px
    on two threads, the mean gray of one image alone (36,864 pixels) would be summed by both threads and round
    otherwise than in a batch."""
    from engine import devices

    spec = ViewSpec(size, MEAN, STD, jitter=(0.8, 0.8, 0.8, 0.5), gray_prob=0.3, blur_prob=0.5, solarize_prob=0.3)
    images = torch.randint(0, 256, (batch, 3, size + 8, size + 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        views = []
        for on_host in (True, False):
            monkeypatch.setattr(devices, "host_reads_are_free", lambda tensor, on_host=on_host: on_host)
            torch.manual_seed(0)
            views.append(torch.cat([BatchedAugment(spec)(images) for _ in range(4)]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(views[0].view(torch.int32), views[1].view(torch.int32))


@pytest.mark.parametrize("on_accelerator", [False, True])
def test_by_kind_sends_each_sample_through_the_transform_of_its_kind_and_keeps_the_callers_batch(on_accelerator, monkeypatch):
    from engine import devices

    monkeypatch.setattr(devices, "host_reads_are_free", lambda tensor: not on_accelerator)
    images = torch.arange(12.0).view(6, 1, 1, 2)
    before = images.clone()
    kinds = torch.tensor([2, 0, 1, 2, 5, 0])  # kind 3 has no sample, kind 5 no transform
    offsets = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    transforms = (None, lambda x, index: -x, lambda x, index: x + offsets[index].view(-1, 1, 1, 1), lambda x, index: x * 100)
    out = by_kind(kinds, transforms, images)
    expected = torch.stack([image + offset if kind == 2 else -image if kind == 1 else image for image, kind, offset in zip(images, kinds, offsets)])
    assert torch.equal(out, expected)
    untouched = by_kind(torch.tensor([0, 0, 3, 3, 3, 3]), transforms[:3], images)
    assert torch.equal(untouched, images) and (untouched is images) == (not on_accelerator)
    assert torch.equal(images, before)
