"""Contrastive losses of the reproduced papers, as pure functions of tensors.

Conventions shared by every function:

- embeddings are already L2-normalised rows; a queue or memory bank is a ``(K, D)`` tensor, one key per row;
- each function returns the mean of its per-anchor losses as a 0-d tensor;
- the math runs with autocast disabled, in float32, or in float64 when any input is float64 (so that
  ``torch.autograd.gradcheck`` works); only logsumexp / log-softmax forms are used, never ``exp`` then ``log``;
- nothing is updated: queues, banks and momentum encoders belong to the caller;
- gradients reach every input that requires them, except the SCE and ReSSL target distributions, which are
  detached as in the official code;
- bad input raises ``ValueError`` naming the offending argument.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

__all__ = [
    "contrastive_loss",
    "info_nce",
    "jcl_loss",
    "nt_xent",
    "paco_loss",
    "ressl_loss",
    "sce_loss",
    "supcon_loss",
    "tcl_loss",
]


# --- precision and validation helpers -------------------------------------------------------------------


def _float32(loss_fn):
    """Run ``loss_fn`` outside autocast with its floating-point tensors in float32 (float64 if any input is)."""

    @functools.wraps(loss_fn)
    def wrapper(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32

        def cast(value):
            return value.to(dtype) if isinstance(value, Tensor) and value.is_floating_point() else value

        with torch.autocast(device_type=tensors[0].device.type, enabled=False):
            return loss_fn(*map(cast, args), **{name: cast(v) for name, v in kwargs.items()})

    return wrapper


# The domain of every scalar hyper-parameter of these losses, written once: each loss checks its arguments with it
# on every call, and each method its constructor's (`where="model."`) before it builds anything.
_POSITIVE, _NONNEGATIVE = ("be > 0", lambda v: v > 0), ("be >= 0", lambda v: v >= 0)
HYPERPARAMETER_DOMAINS = {
    **dict.fromkeys(("temperature", "temperature_momentum", "base_temperature"), _POSITIVE),
    **dict.fromkeys(("k1", "k2", "alpha", "beta", "gamma", "lam", "log_eps"), _NONNEGATIVE),
    "jcl_lambda": _NONNEGATIVE,  # JCL's lambda as its method names it (`lam` of `jcl_loss`)
    "coeff": ("lie in [0, 1]", lambda v: 0 <= v <= 1),
    "num_hard": ("be >= 1", lambda v: v >= 1),
}


def check_hyperparameters(where: str = "", **values: float | Tensor | None) -> None:
    """Raise a ValueError naming the first value outside its domain in `HYPERPARAMETER_DOMAINS` (None: not set)."""
    for name, value in values.items():
        description, holds = HYPERPARAMETER_DOMAINS[name]
        if value is not None and not holds(value):
            raise ValueError(f"{where}{name} must {description}, got {float(value) if isinstance(value, Tensor) else value}")


def _check_shape(name: str, tensor: Tensor, *expected: int | None) -> None:
    """Raise unless ``tensor`` has ``len(expected)`` dims whose sizes match every non-None entry."""
    if tensor.ndim != len(expected) or any(e is not None and s != e for s, e in zip(tensor.shape, expected)):
        wanted = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name} must have shape ({wanted}), got {tuple(tensor.shape)}")


def _check_query_key_bank(query: Tensor, key: Tensor, bank: Tensor, key_name="key", bank_name="queue") -> None:
    _check_shape("query", query, None, None)
    _check_shape(key_name, key, *query.shape)
    _check_shape(bank_name, bank, None, query.shape[1])


def _host_reads_are_free(tensor: Tensor) -> bool:
    """Whether checks of a tensor's values run: on CPU tensors only. On an accelerator reading a value on the
    host stalls the step until the device has caught up (issue 11); the values checked here come from the
    DataModules, which check labels when they are built, and from the methods' own buffers."""
    return tensor.device.type == "cpu"


