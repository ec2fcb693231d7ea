"""Trunks: torchvision ResNet/ResNeXt (optionally with the small-input stem), the CIFAR ResNets, Vision
Transformers with the official recipes' options (`backbones.vit`), any timm model, each optionally initialised
from torchvision's published weights or a local state dict."""

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn
import torchvision
from torchvision.models.resnet import Bottleneck, ResNet

from backbones.cifar_resnet import CifarResNet
from backbones.ride import RIDE_BUILDERS
from backbones.vit import VIT_SIZES, build_vit, timm_arguments
from engine.files import read_checkpoint


def resnext101_32x4d(weights: None = None, **kwargs: Any) -> ResNet:
    """ResNeXt-101 32x4d, PaCo's ImageNet-LT X101 (torchvision ships only 32x8d and 64x4d):
    44,177,704 parameters with the 1000-class fc, as timm's `resnext101_32x4d`. `weights` completes
    the signature of torchvision's builders; torchvision publishes none for it."""
    return ResNet(Bottleneck, [3, 4, 23, 3], groups=32, width_per_group=4, **kwargs)


TORCHVISION_BUILDERS = {
    name: getattr(torchvision.models, name)
    for name in (
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "resnext50_32x4d",
        "resnext101_32x8d",
        "resnext101_64x4d",
    )
} | {"resnext101_32x4d": resnext101_32x4d}
CIFAR_DEPTHS = {f"cifar_resnet{depth}": depth for depth in (20, 32, 44, 56, 110)}
# The 3x3 stride-1 convolution of the small-input stem, after the torchvision constructor drew its weights: `sce` pads
# by 1 with nn.Conv2d's own initialisation (CEA-LIST/SCE sce/models/trunks/resnet.py create_resnet(small_input=True));
# `solo_learn` pads by 2 (a 34 x 34 first feature map from 32 px), nn.Conv2d's initialisation too (vturrisi/solo-learn
# solo/methods/base.py, for cifar10 and cifar100); `kaiming` pads by 1 and draws kaiming-normal fan-out weights, as
# those codes draw every convolution's (WangFeng18/UnsupervisedLearningCodes models/resnet_cifar.py for NPID,
# HobbitLong/SupContrast networks/resnet_big.py and TCL's copy of it).
SmallInputStem = Literal["sce", "solo_learn", "kaiming"]
BACKBONE_NAMES = tuple(TORCHVISION_BUILDERS) + tuple(CIFAR_DEPTHS) + tuple(RIDE_BUILDERS) + tuple(VIT_SIZES) + ("timm:<model_name>",)
WEIGHTS_KEY = "model.init_args.backbone.weights"


@dataclass
class BackboneSpec:
    """What a config says about the trunk: `name` as in `build_backbone`, the small-input stem for
    32-64 px images, the initial `weights` (see `build_backbone`) and extra constructor keyword
    arguments (e.g. `zero_init_residual: true`, `base_width: 32` for a CIFAR ResNet, or a ViT's `patch_size` and
    MoCo v3 options, see `backbones.vit`)."""

    name: str = "resnet18"
    small_input: bool = False
    weights: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    small_input_stem: SmallInputStem = "sce"

    def build(self) -> tuple[nn.Module, int]:
        return build_backbone(self.name, self.small_input, self.weights, small_input_stem=self.small_input_stem, **self.kwargs)


