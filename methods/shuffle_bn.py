"""Keeping BatchNorm statistics from telling a query which key is its positive (facebookresearch/moco issue 47): MoCo's shuffle-BN
across processes (`distributed_shuffled_forward`) and its one-device emulation of the CIFAR recipe that SCE and ReSSL
follow on small datasets (`SplitBatchNorm2d` in the momentum trunk only, as CEA-LIST/SCE's `convert_to_split_batchnorm`;
MoCo's CIFAR colab splits the BatchNorm of both encoders)."""

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


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
        # back in a channels-last input's layout: the reshapes leave NCHW, and a channels-last trunk would run every
        # later layer on it (each convolution converting back, the max-pool on its NCHW kernel, ~14x slower on a CPU)
        return out.contiguous(memory_format=torch.channels_last) if x.is_contiguous(memory_format=torch.channels_last) else out


def convert_to_split_batchnorm(module: nn.Module, num_splits: int, name: str = "") -> nn.Module:
    """Replace every BatchNorm2d by a SplitBatchNorm2d with the same state. Only 2-d BN is split, as in
    SCE's `convert_to_split_batchnorm`: the projector's BatchNorm1d keeps full-batch statistics. A subclass of
    BatchNorm2d (timm's BatchNormAct2d, which adds its activation) is refused: left whole, its keys' statistics would
    be the full batch's, which split BN is there to avoid (MoCo, Sec. 3.3)."""
    if isinstance(module, nn.BatchNorm2d) and type(module) not in (nn.BatchNorm2d, SplitBatchNorm2d):
        raise ValueError(f"momentum.split_bn {num_splits}: the trunk's {name or 'module'} is a {type(module).__name__}, which cannot be split "
                         "into groups: give a trunk with plain BatchNorm2d, or momentum.split_bn 1 with shuffle_bn false")
    if type(module) is nn.BatchNorm2d:
        split = SplitBatchNorm2d(
            module.num_features, num_splits, eps=module.eps, momentum=module.momentum, affine=module.affine
        )
        split.load_state_dict(module.state_dict())
        split.train(module.training)
        return split
    for child_name, child in module.named_children():
        setattr(module, child_name, convert_to_split_batchnorm(child, num_splits, f"{name}.{child_name}" if name else child_name))
    return module
