"""Per-sample random augmentation of a whole batch of tensors, on whatever device the batch is on.

`BatchedAugment` runs the `ViewSpec` (`datamodules.view_spec`) that `datamodules.transforms.augment` runs per
image and draws every random parameter per sample, like the per-image pipeline does (torchvision v2 applied
to a batch would draw one set for the whole batch, which is wrong for two-view contrastive learning):

- RandomResizedCrop: torchvision's sampling (10 tries of area and log-ratio, then the clamped centre
  fallback) vectorised, resampled by PIL's bilinear filter, or with `interpolation: bicubic` its bicubic one, as two
  matrix products per batch (`filter_weights`; bilinear crops of images no larger than the output, which can only
  enlarge, by `roi_align`, whose one sample per pixel is then that filter);
- ColorJitter: torchvision's tensor formulas for brightness, contrast, saturation (each clamped to [0, 1])
  and hue, in an order drawn per sample;
- grayscale (ITU-R 601 weights as torchvision), PIL's Gaussian blur (three box blurs each way, as the
  per-image pipeline's) with a per-sample sigma, solarisation, horizontal flip; then normalisation.

Plain torch and torchvision operations (no kornia: it is not among the project's packages, and whether it
would be faster here is unmeasured), each primitive tested against torchvision's per-image formula.

Input: uint8 or float in [0, 1], either one (B, C, H, W) tensor or a list of B (C, H_i, W_i) images of any
sizes (folders decoded on the device, `datamodules.encoded`). Output: float32 (B, C, size, size), normalised.
"""

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torchvision.ops import roi_align

from datamodules.view_spec import ViewSpec
from engine import devices

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)


def process_rows(draw: Callable[[int], torch.Tensor], batch: int) -> torch.Tensor:
    """The rows of this process's `batch` samples of `draw(n)`, n the samples of all processes: every process draws
    the numbers of all samples and keeps its own. seed_everything seeds every process alike, so that each drawing its
    batch alone would repeat rank 0's crops, jitters and flips on every rank (solo-learn's DALI pipeline seeds each
    device apart, solo/data/dali_dataloader.py); this way they keep one random state, which a resumed run restores
    from rank 0 (`engine.random_state`). One process draws its batch alone."""
    processes = devices.process_group()
    world, rank = processes["num_replicas"], processes["rank"]
    return draw(batch) if world == 1 else draw(batch * world)[rank * batch : (rank + 1) * batch]


def _uniform(low: float, high: float, count: int, device) -> torch.Tensor:
    return process_rows(lambda n: torch.empty(n, device=device).uniform_(low, high), count)


def _rand(count: int, device, *shape: int) -> torch.Tensor:
    """`torch.rand(count, *shape)` of this process's samples (`process_rows`)."""
    return process_rows(lambda n: torch.rand(n, *shape, device=device), count)


def crop_boxes(batch: int, height, width, scale, ratio, device, tries: int = 10) -> torch.Tensor:
    """(B, 4) boxes (x1, y1, x2, y2) drawn per sample as torchvision's RandomResizedCrop.get_params:
    up to `tries` draws of area and log-ratio, the first that fits wins, else the centred fallback.
    `height` and `width` are one size for the whole batch (ints) or each sample's own ((B,) tensors)."""
    height, width = _per_sample(height, batch, device), _per_sample(width, batch, device)
    area = (height * width)[:, None] * process_rows(lambda n: torch.empty(n, tries, device=device).uniform_(*scale), batch)
    aspect = process_rows(lambda n: torch.empty(n, tries, device=device).uniform_(math.log(ratio[0]), math.log(ratio[1])), batch).exp()
    crop_w = torch.sqrt(area * aspect).round()
    crop_h = torch.sqrt(area / aspect).round()
    fits = (crop_w > 0) & (crop_w <= width[:, None]) & (crop_h > 0) & (crop_h <= height[:, None])
    found = fits.any(dim=1)
    first = fits.float().argmax(dim=1, keepdim=True)
    fallback_w, fallback_h = _fallback_size(height, width, ratio)
    w = torch.where(found, crop_w.gather(1, first)[:, 0], fallback_w)
    h = torch.where(found, crop_h.gather(1, first)[:, 0], fallback_h)
    top = torch.where(found, torch.floor(_rand(batch, device) * (height - h + 1)), torch.div(height - h, 2, rounding_mode="floor"))
    left = torch.where(found, torch.floor(_rand(batch, device) * (width - w + 1)), torch.div(width - w, 2, rounding_mode="floor"))
    return torch.stack([left, top, left + w, top + h], dim=1)


