"""Pretraining methods (LightningModules), their shared machinery and the loss library.

Configs refer to a method by its short name, e.g. `class_path: methods.MoCoV2`.
"""

from methods.base import MethodBase, PretrainMethod
from methods.finetune import FineTune
from methods.jcl import JCL
from methods.linear import LinearProbe
from methods.longtail import CrossEntropy, LongTailClassifier, MultiTaskContrast, PaCo, PaCoRIDE
from methods.moco import MoCoV2
from methods.npid import NPID
from methods.ressl import ReSSL
from methods.sce import SCE
from methods.simclr import SimCLR
from methods.supcon import SupCon

__all__ = [
    "JCL",
    "CrossEntropy",
    "FineTune",
    "LinearProbe",
    "LongTailClassifier",
    "MethodBase",
    "MoCoV2",
    "MultiTaskContrast",
    "NPID",
    "PaCo",
    "PaCoRIDE",
    "PretrainMethod",
    "ReSSL",
    "SCE",
    "SimCLR",
    "SupCon",
]
