"""The momentum encoder shared by MoCo v2, ReSSL, SCE, JCL, PaCo (and PaCo on RIDE, the multi-task model), BYOL, MoCo v3
and DINO: `MomentumMixin` keeps EMA copies of (online, target) module pairs, steps them with the momentum schedule
after every optimizer step, and runs the target branch with shuffle-BN (across processes) or split-BN (emulated on one
device, `methods.shuffle_bn`). The queue and the memory bank are in `methods.queues`.
"""

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.config import as_spec, check_choices
from engine.optim import schedule_length
from methods.base import several_processes
from methods.shuffle_bn import convert_to_split_batchnorm, distributed_shuffled_forward

MomentumSchedule = Literal["constant", "cosine", "cosine_byol", "cosine_mocov3"]


def momentum_at(step: int, total_steps: int, base: float, schedule: MomentumSchedule) -> float:
    """Momentum of the EMA update made after optimizer step `step` (0-based) of `total_steps` = T.

    The cosine schedules are m = 1 - (1 - m_0)(cos(pi p) + 1) / 2 at a progress p that differs by official code:
    - `cosine`: p = step / (T - 1), so m goes from m_0 at the first step to exactly 1 at the last (SCE's, eztorch's
      momentum scheduler);
    - `cosine_byol`: p = step / T, BYOL's tau_k with k the step just taken (deepmind-research byol/utils/schedules.py
      `target_ema`; byol/byol_experiment.py updates the target after the optimizer step);
    - `cosine_mocov3`: p = (step + 1) / T. MoCo v3 sets m from `epoch + i / iters` at the start of step i and updates the
      momentum encoder in its forward, before the keys (facebookresearch/moco-v3 main_moco.py `adjust_moco_momentum`,
      moco/builder.py `forward`): the update after step s here is the official one at the start of step s + 1, the
      same sequence of momentum encoders (its update at step 0 changes nothing: the encoder is still a copy), and the
      last one here, m = 1, changes nothing either.
    """
    if schedule == "constant":
        return base
    if schedule == "cosine":
        last = max(total_steps - 1, 1)
        angle = math.pi * min(step, last) / last
    else:
        angle = math.pi * min(step + (schedule == "cosine_mocov3"), total_steps) / max(total_steps, 1)
    return 1.0 - (1.0 - base) * (math.cos(angle) + 1.0) / 2.0


@torch.no_grad()
def ema_update_(online: nn.Module, target: nn.Module, momentum: float) -> None:
    """theta_target <- m * theta_target + (1 - m) * theta_online, over parameters only: BN running
    statistics of the target are its own (they are never used in train mode; moco issue #70)."""
    online_params = list(online.parameters())
    target_params = list(target.parameters())
    if len(online_params) != len(target_params):
        raise RuntimeError("online and target modules have different parameter lists")
    torch._foreach_lerp_(target_params, online_params, 1.0 - momentum)


@dataclass
class MomentumSpec:
    """The momentum branch of a config: EMA momentum and its schedule, and how BatchNorm statistics
    are kept from leaking which key belongs to which query (facebookresearch/moco issue 47 and its CIFAR colab)."""

    base: float = 0.999  # m in theta_target <- m theta_target + (1 - m) theta_online
    schedule: MomentumSchedule = "constant"
    shuffle_bn: bool = True  # shuffle the target batch across processes (MoCo's shuffle-BN)
    split_bn: int = 1  # > 1: one-device emulation, target BatchNorm2d over this many interleaved groups


