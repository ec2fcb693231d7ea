"""Instance discrimination against negatives: MoCo's InfoNCE with a queue, SimCLR's NT-Xent over the batch, Wang &
Liu's ordinary and hard contrastive losses (NPID's memory bank), and JCL's closed form of infinitely many positives."""

import math

import torch
from torch import Tensor

from methods.losses.common import (
    check_hyperparameters,
    check_labels,
    check_query_key_bank,
    check_shape,
    float32_math,
    masked_logsumexp,
    off_diagonal,
    positive_nll,
)


@float32_math
def info_nce(query: Tensor, key: Tensor, queue: Tensor, temperature: float) -> Tensor:
    """MoCo v2 InfoNCE: cross-entropy of ``[q.k, q.queue] / T`` with the positive in column 0 (moco builder.py)."""
    check_query_key_bank(query, key, queue)
    check_hyperparameters(temperature=temperature)
    positive = (query * key).sum(dim=1) / temperature
    return positive_nll(positive, query @ queue.T / temperature).mean()


@float32_math
def nt_xent(z1: Tensor, z2: Tensor, temperature: float) -> Tensor:
    """SimCLR NT-Xent, mean over the 2B anchors; self-similarity is masked before the softmax.

    Note: SimCLR's official ``add_contrastive_loss`` sums the two directions, i.e. returns 2x this mean.
    """
    check_shape("z1", z1, None, None)
    check_shape("z2", z2, *z1.shape)
    check_hyperparameters(temperature=temperature)
    z = torch.cat([z1, z2])
    logits = z @ z.T / temperature
    log_prob = logits - masked_logsumexp(logits, off_diagonal(len(z), len(z), z.device))[:, None]
    other_view = torch.arange(len(z), device=z.device).roll(len(z1))  # row i pairs with row i +- B
    return -log_prob.gather(1, other_view[:, None]).mean()


@float32_math
def jcl_loss(query: Tensor, keys: Tensor, queue: Tensor, temperature: float, lam: float) -> Tensor:
    """JCL (Cai et al., NeurIPS 2020), Eq. (S.3) of the supplement.

    ``keys`` (B, M, D) are the M positive keys of each query; mu is their mean (not re-normalised) and
    Sigma their biased (1/M) covariance. Per anchor:
    ``log[exp(q.mu/T + lam/(2T^2) q'Sigma q) + sum_j exp(q.n_j/T)] - q.mu/T``, which equals the official
    code's ``CE([q.(mu + Sigma' q / 2), q.queue] / T, 0) + q'Sigma' q / (2T)`` with ``Sigma' = lam Sigma / T``
    (``lam`` is the code's ``jcl_lambda`` after its per-epoch ramp). ``q'Sigma q`` is computed as the mean
    squared projection of the centred keys, so the (B, D, D) covariance is never built.
    """
    check_shape("query", query, None, None)
    check_shape("keys", keys, len(query), None, query.shape[1])
    check_shape("queue", queue, None, query.shape[1])
    check_hyperparameters(temperature=temperature, lam=lam)
    mean_key = keys.mean(dim=1)
    spread = ((keys - mean_key[:, None]) @ query[:, :, None]).squeeze(2).pow(2).mean(dim=1)  # q' Sigma q
    quadratic = lam / (2 * temperature**2) * spread
    positive = (query * mean_key).sum(dim=1) / temperature
    return (positive_nll(positive + quadratic, query @ queue.T / temperature) + quadratic).mean()


@float32_math
def contrastive_loss(
    query: Tensor,
    positive: Tensor,
    negatives: Tensor,
    temperature: float,
    num_hard: int | None = None,
    exclude: Tensor | None = None,
    log_eps: float = 0.0,
) -> Tensor:
    """Wang & Liu (CVPR 2021): the ordinary contrastive loss, or with ``num_hard=n`` their hard loss.

    The hard loss keeps the positive and only the n most similar negatives of each anchor in the
    denominator (the paper's formula; the author code's top-n over the whole bank can drop the positive).
    ``exclude`` (B,) or (B, E) names, per anchor, rows of ``negatives`` to drop, e.g. its own memory-bank
    entry (NPID), or itself and its other view when the negatives are the batch (SimCLR).
    ``log_eps`` > 0 gives -log(p + log_eps) per anchor instead of -log p: the author code's guard
    (1e-7 in every loss of its ``objective.py``), which caps the loss near 16.1 and scales the gradient
    by p / (p + log_eps).
    """
    check_query_key_bank(query, positive, negatives, key_name="positive", bank_name="negatives")
    check_hyperparameters(temperature=temperature, num_hard=num_hard, log_eps=log_eps)
    negative_logits = query @ negatives.T / temperature
    if exclude is not None:
        columns = exclude.long().view(len(exclude), -1)
        for column in columns.T:
            check_labels("exclude", column, len(query), len(negatives))
        negative_logits = negative_logits.scatter(1, columns, -math.inf)
    if num_hard is not None and num_hard < negative_logits.shape[1]:
        negative_logits = negative_logits.topk(num_hard, dim=1).values
    positive_logit = (query * positive).sum(dim=1) / temperature
    nll = positive_nll(positive_logit, negative_logits)
    if log_eps > 0:  # -log(p + eps) = -logaddexp(log p, log eps), without forming p
        nll = -torch.logaddexp(-nll, torch.full_like(nll, math.log(log_eps)))
    return nll.mean()
