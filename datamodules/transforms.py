"""Named augmentation pipelines ("presets"), each with its paper's parameters.

A view in a config is `{preset: <name>, **parameters}`, e.g. `{preset: mocov2, blur_prob: 0.0}`; the
DataModule fills in `size`, `mean` and `std` for its dataset unless the view sets them, and `count: N`
draws N independent augmentations of the same image (stacked along a new dimension after the batch).

The contrastive presets are parameter sets of one augmentation family, which runs either per image in
the DataLoader workers (`augment`, PIL) or per batch on the training device (`BatchedAugment`, the
same parameters, every random draw per sample): `data.pipeline: workers | device`.
"""

import inspect
import random
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2 as T

from datamodules.batched import BatchedAugment


class PILGaussianBlur:
    """Gaussian blur with sigma ~ U[sigma_min, sigma_max] via PIL, as MoCo v2's `loader.py` and SCE's
    small-dataset pipelines apply it (the PIL radius is the standard deviation)."""

    def __init__(self, sigma: tuple[float, float] = (0.1, 2.0)):
        self.sigma = tuple(sigma)

    def __call__(self, image: Image.Image) -> Image.Image:
        return image.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))

    def __repr__(self) -> str:
        return f"PILGaussianBlur(sigma={self.sigma})"


class ToNormalizedTensor:
    """PIL image -> float32 (C, H, W) tensor, (x / 255 - mean) / std: the same numbers as torchvision's
    ToImage + ToDtype(scale=True) + Normalize, in one step (7x faster on 32 px images, where the
    three-step version costs as much as the augmentations)."""

    def __init__(self, mean, std):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1) * 255

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.float32)).permute(2, 0, 1)
        return pixels.sub_(self.mean).div_(self.std)

    def __repr__(self) -> str:
        return f"ToNormalizedTensor(mean={(self.mean / 255).flatten().tolist()}, std={(self.std / 255).flatten().tolist()})"


def augment(
    size: int,
    mean,
    std,
    scale=(0.2, 1.0),
    ratio=(3 / 4, 4 / 3),
    jitter=(0.4, 0.4, 0.4, 0.1),
    jitter_prob: float = 0.8,
    gray_prob: float = 0.2,
    blur_prob: float = 0.0,
    blur_sigma=(0.1, 2.0),
    solarize_prob: float = 0.0,
    solarize_threshold: float = 0.5,
    flip: bool = True,
) -> T.Compose:
    """The contrastive augmentation family, per PIL image: RandomResizedCrop(scale, ratio),
    ColorJitter(brightness, contrast, saturation, hue) with probability `jitter_prob` (the four in random
    order), grayscale, Gaussian blur (sigma uniform in `blur_sigma`), solarisation (pixels >= threshold,
    as a fraction of 255, are inverted), horizontal flip. Flip commutes with the colour operations and
    the blur, so its position does not matter."""
    return T.Compose(
        [
            T.RandomResizedCrop(size, scale=scale, ratio=ratio),
            T.RandomApply([T.ColorJitter(*jitter)], p=jitter_prob),
            T.RandomGrayscale(p=gray_prob),
            T.RandomApply([PILGaussianBlur(blur_sigma)], p=blur_prob),
            T.RandomSolarize(threshold=round(255 * solarize_threshold), p=solarize_prob),
            *([T.RandomHorizontalFlip()] if flip else []),
            ToNormalizedTensor(mean, std),
        ]
    )


# ---- contrastive presets: each returns the parameters of `augment` / `BatchedAugment`
def crop_flip(**overrides) -> dict:
    """Weak view of SCE/ReSSL: RandomResizedCrop(0.2-1) + horizontal flip only (spec_selfsup 5.3)."""
    return dict(jitter_prob=0.0, gray_prob=0.0) | overrides


def mocov2(**overrides) -> dict:
    """MoCo v2 aug+, also SCE's strong view: crop (0.2-1), jitter(0.4, 0.4, 0.4, 0.1) p=0.8, grayscale
    p=0.2, blur p=0.5, flip (spec_selfsup 2 and 5.3)."""
    return dict(blur_prob=0.5) | overrides


def npid(**overrides) -> dict:
    """NPID / Wang & Liu CIFAR pipeline: crop (0.2-1), jitter(0.4, 0.4, 0.4, 0.4) always, grayscale 0.2,
    no flip (their ImageNet-100 pipeline adds it: `flip: true`) (spec_selfsup 7.2)."""
    return dict(jitter=(0.4, 0.4, 0.4, 0.4), jitter_prob=1.0, flip=False) | overrides


