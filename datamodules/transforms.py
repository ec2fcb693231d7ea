"""Named augmentation pipelines ("presets"), each with its paper's parameters.

A view in a config is `{preset: <name>, **parameters}`, e.g. `{preset: mocov2, blur_prob: 0.0}`; the
DataModule fills in `size`, `mean` and `std` for its dataset unless the view sets them, and `count: N`
draws N independent augmentations of the same image (stacked along a new dimension after the batch).

The contrastive presets (`crop_flip`, `mocov2`, `npid`, `simclr`, `simaugment`, `paco_sim`, `byol1`,
`byol2`) are parameter sets of one augmentation family, `datamodules.view_spec.ViewSpec`, which runs
either per image in the DataLoader workers (`augment`, PIL) or per batch on the training device
(`BatchedAugment`, every random draw per sample): `data.pipeline: cpu | gpu`. The policy presets (`autoaugment`,
`randaugment`) and the evaluation presets (`crop_pad_flip`, `center`) run per image only.
"""

import inspect
import random
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torchvision.transforms import v2 as T

from datamodules.batched import BatchedAugment
from datamodules.paco_autoaugment import PacoAutoAugment
from datamodules.tcl_autoaugment import TCLAutoAugment
from datamodules.view_spec import CONTRASTIVE_PRESETS, FIELDS, INTERPOLATIONS, PACO_RANDCLS, ViewSpec, accepted_keys, view_spec


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


def augment(spec: ViewSpec) -> T.Compose:
    """The contrastive augmentation family of `spec`, per PIL image. Flip commutes with the colour
    operations and the blur, so its position does not matter."""
    return T.Compose(
        [
            T.RandomResizedCrop(spec.size, scale=spec.scale, ratio=spec.ratio, interpolation=T.InterpolationMode(spec.interpolation)),
            T.RandomApply([T.ColorJitter(*spec.jitter)], p=spec.jitter_prob),
            T.RandomGrayscale(p=spec.gray_prob),
            T.RandomApply([PILGaussianBlur(spec.blur_sigma)], p=spec.blur_prob),
            T.RandomSolarize(threshold=round(255 * spec.solarize_threshold), p=spec.solarize_prob),
            *([T.RandomHorizontalFlip()] if spec.flip else []),
            ToNormalizedTensor(spec.mean, spec.std),
        ]
    )


# ---- policy presets (per image only)
class Cutout:
    """One black square of side `length` at a uniformly drawn centre, clipped at the border (DeVries &
    Taylor's Cutout, zeroing pixels before normalisation as PaCo's CIFAR pipeline does)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, image: Image.Image) -> Image.Image:
        x, y = random.randrange(image.width), random.randrange(image.height)
        half = self.length // 2
        image = image.copy()
        ImageDraw.Draw(image).rectangle([x - half, y - half, x + half - 1, y + half - 1], fill=0)
        return image

    def __repr__(self) -> str:
        return f"Cutout(length={self.length})"


AUTOAUGMENT_POLICIES = {policy.value.lower(): policy for policy in T.AutoAugmentPolicy}


def check_number(preset: str, name: str, value, low: float, integer: bool = True) -> None:
    """A per-image preset's parameter checked when the view is built: its transform would fail only at the first image."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value < low:
        raise ValueError(f"{preset} {name} must be {'an integer' if integer else 'a number'} >= {low}, got {value!r}")


