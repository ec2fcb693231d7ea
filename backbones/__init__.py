"""One factory for every trunk and head used in contrastlab.

`build_backbone(name, small_input=False, weights=None, small_input_stem="sce", **kwargs) -> (module, feature_dim)` returns a
trunk whose forward gives the pooled feature vector (classifier removed): torchvision ResNets and
ResNeXts, the CIFAR ResNets of LDAM-DRW/PaCo (`cifar_resnet32`, 64-d), the RIDE multi-expert trunks
(`ride_resnet50`, `ride_resnext50`, `ride_resnet32`, ...: one feature per expert, shape (B, E, D)), the Vision
Transformers `vit_tiny` / `vit_small` / `vit_base` with the official recipes' options (`backbones.vit`) and any
`timm:` model, randomly initialised or from torchvision's weights or a local state dict. `build_mlp` builds every paper's
projector / predictor from a handful of numbers, so a head is a config entry rather than code.
"""

from backbones.factory import BACKBONE_NAMES, BackboneSpec, attention_heads, build_backbone, load_state_strictly
from backbones.heads import MLPSpec, build_mlp

__all__ = ["BACKBONE_NAMES", "BackboneSpec", "MLPSpec", "attention_heads", "build_backbone", "build_mlp", "load_state_strictly"]