def simclr(strength: float = 0.5, **overrides) -> dict:
    """SimCLR: crop (0.08-1), flip, jitter of strength s (0.8s, 0.8s, 0.8s, 0.2s) p=0.8, grayscale 0.2;
    blur only on ImageNet (`blur_prob: 0.5`). CIFAR recipe: s=0.5, no blur (spec_selfsup 3)."""
    jitter = (0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength)
    return dict(scale=(0.08, 1.0), jitter=jitter) | overrides


CONTRASTIVE_PRESETS: dict[str, Callable[..., dict]] = {
    "augment": lambda **overrides: overrides,  # the family with its own defaults
    "crop_flip": crop_flip,
    "mocov2": mocov2,
    "npid": npid,
    "simclr": simclr,
}


# ---- evaluation presets (per image only)
def crop_pad_flip(size: int, mean, std, padding: int = 4) -> T.Compose:
    """Linear-evaluation training view for small datasets: RandomCrop(size, padding) + flip (SCE seed D)."""
    return T.Compose([T.RandomCrop(size, padding=padding), T.RandomHorizontalFlip(), ToNormalizedTensor(mean, std)])


def center(size: int, mean, std, resize: int | None = None) -> T.Compose:
    """Evaluation view: resize the short side to `resize` (default: `size`, i.e. no crop margin for
    small datasets; 256 for 224 px ImageNet) then center-crop `size` (SCE seed D)."""
    return T.Compose([T.Resize(resize or size), T.CenterCrop(size), ToNormalizedTensor(mean, std)])


EVALUATION_PRESETS: dict[str, Callable[..., T.Compose]] = {"crop_pad_flip": crop_pad_flip, "center": center}
PRESET_NAMES = sorted(CONTRASTIVE_PRESETS) + sorted(EVALUATION_PRESETS)


class MultipleViews:
    """`count` independent draws of one pipeline, stacked along a new dimension: per image
    (C, H, W) -> (count, C, H, W); per batch (B, C, H, W) -> (B, count, C, H, W)."""

    def __init__(self, transform: Callable, count: int, batched: bool):
        self.transform, self.count, self.batched = transform, count, batched

    def __call__(self, images):
        return torch.stack([self.transform(images) for _ in range(self.count)], dim=1 if self.batched else 0)


def _check_keys(view_name: str, preset: str, given: dict, accepted: set[str]) -> None:
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ValueError(f"view {view_name!r}: preset {preset!r} does not accept {unknown}; it takes {sorted(accepted)}")


def build_view(view_name: str, spec: dict[str, Any], defaults: dict[str, Any], pipeline: str = "workers") -> Callable:
    """Build the pipeline of one named view from its config entry, failing with a message that names
    the view and the offending key. `defaults` gives `size`, `mean` and `std` of the dataset."""
    if not isinstance(spec, dict) or "preset" not in spec:
        raise ValueError(f"view {view_name!r} must be a mapping with a 'preset' key (one of {PRESET_NAMES}), got {spec!r}")
    params = dict(spec)
    preset = params.pop("preset")
    count = params.pop("count", 1)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"view {view_name!r}: count must be an integer >= 1, got {count!r}")
    if preset in EVALUATION_PRESETS:
        if pipeline != "workers":
            raise ValueError(f"view {view_name!r}: preset {preset!r} runs per image only; use data.pipeline: workers")
        factory = EVALUATION_PRESETS[preset]
        _check_keys(view_name, preset, params, set(inspect.signature(factory).parameters))
        transform = factory(**(defaults | params))
    elif preset in CONTRASTIVE_PRESETS:
        family = set(inspect.signature(augment).parameters)
        own = {name for name in inspect.signature(CONTRASTIVE_PRESETS[preset]).parameters if name != "overrides"}
        _check_keys(view_name, preset, params, family | own)
        arguments = defaults | CONTRASTIVE_PRESETS[preset](**params)
        transform = augment(**arguments) if pipeline == "workers" else BatchedAugment(**arguments)
    else:
        raise ValueError(f"view {view_name!r}: unknown preset {preset!r}; choose one of {PRESET_NAMES}")
    return MultipleViews(transform, count, batched=pipeline == "device") if count > 1 else transform