def build_backbone(
    name: str, small_input: bool = False, weights: str | None = None, small_input_stem: SmallInputStem = "sce", **kwargs: Any
) -> tuple[nn.Module, int]:
    """Return `(trunk, feature_dim)`; the trunk maps images to pooled features of size `feature_dim`.

    Names: the torchvision ResNets/ResNeXts (incl. `resnext101_32x4d`), `cifar_resnet{20,32,44,56,110}`
    (LDAM-DRW's CIFAR ResNets, 64-d, see `backbones.cifar_resnet`), the RIDE multi-expert trunks
    `ride_resnet50`, `ride_resnext50`, `ride_resnet32` and the small `ride_resnet8_narrow` (their forward
    gives (B, num_experts, feature_dim), see `backbones.ride`), the Vision Transformers `vit_tiny`, `vit_small`,
    `vit_base` (timm's, with the official recipes' options, see `backbones.vit`) and `timm:<model_name>`.

    `small_input=True` replaces the 7x7/2 stem and max-pool by a 3x3 stride-1 convolution (no bias,
    no pooling): the ResNet variant SCE, ReSSL and SimCLR use for 32-64 px images (CEA-LIST/SCE create_resnet(small_input=True));
    `small_input_stem="solo_learn"` builds solo-learn's variant of it (`SmallInputStem`).

    `weights=None` keeps the random initialisation. A value ending in `.pth`/`.pt` or containing a
    `/` is a local state dict of the trunk as built here, loaded strictly; the `fc.*` keys of the
    removed classifier are ignored, so torchvision's checkpoint files (e.g. `resnet152-394f9c45.pth`)
    load as they are. Any other value is a torchvision weights name of the backbone (`IMAGENET1K_V1`,
    `DEFAULT`, ...), downloaded by torchvision on first use: PaCo's Places-LT run starts ResNet-152
    from `IMAGENET1K_V1` (PaCo's training scripts). timm and CIFAR backbones take local files only.
    """
    if small_input_stem not in SmallInputStem.__args__:
        raise ValueError(f"backbone.small_input_stem must be one of {', '.join(SmallInputStem.__args__)}, got {small_input_stem!r}")
    if small_input_stem != "sce" and not (small_input and name in TORCHVISION_BUILDERS):
        raise ValueError(f"backbone.small_input_stem {small_input_stem!r} is a stem of the torchvision ResNets with small_input: true, not of {name!r} with small_input: {str(small_input).lower()}")
    weights_file = weights if weights is not None and _names_a_file(weights) else None
    weights_name = weights if weights_file is None else None
    if name.startswith("timm:"):
        trunk, feature_dim = _build_timm(name.removeprefix("timm:"), small_input, weights_name, **kwargs)
    elif name in CIFAR_DEPTHS:
        trunk, feature_dim = _build_cifar(name, small_input, weights_name, **kwargs)
    elif name in TORCHVISION_BUILDERS:
        trunk, feature_dim = _build_torchvision(name, small_input, weights_name, small_input_stem, **kwargs)
    elif name in RIDE_BUILDERS:
        trunk, feature_dim = _build_ride(name, small_input, weights_name, **kwargs)
    elif name in VIT_SIZES:
        trunk, feature_dim = _build_vit(name, small_input, weights_name, **kwargs)
    else:
        raise ValueError(f"unknown backbone name {name!r}; choose one of {', '.join(BACKBONE_NAMES)}")
    if weights_file is not None:
        load_weights_file(trunk, weights_file, name)
    return trunk, feature_dim


def _names_a_file(weights: str) -> bool:
    return weights.endswith((".pth", ".pt")) or "/" in weights


def _build_torchvision(name: str, small_input: bool, weights_name: str | None, small_input_stem: SmallInputStem, **kwargs: Any) -> tuple[nn.Module, int]:
    if weights_name is not None and small_input:
        raise ValueError(
            f"{WEIGHTS_KEY}={weights_name!r} cannot be combined with small_input=True: the small-input stem "
            f"replaces the pretrained 7x7 stem of {name!r}"
        )
    weights = _torchvision_weights(name, weights_name) if weights_name is not None else None
    try:
        trunk = TORCHVISION_BUILDERS[name](weights=weights, **kwargs)
    except TypeError as error:
        raise ValueError(f"backbone {name!r} rejected its keyword arguments {kwargs}: {error}") from None
    feature_dim = trunk.fc.in_features
    trunk.fc = nn.Identity()
    if small_input:
        trunk.conv1 = nn.Conv2d(3, trunk.conv1.out_channels, kernel_size=3, stride=1, padding=small_input_padding(small_input_stem), bias=False)
        if small_input_stem == "kaiming":
            nn.init.kaiming_normal_(trunk.conv1.weight, mode="fan_out", nonlinearity="relu")
        trunk.maxpool = nn.Identity()
    return trunk, feature_dim


def small_input_padding(stem: SmallInputStem) -> int:
    return 2 if stem == "solo_learn" else 1


def _torchvision_weights(name: str, weights_name: str) -> torchvision.models.WeightsEnum:
    if name not in torchvision.models.list_models():
        raise _no_published_weights(name, weights_name)
    choices = torchvision.models.get_model_weights(name)
    if weights_name not in choices.__members__:
        raise ValueError(
            f"{WEIGHTS_KEY}={weights_name!r} is not a torchvision weights name of {name!r}; choose one of "
            f"{', '.join(choices.__members__)}, or give the path of a local .pth state dict"
        )
    return choices[weights_name]


def _no_published_weights(name: str, weights_name: str) -> ValueError:
    return ValueError(
        f"{WEIGHTS_KEY}={weights_name!r}: torchvision publishes no weights for backbone {name!r}; "
        "give the path of a local .pth state dict instead"
    )


def _build_cifar(name: str, small_input: bool, weights_name: str | None, **kwargs: Any) -> tuple[nn.Module, int]:
    if small_input:
        raise ValueError(f"small_input=True is meaningless for {name!r}: its 3x3 stride-1 stem is made for 32 px images")
    if weights_name is not None:
        raise _no_published_weights(name, weights_name)
    try:
        trunk = CifarResNet(CIFAR_DEPTHS[name], **kwargs)
    except TypeError as error:
        raise ValueError(f"backbone {name!r} rejected its keyword arguments {kwargs}: {error}") from None
    return trunk, trunk.feature_dim


