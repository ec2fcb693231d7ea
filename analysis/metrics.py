"""Embedding-space metrics of Wang & Isola (ICML 2020) and Wang & Liu (CVPR 2021), and the collapse indicators
of RankMe (Garrido et al., ICML 2023) and SimSiam (Chen & He, CVPR 2021).

All compute in float32 (float64 kept). The pairwise ones take the embeddings as given (pass L2-normalised rows,
as the papers do) and cost O(N^2): subsample large sets. `local_separation` and `negative_entropy` take
anchors and targets in pairs: target i is anchor i's positive, every other target is a negative of it
(an NPID anchor against the memory bank, or one augmented view against another); `alignment` takes two views
in the same pairing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["alignment", "local_separation", "negative_entropy", "normalised_std", "rankme", "tolerance", "uniformity"]

RANKME_EPSILON = 1e-7  # Garrido et al. Eq. 1: added to each normalised singular value, for float32


def _as_float(z: Tensor) -> Tensor:
    if z.ndim != 2 or len(z) < 2:
        raise ValueError(f"z must have shape (N, D) with N >= 2, got {tuple(z.shape)}")
    return z if z.dtype == torch.float64 else z.float()


def uniformity(z: Tensor, t: float = 2.0) -> Tensor:
    """Wang & Isola's L_uniformity = log mean_{i<j} exp(-t ||z_i - z_j||^2) of L2-normalised rows; lower is more uniform.

    Wang & Liu plot -L_uniformity. Computed as a logsumexp over ``torch.pdist`` pairs. Rows of other norms are refused
    (Wang & Isola's function, like this one, does not normalise: 3z would read as far more uniform than z).
    """
    if not t > 0:
        raise ValueError(f"t must be > 0, got {float(t)}")
    z = _as_float(z)
    norms = z.norm(dim=1)
    if len(z) and not torch.allclose(norms, torch.ones_like(norms), atol=1e-2):  # bf16 rows are unit to 0.2%
        raise ValueError(f"uniformity needs L2-normalised rows, got norms from {norms.min().item():.4g} to {norms.max().item():.4g}")
    exponents = -t * torch.pdist(z).pow(2)
    return exponents.logsumexp(dim=0) - math.log(len(exponents))


def alignment(z: Tensor, positives: Tensor, alpha: float = 2.0) -> Tensor:
    """Wang & Isola's L_align = mean_i ||z_i - positives_i||^alpha over positive pairs (two views of image i);
    0 when both views map to the same point, lower is better aligned (at most 2^alpha for unit vectors)."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {float(alpha)}")
    z = _as_float(z)
    if positives.shape != z.shape:
        raise ValueError(f"positives must have the shape of z {tuple(z.shape)}, got {tuple(positives.shape)}")
    return (z - positives.to(z.dtype)).norm(dim=1).pow(alpha).mean()


def rankme(z: Tensor, epsilon: float = RANKME_EPSILON) -> Tensor:
    """RankMe (Garrido et al. 2023, Eq. 1), the effective rank of the (N, D) embedding matrix z as given (not
    centred): exp(-sum_k p_k log p_k) with p_k = sigma_k / ||sigma||_1 + epsilon over its min(N, D) singular
    values. About r for a matrix of rank r with equal singular values, about 1 for a collapsed one; at most
    min(N, D), so values compare at a fixed N (the paper uses N = 25,600)."""
    singular_values = torch.linalg.svdvals(_as_float(z))
    p = singular_values / singular_values.sum() + epsilon
    return (-(p * p.log()).sum()).exp()


def normalised_std(z: Tensor) -> Tensor:
    """SimSiam's collapse indicator (Sec. 4.1, Fig. 2): the std over the N samples of each dimension of the
    L2-normalised rows z_i / ||z_i||, averaged over the D dimensions. 0 for a collapsed output (every row the
    same direction); about 1/sqrt(D) for rows from an isotropic Gaussian."""
    return F.normalize(_as_float(z), dim=1).std(dim=0).mean()


def tolerance(z: Tensor, labels: Tensor) -> Tensor:
    """Wang & Liu's tolerance: mean cosine similarity over all same-class pairs (i != j), pooled over classes.

    This is the third-party ``tolerance.py`` reading of E[f(x)'f(y) 1{l(x) = l(y)}]; averaging the indicator
    over all pairs instead would rescale it by about 1/#classes.
    """
    z = F.normalize(_as_float(z), dim=1)
    if labels.shape != (len(z),):
        raise ValueError(f"labels must have shape ({len(z)},), got {tuple(labels.shape)}")
    same_class = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0)  # an unlabelled image (-1) is of no class
    same_class.fill_diagonal_(False)
    if not same_class.any():
        raise ValueError("labels must contain at least one class with two samples (unlabelled images, label -1, count in none)")
    return (z @ z.T)[same_class].mean()


def _pair_similarities(anchors: Tensor, targets: Tensor) -> Tensor:
    anchors = _as_float(anchors)
    if targets.shape != anchors.shape:
        raise ValueError(f"targets must have the anchors' shape {tuple(anchors.shape)}, got {tuple(targets.shape)}")
    return anchors @ targets.to(anchors.dtype).T


def local_separation(anchors: Tensor, targets: Tensor, k: int = 10) -> tuple[Tensor, Tensor]:
    """Wang & Liu's local separation (their Figs. 1-7): per anchor i, the similarity s_ii to its positive
    and the k largest similarities s_ij to negatives (j != i), sorted from n1 (the nearest) down to nk.

    Returns ``(positive (N,), nearest_negatives (N, k))``.
    """
    similarity = _pair_similarities(anchors, targets)
    if not 1 <= k < len(similarity):
        raise ValueError(f"k must lie in [1, {len(similarity) - 1}] (negatives per anchor), got {k}")
    negatives = similarity.masked_fill(torch.eye(len(similarity), dtype=torch.bool, device=similarity.device), -math.inf)
    return similarity.diagonal(), negatives.topk(k, dim=1).values


def negative_entropy(anchors: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """Entropy H(r_i) of each anchor's relative penalty over its negatives, the Boltzmann distribution
    r_i(j) = exp(s_ij / T) / sum_{k != i} exp(s_ik / T) (Wang & Liu 3.2; it grows with T). Returns (N,)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {float(temperature)}")
    logits = _pair_similarities(anchors, targets) / temperature
    logits = logits.masked_fill(torch.eye(len(logits), dtype=torch.bool, device=logits.device), -math.inf)
    return torch.special.entr(logits.softmax(dim=1)).sum(dim=1)
