"""Momentum-encoder machinery shared by MoCo v2, ReSSL, SCE, JCL, PaCo (and NPID's memory bank).

- `MomentumMixin`: EMA copies of (online, target) module pairs, their momentum schedule, and the
  target-branch forward with shuffle-BN (across processes) or split-BN (emulated on one device).
- `KeyQueue`: FIFO queue of keys (one per row) with optional labels, filled with gathered keys.
- `MemoryBank`: one entry per training sample, momentum-updated by sample index (NPID).
- `SplitBatchNorm2d` / `convert_to_split_batchnorm`: the one-device shuffle-BN emulation of the MoCo
  CIFAR recipe that SCE and ReSSL follow on small datasets (MoCo issue #46 and its CIFAR colab).
"""

import copy
import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from engine.config import as_spec

MomentumSchedule = Literal["constant", "cosine"]


def momentum_at(step: int, total_steps: int, base: float, schedule: MomentumSchedule) -> float:
    """Momentum of the EMA update made after optimizer step `step` (0-based).

    `cosine` is SCE's per-step schedule m_t = 1 - (1 - m_0)(cos(pi t / T) + 1) / 2 with
    T = total_steps - 1, so m goes from m_0 at the first step to exactly 1 at the last (eztorch's momentum scheduler).
    """
    if schedule == "constant":
        return base
    last = max(total_steps - 1, 1)
    return 1.0 - (1.0 - base) * (math.cos(math.pi * min(step, last) / last) + 1.0) / 2.0


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
    are kept from leaking which key belongs to which query (MoCo issue #46 and its CIFAR colab)."""

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
    """

    momentum_modules: tuple[str, ...] = ("backbone", "projector")

    def init_momentum(self, spec: MomentumSpec | dict) -> None:
        spec = as_spec(MomentumSpec, spec)
        if not 0.0 <= spec.base <= 1.0:
            raise ValueError(f"momentum.base must lie in [0, 1], got {spec.base}")
        if spec.split_bn < 1:
            raise ValueError(f"momentum.split_bn is a number of BatchNorm groups and must be >= 1, got {spec.split_bn}")
        self.momentum_spec = spec
        for name in self.momentum_modules:  # split-BN converts BatchNorm2d only: a projector's BatchNorm1d is never split
            setattr(self, f"target_{name}", frozen_copy(getattr(self, name), spec.split_bn))

    def momentum_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(online, target) module pairs of the EMA update, in `momentum_modules` order."""
        return [(getattr(self, name), getattr(self, f"target_{name}")) for name in self.momentum_modules]

    def on_fit_start(self) -> None:
        super().on_fit_start()
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
        if spec.shuffle_bn and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        spec = self.momentum_spec
        step = self.trainer.global_step  # optimizer steps completed before this one: its 0-based index
        momentum = momentum_at(step, self.trainer.estimated_stepping_batches, spec.base, spec.schedule)
        for online, target in self.momentum_pairs():
            ema_update_(online, target, momentum)
        self.log("train/momentum", momentum, on_step=True, on_epoch=False)


def frozen_copy(online: nn.Module, split_bn: int = 1) -> nn.Module:
    """A gradient-free copy of `online`, its BatchNorm2d split into `split_bn` groups when > 1."""
    target = copy.deepcopy(online)
    if split_bn > 1:
        target = convert_to_split_batchnorm(target, split_bn)
    return target.requires_grad_(False)


def distributed_shuffled_forward(encoder: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """MoCo's shuffle-BN: gather all inputs, apply one permutation drawn on rank 0, encode this
    rank's share, gather the outputs and undo the permutation. Needs equal batch sizes per rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gathered = _all_gather(images)
    order = torch.randperm(gathered.shape[0], device=images.device)
    dist.broadcast(order, src=0)
    local = encoder(gathered[order.view(world, -1)[rank]])
    return _all_gather(local)[torch.argsort(order)].view(world, -1, *local.shape[1:])[rank]


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


class KeyQueue(nn.Module):
    """FIFO queue of `size` keys of dimension `dim` (one key per row), with optional integer labels.

    Keys start as random unit vectors (MoCo's initialisation); labels, when kept, start as random
    classes (PaCo's initialisation). `push` writes a batch at the pointer and wraps around modulo the
    queue size, so any batch up to `size` keys is handled. Keys, labels and the pointer are buffers,
    hence saved in and restored from checkpoints.
    """

    def __init__(self, size: int, dim: int, num_classes: int | None = None):
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"queue size and dim must be >= 1, got size={size}, dim={dim}")
        self.register_buffer("keys", F.normalize(torch.randn(size, dim), dim=1))
        self.register_buffer("pointer", torch.zeros((), dtype=torch.long))
        self.register_buffer(
            "labels", torch.randint(0, num_classes, (size,)) if num_classes is not None else None
        )

    @property
    def size(self) -> int:
        return self.keys.shape[0]

    def read(self) -> torch.Tensor:
        """A detached copy: the caller's loss graph must not see this step's enqueue."""
        return self.keys.clone()

    def read_labels(self) -> torch.Tensor:
        return self.labels.clone()

    @torch.no_grad()
    def push(self, keys: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Enqueue already-gathered keys (and labels) in order, overwriting the oldest entries. At most `size`
        keys: `MethodBase.check_data` refuses, before training, a queue smaller than the keys of a step."""
        count = keys.shape[0]
        if (labels is None) != (self.labels is None):
            raise ValueError("labels must be given exactly when the queue keeps labels")
        slots = (self.pointer + torch.arange(count, device=keys.device)) % self.size
        self.keys[slots] = keys.detach().to(self.keys.dtype)
        if labels is not None:
            self.labels[slots] = labels.to(self.labels.dtype)
        self.pointer.copy_((self.pointer + count) % self.size)


class MemoryBank(nn.Module):
    """One `dim`-vector per training sample (NPID). Initialised uniformly in +-1/sqrt(dim/3) as in
    NPID; `update` sets v_i <- normalize(m * v_i + (1 - m) * f_i) for the given sample indices."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        bound = 1.0 / math.sqrt(dim / 3)
        self.register_buffer("entries", torch.rand(size, dim) * 2 * bound - bound)

    def read(self) -> torch.Tensor:
        return self.entries.clone()

    @torch.no_grad()
    def update(self, indices: torch.Tensor, features: torch.Tensor, momentum: float) -> None:
        mixed = momentum * self.entries[indices] + (1.0 - momentum) * features.detach().to(self.entries.dtype)
        self.entries[indices] = F.normalize(mixed, dim=1)


class SplitBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm over `num_splits` interleaved groups of the batch (group s holds samples s, S+s, ...),
    so one device sees the per-GPU statistics of S GPUs; running statistics are averaged back."""

    def __init__(self, num_features: int, num_splits: int, **kwargs):
        super().__init__(num_features, **kwargs)
        self.num_splits = num_splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        batch, channels, height, width = x.shape
        if batch % self.num_splits:
            raise ValueError(f"split BatchNorm needs a batch divisible by {self.num_splits} groups, got {batch}")
        splits = self.num_splits
        running_mean = self.running_mean.repeat(splits)
        running_var = self.running_var.repeat(splits)
        out = F.batch_norm(
            x.reshape(-1, channels * splits, height, width),
            running_mean,
            running_var,
            self.weight.repeat(splits) if self.affine else None,
            self.bias.repeat(splits) if self.affine else None,
            True,
            self.momentum if self.momentum is not None else 0.1,
            self.eps,
        ).reshape(batch, channels, height, width)
        with torch.no_grad():
            self.running_mean.copy_(running_mean.view(splits, channels).mean(0))
            self.running_var.copy_(running_var.view(splits, channels).mean(0))
            self.num_batches_tracked += 1
        return out


def convert_to_split_batchnorm(module: nn.Module, num_splits: int) -> nn.Module:
    """Replace every BatchNorm2d by a SplitBatchNorm2d with the same state. Only 2-d BN is split, as in
    SCE's `convert_to_split_batchnorm`: the projector's BatchNorm1d keeps full-batch statistics."""
    if type(module) is nn.BatchNorm2d:
        split = SplitBatchNorm2d(
            module.num_features, num_splits, eps=module.eps, momentum=module.momentum, affine=module.affine
        )
        split.load_state_dict(module.state_dict())
        split.train(module.training)
        return split
    for name, child in module.named_children():
        setattr(module, name, convert_to_split_batchnorm(child, num_splits))
    return module