def filter_weights(start: torch.Tensor, length: torch.Tensor, size: int, extent: int, interpolation: str) -> torch.Tensor:
    """(B, size, extent): the weights that resample pixels [start, start + length) of each sample's axis of `extent`
    pixels to `size` pixels as PIL's BILINEAR or BICUBIC resize of that crop (Pillow src/libImaging/Resample.c: the
    triangle, or the cubic convolution with a = -0.5, its support widened by the scale when it shrinks, so that it
    averages; the weights of each output pixel normalised over the pixels of the crop), which torch's `interpolate`
    with `antialias=True` computes too."""
    scale = (length / size)[:, None, None]
    centres = start[:, None, None] + (torch.arange(size, device=start.device) + 0.5)[None, :, None] * scale
    pixels = torch.arange(extent, device=start.device)[None, None, :]
    distance = ((pixels + 0.5 - centres) / scale.clamp(min=1.0)).abs()
    if interpolation == "bilinear":
        weights = (1 - distance).clamp(min=0)
    else:
        a = -0.5
        near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
        far = (((distance - 5) * distance + 8) * distance - 4) * a
        weights = torch.where(distance < 1, near, torch.where(distance < 2, far, 0.0))
    weights = weights * ((pixels >= start[:, None, None]) & (pixels < (start + length)[:, None, None]))
    return weights / weights.sum(dim=-1, keepdim=True)


def filtered_crops(images: torch.Tensor, boxes: torch.Tensor, size: int, interpolation: str) -> torch.Tensor:
    """The (x1, y1, x2, y2) `boxes` of float (B, C, H, W) `images` resampled to size x size by PIL's bilinear or
    bicubic filter: rows, then columns, clamped to [0, 1] as PIL clamps to 8 bits (PIL also rounds to 8 bits between
    its two passes, and takes them in either order: up to a few levels of 255 apart where the cubic overshoots at
    sharp edges)."""
    columns = filter_weights(boxes[:, 0], boxes[:, 2] - boxes[:, 0], size, images.shape[-1], interpolation)
    rows = filter_weights(boxes[:, 1], boxes[:, 3] - boxes[:, 1], size, images.shape[-2], interpolation)
    return (rows[:, None] @ (images @ columns.transpose(1, 2)[:, None])).clamp(0, 1)


def _per_sample(size: int | torch.Tensor, batch: int, device) -> torch.Tensor:
    """A size as a float (B,) tensor on the device; an int is filled in there, not copied from the host
    (a blocking copy would synchronise the host with the device)."""
    if isinstance(size, torch.Tensor):
        return size.to(device=device, dtype=torch.float32)
    return torch.full((batch,), float(size), device=device)


def _fallback_size(height: torch.Tensor, width: torch.Tensor, ratio) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's fallback: the whole image, narrowed to the nearest allowed aspect ratio."""
    in_ratio = width / height
    fallback_w = torch.where(in_ratio > max(ratio), torch.round(height * max(ratio)), width)
    fallback_h = torch.where(in_ratio < min(ratio), torch.round(width / min(ratio)), height)
    return fallback_w, fallback_h


def _unit_range(images: torch.Tensor) -> torch.Tensor:
    return images.float() / 255 if images.dtype == torch.uint8 else images.float()