def autoaugment(
    size: int, mean, std, padding: int = 4, policy: str = "imagenet", cutout: int = 0, fill: int = 0, operations: str = "torchvision"
) -> T.Compose:
    """TCL's supervised pipeline (`--augment autoaug` of its train.py; TCL supplement 2.1): resize to
    size x size, RandomCrop(size, padding) + flip + AutoAugment (`policy`: imagenet, the default as in torchvision,
    cifar10, svhn) + optional Cutout. `operations` says whose operations run the CIFAR-10 policy: `torchvision`'s
    (with `fill`, the grey of the pixels they uncover), `tcl` (TCL's data_augmentation/auto_augment.py:
    `datamodules.tcl_autoaugment`; TCL's configs) or `paco` (PaCo/LT/autoaug.py CIFAR10Policy:
    `datamodules.paco_autoaugment`; with `cutout: 16`, PaCo's CIFAR-LT query view)."""
    if policy not in AUTOAUGMENT_POLICIES:
        raise ValueError(f"autoaugment policy must be one of {sorted(AUTOAUGMENT_POLICIES)}, got {policy!r}")
    check_number("autoaugment", "padding", padding, 0)
    check_number("autoaugment", "cutout", cutout, 0)
    if not 0 <= fill <= 255:
        raise ValueError(f"autoaugment fill must lie in [0, 255] (a grey level of the uint8 image), got {fill}")
    own = {"tcl": TCLAutoAugment, "paco": PacoAutoAugment}
    if operations not in ("torchvision", *own) or (operations in own and (policy != "cifar10" or fill)):
        raise ValueError(
            f"autoaugment operations must be 'torchvision', 'tcl' or 'paco' (the last two: policy cifar10 and no fill), "
            f"got operations {operations!r} with policy {policy!r} and fill {fill}"
        )
    augment = own[operations]() if operations in own else T.AutoAugment(AUTOAUGMENT_POLICIES[policy], fill=[fill] * 3 if fill else None)
    return T.Compose(
        [
            T.Resize((size, size)),
            T.RandomCrop(size, padding=padding),
            T.RandomHorizontalFlip(),
            augment,
            *([Cutout(cutout)] if cutout else []),
            ToNormalizedTensor(mean, std),
        ]
    )


def randaugment(
    size: int, mean, std, num_ops: int = 2, magnitude: int = 10, magnitude_std: float = 0.5, fill=None, **family
) -> T.Compose:
    """PaCo's `randcls` query view (ImageNet-LT, iNat, ImageNet; PaCo's training scripts): crop (0.08-1),
    flip, jitter (0.4, 0.4, 0.4, 0) always, then RandAugment `rand-n{num_ops}-m{magnitude}-mstd{magnitude_std}`
    with timm's implementation (PaCo's `randaugment.py` is a copy of it), translations up to 45% of the
    size, fill colour `fill` (RGB in [0, 1]; default the dataset mean: PaCo fills with the ImageNet mean on
    every dataset, iNat included). `gray_prob: 0.2, blur_prob: 0.5` gives `randclsstack` (ResNeXt
    runs), `num_ops: 3` the ResNeXt-101 one. Other `ViewSpec` fields are accepted as overrides."""
    from timm.data.auto_augment import rand_augment_transform  # here: timm's import is seconds that only this view needs

    check_number("randaugment", "num_ops", num_ops, 0)
    check_number("randaugment", "magnitude", magnitude, 0, integer=False)
    check_number("randaugment", "magnitude_std", magnitude_std, 0, integer=False)
    if fill is not None and not (isinstance(fill, (list, tuple)) and len(fill) == 3 and all(isinstance(value, (int, float)) and 0 <= value <= 1 for value in fill)):
        raise ValueError(f"randaugment fill must be an RGB colour of three values in [0, 1] (as the dataset's mean), got {fill!r}")
    base = augment(ViewSpec(size, mean, std, **(PACO_RANDCLS | family)))
    policy = rand_augment_transform(
        f"rand-n{num_ops}-m{magnitude}-mstd{magnitude_std}",
        {"translate_const": int(size * 0.45), "img_mean": tuple(min(255, round(255 * value)) for value in (mean if fill is None else fill))},
    )
    return T.Compose([*base.transforms[:-1], policy, base.transforms[-1]])


# ---- evaluation presets (per image only)
def crop_pad_flip(size: int, mean, std, padding: int = 4, resize: int | None = None) -> T.Compose:
    """Linear-evaluation training view for small datasets: RandomCrop(size, padding) + flip (SCE supplementary, Sec. D);
    `resize` first resizes the short side (e.g. STL-10's 96 px images to a 64 px protocol)."""
    check_number("crop_pad_flip", "padding", padding, 0)
    if resize is not None and (isinstance(resize, bool) or not isinstance(resize, int) or resize < size):
        raise ValueError(f"crop_pad_flip resize {resize!r} is smaller than the {size} px crop: give its size too (size: {resize}) or an integer >= {size}")
    return T.Compose([*([T.Resize(resize)] if resize else []), T.RandomCrop(size, padding=padding), T.RandomHorizontalFlip(), ToNormalizedTensor(mean, std)])


