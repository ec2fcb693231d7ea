"""The CIFAR ResNets (He et al. 2016, §4.2: 6n+2 layers, three stages of n BasicBlocks, widths 16/32/64,
parameter-free "option A" shortcuts), the trunk of PaCo's CIFAR-LT runs (PaCo's LT/models/resnet_cifar.py and its CIFAR scripts).

Follows `ResNet_s` of PaCo's `LT/models/resnet_cifar.py` (dvlab-research/Parametric-Contrastive-Learning),
copied from LDAM-DRW (kaidic/LDAM-DRW `models/resnet_cifar.py`): 3x3 stem convolution + BN + ReLU, no
max-pool, stride 2 at the first block of stages 2 and 3, global average pooling, and
`init.kaiming_normal_` (fan-in, ReLU gain) on every convolution; BatchNorm keeps its default init.
The classifier `fc` is left out: the trunk returns the pooled `4 * base_width`-d feature.

PaCo's repository at commit 9afe122 (2021-09-07) widened this net by `factor = 2` (widths 32/64/128,
`--feat_dim 128` in its imb-0.02 script); its CIFAR scripts of commit 3976961 pass `--feat_dim 64`,
i.e. the standard widths used here. `base_width=32` builds the widened variant.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock


class ZeroPadShortcut(nn.Module):
    """Option A shortcut (He et al. 2016): subsample by 2 and append zero channels, no parameters.

    The channels are padded equally on both sides, as `F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, p, p))`
    with `p = planes // 4` in LDAM-DRW's code (the block doubles its channels)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.pad = (out_channels - in_channels) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class CifarResNet(nn.Module):
    def __init__(self, depth: int = 32, base_width: int = 16):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"a CIFAR ResNet has depth 6n+2 (20, 32, 44, 56, 110, ...), got {depth}")
        if base_width < 2 or base_width % 2:  # the option-A shortcut pads half the new channels on each side
            raise ValueError(f"a CIFAR ResNet's base_width must be an even number >= 2, got {base_width}")
        blocks_per_stage = (depth - 2) // 6
        widths = (base_width, 2 * base_width, 4 * base_width)
        self.conv1 = nn.Conv2d(3, base_width, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        self.relu = nn.ReLU(inplace=True)
        in_channels = base_width
        stages = []
        for stage, width in enumerate(widths):
            stride = 1 if stage == 0 else 2
            shortcut = ZeroPadShortcut(in_channels, width) if stride != 1 else None
            blocks = [BasicBlock(in_channels, width, stride, downsample=shortcut)]
            blocks += [BasicBlock(width, width) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = width
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = widths[-1]
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight)  # LDAM-DRW `_weights_init`: fan-in mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return torch.flatten(self.avgpool(x), 1)
