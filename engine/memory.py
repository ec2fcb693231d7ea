"""How large the tensors of a computation get: the loss benchmark's memory probe, and the loss tests' check that no
loss builds a (B, K, D) or (B, D, D) intermediate."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns while the mode is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out
