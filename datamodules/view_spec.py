"""The contrastive augmentation family as one spec, `ViewSpec`, and its named presets as data.

Both pipelines consume the same `ViewSpec`: `datamodules.transforms.augment` per PIL image in the DataLoader
workers, `datamodules.batched.BatchedAugment` per batch on the training device. A preset is a set of
`ViewSpec` fields over the family's defaults; a view in a config sets more of them on top, e.g.
`{preset: mocov2, blur_prob: 0.0}`.
"""

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class ViewSpec:
    """RandomResizedCrop(scale, ratio), ColorJitter(brightness, contrast, saturation, hue) with probability
    `jitter_prob` (the four in random order), grayscale with `gray_prob`, Gaussian blur with `blur_prob`
    (sigma uniform in `blur_sigma`), solarisation with `solarize_prob` (pixels >= threshold, a fraction of
    255, are inverted), horizontal flip; then normalisation by `mean` and `std`. The defaults are MoCo v2's
    aug+ without its blur (facebookresearch/moco main_moco.py)."""

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    scale: tuple[float, float] = (0.2, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)
    jitter_prob: float = 0.8
    gray_prob: float = 0.2
    blur_prob: float = 0.0
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    solarize_prob: float = 0.0
    solarize_threshold: float = 0.5
    flip: bool = True  # with probability 0.5
    # how the crop is resampled: torchvision's default, or bicubic as solo-learn, DINO, Barlow Twins, VICReg, BYOL and SimCLR crop
    interpolation: str = "bilinear"

    def __post_init__(self):
        for name, length in LENGTHS.items():  # config lists as tuples
            value = tuple(getattr(self, name))
            if len(value) != length:
                raise ValueError(f"{name} must have {length} values, got {list(value)}")
            object.__setattr__(self, name, value)
        for name in (item.name for item in fields(self) if item.name not in ("flip", "interpolation")):
            value = getattr(self, name)
            numbers = value if isinstance(value, tuple) else (value,)
            if not all(isinstance(number, (int, float)) and not isinstance(number, bool) for number in numbers):
                raise ValueError(f"{name} must be {'numbers' if name in LENGTHS else 'a number'}, got {list(value) if name in LENGTHS else value!r}")
        checks = [
            ("size", self.size >= 1, "an image side >= 1"),
            ("std", min(self.std) > 0, "positive"),
            ("scale", 0 < self.scale[0] <= self.scale[1] <= 1, "(min, max) with 0 < min <= max <= 1"),
            ("ratio", 0 < self.ratio[0] <= self.ratio[1], "(min, max) with 0 < min <= max"),
            ("jitter", min(self.jitter) >= 0 and self.jitter[3] <= 0.5, "(brightness, contrast, saturation, hue) >= 0, hue <= 0.5"),
            ("blur_sigma", 0 <= self.blur_sigma[0] <= self.blur_sigma[1], "(min, max) with 0 <= min <= max"),
            *((name, 0 <= getattr(self, name) <= 1, "a probability in [0, 1]") for name in ("jitter_prob", "gray_prob", "blur_prob", "solarize_prob")),
            ("solarize_threshold", 0 <= self.solarize_threshold <= 1, "a fraction of 255 in [0, 1]"),
            ("interpolation", self.interpolation in INTERPOLATIONS, f"one of {', '.join(INTERPOLATIONS)}"),
            ("flip", isinstance(self.flip, bool), "true or false (a horizontal flip with probability 0.5)"),  # 0.3 read as true
        ]
        for name, valid, meaning in checks:
            if not valid:  # torchvision would accept some (a reversed scale: a warning) or fail later without the key
                value = getattr(self, name)
                raise ValueError(f"{name} must be {meaning}, got {list(value) if isinstance(value, tuple) else value!r}")


INTERPOLATIONS = ("bilinear", "bicubic")
LENGTHS = {"mean": 3, "std": 3, "scale": 2, "ratio": 2, "jitter": 4, "blur_sigma": 2}


FIELDS = frozenset(field.name for field in fields(ViewSpec))


