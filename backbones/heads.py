"""Projector and predictor MLPs: every paper's head is one `MLPSpec`.

Examples (input dim comes from the trunk or the previous head):
- MoCo v2: `MLPSpec(hidden_dim=2048, output_dim=128, batch_norm=False)` -> Linear-ReLU-Linear, biases.
- SCE small datasets: `MLPSpec(512, 256)` -> Linear(no bias)-BN-ReLU-Linear(bias).
- SCE ImageNet: `MLPSpec(4096, 256, num_layers=3, last_batch_norm=True, last_batch_norm_affine=False)`,
  predictor `MLPSpec(4096, 256, last_bias=False)`.
- NPID / Wang & Liu: `MLPSpec(output_dim=128, num_layers=1)` -> one Linear.
- Barlow Twins / VICReg: `MLPSpec(8192, 8192, num_layers=3, last_bias=False)`.
- DINO: `MLPSpec(2048, 256, num_layers=3, batch_norm=False, activation="gelu")` (its weight-normalised last layer is
  the method's).
"""

from dataclasses import dataclass
from typing import Literal

import torch.nn as nn


@dataclass
class MLPSpec:
    hidden_dim: int = 2048
    output_dim: int = 128
    num_layers: int = 2
    batch_norm: bool = True  # BN after every hidden Linear
    last_batch_norm: bool = False  # BN after the output Linear (SCE/BYOL-style ImageNet projectors)
    last_batch_norm_affine: bool = True
    # False: that BN scales but does not shift, its bias held at 0 (SimCLR's projection head ends in a BN with
    # center=False, scale=True: google-research/simclr model_util.py linear_layer, resnet.py batch_norm_relu)
    last_batch_norm_shift: bool = True
    last_bias: bool | None = None  # None: a bias exactly when no BN follows (eztorch's predictor has none)
    activation: Literal["relu", "gelu"] = "relu"  # between the layers (GELU: DINO's head, facebookresearch/dino)

    def build(self, input_dim: int) -> nn.Sequential:
        return build_mlp(input_dim, self)


def build_mlp(input_dim: int, spec: MLPSpec) -> nn.Sequential:
    """Linear layers with ReLU (or GELU) between them; a Linear has a bias exactly when no BN follows it
    (a bias before BN is cancelled by the mean subtraction)."""
    if spec.num_layers < 1:
        raise ValueError(f"an MLP head needs num_layers >= 1, got {spec.num_layers}")
    for name in ("hidden_dim", "output_dim"):
        if getattr(spec, name) < 1:
            raise ValueError(f"MLP head {name} must be >= 1, got {getattr(spec, name)}")
    if spec.activation not in ("relu", "gelu"):
        raise ValueError(f"MLP head activation must be 'relu' or 'gelu', got {spec.activation!r}")
    if not spec.last_batch_norm_shift and not (spec.last_batch_norm and spec.last_batch_norm_affine):
        raise ValueError("MLP head last_batch_norm_shift: false needs last_batch_norm: true and last_batch_norm_affine: true (a shift to hold at 0)")
    layers: list[nn.Module] = []
    in_dim = input_dim
    for _ in range(spec.num_layers - 1):
        layers.append(nn.Linear(in_dim, spec.hidden_dim, bias=not spec.batch_norm))
        if spec.batch_norm:
            layers.append(nn.BatchNorm1d(spec.hidden_dim))
        layers.append(nn.ReLU(inplace=True) if spec.activation == "relu" else nn.GELU())
        in_dim = spec.hidden_dim
    last_bias = not spec.last_batch_norm if spec.last_bias is None else spec.last_bias
    layers.append(nn.Linear(in_dim, spec.output_dim, bias=last_bias))
    if spec.last_batch_norm:
        layers.append(nn.BatchNorm1d(spec.output_dim, affine=spec.last_batch_norm_affine))
        if not spec.last_batch_norm_shift:
            layers[-1].bias.requires_grad_(False)  # stays at its initial 0: no gradient, no weight decay, no step
    return nn.Sequential(*layers)
