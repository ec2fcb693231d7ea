"""RIDE trunks (Wang et al., ICLR 2021, "Long-tailed Recognition by Routing Diverse Distribution-Aware
Experts"): shared early stages, then `num_experts` branches of the later stages at a reduced width, each
pooled on its own. The forward gives one feature per expert, shape (B, E, D); the classifiers (RIDE's
normalised linear layers, PaCo's centres) belong to the method.

Facts from RIDE's official code (frank-xwang/RIDE-LongTailRecognition):
- ImageNet ResNet-50 / ResNeXt-50 32x4d (`model/fb_resnets/RIDEResNet.py`, `RIDEResNeXt.py`): the stem,
  layer1 and layer2 are shared; layer3 and layer4 exist once per expert (`layer3s`, `layer4s`;
  `share_layer3` is off by default and in every config); `reduce_dimension` (true in every RIDE config)
  sets their planes to 192 and 384 instead of 256 and 512 (`layer3_output_dim`, `layer4_output_dim`),
  so each expert gives a 384 x 4 = 1536-d feature; each branch is average-pooled (AvgPool2d(7) at 224 px)
  and feeds its own classifier, a cosine classifier scaled by s = 30 (`use_norm`); the experts' logits
  are averaged. Convolutions are initialised N(0, 2 / (k^2 out_channels)) (= Kaiming fan-out), BatchNorm
  to (1, 0). `model.py` builds the ResNeXt with `groups=32, width_per_group=4`.
- CIFAR ResNet-32 (`model/ldam_drw_resnets/ride_resnet_cifar.py`): conv1 and layer1 (16 channels) are
  shared; layer2 and layer3 exist once per expert at 24 and 48 channels with `reduce_dimension` (32 and
  64 without), option-A zero-padding shortcuts, `kaiming_normal_` (fan-in) on every convolution.
- `model/model.py`: with `num_experts == 1` RIDE builds its plain ResNet / ResNeXt and passes it the same
  width arguments (`reduce_dimension`, `layer3_output_dim`, `layer4_output_dim`), from which
  `model/fb_resnets/ResNet.py` takes layer3 and layer4 of 192 and 384 planes: this trunk with one branch.

Pooling here is adaptive (the same as AvgPool2d(7) at 224 px, and defined at any input size). The blocks
are torchvision's `Bottleneck` / `BasicBlock` and the CIFAR option-A shortcut of `backbones.cifar_resnet`.
Names: `ride_resnet50`, `ride_resnext50`, `ride_resnet32`, and `ride_resnet8_narrow`, a shrunk CIFAR trunk
for CPU runs on Digits-LT (not a RIDE setting).
"""

from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from backbones.cifar_resnet import ZeroPadShortcut

Shortcut = Callable[[int, int, int], nn.Module]


class RIDEResNet(nn.Module):
    """`shared` (stem and early stages, one module) feeds every branch of `experts`; each branch ends with
    its own pooling, so `forward` returns the stacked per-expert features (B, E, feature_dim)."""

    def __init__(self, shared: nn.Module, experts: list[nn.Module], feature_dim: int):
        super().__init__()
        self.shared = shared
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        return torch.stack([expert(shared) for expert in self.experts], dim=1)


def _stage(block, in_channels: int, planes: int, blocks: int, stride: int, shortcut: Shortcut, **block_kwargs) -> nn.Sequential:
    out_channels = planes * block.expansion
    downsample = shortcut(in_channels, out_channels, stride) if stride != 1 or in_channels != out_channels else None
    first = block(in_channels, planes, stride, downsample, **block_kwargs)
    return nn.Sequential(first, *(block(out_channels, planes, **block_kwargs) for _ in range(blocks - 1)))


def _projection_shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels))


def _zero_pad_shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    return ZeroPadShortcut(in_channels, out_channels)  # CIFAR stages widen only where they halve the size


def _pooled(**stages: nn.Module) -> nn.Sequential:
    return nn.Sequential(OrderedDict(**stages, avgpool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten()))


def _check(num_experts: int, expert_widths: Sequence[int]) -> None:
    if num_experts < 1:
        raise ValueError(f"model.init_args.backbone.kwargs.num_experts must be >= 1, got {num_experts}")
    if len(expert_widths) != 2 or min(expert_widths) < 1:
        raise ValueError(f"model.init_args.backbone.kwargs.expert_widths must be two positive widths (planes of the two expert stages), got {expert_widths}")