def _check_labels(name: str, labels: Tensor, length: int, num_classes: int | None = None) -> None:
    _check_shape(name, labels, length)
    if labels.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor, got {labels.dtype}")
    if num_classes is not None and labels.numel() > 0 and _host_reads_are_free(labels):
        outside = (labels < 0) | (labels >= num_classes)
        if outside.any():
            raise ValueError(f"{name} must lie in [0, {num_classes}), got {labels[outside][0].item()}")


# --- shared math ----------------------------------------------------------------------------------------


def _log(value: float) -> float:
    """log that maps a zero weight to -inf, so ``k1 = 0`` or ``gamma = 0`` removes a denominator term exactly."""
    return math.log(value) if value > 0 else -math.inf


def _not_self(rows: int, cols: int, device: torch.device) -> Tensor:
    """False at (r, r): anchor r is also column r of the contrast set and never its own contrast."""
    return ~torch.eye(rows, cols, dtype=torch.bool, device=device)


def _masked_logsumexp(logits: Tensor, mask: Tensor) -> Tensor:
    """Row-wise log of the sum of exp(logits) over ``mask``; -inf for an empty row."""
    return logits.masked_fill(~mask, -math.inf).logsumexp(dim=1)


def _soft_cross_entropy(log_prob: Tensor, weights: Tensor) -> Tensor:
    """Per row, -sum_j w_j log p_j / sum_j w_j; a row without weight gives 0 (SupCon's post-2023 guard)."""
    total = weights.sum(dim=1)
    return -(weights * log_prob).sum(dim=1) / torch.where(total > 0, total, torch.ones_like(total))


def _positive_nll(positive_logit: Tensor, negative_logits: Tensor) -> Tensor:
    """Per row, -log softmax of the positive logit against [positive, negatives] (no (B, 1+K) copy)."""
    return torch.logaddexp(positive_logit, negative_logits.logsumexp(dim=1)) - positive_logit


def _multiview_similarities(features: Tensor, labels: Tensor | None, num_anchors: int):
    """SupCon's layout: flatten (B, V, D) view-major; anchors are the first ``num_anchors`` rows.

    Returns the anchor-contrast cosine similarities, the positives mask (same label, self excluded) and
    the not-self mask, all of shape (num_anchors, V*B).
    """
    batch, views, dim = features.shape
    contrast = features.transpose(0, 1).reshape(views * batch, dim)
    if labels is None:  # instance discrimination: the other views of the same image are the positives
        labels = torch.arange(batch, device=features.device)
    contrast_labels = labels.repeat(views)
    not_self = _not_self(num_anchors, views * batch, features.device)
    positive = (contrast_labels[:num_anchors, None] == contrast_labels[None, :]) & not_self
    return contrast[:num_anchors] @ contrast.T, positive, not_self


def _check_multiview(features: Tensor, labels: Tensor | None, temperature: float) -> None:
    _check_shape("features", features, None, None, None)
    if labels is not None:
        _check_labels("labels", labels, features.shape[0])
    check_hyperparameters(temperature=temperature)


# --- losses ---------------------------------------------------------------------------------------------


@_float32
def info_nce(query: Tensor, key: Tensor, queue: Tensor, temperature: float) -> Tensor:
    """MoCo v2 InfoNCE: cross-entropy of ``[q.k, q.queue] / T`` with the positive in column 0 (moco builder.py)."""
    _check_query_key_bank(query, key, queue)
    check_hyperparameters(temperature=temperature)
    positive = (query * key).sum(dim=1) / temperature
    return _positive_nll(positive, query @ queue.T / temperature).mean()