def simclr_jitter(strength: float) -> tuple[float, float, float, float]:
    """SimCLR's colour distortion of strength s: ColorJitter(0.8 s, 0.8 s, 0.8 s, 0.2 s) (Chen et al. 2020, appendix A)."""
    return (0.8 * strength, 0.8 * strength, 0.8 * strength, 0.2 * strength)


# Each preset: the ViewSpec fields it sets over the defaults.
CONTRASTIVE_PRESETS: dict[str, dict[str, Any]] = {
    # the family with its own defaults
    "augment": {},
    # weak view of SCE / ReSSL: crop (0.2-1) and flip only (the weak augmentation of ReSSL, Zheng et al. 2021,
    # that SCE, Denize et al. 2023, keeps)
    "crop_flip": {"jitter_prob": 0.0, "gray_prob": 0.0},
    # MoCo v2 aug+, also SCE's strong view: the defaults with blur p=0.5 (`--aug-plus` of facebookresearch/moco main_moco.py)
    "mocov2": {"blur_prob": 0.5},
    # NPID / Wang & Liu's CIFAR pipeline: jitter (0.4, 0.4, 0.4, 0.4) always, no flip (their ImageNet-100
    # pipeline adds it: `flip: true`)
    "npid": {"jitter": (0.4, 0.4, 0.4, 0.4), "jitter_prob": 1.0, "flip": False},
    # SimCLR's CIFAR recipe: crop (0.08-1), colour strength 0.5 (the view key `strength` sets s), no blur
    # (google-research/simclr's CIFAR-10 command: `--color_jitter_strength=0.5 --use_blur=False`; ImageNet
    # adds `blur_prob: 0.5`)
    "simclr": {"scale": (0.08, 1.0), "jitter": simclr_jitter(0.5)},
    # SimAugment, TCL's self-supervised pipeline: SimCLR at strength 1 with blur p=0.5, as solo-learn's SimCLR views
    "simaugment": {"scale": (0.08, 1.0), "jitter": simclr_jitter(1.0), "blur_prob": 0.5},
    # PaCo's `sim` view (`augmentation_sim` of PaCo/LT/paco_lt.py): jitter (0.4, 0.4, 0.4, 0) always, blur p=0.5
    "paco_sim": {"scale": (0.08, 1.0), "jitter": (0.4, 0.4, 0.4, 0.0), "jitter_prob": 1.0, "blur_prob": 0.5},
    # first view of the asymmetric BYOL pair that SCE uses on ImageNet (eztorch `imagenet_two_crops_mocov3`;
    # Grill et al. 2020, table 6): jitter (0.4, 0.4, 0.2, 0.1) p=0.8, blur always; BYOL's own crops are 0.08-1
    "byol1": {"jitter": (0.4, 0.4, 0.2, 0.1), "blur_prob": 1.0},
}
# the pair's second view: blur p=0.1 and solarisation p=0.2
CONTRASTIVE_PRESETS["byol2"] = CONTRASTIVE_PRESETS["byol1"] | {"blur_prob": 0.1, "solarize_prob": 0.2}

# The family part of PaCo's `randcls` view (`augmentation_randncls` of PaCo/LT/paco_lt.py): its `sim` view
# without grayscale and blur; `datamodules.transforms.randaugment` adds RandAugment after it.
PACO_RANDCLS = CONTRASTIVE_PRESETS["paco_sim"] | {"gray_prob": 0.0, "blur_prob": 0.0}

# Keys a view of one preset may set besides the ViewSpec fields, each turned into fields.
PRESET_KEYS = {"simclr": {"strength": lambda strength: {"jitter": simclr_jitter(strength)}}}


def accepted_keys(preset: str) -> set[str]:
    return set(FIELDS) | set(PRESET_KEYS.get(preset, {}))


def view_spec(preset: str, parameters: dict[str, Any], defaults: dict[str, Any]) -> ViewSpec:
    """The spec of a contrastive view: the dataset's `defaults` (size, mean, std), then the preset's fields,
    then the view's own `parameters` (checked by the caller against `accepted_keys`)."""
    own = dict(parameters)
    derived = {}
    for key, to_fields in PRESET_KEYS.get(preset, {}).items():
        if key in own:
            derived |= to_fields(own.pop(key))
    return ViewSpec(**(defaults | CONTRASTIVE_PRESETS[preset] | derived | own))
