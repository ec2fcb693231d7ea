"""What every loss of the library shares: float32 (or float64) math outside autocast, the domain of each scalar
hyper-parameter, the checks of shapes and labels, and small numerically stable pieces."""

import functools
import math

import torch
from torch import Tensor

from engine import devices


def float32_math(loss_fn):
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
POSITIVE, NONNEGATIVE = ("be > 0", lambda v: v > 0), ("be >= 0", lambda v: v >= 0)
HYPERPARAMETER_DOMAINS = {
    **dict.fromkeys(("temperature", "temperature_momentum", "base_temperature"), POSITIVE),
    **dict.fromkeys(("k1", "k2", "alpha", "beta", "gamma", "lam", "log_eps"), NONNEGATIVE),
    "jcl_lambda": NONNEGATIVE,  # JCL's lambda as its method names it (`lam` of `jcl_loss`)
    "coeff": ("lie in [0, 1]", lambda v: 0 <= v <= 1),
    "num_hard": ("be >= 1", lambda v: v >= 1),
    # Barlow Twins, VICReg (methods/losses/redundancy.py); SwAV, DINO (methods/losses/clustering.py)
    **dict.fromkeys(("off_diagonal_weight", "invariance_weight", "variance_weight", "covariance_weight"), NONNEGATIVE),
    **dict.fromkeys(("loss_scale", "epsilon", "student_temperature", "teacher_temperature"), POSITIVE),
    "sinkhorn_iterations": ("be >= 1", lambda v: v >= 1),
    "center_momentum": ("lie in [0, 1]", lambda v: 0 <= v <= 1),
}


def check_hyperparameters(where: str = "", **values: float | Tensor | None) -> None:
    """Raise a ValueError naming the first value outside its domain in `HYPERPARAMETER_DOMAINS` (None: not set)."""
    for name, value in values.items():
        if name not in HYPERPARAMETER_DOMAINS:
            raise ValueError(f"{where}{name} has no domain in HYPERPARAMETER_DOMAINS (methods/losses/common.py): add one, or check it in __init__")
        description, holds = HYPERPARAMETER_DOMAINS[name]
        if value is not None and not holds(value):
            raise ValueError(f"{where}{name} must {description}, got {float(value) if isinstance(value, Tensor) else value}")


def check_shape(name: str, tensor: Tensor, *expected: int | None) -> None:
    """Raise unless ``tensor`` has ``len(expected)`` dims whose sizes match every non-None entry."""
    if tensor.ndim != len(expected) or any(e is not None and s != e for s, e in zip(tensor.shape, expected)):
        wanted = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{name} must have shape ({wanted}), got {tuple(tensor.shape)}")


def check_query_key_bank(query: Tensor, key: Tensor, bank: Tensor, key_name="key", bank_name="queue") -> None:
    check_shape("query", query, None, None)
    check_shape(key_name, key, *query.shape)
    check_shape(bank_name, bank, None, query.shape[1])


def check_labels(name: str, labels: Tensor, length: int, num_classes: int | None = None) -> None:
    check_shape(name, labels, length)
    if labels.is_floating_point():
        raise ValueError(f"{name} must be an integer tensor, got {labels.dtype}")
    if num_classes is not None and labels.numel() > 0 and devices.host_reads_are_free(labels):
        outside = (labels < 0) | (labels >= num_classes)
        if outside.any():
            raise ValueError(f"{name} must lie in [0, {num_classes}), got {labels[outside][0].item()}")


def log_weight(value: float) -> float:
    """log that maps a zero weight to -inf, so ``k1 = 0`` or ``gamma = 0`` removes a denominator term exactly."""
    return math.log(value) if value > 0 else -math.inf


def off_diagonal(rows: int, cols: int, device: torch.device) -> Tensor:
    """False at (r, r): anchor r is also column r of the contrast set and never its own contrast."""
    return ~torch.eye(rows, cols, dtype=torch.bool, device=device)


def masked_logsumexp(logits: Tensor, mask: Tensor) -> Tensor:
    """Row-wise log of the sum of exp(logits) over ``mask``; -inf for an empty row."""
    return logits.masked_fill(~mask, -math.inf).logsumexp(dim=1)


def soft_cross_entropy(log_prob: Tensor, weights: Tensor) -> Tensor:
    """Per row, -sum_j w_j log p_j / sum_j w_j; a row without weight gives 0 (SupCon's post-2023 guard)."""
    total = weights.sum(dim=1)
    return -(weights * log_prob).sum(dim=1) / torch.where(total > 0, total, torch.ones_like(total))


def positive_nll(positive_logit: Tensor, negative_logits: Tensor) -> Tensor:
    """Per row, -log softmax of the positive logit against [positive, negatives] (no (B, 1+K) copy)."""
    return torch.logaddexp(positive_logit, negative_logits.logsumexp(dim=1)) - positive_logit