@_float32
def nt_xent(z1: Tensor, z2: Tensor, temperature: float) -> Tensor:
    """SimCLR NT-Xent, mean over the 2B anchors; self-similarity is masked before the softmax.

    Note: SimCLR's official ``add_contrastive_loss`` sums the two directions, i.e. returns 2x this mean.
    """
    _check_shape("z1", z1, None, None)
    _check_shape("z2", z2, *z1.shape)
    check_hyperparameters(temperature=temperature)
    z = torch.cat([z1, z2])
    logits = z @ z.T / temperature
    log_prob = logits - _masked_logsumexp(logits, _not_self(len(z), len(z), z.device))[:, None]
    other_view = torch.arange(len(z), device=z.device).roll(len(z1))  # row i pairs with row i +- B
    return -log_prob.gather(1, other_view[:, None]).mean()


@_float32
def ressl_loss(query: Tensor, key: Tensor, queue: Tensor, temperature: float, temperature_momentum: float) -> Tensor:
    """ReSSL: cross-entropy between the detached softmax(k.queue / T_m) and log_softmax(q.queue / T).

    The positive is not among the candidates (official ReSSL); T = 0.1, T_m = 0.04 in the paper.
    """
    _check_query_key_bank(query, key, queue)
    check_hyperparameters(temperature=temperature, temperature_momentum=temperature_momentum)
    with torch.no_grad():
        target = (key @ queue.T / temperature_momentum).softmax(dim=1)
    log_prob = (query @ queue.T / temperature).log_softmax(dim=1)
    return _soft_cross_entropy(log_prob, target).mean()


@_float32
def sce_loss(
    query: Tensor,
    key: Tensor,
    queue: Tensor,
    temperature: float,
    temperature_momentum: float,
    coeff: float,
    mask_positive_target: bool = False,
) -> Tensor:
    """SCE (Denize et al., WACV 2023), queue form of eztorch ``compute_sce_loss`` / the seed's Algorithm 1.

    Online logits ``[q.k, q.queue] / T``; detached target
    ``coeff * one_hot(0) + (1 - coeff) * softmax([0, k.queue] / T_m)``. The positive's target logit is 0
    as in the official code, or -inf with ``mask_positive_target=True``, the form of the seed's
    Proposition 1 (then the loss is coeff * InfoNCE + (1 - coeff) * (ReSSL + Ceil)).
    """
    _check_query_key_bank(query, key, queue)
    check_hyperparameters(temperature=temperature, temperature_momentum=temperature_momentum, coeff=coeff)
    positive = (query * key).sum(dim=1, keepdim=True)
    log_prob = (torch.cat([positive, query @ queue.T], dim=1) / temperature).log_softmax(dim=1)
    with torch.no_grad():
        queue_logits = key @ queue.T / temperature_momentum
        positive_slot = torch.full_like(queue_logits[:, :1], -math.inf if mask_positive_target else 0.0)
        target = (1 - coeff) * torch.cat([positive_slot, queue_logits], dim=1).softmax(dim=1)
        target[:, 0] += coeff
    return _soft_cross_entropy(log_prob, target).mean()


@_float32
def supcon_loss(
    features: Tensor,
    labels: Tensor | None = None,
    temperature: float = 0.07,
    base_temperature: float = 0.07,
    contrast_mode: str = "all",
) -> Tensor:
    """SupCon L_out exactly as HobbitLong/SupContrast ``SupConLoss`` (post-2023 NaN fix).

    ``features`` is (B, V, D), flattened view-major; ``contrast_mode="one"`` uses only view 0 as anchors.
    Positives stay in the denominator; the loss is scaled by ``temperature / base_temperature``;
    ``labels=None`` is SimCLR. An anchor without a positive contributes 0 and still counts in the mean.
    """
    _check_multiview(features, labels, temperature)
    check_hyperparameters(base_temperature=base_temperature)
    if contrast_mode not in ("all", "one"):
        raise ValueError(f"contrast_mode must be 'all' or 'one', got {contrast_mode!r}")
    batch, views, _ = features.shape
    num_anchors = batch if contrast_mode == "one" else batch * views
    similarity, positive, not_self = _multiview_similarities(features, labels, num_anchors)
    logits = similarity / temperature
    log_prob = logits - _masked_logsumexp(logits, not_self)[:, None]
    per_anchor = _soft_cross_entropy(log_prob, positive.to(logits.dtype))
    return temperature / base_temperature * per_anchor.mean()


