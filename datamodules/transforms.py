"""Named augmentation pipelines ("presets"), each with its paper's parameters.

A view in a config is `{preset: <name>, **parameters}`, e.g. `{preset: mocov2, size: 32}`; the
DataModule fills in `size`, `mean` and `std` for its dataset unless the view sets them, and `count: N`
draws N independent augmentations of the same image (stacked along a new first dimension).
"""

import inspect
import random
from typing import Any, Callable

import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2 as T


class PILGaussianBlur:
    """Gaussian blur with sigma ~ U[sigma_min, sigma_max] via PIL, as MoCo v2's `loader.py` and SCE's
    small-dataset pipelines apply it (the PIL radius is the standard deviation)."""

    def __init__(self, sigma: tuple[float, float] = (0.1, 2.0)):
        self.sigma = sigma

    def __call__(self, image: Image.Image) -> Image.Image:
        return image.filter(ImageFilter.GaussianBlur(radius=random.uniform(*self.sigma)))

    def __repr__(self) -> str:
        return f"PILGaussianBlur(sigma={self.sigma})"


def _to_normalized_tensor(mean, std) -> list:
    return [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)]


def crop_flip(size: int, mean, std, scale=(0.2, 1.0)) -> T.Compose:
    """Weak view of SCE/ReSSL: RandomResizedCrop + horizontal flip only (spec_selfsup 5.3)."""
    return T.Compose([T.RandomResizedCrop(size, scale=scale), T.RandomHorizontalFlip(), *_to_normalized_tensor(mean, std)])


def mocov2(size: int, mean, std, scale=(0.2, 1.0), blur_prob: float = 0.5) -> T.Compose:
    """MoCo v2 "aug+", also SCE's strong view: crop, jitter(0.4, 0.4, 0.4, 0.1) p=0.8, grayscale
    p=0.2, PIL blur sigma in [0.1, 2] p=0.5, flip (spec_selfsup 2 and 5.3)."""
    return T.Compose(
        [
            T.RandomResizedCrop(size, scale=scale),
            T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            T.RandomGrayscale(p=0.2),
            T.RandomApply([PILGaussianBlur()], p=blur_prob),
            T.RandomHorizontalFlip(),
            *_to_normalized_tensor(mean, std),
        ]
    )


def simclr(size: int, mean, std, strength: float = 0.5, blur_prob: float = 0.0, scale=(0.08, 1.0)) -> T.Compose:
    """SimCLR: crop (0.08-1), flip, jitter of strength s (0.8s, 0.8s, 0.8s, 0.2s) p=0.8, grayscale
    p=0.2, blur (ImageNet only: blur_prob 0.5). CIFAR recipe: s=0.5, no blur (spec_selfsup 3)."""
    jitter = T.ColorJitter(0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength)
    return T.Compose(
        [
            T.RandomResizedCrop(size, scale=scale),
            T.RandomHorizontalFlip(),
            T.RandomApply([jitter], p=0.8),
            T.RandomGrayscale(p=0.2),
            T.RandomApply([PILGaussianBlur()], p=blur_prob),
            *_to_normalized_tensor(mean, std),
        ]
    )


def npid(size: int, mean, std, scale=(0.2, 1.0), flip: bool = False) -> T.Compose:
    """NPID / Wang & Liu CIFAR pipeline: crop, jitter(0.4, 0.4, 0.4, 0.4) always, grayscale p=0.2,
    no flip (their ImageNet-100 pipeline adds the flip: `flip: true`) (spec_selfsup 7.2)."""
    return T.Compose(
        [
            T.RandomResizedCrop(size, scale=scale),
            T.ColorJitter(0.4, 0.4, 0.4, 0.4),
            T.RandomGrayscale(p=0.2),
            *([T.RandomHorizontalFlip()] if flip else []),
            *_to_normalized_tensor(mean, std),
        ]
    )


def crop_pad_flip(size: int, mean, std, padding: int = 4) -> T.Compose:
    """Linear-evaluation training view for small datasets: RandomCrop(size, padding) + flip (SCE seed D)."""
    return T.Compose([T.RandomCrop(size, padding=padding), T.RandomHorizontalFlip(), *_to_normalized_tensor(mean, std)])


def center(size: int, mean, std, resize: int | None = None) -> T.Compose:
    """Evaluation view: resize the short side to `resize` (default: `size`, i.e. no crop margin for
    small datasets; 256 for 224 px ImageNet) then center-crop `size` (SCE seed D)."""
    return T.Compose([T.Resize(resize or size), T.CenterCrop(size), *_to_normalized_tensor(mean, std)])


PRESETS: dict[str, Callable[..., T.Compose]] = {
    "crop_flip": crop_flip,
    "mocov2": mocov2,
    "simclr": simclr,
    "npid": npid,
    "crop_pad_flip": crop_pad_flip,
    "center": center,
}


class MultipleViews:
    """`count` independent draws of one pipeline, stacked: (count, C, H, W)."""

    def __init__(self, transform: Callable, count: int):
        self.transform, self.count = transform, count

    def __call__(self, image):
        return torch.stack([self.transform(image) for _ in range(self.count)])


def build_view(view_name: str, spec: dict[str, Any], defaults: dict[str, Any]) -> Callable:
    """Build the pipeline of one named view from its config entry, failing with a message that names
    the view and the offending key."""
    if not isinstance(spec, dict) or "preset" not in spec:
        raise ValueError(f"view {view_name!r} must be a mapping with a 'preset' key (one of {sorted(PRESETS)}), got {spec!r}")
    params = dict(spec)
    preset = params.pop("preset")
    count = params.pop("count", 1)
    if preset not in PRESETS:
        raise ValueError(f"view {view_name!r}: unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"view {view_name!r}: count must be an integer >= 1, got {count!r}")
    factory = PRESETS[preset]
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"view {view_name!r}: preset {preset!r} does not accept {unknown}; it takes {sorted(accepted)}"
        )
    transform = factory(**{key: value for key, value in defaults.items() if key in accepted} | params)
    return MultipleViews(transform, count) if count > 1 else transform
