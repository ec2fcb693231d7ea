"""Embedding-space metrics of Wang & Isola (ICML 2020) and Wang & Liu (CVPR 2021).

Both take the embeddings as given (pass L2-normalised rows, as the papers do), compute in float32
(float64 kept) and cost O(N^2): subsample large sets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["tolerance", "uniformity"]


def _as_float(z: Tensor) -> Tensor:
    if z.ndim != 2 or len(z) < 2:
        raise ValueError(f"z must have shape (N, D) with N >= 2, got {tuple(z.shape)}")
    return z if z.dtype == torch.float64 else z.float()


def uniformity(z: Tensor, t: float = 2.0) -> Tensor:
    """Wang & Isola's L_uniformity = log mean_{i<j} exp(-t ||z_i - z_j||^2); lower is more uniform.

    Wang & Liu plot -L_uniformity. Computed as a logsumexp over ``torch.pdist`` pairs.
    """
    if not t > 0:
        raise ValueError(f"t must be > 0, got {float(t)}")
    z = _as_float(z)
    exponents = -t * torch.pdist(z).pow(2)
    return exponents.logsumexp(dim=0) - math.log(len(exponents))


def tolerance(z: Tensor, labels: Tensor) -> Tensor:
    """Wang & Liu's tolerance: mean cosine similarity over all same-class pairs (i != j), pooled over classes.

    This is the third-party ``tolerance.py`` reading of E[f(x)'f(y) 1{l(x) = l(y)}]; averaging the indicator
    over all pairs instead would rescale it by about 1/#classes.
    """
    z = F.normalize(_as_float(z), dim=1)
    if labels.shape != (len(z),):
        raise ValueError(f"labels must have shape ({len(z)},), got {tuple(labels.shape)}")
    same_class = labels[:, None] == labels[None, :]
    same_class.fill_diagonal_(False)
    if not same_class.any():
        raise ValueError("labels must contain at least one class with two samples")
    return (z @ z.T)[same_class].mean()