def _build_ride(name: str, small_input: bool, weights_name: str | None, **kwargs: Any) -> tuple[nn.Module, int]:
    if weights_name is not None:
        raise _no_published_weights(name, weights_name)
    if small_input:
        if name in ("ride_resnet32", "ride_resnet8_narrow"):
            raise ValueError(f"small_input=True is meaningless for {name!r}: its 3x3 stride-1 stem is made for 32 px images")
        kwargs = kwargs | {"small_input": True}
    try:
        trunk = RIDE_BUILDERS[name](**kwargs)
    except TypeError as error:
        raise ValueError(f"backbone {name!r} rejected its keyword arguments {kwargs}: {error}") from None
    return trunk, trunk.feature_dim


def _build_vit(name: str, small_input: bool, weights_name: str | None, **kwargs: Any) -> tuple[nn.Module, int]:
    if small_input:
        raise ValueError(f"small_input=True is only defined for the ResNets; a ViT for small images sets kwargs img_size and patch_size (backbone {name!r})")
    if weights_name is not None:
        raise _no_published_weights(name, weights_name)
    return build_vit(name, **kwargs)


def _build_timm(model_name: str, small_input: bool, weights_name: str | None, **kwargs: Any) -> tuple[nn.Module, int]:
    if small_input:
        raise ValueError(
            f"small_input=True is only defined for the torchvision ResNets, not for 'timm:{model_name}'; "
            "pick a timm model made for small images instead"
        )
    if weights_name is not None:
        raise _no_published_weights(f"timm:{model_name}", weights_name)
    import timm  # imported lazily: timm is only needed for `timm:` backbones

    if not timm.is_model(model_name):
        raise ValueError(f"unknown timm model {model_name!r} (backbone 'timm:{model_name}'); see timm.list_models()")
    try:
        trunk = timm.create_model(model_name, pretrained=False, num_classes=0, **kwargs)
    except TypeError as error:
        raise ValueError(f"backbone 'timm:{model_name}' rejected its keyword arguments {kwargs}: {error}") from None
    # without a classifier, a head with a pre-logits layer (MobileNetV3, GhostNet, LCNet) gives head_hidden_size features
    return trunk, getattr(trunk, "head_hidden_size", trunk.num_features)


def attention_heads(spec: BackboneSpec) -> int | None:
    """The attention heads per block of the ViT that `spec` builds (None for a trunk without attention): the head
    count changes no tensor shape, so weights of a ViT with other heads load into it and are read as another network."""
    if spec.name in VIT_SIZES:
        return timm_arguments(spec.name, spec.kwargs)["num_heads"]
    if not spec.name.startswith("timm:"):
        return None
    model_name = spec.name.removeprefix("timm:")
    import timm  # imported lazily: timm is only needed for `timm:` backbones

    if not timm.is_model(model_name):
        return None
    with torch.device("meta"):  # the architecture alone: no memory, no initialisation
        trunk = timm.create_model(model_name, pretrained=False, num_classes=0, **spec.kwargs)
    return next((module.num_heads for module in trunk.modules() if isinstance(getattr(module, "num_heads", None), int)), None)


def load_weights_file(trunk: nn.Module, path: str, name: str) -> None:
    """Load a local state dict into `trunk` strictly, except for the `fc.*` keys of a classifier the
    trunk does not have (torchvision's checkpoint files carry one)."""
    state = read_checkpoint(path, f"{WEIGHTS_KEY}: file {path!r}")
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(f"{WEIGHTS_KEY}: file {path!r} is not a state dict (a mapping of names to tensors)")
    own_keys = trunk.state_dict().keys()
    state = {key: value for key, value in state.items() if key in own_keys or not key.startswith("fc.")}
    load_state_strictly(trunk, state, f"{WEIGHTS_KEY}: file {path!r}", f"backbone {name!r}")


def load_state_strictly(trunk: nn.Module, state: dict, source: str, target: str) -> None:
    """`trunk.load_state_dict(state)` with one ValueError `"<source> does not match|fit <target>: ..."`
    that lists the first missing and unexpected keys or the first tensors of another shape."""
    own = trunk.state_dict()
    misfits = [key for key in own.keys() & state.keys() if own[key].shape != state[key].shape]
    if misfits:
        shapes = [f"{key} {list(state[key].shape)} (here {list(own[key].shape)})" for key in sorted(misfits)[:5]]
        raise ValueError(f"{source} does not fit {target}: {len(misfits)} tensors of another shape: {', '.join(shapes)}")
    incompatible = trunk.load_state_dict(state, strict=False)
    if incompatible.missing_keys or incompatible.unexpected_keys:
        raise ValueError(
            f"{source} does not match {target}: missing keys {incompatible.missing_keys[:5]}, "
            f"unexpected keys {incompatible.unexpected_keys[:5]}"
        )