def _ride_bottleneck_resnet(num_experts: int, expert_widths: Sequence[int], small_input: bool, **block_kwargs) -> RIDEResNet:
    """ResNet-50 layout [3, 4, 6, 3]; `block_kwargs` (groups, base_width) make it a ResNeXt."""
    _check(num_experts, expert_widths)
    width3, width4 = expert_widths
    stage = lambda in_channels, planes, blocks, stride: _stage(  # noqa: E731
        Bottleneck, in_channels, planes, blocks, stride, _projection_shortcut, **block_kwargs
    )
    shared = nn.Sequential(
        OrderedDict(
            # small_input: the 32-64 px stem of backbones.factory, a 3x3 stride-1 convolution without max-pool
            conv1=nn.Conv2d(3, 64, 3, padding=1, bias=False) if small_input else nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            bn1=nn.BatchNorm2d(64),
            relu=nn.ReLU(inplace=True),
            maxpool=nn.Identity() if small_input else nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            layer1=stage(64, 64, 3, 1),
            layer2=stage(256, 128, 4, 2),
        )
    )
    experts = [_pooled(layer3=stage(512, width3, 6, 2), layer4=stage(4 * width3, width4, 3, 2)) for _ in range(num_experts)]
    trunk = RIDEResNet(shared, experts, feature_dim=4 * width4)
    for module in trunk.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return trunk


def ride_resnet50(num_experts: int = 3, expert_widths: Sequence[int] = (192, 384), small_input: bool = False) -> RIDEResNet:
    """RIDEResNet-50; `expert_widths` (256, 512) gives full-width experts (RIDE without reduce_dimension)."""
    return _ride_bottleneck_resnet(num_experts, expert_widths, small_input)


def ride_resnext50(num_experts: int = 3, expert_widths: Sequence[int] = (192, 384), small_input: bool = False) -> RIDEResNet:
    """RIDEResNeXt-50 32x4d (`groups=32, width_per_group=4` in RIDE's model.py)."""
    if min(expert_widths) < 16:
        raise ValueError(
            f"model.init_args.backbone.kwargs.expert_widths {list(expert_widths)}: ResNeXt-50 32x4d needs expert widths >= 16 "
            "(a block's grouped width is int(planes * 4 / 64) * 32 channels)"
        )
    return _ride_bottleneck_resnet(num_experts, expert_widths, small_input, groups=32, base_width=4)


def ride_resnet32(num_experts: int = 3, expert_widths: Sequence[int] = (24, 48)) -> RIDEResNet:
    """RIDE's CIFAR ResNet-32 (5 blocks per stage); `expert_widths` (32, 64) gives full-width experts."""
    return _ride_cifar_resnet(num_experts, expert_widths, base_width=16, blocks_per_stage=5)


def ride_resnet8_narrow(num_experts: int = 3) -> RIDEResNet:
    """Not a RIDE trunk: ResNet-32's layout with 1 block per stage and half its widths (8 shared, experts
    12 and 24), a RIDE trunk that trains on 32 px Digits-LT in a few CPU minutes, like timm:test_resnet."""
    return _ride_cifar_resnet(num_experts, (12, 24), base_width=8, blocks_per_stage=1)


def _ride_cifar_resnet(num_experts: int, expert_widths: Sequence[int], base_width: int, blocks_per_stage: int) -> RIDEResNet:
    _check(num_experts, expert_widths)
    width2, width3 = expert_widths
    if not base_width <= width2 <= width3 or (width2 - base_width) % 2 or (width3 - width2) % 2:
        raise ValueError(
            f"model.init_args.backbone.kwargs.expert_widths {list(expert_widths)}: the option-A shortcuts pad channels equally on both "
            f"sides, so each stage must widen the previous one (the shared stage has {base_width}) by an even number"
        )
    stage = lambda in_channels, planes, stride: _stage(BasicBlock, in_channels, planes, blocks_per_stage, stride, _zero_pad_shortcut)  # noqa: E731
    shared = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, base_width, 3, stride=1, padding=1, bias=False),
            bn1=nn.BatchNorm2d(base_width),
            relu=nn.ReLU(inplace=True),
            layer1=stage(base_width, base_width, 1),
        )
    )
    experts = [_pooled(layer2=stage(base_width, width2, 2), layer3=stage(width2, width3, 2)) for _ in range(num_experts)]
    trunk = RIDEResNet(shared, experts, feature_dim=width3)
    for module in trunk.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight)  # LDAM-DRW / RIDE `_weights_init`: fan-in
    return trunk


RIDE_BUILDERS = {
    "ride_resnet50": ride_resnet50,
    "ride_resnext50": ride_resnext50,
    "ride_resnet32": ride_resnet32,
    "ride_resnet8_narrow": ride_resnet8_narrow,
}
