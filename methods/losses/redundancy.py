"""Redundancy reduction over the whole batch: Barlow Twins' cross-correlation (Zbontar et al., ICML 2021) and VICReg's
variance, invariance and covariance terms (Bardes et al., ICLR 2022).

Both are functions of the embeddings of the whole (global) batch: a method gathers them across processes with their
gradients (`MethodBase.gather_with_grad`) before calling these, so that W processes train as one process would on
the concatenated batch.
"""

import torch.nn.functional as F
from torch import Tensor

from methods.losses.common import check_hyperparameters, check_shape, float32_math


def standardized(embeddings: Tensor, eps: float = 1e-5) -> Tensor:
    """Each dimension to zero mean and unit variance over the batch (biased variance, `eps` inside the root): a
    `BatchNorm1d(affine=False)` in training mode, the normalisation of facebookresearch/barlowtwins main.py."""
    centred = embeddings - embeddings.mean(dim=0)
    return centred / (centred.pow(2).mean(dim=0) + eps).sqrt()


def off_diagonal_squares(matrix: Tensor) -> Tensor:
    """Sum of the squared off-diagonal entries of a square matrix."""
    return matrix.pow(2).sum() - matrix.diagonal().pow(2).sum()


def check_pair(z1: Tensor, z2: Tensor) -> None:
    check_shape("z1", z1, None, None)
    check_shape("z2", z2, *z1.shape)
    if z1.shape[0] < 2:
        raise ValueError(f"z1 must hold at least 2 embeddings (batch statistics), got {z1.shape[0]}")


@float32_math
def barlow_twins_loss(z1: Tensor, z2: Tensor, off_diagonal_weight: float = 0.0051, loss_scale: float = 1.0) -> Tensor:
    """Barlow Twins (Eq. 1): C = standardized(z1)^T standardized(z2) / N over the N embeddings of the batch, loss
    sum_i (1 - C_ii)^2 + lambda sum_{i != j} C_ij^2, lambda = `off_diagonal_weight` (0.0051, facebookresearch/barlowtwins
    main.py `--lambd`), times `loss_scale` (1 in the official code since June 2021; solo-learn's `scale_loss`,
    0.1 on CIFAR, is the official code's earlier form)."""
    check_pair(z1, z2)
    check_hyperparameters(off_diagonal_weight=off_diagonal_weight, loss_scale=loss_scale)
    correlation = standardized(z1).T @ standardized(z2) / z1.shape[0]
    invariance = (1 - correlation.diagonal()).pow(2).sum()
    return loss_scale * (invariance + off_diagonal_weight * off_diagonal_squares(correlation))


@float32_math
def vicreg_loss(
    z1: Tensor,
    z2: Tensor,
    invariance_weight: float = 25.0,
    variance_weight: float = 25.0,
    covariance_weight: float = 1.0,
    gamma: float = 1.0,
    epsilon: float = 1e-4,
) -> Tensor:
    """VICReg (Eq. 1-6) as facebookresearch/vicreg main_vicreg.py computes it:
    - invariance: the mean squared difference of z1 and z2 over the N x D entries;
    - variance: per dimension std = sqrt(Var + epsilon) (unbiased variance), the hinge mean(relu(gamma - std)), half
      of it for each branch;
    - covariance: Cov = Zc^T Zc / (N - 1) of the centred embeddings, sum of its squared off-diagonal entries / D, for
      each branch (not halved);
    weighted 25 / 25 / 1 (the paper's lambda, mu, nu)."""
    check_pair(z1, z2)
    check_hyperparameters(
        invariance_weight=invariance_weight, variance_weight=variance_weight, covariance_weight=covariance_weight,
        gamma=gamma, epsilon=epsilon,
    )  # fmt: skip
    count, dim = z1.shape
    invariance = F.mse_loss(z1, z2)
    variance, covariance = z1.new_zeros(()), z1.new_zeros(())
    for z in (z1, z2):
        centred = z - z.mean(dim=0)
        std = (centred.pow(2).sum(dim=0) / (count - 1) + epsilon).sqrt()
        variance = variance + F.relu(gamma - std).mean() / 2
        covariance = covariance + off_diagonal_squares(centred.T @ centred / (count - 1)) / dim
    return invariance_weight * invariance + variance_weight * variance + covariance_weight * covariance