@_float32
def tcl_loss(
    features: Tensor,
    labels: Tensor | None = None,
    temperature: float = 0.1,
    k1: float = 5000.0,
    k2: float = 1.0,
) -> Tensor:
    """TCL (Animesh & Chandraker, WACV 2025), supplement Eq. (6), computed row-wise per anchor.

    Denominator ``sum_P e^{s/T} + k1 sum_P e^{-s} + k2 sum_N e^{s/T}`` (the k1 term has no temperature),
    evaluated in log space; mean over all V*B anchors; same (B, V, D) layout as :func:`supcon_loss`, and
    ``labels=None`` is the self-supervised variant. The official code divides column-wise, which gives the
    same mean; an anchor without a positive contributes 0 (the official code gives NaN).
    """
    _check_multiview(features, labels, temperature)
    check_hyperparameters(k1=k1, k2=k2)
    batch, views, _ = features.shape
    similarity, positive, not_self = _multiview_similarities(features, labels, batch * views)
    logits = similarity / temperature
    # sum_P e^{s/T} + k2 sum_N e^{s/T} as one masked logsumexp with a log(k2) offset on the negatives
    weighted = torch.where(positive, logits, logits + _log(k2))
    log_denominator = torch.logaddexp(
        _masked_logsumexp(weighted, not_self), _log(k1) + _masked_logsumexp(-similarity, positive)
    )
    log_prob = logits - log_denominator[:, None]
    return _soft_cross_entropy(log_prob, positive.to(logits.dtype)).mean()


@_float32
def paco_loss(
    query: Tensor,
    key: Tensor,
    queue: Tensor,
    labels: Tensor,
    queue_labels: Tensor,
    center_logits: Tensor | None,
    alpha: float,
    temperature: float,
    beta: float = 1.0,
    gamma: float = 1.0,
    class_prior: Tensor | None = None,
    anchor_weights: Tensor | None = None,
) -> Tensor:
    """PaCo as ``PaCoLoss`` of dvlab-research/Parametric-Contrastive-Learning (PaCo/LT/losses.py) computes it.

    Anchors are the queries; the contrast set is ``[queries, keys, queue]`` minus the anchor itself, so the
    anchor's own key is always a positive. ``center_logits`` (B, C) come from the unnormalised backbone
    feature and are not divided by T; ``log(class_prior + 1e-9)`` is added when a prior is given (balanced
    softmax; ``class_prior`` are class frequencies summing to 1). Weight beta on the own centre, alpha on
    each positive, gamma on the contrast terms of the denominator; each anchor's loss is divided by
    ``beta + alpha |P(i)|`` (the paper's Eq. 4 omits this normalisation).

    Without centres (``center_logits=None``) this is the supervised contrast of the queries against
    ``[queries, keys, queue]``, the mean of -log p over each anchor's positives (the contrastive term of
    the seed's multi-task baselines, Table 13); ``anchor_weights`` (B,) then weighs each anchor's loss in
    the batch mean, e.g. by the class-balanced weight of its class (Cui et al. 2019).
    """
    _check_query_key_bank(query, key, queue)
    batch = len(query)
    num_classes = None if center_logits is None else center_logits.shape[-1]
    if center_logits is not None:
        _check_shape("center_logits", center_logits, batch, None)
    elif class_prior is not None:
        raise ValueError("class_prior adjusts centre logits: it needs center_logits")
    _check_labels("labels", labels, batch, num_classes)
    _check_labels("queue_labels", queue_labels, len(queue), num_classes)
    check_hyperparameters(temperature=temperature, alpha=alpha, beta=beta, gamma=gamma)
    if class_prior is not None:
        _check_shape("class_prior", class_prior, num_classes)
        if _host_reads_are_free(class_prior) and abs(class_prior.sum().item() - 1) > 1e-3:
            raise ValueError(f"class_prior must sum to 1 (class frequencies), got {class_prior.sum().item():.4g}")
        center_logits = center_logits + torch.log(class_prior + 1e-9)
    if anchor_weights is not None:
        _check_shape("anchor_weights", anchor_weights, batch)

    contrast = torch.cat([query, key, queue])
    not_self = _not_self(batch, len(contrast), query.device)
    positive = (labels[:, None] == torch.cat([labels, labels, queue_labels])[None, :]) & not_self
    contrast_logits = query @ contrast.T / temperature
    log_contrast_sum = _log(gamma) + _masked_logsumexp(contrast_logits, not_self)
    if center_logits is None:
        log_prob = contrast_logits - log_contrast_sum[:, None]
        weights = positive.to(log_prob.dtype)
    else:
        log_denominator = torch.logaddexp(center_logits.logsumexp(dim=1), log_contrast_sum)
        log_prob = torch.cat([center_logits, contrast_logits], dim=1) - log_denominator[:, None]
        own_center = (labels[:, None] == torch.arange(num_classes, device=labels.device)).to(log_prob.dtype)  # one_hot reads the labels' range on the host
        weights = torch.cat([beta * own_center, alpha * positive.to(log_prob.dtype)], dim=1)
    per_anchor = _soft_cross_entropy(log_prob, weights)
    return per_anchor.mean() if anchor_weights is None else (per_anchor * anchor_weights).mean()