def rgb_to_gray(images: torch.Tensor) -> torch.Tensor:
    # weights as Python numbers, torchvision's formula: a weight tensor made here would be a blocking host-to-device copy
    red, green, blue = images.unbind(1)
    return (GRAY_WEIGHTS[0] * red + GRAY_WEIGHTS[1] * green + GRAY_WEIGHTS[2] * blue).unsqueeze(1)


def _blend(images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    factor = factor.view(-1, 1, 1, 1)
    return (factor * images + (1 - factor) * other).clamp(0, 1)


def adjust_hue(images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's tensor `adjust_hue`: RGB -> HSV, hue + shift (mod 1), HSV -> RGB, per sample."""
    red, green, _ = images.unbind(1)
    maximum, minimum = images.amax(dim=1), images.amin(dim=1)  # max(dim) also finds indices: 40x slower on the CPU
    chroma = maximum - minimum
    safe_max = torch.where(maximum == 0, torch.ones_like(maximum), maximum)
    saturation = chroma / safe_max
    safe_chroma = torch.where(chroma == 0, torch.ones_like(chroma), chroma)
    rc, gc, bc = ((maximum.unsqueeze(1) - images) / safe_chroma.unsqueeze(1)).unbind(1)
    # no select of hue 0 where chroma is 0 (torchvision's): there the saturation is 0, and the output the value, whatever the hue
    hue = torch.where(maximum == red, bc - gc, torch.where(maximum == green, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.fmod(hue / 6.0 + 1.0, 1.0)
    hue = torch.remainder(hue + shift.view(-1, 1, 1), 1.0) * 6.0
    # HSV -> RGB in closed form, channel = v - v s clamp(min(k, 4 - k), 0, 1) with k = (n + 6h) mod 6 for
    # n = 5, 3, 1 (red, green, blue): the same values as torchvision's sector table, without building six candidate maps.
    k = torch.remainder(hue.unsqueeze(1) + torch.arange(5.0, 0.0, -2.0, device=images.device, dtype=images.dtype).view(1, 3, 1, 1), 6.0)
    return maximum.unsqueeze(1) - (maximum * saturation).unsqueeze(1) * torch.minimum(k, 4.0 - k).clamp(0, 1)


def blur_boxes(sigma: torch.Tensor, max_sigma: float, passes: int = 3) -> torch.Tensor:
    """(B, K) box kernels of PIL's `GaussianBlur(radius=sigma)`, the blur of the per-image pipeline (MoCo
    v2's loader): 2 l + 1 whole pixels and a fractional pixel `a` at each end, with the variance
    sigma^2 / passes, so that `passes` of them approximate the Gaussian (Pillow's BoxBlur.c, after Gwosdek
    et al. 2011). Sampling the Gaussian itself would be another blur: sigma = 0.3 would barely change an image."""
    variance = sigma**2 / passes
    whole = torch.floor((torch.sqrt(12 * variance + 1) - 1) / 2)
    fraction = (2 * whole + 1) * (whole * (whole + 1) - 3 * variance) / (6 * (variance - (whole + 1) ** 2))
    reach = math.floor((math.sqrt(12 * max_sigma**2 / passes + 1) - 1) / 2) + 1  # from the bound: no host read
    distance = torch.arange(-reach, reach + 1, device=sigma.device, dtype=sigma.dtype).abs()
    box = torch.where(distance <= whole[:, None], 1.0, torch.where(distance == whole[:, None] + 1, fraction[:, None], 0.0))
    return box / (2 * (whole + fraction) + 1)[:, None]


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor, max_sigma: float, passes: int = 3) -> torch.Tensor:
    """PIL's Gaussian blur with one sigma per sample: `passes` box blurs along the rows, then along the
    columns, each repeating the edge pixels outwards, as PIL does."""
    batch, channels, height, width = images.shape
    box = blur_boxes(sigma.to(images.dtype), max_sigma, passes).repeat_interleave(channels, dim=0)  # (B*C, K)
    reach = box.shape[1] // 2
    flat = images.reshape(1, batch * channels, height, width)
    if flat.device.type == "cpu":  # oneDNN's depthwise kernel for channels-last runs this 2-3x faster, with the same bits
        flat = flat.contiguous(memory_format=torch.channels_last)
    for padding, kernel in (((reach, reach, 0, 0), box[:, None, None, :]), ((0, 0, reach, reach), box[:, None, :, None])):
        for _ in range(passes):
            flat = F.conv2d(F.pad(flat, padding, mode="replicate"), kernel, groups=batch * channels)
    return flat.reshape(batch, channels, height, width)  # on the CPU a strided view: the callers copy its rows


def by_kind(kinds: torch.Tensor, transforms, images: torch.Tensor) -> torch.Tensor:
    """Each sample through the transform of its kind: `transforms[k](images, index)` for the samples whose entry of
    `kinds` (B,) is k, where `index` picks their per-sample parameters; the samples of a None transform, or of a kind
    outside range(len(transforms)), stay as they are. A transform keeps the shape and dtype of what it is given. On an
    accelerator every transform runs on the whole batch and torch.where picks (index `slice(None)`, no host
    synchronisation); on the CPU each transform runs on its own samples only, copied into one new batch (torch.where's
    CPU kernel is about 10x slower than a copy), and the batch itself is returned when no sample is transformed."""
    if not devices.host_reads_are_free(images):
        out = images
        for kind, transform in enumerate(transforms):
            if transform is not None:
                out = torch.where((kinds == kind).view(-1, 1, 1, 1), transform(images, slice(None)), out)
        return out
    out = images
    for kind, transform in enumerate(transforms):
        rows = (kinds == kind).nonzero()[:, 0] if transform is not None else ()
        if len(rows):
            out = images.clone() if out is images else out  # the caller's batch stays as it is
            out.index_copy_(0, rows, transform(images[rows], rows))
    return out


def where_rows(selected: torch.Tensor, transform, images: torch.Tensor) -> torch.Tensor:
    """`transform(images, index)` for the samples `selected` (B,), the others as they are (`by_kind`)."""
    return by_kind(selected.long(), (None, transform), images)


class BatchedAugment:
    """A `ViewSpec` on a batch, every parameter drawn per sample."""

    def __init__(self, spec: ViewSpec):
        self.spec = spec
        brightness, contrast, saturation, hue = spec.jitter
        self.jitter_ranges = (
            (max(0.0, 1 - brightness), 1 + brightness),
            (max(0.0, 1 - contrast), 1 + contrast),
            (max(0.0, 1 - saturation), 1 + saturation),
            (-hue, hue),
        )
        self.mean = torch.tensor(spec.mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(spec.std, dtype=torch.float32).view(1, -1, 1, 1)

    def _chance(self, probability: float, batch: int, device) -> torch.Tensor:
        return _rand(batch, device) < probability

    def color_jitter(self, images: torch.Tensor) -> torch.Tensor:
        batch, device = images.shape[0], images.device
        applied = self._chance(self.spec.jitter_prob, batch, device)
        neutral = (1.0, 1.0, 1.0, 0.0)
        factors = [
            torch.where(applied, _uniform(low, high, batch, device), torch.full((batch,), value, device=device))
            for (low, high), value in zip(self.jitter_ranges, neutral)
        ]
        order = _rand(batch, device, 4).argsort(dim=1)  # a random order per sample, as torchvision
        on_host = devices.host_reads_are_free(images)
        for position in range(4):
            step = order[:, position]
            # brightness, contrast and saturation blend with a reference: black, the mean gray, the gray image. The mean is
            # reduced over the whole batch: for one image alone (32,768 pixels or more) two threads would sum it, rounding otherwise
            gray = rgb_to_gray(images)
            references = (torch.zeros_like(gray[:, :, :1, :1]), gray.mean(dim=(1, 2, 3), keepdim=True), gray)
            if on_host:  # each adjustment on its own samples only
                blends = [lambda selected, index, kind=kind: _blend(selected, references[kind][index], factors[kind][index]) for kind in range(3)]
                images = by_kind(step, [*blends, lambda selected, index: adjust_hue(selected, factors[3][index])], images)
            else:  # an accelerator: every sample blended with its own reference and hue-shifted, each kept by its step
                blend = step.clamp(max=2)
                kind = blend.view(-1, 1, 1, 1)
                reference = torch.where(kind == 2, gray, torch.where(kind == 1, references[1], 0.0))
                blended = _blend(images, reference, torch.stack(factors[:3], dim=1).gather(1, blend[:, None])[:, 0])
                images = torch.where((step == 3).view(-1, 1, 1, 1), adjust_hue(images, factors[3]), blended)
        return images

    def resample(self, images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """The (x1, y1, x2, y2) `boxes` of float (B, C, H, W) `images` resampled to size x size, as `spec.interpolation`
        says. A bilinear crop of an image no larger than the output only enlarges: `roi_align` then takes one bilinear
        sample per pixel, PIL's filter, except that on the output's outer ring it blends in the image's pixel beyond the
        crop where PIL's crop-then-resize clamps to the crop (the inside agrees to 1e-4 of a level of 255). A larger
        image's crop may shrink, where roi_align averages a grid of samples instead of widening the filter as PIL does
        (scikit-learn's two sample photographs, a 128 or 256 px crop to 64 px: 28 to 44 levels apart at most, 0.7 to 5.0
        on average; the filter's weights: under 1 level)."""
        if self.spec.interpolation == "bilinear" and max(images.shape[-2:]) <= self.spec.size:
            indexed = torch.cat([torch.arange(len(boxes), device=boxes.device, dtype=boxes.dtype)[:, None], boxes], dim=1)
            return roi_align(images, indexed, self.spec.size, spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        return filtered_crops(images, boxes, self.spec.size, self.spec.interpolation)

    def resized_crops(self, images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """A random crop of every image (drawn from its own height and width), resampled to size x size:
        float (B, C, size, size) in [0, 1]. A list of images of different sizes is resampled image by image."""
        batch, device = len(images), images[0].device
        if isinstance(images, torch.Tensor):
            boxes = crop_boxes(batch, images.shape[-2], images.shape[-1], self.spec.scale, self.spec.ratio, device)
            return self.resample(_unit_range(images), boxes)
        heights, widths = torch.tensor([image.shape[-2:] for image in images], dtype=torch.float32).to(device, non_blocking=True).unbind(1)
        boxes = crop_boxes(batch, heights, widths, self.spec.scale, self.spec.ratio, device)
        return torch.cat([self.resample(_unit_range(image)[None], box[None]) for image, box in zip(images, boxes)])

    @torch.no_grad()
    def __call__(self, images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        images = self.resized_crops(images)
        batch, device = images.shape[0], images.device
        if any(high != low for low, high in self.jitter_ranges) and self.spec.jitter_prob > 0:
            images = self.color_jitter(images)
        if self.spec.gray_prob > 0:
            images = where_rows(self._chance(self.spec.gray_prob, batch, device), lambda selected, _: rgb_to_gray(selected).expand_as(selected), images)
        if self.spec.blur_prob > 0:
            sigma = _uniform(*self.spec.blur_sigma, batch, device)
            images = where_rows(self._chance(self.spec.blur_prob, batch, device),
                                lambda selected, index: gaussian_blur(selected, sigma[index], self.spec.blur_sigma[1]), images)
        if self.spec.solarize_prob > 0:
            images = where_rows(self._chance(self.spec.solarize_prob, batch, device),
                                lambda selected, _: torch.where(selected >= self.spec.solarize_threshold, 1 - selected, selected), images)
        if self.spec.flip:
            images = where_rows(self._chance(0.5, batch, device), lambda selected, _: selected.flip(-1), images)
        if self.mean.device != device:  # moved once: a blocking host-to-device copy per batch would wait for the GPU
            self.mean, self.std = self.mean.to(device), self.std.to(device)
        return (images - self.mean) / self.std
