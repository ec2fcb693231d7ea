"""Pretraining methods (LightningModules), their shared machinery and the loss library.

Configs refer to a method by its short name, e.g. `class_path: methods.MoCoV2`.
"""

from methods.base import PretrainMethod
from methods.linear import LinearProbe
from methods.moco import MoCoV2
from methods.ressl import ReSSL
from methods.sce import SCE

__all__ = ["LinearProbe", "MoCoV2", "PretrainMethod", "ReSSL", "SCE"]
