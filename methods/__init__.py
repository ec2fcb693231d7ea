"""Pretraining methods (LightningModules), their shared machinery and the loss library.

Configs refer to a method by its short name, e.g. `class_path: methods.MoCoV2`.
"""

from methods.base import MethodBase
from methods.pretrain import PretrainMethod
from methods.barlow_twins import BarlowTwins
from methods.byol import BYOL
from methods.dino import DINO
from methods.finetune import FineTune
from methods.jcl import JCL
from methods.linear import LinearProbe
from methods.longtail import CrossEntropy, LongTailClassifier, MultiTaskContrast, PaCo, PaCoRIDE
from methods.moco import MoCoV2
from methods.mocov3 import MoCoV3
from methods.nnclr import NNCLR
from methods.npid import NPID
from methods.ressl import ReSSL
from methods.sce import SCE
from methods.simclr import SimCLR
from methods.simsiam import SimSiam
from methods.supcon import SupCon
from methods.swav import SwAV
from methods.vicreg import VICReg

__all__ = [
    "BYOL",
    "BarlowTwins",
    "CrossEntropy",
    "DINO",
    "FineTune",
    "JCL",
    "LinearProbe",
    "LongTailClassifier",
    "MethodBase",
    "MoCoV2",
    "MoCoV3",
    "MultiTaskContrast",
    "NNCLR",
    "NPID",
    "PaCo",
    "PaCoRIDE",
    "PretrainMethod",
    "ReSSL",
    "SCE",
    "SimCLR",
    "SimSiam",
    "SupCon",
    "SwAV",
    "VICReg",
]
