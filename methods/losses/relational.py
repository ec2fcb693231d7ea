"""Relational targets: the online distribution over [positive key, queue] is trained towards the momentum branch's
similarities of the weak view to the queue (ReSSL), mixed with InfoNCE's one-hot (SCE)."""

import math

import torch
from torch import Tensor

from methods.losses.common import check_hyperparameters, check_query_key_bank, float32_math, soft_cross_entropy


@float32_math
def ressl_loss(query: Tensor, key: Tensor, queue: Tensor, temperature: float, temperature_momentum: float) -> Tensor:
    """ReSSL: cross-entropy between the detached softmax(k.queue / T_m) and log_softmax(q.queue / T).

    The positive is not among the candidates (official ReSSL); T = 0.1, T_m = 0.04 in the paper.
    """
    check_query_key_bank(query, key, queue)
    check_hyperparameters(temperature=temperature, temperature_momentum=temperature_momentum)
    with torch.no_grad():
        target = (key @ queue.T / temperature_momentum).softmax(dim=1)
    log_prob = (query @ queue.T / temperature).log_softmax(dim=1)
    return soft_cross_entropy(log_prob, target).mean()


@float32_math
def sce_loss(
    query: Tensor,
    key: Tensor,
    queue: Tensor,
    temperature: float,
    temperature_momentum: float,
    coeff: float,
    mask_positive_target: bool = False,
) -> Tensor:
    """SCE (Denize et al., WACV 2023), queue form of eztorch ``compute_sce_loss`` / SCE supplementary, Algorithm 1.

    Online logits ``[q.k, q.queue] / T``; detached target
    ``coeff * one_hot(0) + (1 - coeff) * softmax([0, k.queue] / T_m)``. The positive's target logit is 0
    as in the official code, or -inf with ``mask_positive_target=True``, the form of SCE's Proposition 1,
    proved in SCE supplementary, Sec. B (then the loss is coeff * InfoNCE + (1 - coeff) * (ReSSL + Ceil)).
    """
    check_query_key_bank(query, key, queue)
    check_hyperparameters(temperature=temperature, temperature_momentum=temperature_momentum, coeff=coeff)
    positive = (query * key).sum(dim=1, keepdim=True)
    log_prob = (torch.cat([positive, query @ queue.T], dim=1) / temperature).log_softmax(dim=1)
    with torch.no_grad():
        queue_logits = key @ queue.T / temperature_momentum
        positive_slot = torch.full_like(queue_logits[:, :1], -math.inf if mask_positive_target else 0.0)
        target = (1 - coeff) * torch.cat([positive_slot, queue_logits], dim=1).softmax(dim=1)
        target[:, 0] += coeff
    return soft_cross_entropy(log_prob, target).mean()