def center(size: int, mean, std, resize: int | list[int] | None = None, interpolation: str = "bilinear") -> T.Compose:
    """Evaluation view: resize the short side to `resize` (default: `size`, i.e. no crop margin for
    small datasets; 256 for 224 px ImageNet) then center-crop `size` (SCE supplementary, Sec. D). A pair `[h, w]`
    resizes the whole image to exactly h x w, aspect ratio not kept (TCL's ImageNet-100 test view,
    `Resize((224, 224))` in its train.py), so `[size, size]` crops nothing. `interpolation: bicubic` resizes as
    DINO's eval_linear.py (`Resize(256, interpolation=3)`)."""
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    check_number("center", "size", size, 1)
    for side in resize if isinstance(resize, (list, tuple)) else [resize or size]:  # as T.Resize below takes it
        check_number("center", "resize", side, size)  # smaller, CenterCrop would pad the image with black
    return T.Compose([T.Resize(resize or size, interpolation=T.InterpolationMode(interpolation)), T.CenterCrop(size), ToNormalizedTensor(mean, std)])


PER_IMAGE_PRESETS: dict[str, Callable[..., T.Compose]] = {
    "autoaugment": autoaugment,
    "randaugment": randaugment,
    "crop_pad_flip": crop_pad_flip,
    "center": center,
}
PRESET_NAMES = sorted(CONTRASTIVE_PRESETS) + sorted(PER_IMAGE_PRESETS)


def accepted_parameters(factory: Callable) -> set[str]:
    """The keys a view of this per-image preset may set; `**family` stands for the `ViewSpec` fields."""
    parameters = inspect.signature(factory).parameters
    named = {name for name, parameter in parameters.items() if parameter.kind is not inspect.Parameter.VAR_KEYWORD}
    open_ended = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    return named | (FIELDS if open_ended else set())


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


def build_view(view_name: str, spec: dict[str, Any], defaults: dict[str, Any], pipeline: str = "cpu") -> Callable:
    """Build the pipeline of one named view from its config entry, failing with a message that names
    the view and the offending key. `defaults` gives `size`, `mean` and `std` of the dataset."""
    if not isinstance(spec, dict) or "preset" not in spec:
        # the usual way there: a command line's --data.init_args.views.NAME.KEY, which jsonargparse gives as the whole view
        hint = (f"; a key of a view given on the command line replaces the config's whole view: give the view whole, as --data.init_args.views.{view_name} "
                f"'{{preset: ..., {next(iter(spec))}: ...}}'") if isinstance(spec, dict) and spec else ""
        raise ValueError(f"view {view_name!r} must be a mapping with a 'preset' key (one of {PRESET_NAMES}), got {spec!r}{hint}")
    params = dict(spec)
    preset = params.pop("preset")
    count = params.pop("count", 1)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"view {view_name!r}: count must be an integer >= 1, got {count!r}")
    if preset in PER_IMAGE_PRESETS:
        if pipeline != "cpu":
            raise ValueError(f"view {view_name!r}: preset {preset!r} runs per image only; use data.pipeline: cpu")
        factory = PER_IMAGE_PRESETS[preset]
        _check_keys(view_name, preset, params, accepted_parameters(factory))
        try:
            transform = factory(**(defaults | params))
        except (ValueError, TypeError) as error:  # TypeError: a value of another type (a string for a number)
            raise ValueError(f"view {view_name!r}: {error}") from None
    elif preset in CONTRASTIVE_PRESETS:
        _check_keys(view_name, preset, params, accepted_keys(preset))
        try:
            spec = view_spec(preset, params, defaults)
        except (ValueError, TypeError) as error:
            raise ValueError(f"view {view_name!r}: {error}") from None
        transform = augment(spec) if pipeline == "cpu" else BatchedAugment(spec)
    else:
        raise ValueError(f"view {view_name!r}: unknown preset {preset!r}; choose one of {PRESET_NAMES}")
    return MultipleViews(transform, count, batched=pipeline == "gpu") if count > 1 else transform
