"""Clustering and self-distillation: SwAV's Sinkhorn-Knopp codes and swapped prediction (Caron et al., NeurIPS 2020)
and DINO's cross-entropy between a centred, sharpened teacher and the student (Caron et al., ICCV 2021).

Crops come stacked: `(V, B, K)` holds the scores (or logits) of V crops of the same B images over K prototypes,
the global crops first, in the order of the official multi-crop code.
"""

import torch
from torch import Tensor

from methods.losses.common import check_hyperparameters, check_shape, float32_math


@torch.no_grad()
@float32_math
def sinkhorn_knopp(scores: Tensor, epsilon: float = 0.05, iterations: int = 3) -> Tensor:
    """SwAV's codes (Sec. 3.1, Eq. 3): the transport plan Q of exp(scores / epsilon) whose prototype (column) sums
    are uniform, B / K each, and whose sample (row) sums are 1, approached by `iterations` alternate normalisations
    starting with the prototypes (facebookresearch/swav main_swav.py `distributed_sinkhorn`, over every sample of
    the global batch and the queue in `scores` (B x K)). The rows sum to 1 exactly, the columns to B / K up to the
    iterations. The largest score is subtracted before the exponential (a factor that every normalisation
    divides out): exp(1 / 0.05) would overflow a half-precision float."""
    check_shape("scores", scores, None, None)
    check_hyperparameters(epsilon=epsilon, sinkhorn_iterations=iterations)
    plan = torch.exp((scores - scores.max()) / epsilon)
    plan = plan / plan.sum()
    samples, prototypes = plan.shape
    for _ in range(iterations):
        plan = plan / (plan.sum(dim=0, keepdim=True) * prototypes)
        plan = plan / (plan.sum(dim=1, keepdim=True) * samples)
    return plan * samples


def crop_pair_mean(targets: Tensor, log_probs: Tensor) -> Tensor:
    """The mean, over every pair (target crop t, other crop v != t), of the batch mean of -sum_k target_t log p_v:
    targets (T, B, K) are those of the first T crops of log_probs (V, B, K)."""
    count, batch, crops = targets.shape[0], targets.shape[1], log_probs.shape[0]
    cross = -torch.einsum("tbk,vbk->tv", targets, log_probs) / batch  # (T, V): the batch-mean cross-entropies
    # the same-crop pairs are the diagonal (t, t); no boolean mask, whose selection the host would have to read
    return (cross.sum() - cross.diagonal().sum()) / (count * (crops - 1))


def check_crops(student_name: str, student: Tensor, target_name: str, targets: Tensor) -> None:
    check_shape(student_name, student, None, None, None)
    check_shape(target_name, targets, None, *student.shape[1:])
    if student.shape[0] < 2 or not 1 <= targets.shape[0] <= student.shape[0]:
        raise ValueError(f"{student_name} must hold at least 2 crops and {target_name} 1 to as many, got {student.shape[0]} and {targets.shape[0]}")


@float32_math
def swav_loss(scores: Tensor, codes: Tensor, temperature: float = 0.1) -> Tensor:
    """SwAV's swapped prediction (Eq. 1-2): the codes of each of the first A crops (`codes`, A x B x K, from
    `sinkhorn_knopp`, no gradient) are predicted by softmax(scores / temperature) of every other crop of `scores`
    (V x B x K, the cosine scores of all crops against the normalised prototypes); the mean over the A (V - 1) pairs
    (facebookresearch/swav main_swav.py, temperature 0.1)."""
    check_crops("scores", scores, "codes", codes)
    check_hyperparameters(temperature=temperature)
    return crop_pair_mean(codes.detach(), (scores / temperature).log_softmax(dim=-1))


@float32_math
def dino_loss(
    student: Tensor, teacher: Tensor, center: Tensor, student_temperature: float = 0.1, teacher_temperature: float = 0.04
) -> Tensor:
    """DINO (Eq. 2-3, Algorithm 1): the teacher's distribution softmax((t - center) / teacher_temperature) of each
    global crop (`teacher`, G x B x K, centred and sharpened, no gradient) is the target of the student's
    softmax(s / student_temperature) of every other crop (`student`, V x B x K, the global crops first); the mean over
    the G (V - 1) pairs (facebookresearch/dino main_dino.py `DINOLoss`, student temperature 0.1)."""
    check_crops("student", student, "teacher", teacher)
    check_shape("center", center, 1, student.shape[-1])
    check_hyperparameters(student_temperature=student_temperature, teacher_temperature=teacher_temperature)
    targets = ((teacher - center) / teacher_temperature).softmax(dim=-1).detach()
    return crop_pair_mean(targets, (student / student_temperature).log_softmax(dim=-1))
