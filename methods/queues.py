"""What a method remembers of past steps: `KeyQueue`, a FIFO queue of keys (one per row) with optional labels,
filled with gathered keys (MoCo, SCE, ReSSL, JCL, PaCo and its RIDE and multi-task variants, NNCLR's support set);
`MemoryBank`, one entry per training sample, momentum-updated by sample index (NPID); `EmbeddingQueue`, the past
embeddings of SwAV's codes."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        if count > self.size:  # the slots would repeat: a method that enqueues more keys per image than its keys_per_sample says
            raise ValueError(f"{count} keys pushed into a queue of {self.size}: a step's keys must fit (the method's keys_per_sample)")
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


class EmbeddingQueue(nn.Module):
    """The last `size` embeddings of one stream (one per row), newest first, starting empty (zeros): SwAV's queue of
    past crop embeddings (facebookresearch/swav main_swav.py), which the method reads only once it is full. Its
    buffer is saved in and restored from checkpoints; whether it is full follows from how many rows were pushed,
    which the method counts from the training progress (no host read of a device value)."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        if size < 1 or dim < 1:
            raise ValueError(f"queue size and dim must be >= 1, got size={size}, dim={dim}")
        self.register_buffer("embeddings", torch.zeros(size, dim))

    @property
    def size(self) -> int:
        return self.embeddings.shape[0]

    def read(self) -> torch.Tensor:
        return self.embeddings.clone()

    @torch.no_grad()
    def push(self, rows: torch.Tensor) -> None:
        """Shift the queue by len(rows) and write `rows` (already gathered, in rank order) at its head."""
        count = min(rows.shape[0], self.size)
        self.embeddings.copy_(torch.cat([rows[:count].detach().to(self.embeddings.dtype), self.embeddings[: self.size - count]]))
