"""Trunks: torchvision ResNet/ResNeXt (optionally with the small-input stem) and any timm model."""

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
import torchvision

TORCHVISION_NAMES = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "resnext101_64x4d",
)
BACKBONE_NAMES = TORCHVISION_NAMES + ("timm:<model_name>",)


@dataclass
class BackboneSpec:
    """What a config says about the trunk: `name` as in `build_backbone`, the small-input stem for
    32-64 px images, and extra constructor keyword arguments (e.g. `zero_init_residual: true`)."""

    name: str = "resnet18"
    small_input: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self) -> tuple[nn.Module, int]:
        return build_backbone(self.name, self.small_input, **self.kwargs)


def build_backbone(name: str, small_input: bool = False, **kwargs: Any) -> tuple[nn.Module, int]:
    """Return `(trunk, feature_dim)`; the trunk maps images to pooled features of size `feature_dim`.

    `small_input=True` replaces the 7x7/2 stem and max-pool by a 3x3 stride-1 convolution (no bias,
    no pooling): the ResNet variant SCE, ReSSL and SimCLR use for 32-64 px images (spec_selfsup 1.5).
    """
    if name.startswith("timm:"):
        return _build_timm(name.removeprefix("timm:"), small_input, **kwargs)
    if name not in TORCHVISION_NAMES:
        raise ValueError(f"unknown backbone name {name!r}; choose one of {', '.join(BACKBONE_NAMES)}")
    try:
        trunk = getattr(torchvision.models, name)(weights=None, **kwargs)
    except TypeError as error:
        raise ValueError(f"backbone {name!r} rejected its keyword arguments {kwargs}: {error}") from None
    feature_dim = trunk.fc.in_features
    trunk.fc = nn.Identity()
    if small_input:
        trunk.conv1 = nn.Conv2d(3, trunk.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(trunk.conv1.weight, mode="fan_out", nonlinearity="relu")
        trunk.maxpool = nn.Identity()
    return trunk, feature_dim


def _build_timm(model_name: str, small_input: bool, **kwargs: Any) -> tuple[nn.Module, int]:
    import timm  # imported lazily: timm is only needed for `timm:` backbones

    if small_input:
        raise ValueError(
            f"small_input=True is only defined for the torchvision ResNets, not for 'timm:{model_name}'; "
            "pick a timm model made for small images instead"
        )
    if not timm.is_model(model_name):
        raise ValueError(f"unknown timm model {model_name!r} (backbone 'timm:{model_name}'); see timm.list_models()")
    trunk = timm.create_model(model_name, pretrained=False, num_classes=0, **kwargs)
    return trunk, trunk.num_features