@_float32
def jcl_loss(query: Tensor, keys: Tensor, queue: Tensor, temperature: float, lam: float) -> Tensor:
    """JCL (Cai et al., NeurIPS 2020), Eq. (S.3) of the supplement.

    ``keys`` (B, M, D) are the M positive keys of each query; mu is their mean (not re-normalised) and
    Sigma their biased (1/M) covariance. Per anchor:
    ``log[exp(q.mu/T + lam/(2T^2) q'Sigma q) + sum_j exp(q.n_j/T)] - q.mu/T``, which equals the official
    code's ``CE([q.(mu + Sigma' q / 2), q.queue] / T, 0) + q'Sigma' q / (2T)`` with ``Sigma' = lam Sigma / T``
    (``lam`` is the code's ``jcl_lambda`` after its per-epoch ramp). ``q'Sigma q`` is computed as the mean
    squared projection of the centred keys, so the (B, D, D) covariance is never built.
    """
    _check_shape("query", query, None, None)
    _check_shape("keys", keys, len(query), None, query.shape[1])
    _check_shape("queue", queue, None, query.shape[1])
    check_hyperparameters(temperature=temperature, lam=lam)
    mean_key = keys.mean(dim=1)
    spread = ((keys - mean_key[:, None]) @ query[:, :, None]).squeeze(2).pow(2).mean(dim=1)  # q' Sigma q
    quadratic = lam / (2 * temperature**2) * spread
    positive = (query * mean_key).sum(dim=1) / temperature
    return (_positive_nll(positive + quadratic, query @ queue.T / temperature) + quadratic).mean()


@_float32
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
    _check_query_key_bank(query, positive, negatives, key_name="positive", bank_name="negatives")
    check_hyperparameters(temperature=temperature, num_hard=num_hard, log_eps=log_eps)
    negative_logits = query @ negatives.T / temperature
    if exclude is not None:
        columns = exclude.long().view(len(exclude), -1)
        for column in columns.T:
            _check_labels("exclude", column, len(query), len(negatives))
        negative_logits = negative_logits.scatter(1, columns, -math.inf)
    if num_hard is not None and num_hard < negative_logits.shape[1]:
        negative_logits = negative_logits.topk(num_hard, dim=1).values
    positive_logit = (query * positive).sum(dim=1) / temperature
    nll = _positive_nll(positive_logit, negative_logits)
    if log_eps > 0:  # -log(p + eps) = -logaddexp(log p, log eps), without forming p
        nll = -torch.logaddexp(-nll, torch.full_like(nll, math.log(log_eps)))
    return nll.mean()
