"""Losses with labels: SupCon's single masked loss over V views per image, TCL's bounded variant, and PaCo's contrast
with learnable class centres; and, in SupCon's layout with the image as the label, SimCLR's loss over V crops."""

import torch
from torch import Tensor

from engine import devices
from methods.losses.common import (
    check_hyperparameters,
    check_labels,
    check_query_key_bank,
    check_shape,
    float32_math,
    log_weight,
    masked_logsumexp,
    off_diagonal,
    soft_cross_entropy,
)


def multiview_similarities(features: Tensor, labels: Tensor | None, num_anchors: int):
    """SupCon's layout: flatten (B, V, D) view-major; anchors are the first ``num_anchors`` rows.

    Returns the anchor-contrast cosine similarities, the positives mask (same label, self excluded) and
    the not-self mask, all of shape (num_anchors, V*B).
    """
    batch, views, dim = features.shape
    contrast = features.transpose(0, 1).reshape(views * batch, dim)
    if labels is None:  # instance discrimination: the other views of the same image are the positives
        labels = torch.arange(batch, device=features.device)
    contrast_labels = labels.repeat(views)
    not_self = off_diagonal(num_anchors, views * batch, features.device)
    positive = (contrast_labels[:num_anchors, None] == contrast_labels[None, :]) & not_self
    return contrast[:num_anchors] @ contrast.T, positive, not_self


def check_multiview(features: Tensor, labels: Tensor | None, temperature: float) -> None:
    check_shape("features", features, None, None, None)
    if labels is not None:
        check_labels("labels", labels, features.shape[0])
    check_hyperparameters(temperature=temperature)


@float32_math
def nt_xent_multi_crop(features: Tensor, temperature: float) -> Tensor:
    """SimCLR's NT-Xent over the V crops of each image, (B, V, D): the other crops of an anchor's image are its
    positives, summed inside the log, ``-log(sum_pos e^{s/T} / sum_{a != anchor} e^{s/T})``, mean over the V·B anchors
    (vturrisi/solo-learn solo/losses/simclr.py, its multi-crop SimCLR; SupCon's L_in with the image as the label,
    Khosla et al. Eq. 3). With two crops it is `nt_xent`."""
    check_multiview(features, None, temperature)
    similarity, positive, not_self = multiview_similarities(features, None, features.shape[0] * features.shape[1])
    logits = similarity / temperature
    return (masked_logsumexp(logits, not_self) - masked_logsumexp(logits, positive)).mean()


@float32_math
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
    check_multiview(features, labels, temperature)
    check_hyperparameters(base_temperature=base_temperature)
    if contrast_mode not in ("all", "one"):
        raise ValueError(f"contrast_mode must be 'all' or 'one', got {contrast_mode!r}")
    batch, views, _ = features.shape
    num_anchors = batch if contrast_mode == "one" else batch * views
    similarity, positive, not_self = multiview_similarities(features, labels, num_anchors)
    logits = similarity / temperature
    log_prob = logits - masked_logsumexp(logits, not_self)[:, None]
    per_anchor = soft_cross_entropy(log_prob, positive.to(logits.dtype))
    return temperature / base_temperature * per_anchor.mean()


@float32_math
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
    check_multiview(features, labels, temperature)
    check_hyperparameters(k1=k1, k2=k2)
    batch, views, _ = features.shape
    similarity, positive, not_self = multiview_similarities(features, labels, batch * views)
    logits = similarity / temperature
    # sum_P e^{s/T} + k2 sum_N e^{s/T} as one masked logsumexp with a log(k2) offset on the negatives
    weighted = torch.where(positive, logits, logits + log_weight(k2))
    log_denominator = torch.logaddexp(
        masked_logsumexp(weighted, not_self), log_weight(k1) + masked_logsumexp(-similarity, positive)
    )
    log_prob = logits - log_denominator[:, None]
    return soft_cross_entropy(log_prob, positive.to(logits.dtype)).mean()


@float32_math
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
    the multi-task baselines of PaCo supplementary, Table 13); ``anchor_weights`` (B,) then weighs each
    anchor's loss in the batch mean, e.g. by the class-balanced weight of its class (Cui et al. 2019).
    """
    check_query_key_bank(query, key, queue)
    batch = len(query)
    num_classes = None if center_logits is None else center_logits.shape[-1]
    if center_logits is not None:
        check_shape("center_logits", center_logits, batch, None)
    elif class_prior is not None:
        raise ValueError("class_prior adjusts centre logits: it needs center_logits")
    check_labels("labels", labels, batch, num_classes)
    check_labels("queue_labels", queue_labels, len(queue), num_classes)
    check_hyperparameters(temperature=temperature, alpha=alpha, beta=beta, gamma=gamma)
    if class_prior is not None:
        check_shape("class_prior", class_prior, num_classes)
        if devices.host_reads_are_free(class_prior) and abs(class_prior.sum().item() - 1) > 1e-3:
            raise ValueError(f"class_prior must sum to 1 (class frequencies), got {class_prior.sum().item():.4g}")
        center_logits = center_logits + torch.log(class_prior + 1e-9)
    if anchor_weights is not None:
        check_shape("anchor_weights", anchor_weights, batch)

    contrast = torch.cat([query, key, queue])
    not_self = off_diagonal(batch, len(contrast), query.device)
    positive = (labels[:, None] == torch.cat([labels, labels, queue_labels])[None, :]) & not_self
    contrast_logits = query @ contrast.T / temperature
    log_contrast_sum = log_weight(gamma) + masked_logsumexp(contrast_logits, not_self)
    if center_logits is None:
        log_prob = contrast_logits - log_contrast_sum[:, None]
        weights = positive.to(log_prob.dtype)
    else:
        log_denominator = torch.logaddexp(center_logits.logsumexp(dim=1), log_contrast_sum)
        log_prob = torch.cat([center_logits, contrast_logits], dim=1) - log_denominator[:, None]
        own_center = (labels[:, None] == torch.arange(num_classes, device=labels.device)).to(log_prob.dtype)  # one_hot reads the labels' range on the host
        weights = torch.cat([beta * own_center, alpha * positive.to(log_prob.dtype)], dim=1)
    per_anchor = soft_cross_entropy(log_prob, weights)
    return per_anchor.mean() if anchor_weights is None else (per_anchor * anchor_weights).mean()