class MomentumMixin:
    """Adds EMA targets to a method: for every name in `momentum_modules`, `target_<name>` follows `<name>`.

    `init_momentum(spec)` creates the targets as frozen copies of the online modules (MoCo's builder.py
    and eztorch's momentum_base.py initialise the target as a copy), so a method declares what has a
    momentum copy by listing it, and builds its online modules, whatever their shape, before. The update
    runs once per optimizer step, right after it inside Lightning's `optimizer_step` (so it is correct
    under gradient accumulation, and a checkpoint written at the end of the batch holds it), and the
    momentum in use is logged as `train/momentum`. `target_encode` is the key branch's forward, a public hook.
    The mixin comes before the method base in a class's bases: Lightning's own hooks end the `super()` chain, so a
    mixin after them would never run (`methods.contract` refuses that order when the class is created).
    """

    momentum_modules: tuple[str, ...] = ("backbone", "projector")

    def init_momentum(self, spec: MomentumSpec | dict) -> None:
        spec = as_spec(MomentumSpec, spec)
        check_choices(spec, "momentum")
        if not 0.0 <= spec.base <= 1.0:
            raise ValueError(f"momentum.base must lie in [0, 1], got {spec.base}")
        if spec.split_bn < 1:
            raise ValueError(f"momentum.split_bn is a number of BatchNorm groups and must be >= 1, got {spec.split_bn}")
        if "backbone" not in self.momentum_modules and (spec.split_bn > 1 or self.evaluated_encoder == "momentum"):
            why = f"momentum.split_bn {spec.split_bn}" if spec.split_bn > 1 else "evaluated_encoder 'momentum'"
            raise ValueError(f"{type(self).__name__}: {why} needs a momentum trunk, but momentum_modules {list(self.momentum_modules)} has no 'backbone'")
        self.momentum_spec = spec
        for name in self.momentum_modules:  # split-BN converts BatchNorm2d only: a projector's BatchNorm1d is never split
            setattr(self, f"target_{name}", frozen_copy(getattr(self, name), spec.split_bn))

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(online, target) module pairs of the EMA update, in `momentum_modules` order."""
        return [(getattr(self, name), getattr(self, f"target_{name}")) for name in self.momentum_modules]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.momentum_spec.shuffle_bn and self.momentum_spec.split_bn == 1 and not several_processes():
            # a multi-GPU config run on one device: MoCo's shuffle-BN (Sec. 3.3) needs other processes to shuffle with
            warnings.warn(
                "momentum.shuffle_bn is true, but this run has one process and momentum.split_bn 1: the keys are encoded "
                "unshuffled, their BatchNorm statistics taken over the batch they are compared in; give momentum.split_bn N > 1 "
                "to emulate shuffle-BN on one device, or momentum.shuffle_bn false",
                stacklevel=2,
            )
        # Lightning's `trainer.sync_batchnorm` converts every BatchNorm, the split ones too, when it sets up
        if self.momentum_spec.split_bn > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in self.target_backbone.modules()):
            raise ValueError(
                f"momentum.split_bn={self.momentum_spec.split_bn} (per-group BatchNorm statistics in the momentum trunk) "
                "cannot run with trainer.sync_batchnorm=true (statistics of the whole global batch): set one of them "
                "(multi-GPU runs shuffle across processes instead: momentum.shuffle_bn)"
            )

    @torch.no_grad()
    def target_embed(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised target projection of `images`, with the batch shuffled so that BatchNorm
        statistics cannot reveal which key belongs to which query: across processes when distributed
        (MoCo's shuffle-BN), on one device only with split-BN (a plain permutation changes nothing)."""
        spec = self.momentum_spec
        if spec.shuffle_bn and several_processes():
            output = distributed_shuffled_forward(self.target_encode, images)
        elif spec.shuffle_bn and spec.split_bn > 1:
            order = torch.randperm(images.shape[0], device=images.device)
            output = self.target_encode(images[order])[torch.argsort(order)]
        else:
            output = self.target_encode(images)
        return F.normalize(output, dim=1)

    def target_encode(self, images: torch.Tensor) -> torch.Tensor:
        """The key branch before normalisation; a method whose heads differ overrides it (PaCoRIDE)."""
        return self.target_projector(self.target_backbone(images))

    def check_data(self, datamodule, world_size: int) -> None:
        """Split BatchNorm (`momentum.split_bn`) normalises each of its groups of a batch on its own: the batch must
        split evenly, with at least 2 images per group."""
        if not hasattr(self, "momentum_spec"):
            raise ValueError(f"{type(self).__name__} has no momentum encoder: its __init__ must call self.init_momentum(momentum) after building the modules it copies")
        super().check_data(datamodule, world_size)
        groups, batch = self.momentum_spec.split_bn, datamodule.batch_size
        if groups > 1 and (batch % groups or batch // groups < 2):
            raise ValueError(
                f"model.init_args.momentum.split_bn {groups} needs data.init_args.batch_size divisible by {groups} with at least "
                f"2 images per group, got {batch}: give a batch size of {2 * groups}, {3 * groups}, ... or a smaller split_bn"
            )

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        spec = self.momentum_spec
        step = self.trainer.global_step  # optimizer steps completed before this one: its 0-based index
        momentum = momentum_at(step, schedule_length(self.trainer), spec.base, spec.schedule)
        for online, target in self.momentum_pairs():
            ema_update_(online, target, momentum)
        self.log("train/momentum", momentum, on_step=True, on_epoch=False)


def frozen_copy(online: nn.Module, split_bn: int = 1) -> nn.Module:
    """A gradient-free copy of `online`, its BatchNorm2d split into `split_bn` groups when > 1, without stochastic depth
    or dropout: a target is deterministic in every official code (facebookresearch/dino main_dino.py builds the teacher
    without drop_path_rate; moco-v3's ViTs and BYOL's and MoCo's ResNets have none)."""
    target = copy.deepcopy(online)
    for module in target.modules():
        if hasattr(module, "drop_prob"):  # timm's DropPath
            module.drop_prob = 0.0
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    if split_bn > 1:
        target = convert_to_split_batchnorm(target, split_bn)
    return target.requires_grad_(False)
