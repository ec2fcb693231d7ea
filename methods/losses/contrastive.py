"""Instance discrimination against negatives: MoCo's InfoNCE with a queue, SimCLR's NT-Xent over the batch, Wang &
Liu's ordinary and hard contrastive losses (NPID's memory bank), JCL's closed form of infinitely many positives,
MoCo v3's InfoNCE over the global batch and NNCLR's with nearest neighbours from a support set as positives."""

import math

import torch
import torch.nn.functional as F
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
    """MoCo v2 InfoNCE: cross-entropy of ``[q.k, q.queue] / T`` with the positive in column 0 (moco builder.py), Wang &
    Liu's ordinary contrastive loss with the key as the positive and the queue as the negatives."""
    check_query_key_bank(query, key, queue)  # named as MoCo names them
    return contrastive_loss(query, key, queue, temperature)


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


def check_positive_offset(positive_offset: int, rows: int, columns: int) -> None:
    if not 0 <= positive_offset <= columns - rows:
        raise ValueError(f"positive_offset must lie in [0, {columns - rows}] ({rows} rows, {columns} columns), got {positive_offset}")


@float32_math
def mocov3_loss(query: Tensor, keys: Tensor, temperature: float, positive_offset: int = 0) -> Tensor:
    """One term of MoCo v3 (Chen, Xie & He, ICCV 2021, Algorithm 1): ``2 tau CE(q k^T / tau, i + positive_offset)``
    of a process's queries against the keys of the global batch, without a queue; the key of query i is column
    ``positive_offset + i`` (the process's rank times its batch, facebookresearch/moco-v3 moco/builder.py
    `contrastive_loss`, whose factor 2 tau this keeps). The method sums the two views' terms as the official code."""
    check_shape("query", query, None, None)
    check_shape("keys", keys, None, query.shape[1])
    check_hyperparameters(temperature=temperature)
    check_positive_offset(positive_offset, len(query), len(keys))
    logits = query @ keys.T / temperature
    positives = torch.arange(len(query), device=query.device) + positive_offset
    return 2 * temperature * F.cross_entropy(logits, positives)


@float32_math
def nnclr_loss(projection: Tensor, predictions: Tensor, support: Tensor, temperature: float, positive_offset: int = 0) -> Tensor:
    """NNCLR (Dwibedi et al., ICCV 2021, Eq. 2): InfoNCE whose anchor is NN(z_i, Q), the nearest neighbour of the
    projection z_i in the support set Q (largest cosine: the rows are unit vectors; no gradient), against the
    predictions of the other view of the global batch, the positive being column ``positive_offset + i``; mean
    over the rows. As vturrisi/solo-learn solo/losses/nnclr.py (NNCLR has no official code); lightly's NT-Xent
    form adds the opposite direction and same-view negatives (lightly-ai/lightly lightly/loss/ntx_ent_loss.py)."""
    check_shape("projection", projection, None, None)
    check_shape("predictions", predictions, None, projection.shape[1])
    check_shape("support", support, None, projection.shape[1])
    check_hyperparameters(temperature=temperature)
    check_positive_offset(positive_offset, len(projection), len(predictions))
    neighbour = support[(projection.detach() @ support.T).argmax(dim=1)].detach()
    logits = neighbour @ predictions.T / temperature
    positives = torch.arange(len(projection), device=projection.device) + positive_offset
    return F.cross_entropy(logits, positives)
