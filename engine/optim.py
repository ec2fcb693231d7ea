"""Optimizers (SGD, LARS from `engine.lars`, AdamW), parameter groups and the per-step learning-rate schedule.

Configured from YAML through two dataclasses, e.g. SCE's small-dataset recipe:

    optimizer: {name: sgd, lr: 0.06, lr_scaling: linear, weight_decay: 5.0e-4, momentum: 0.9}
    schedule: {warmup_epochs: 5, decay: cosine}

`lr` is the learning rate for 256 images when `lr_scaling` is `linear` or `sqrt` (scaled by the
global batch size, as the papers state it) and the learning rate itself when it is `none`.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal

import torch
from torch.optim import Optimizer

from engine.compat import count_training_batches
from engine.config import check_choices
from engine.lars import LARS


@dataclass
class OptimizerSpec:
    name: Literal["sgd", "lars", "adamw"] = "sgd"
    lr: float = 0.03
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    weight_decay: float = 1e-4
    momentum: float = 0.9  # SGD and LARS
    nesterov: bool = False  # SGD
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW
    trust_coefficient: float = 0.001  # LARS eta
    # LARS's trust ratio eta ||p|| / ||g + wd p|| (`update_norm`, SCE/BYOL) or eta ||p|| / (||g|| + wd ||p||)
    # (`norm_sum`, solo-learn's solo/utils/lars.py, from pl_bolts); `lars_clip_lr` divides the ratio by the lr
    # and caps it at 1 (solo-learn's clip_lr), so a layer's step rate is min(ratio, lr).
    lars_trust_denominator: Literal["update_norm", "norm_sum"] = "update_norm"
    lars_clip_lr: bool = False
    # LARS's learning rate inside the momentum (v = m v + lr trust (g + wd p), p -= v: google-research/simclr
    # lars_optimizer.py `classic_momentum`, its default) instead of after it (p -= lr v: SCE, BYOL, solo-learn);
    # the two differ only while the lr changes (warm-up, decay).
    lars_lr_in_momentum: bool = False
    # No weight decay, and no LARS adaptation, for biases and normalisation parameters (ndim <= 1). Off by
    # default, as torch's optimizers and the official runs that build `SGD(model.parameters(), ...)`
    # (MoCo, PaCo, SupCon); each config states its grouping in its header (tests/test_configs.py).
    exclude_bias_and_norm: bool = False
    # One kernel per step for all parameters (torch's fused SGD / AdamW): None uses it where every parameter is on a
    # CUDA device and nothing clips (LARS is always multi-tensor, `torch._foreach_*`), true asks for it anywhere. A fused
    # step unscales 16-mixed gradients itself (MixedPrecision.optimizer_step): a clip before it would cut scaled norms.
    fused: bool | None = None
    # Modules (top-level names, e.g. `predictor`) whose parameters keep the peak learning rate: their groups carry
    # `fixed_lr` and the schedule leaves them alone (SimSiam's --fix-pred-lr, facebookresearch/simsiam main_simsiam.py).
    fixed_lr_modules: list[str] = field(default_factory=list)
    # The learning rate of the biases and normalisation parameters (with `exclude_bias_and_norm`) as a fraction of the
    # others': Barlow Twins' 0.0048 / 0.2 = 0.024 (facebookresearch/barlowtwins main.py --learning-rate-biases/-weights).
    bias_and_norm_lr_ratio: float = 1.0
    # Weight decay from `weight_decay` to `weight_decay_end` by a per-step cosine over the run, on the decayed groups
    # (DINO's 0.04 -> 0.4, facebookresearch/dino main_dino.py: `cosine_scheduler(weight_decay, weight_decay_end)`,
    # set on its first, regularised group each iteration); None keeps it constant.
    weight_decay_end: float | None = None
    # Each parameter's gradient rescaled to this L2 norm where it is larger, tensor by tensor (DINO's 3.0,
    # facebookresearch/dino utils.py `clip_gradients`), not over the global norm as trainer.gradient_clip_val; None: off.
    clip_grad_per_parameter: float | None = None

    def __post_init__(self):
        check_choices(self, "optimizer")
        # the values as configured: torch would name the scaled learning rate, a number the user never wrote
        for name in ("lr", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"optimizer.{name} must be >= 0, got {getattr(self, name):g}")
        for name, value in (("momentum", self.momentum), ("betas", self.betas[0]), ("betas", self.betas[1])):
            if not 0 <= value < 1:
                raise ValueError(f"optimizer.{name} must lie in [0, 1), got {getattr(self, name)}")
        if not self.trust_coefficient > 0:
            raise ValueError(f"optimizer.trust_coefficient must be > 0, got {self.trust_coefficient:g}")
        if self.nesterov and (self.name != "sgd" or self.momentum == 0):  # torch's SGD refuses it without momentum, LARS and AdamW have none
            raise ValueError(f"optimizer.nesterov: true needs name: sgd with momentum > 0, got name {self.name} with momentum {self.momentum:g}")
        if self.fused and self.name == "lars":
            raise ValueError("optimizer.fused: true, but LARS has no fused kernel (it runs multi-tensor); set optimizer.fused: null")
        if self.fused and self.clip_grad_per_parameter is not None:
            raise ValueError("optimizer.fused: true with optimizer.clip_grad_per_parameter: a fused step unscales 16-mixed gradients "
                             "itself, after the clip would have cut their loss-scaled norms; set optimizer.fused: null")
        if self.bias_and_norm_lr_ratio != 1.0 and not (self.exclude_bias_and_norm and self.bias_and_norm_lr_ratio > 0):
            raise ValueError(f"optimizer.bias_and_norm_lr_ratio {self.bias_and_norm_lr_ratio:g} needs exclude_bias_and_norm: true and a value > 0")
        if self.weight_decay_end is not None and not (self.weight_decay_end >= 0 and self.weight_decay > 0):
            raise ValueError(f"optimizer.weight_decay_end {self.weight_decay_end:g} needs a value >= 0 and optimizer.weight_decay > 0")
        if self.clip_grad_per_parameter is not None and not self.clip_grad_per_parameter > 0:
            raise ValueError(f"optimizer.clip_grad_per_parameter must be > 0, got {self.clip_grad_per_parameter:g}")

    def batch_scale(self, global_batch_size: int) -> float:
        """The factor `lr_scaling` applies to a learning rate given for a batch of 256."""
        ratio = global_batch_size / 256
        return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling]

    def effective_lr(self, global_batch_size: int) -> float:
        return self.lr * self.batch_scale(global_batch_size)


WarmupShape = Literal["(s+1)/W", "s/W", "s/(W-1)"]


@dataclass
class ScheduleSpec:
    warmup_epochs: float = 0.0  # linear warm-up over W = warmup_epochs x steps per epoch steps, of the shape below
    # The factor of the peak lr at warm-up step s (0-based): (s+1)/W from lr / W (PaCo's adjust_learning_rate per
    # epoch, MoCo v2's scripts); s/W from 0 (ReSSL's and SimCLR's official code, BYOL, MoCo v3); s/(W-1) from 0 to
    # the peak at the last warm-up step (eztorch's LinearWarmupCosineAnnealingLR, which SCE's official runs use).
    warmup_shape: WarmupShape = "(s+1)/W"
    # Where the warm-up starts, the same for every scheduled group, to each group's peak in the shape above
    # (vturrisi/solo-learn solo/utils/lr_scheduler.py: warmup_start_lr, 3e-5 in solo/methods/base.py, for every group):
    # the first step's lr under s/W and s/(W-1) (solo-learn's); under (s+1)/W that step is 1/W of the way. 0: the shape's.
    warmup_start_lr: float = 0.0
    decay: Literal["cosine", "step", "constant"] = "cosine"
    milestones: list[int] = field(default_factory=list)  # epochs at which `step` multiplies by gamma
    gamma: float = 0.1
    final_lr_fraction: float = 0.0  # where cosine ends, as a fraction of the peak lr
    unit: Literal["step", "epoch"] = "step"  # `epoch` holds the lr constant within an epoch (MoCo --cos)
    # The cosine starts this many epochs before the warm-up ends: PaCo's adjust_learning_rate decays with
    # (e - W + 1) / (E - W + 1), i.e. 1 here, so its first epoch after the warm-up is already below the peak.
    cosine_offset_epochs: int = 0
    # The whole schedule runs this many epochs late, holding its first value meanwhile (the cosine keeps its
    # length): TCL's train.py sets the lr after each epoch from the 0-based epoch index, so epoch e trains at
    # the cosine of e - 1 over E epochs and its first two epochs both run at the peak.
    lag_epochs: int = 0

    def __post_init__(self):
        check_choices(self, "schedule")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"schedule.warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"schedule.final_lr_fraction must lie in [0, 1] (of the peak lr), got {self.final_lr_fraction}")
        if not self.gamma > 0:
            raise ValueError(f"schedule.gamma must be > 0, got {self.gamma}")
        if self.warmup_start_lr < 0 or (self.warmup_start_lr > 0 and self.warmup_epochs == 0):
            raise ValueError(f"schedule.warmup_start_lr must be >= 0, and 0 without warmup_epochs, got {self.warmup_start_lr} with warmup_epochs {self.warmup_epochs}")
        if self.unit == "epoch" and not float(self.warmup_epochs).is_integer():  # a warm-up of (e + 1) / W per whole epoch
            raise ValueError(f"schedule.warmup_epochs must be a whole number of epochs with unit: epoch, got {self.warmup_epochs}")
        if not 0 <= self.cosine_offset_epochs <= self.warmup_epochs:
            raise ValueError(f"schedule.cosine_offset_epochs must lie in [0, warmup_epochs = {self.warmup_epochs}], got {self.cosine_offset_epochs}")
        if self.lag_epochs < 0:
            raise ValueError(f"schedule.lag_epochs must be >= 0, got {self.lag_epochs}")


def parameter_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], spec: OptimizerSpec) -> list[dict]:
    """Split trainable parameters into a decayed group and, with `exclude_bias_and_norm`, a group of
    biases and norm parameters (ndim <= 1) without weight decay or LARS adaptation; the parameters of
    `fixed_lr_modules` go into groups of their own, in the same split, marked `fixed_lr`."""
    split = {(fixed, excluded): [] for fixed in (False, True) for excluded in (False, True)}
    used = set()
    for name, param in named_params:
        if not param.requires_grad:
            continue
        module = name.split(".", 1)[0]
        fixed = module in spec.fixed_lr_modules
        used |= {module} if fixed else set()
        split[fixed, spec.exclude_bias_and_norm and param.ndim <= 1].append(param)
    if unused := [module for module in spec.fixed_lr_modules if module not in used]:
        raise ValueError(f"optimizer.fixed_lr_modules names {unused[0]!r}, which holds no trainable parameter of the model")
    groups = [{"params": split[False, False], "weight_decay": spec.weight_decay, "lars_exclude": False}]
    if split[False, True]:
        groups.append({"params": split[False, True], "weight_decay": 0.0, "lars_exclude": True} | lr_ratio(spec.bias_and_norm_lr_ratio))
    for excluded in (False, True):
        if split[True, excluded]:
            groups.append({"params": split[True, excluded], "weight_decay": 0.0 if excluded else spec.weight_decay,
                           "lars_exclude": excluded, "fixed_lr": True} | (lr_ratio(spec.bias_and_norm_lr_ratio) if excluded else {}))
    return groups


def lr_ratio(ratio: float) -> dict:
    """The group key of a learning rate `ratio` times the optimizer's (`with_group_lrs`); none for 1."""
    return {} if ratio == 1.0 else {"lr_ratio": ratio}


def with_group_lrs(groups: list[dict], lr: float, batch_scale: float) -> list[dict]:
    """Each group with an `lr_ratio` gets that fraction of the (scaled) learning rate as its own, and each with a
    `batch_scaled_lr` that learning rate times the batch scale of `optimizer.lr_scaling`."""

    def own_lr(group: dict) -> dict:
        if "lr_ratio" in group:
            return {"lr": lr * group["lr_ratio"]}
        if "batch_scaled_lr" in group:
            return {"lr": group["batch_scaled_lr"] * batch_scale}
        return {}

    return [group | own_lr(group) for group in groups]


def build_optimizer(groups: list[dict], spec: OptimizerSpec, lr: float, clipped: bool = False) -> Optimizer:
    """`spec`'s optimizer; not fused where the trainer clips (`clipped`): Lightning refuses it under mixed precision."""
    if spec.name == "lars":
        return LARS(
            groups, lr=lr, momentum=spec.momentum, trust_coefficient=spec.trust_coefficient,
            trust_denominator=spec.lars_trust_denominator, clip_lr=spec.lars_clip_lr, lr_in_momentum=spec.lars_lr_in_momentum,
        )
    on_cuda = all(param.is_cuda for group in groups for param in group["params"])
    fused = spec.fused if spec.fused is not None else on_cuda and spec.clip_grad_per_parameter is None and not clipped
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=spec.momentum, nesterov=spec.nesterov, fused=fused or None)
    return torch.optim.AdamW(groups, lr=lr, betas=spec.betas, fused=fused or None)


def warmup_factor(step: int, warmup_steps: float, shape: WarmupShape) -> float:
    """The factor of the peak lr at warm-up step `step` (0-based) of `warmup_steps`, in the given shape."""
    if shape == "(s+1)/W":
        return (step + 1) / warmup_steps
    if shape == "s/W":
        return step / warmup_steps
    return step / max(warmup_steps - 1, 1)


def lr_factor(step: int, steps_per_epoch: int, total_steps: int, spec: ScheduleSpec, start_fraction: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based); the warm-up starts at
    `start_fraction` of the peak (`warmup_start_lr` over the group's peak)."""
    step = max(step - spec.lag_epochs * steps_per_epoch, 0)
    if spec.unit == "epoch":
        epoch = step // steps_per_epoch
        if epoch < spec.warmup_epochs:  # the shape over epochs: (e + 1) / W in epoch e, as PaCo's adjust_learning_rate
            return start_fraction + (1.0 - start_fraction) * warmup_factor(epoch, spec.warmup_epochs, spec.warmup_shape)
        step = epoch * steps_per_epoch
    # a warm-up shorter than a step still takes one (solo-learn's scheduler runs its first step at warmup_start_lr)
    warmup_steps = max(round(spec.warmup_epochs * steps_per_epoch), 1) if spec.warmup_epochs > 0 else 0
    if step < warmup_steps:
        return start_fraction + (1.0 - start_fraction) * warmup_factor(step, warmup_steps, spec.warmup_shape)
    if spec.decay == "constant":
        return 1.0
    if spec.decay == "step":
        return spec.gamma ** sum(step >= milestone * steps_per_epoch for milestone in spec.milestones)
    cosine_start = warmup_steps - spec.cosine_offset_epochs * steps_per_epoch
    progress = (step - cosine_start) / max(total_steps - cosine_start, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return spec.final_lr_fraction + (1.0 - spec.final_lr_fraction) * cosine


def schedule_length(trainer) -> int:
    """The optimizer steps the learning-rate and momentum schedules run over: `trainer.max_epochs` epochs. A run's
    `max_steps` (or `max_time`) stops it without changing its schedules, so that a run stopped early and resumed
    with a later stop trains as one that ran to that stop at once; without `max_epochs` (-1), `max_steps` is the
    length."""
    if not math.isfinite(trainer.num_training_batches):
        count_training_batches(trainer)
    stepping_batches = int(trainer.estimated_stepping_batches)
    if trainer.max_steps < 0 or trainer.max_epochs is None or trainer.max_epochs < 0:
        return stepping_batches  # no max_steps: the epochs' steps; no max_epochs: max_steps
    return trainer.max_epochs * math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)  # as Lightning counts them


def optimizer_steps_per_epoch(trainer) -> int:
    """Optimizer steps per epoch as Lightning takes them, an epoch's last short window of accumulated batches included:
    ceil(batches / accumulate_grad_batches), at least 1; 1 for a loader without a length (inf batches)."""
    batches = trainer.num_training_batches
    return max(1, math.ceil(batches / trainer.accumulate_grad_batches)) if math.isfinite(batches) else 1


def configure_optimization(trainer, groups: list[dict], optimizer_spec: OptimizerSpec, schedule_spec: ScheduleSpec) -> dict:
    """The optimizer and per-step LambdaLR in the form `configure_optimizers` returns; the learning
    rate is scaled by the global batch size (per-device batch x processes x accumulation) as
    `optimizer_spec.lr_scaling` says. Groups marked `fixed_lr` are not scheduled."""
    global_batch_size = trainer.datamodule.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    total_steps = schedule_length(trainer)
    steps_per_epoch = optimizer_steps_per_epoch(trainer)
    lr = optimizer_spec.effective_lr(global_batch_size)
    optimizer = build_optimizer(with_group_lrs(groups, lr, optimizer_spec.batch_scale(global_batch_size)), optimizer_spec, lr, bool(trainer.gradient_clip_val))

    def schedule(group: dict) -> Callable[[int], float]:
        if group.get("fixed_lr"):
            return lambda step: 1.0  # a group marked `fixed_lr` keeps the peak learning rate
        start_fraction = schedule_spec.warmup_start_lr / group["lr"] if schedule_spec.warmup_start_lr and group["lr"] else 0.0  # lr 0 stays 0
        return lambda step: lr_factor(step, steps_per_epoch, total_steps, schedule_spec, start_fraction)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [schedule(group) for group in optimizer.param_groups])
    trainer.print(f"learning rate {lr:.6g} for a global batch of {global_batch_size} ({optimizer_spec.lr_scaling} scaling)")
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def weight_decay_at(step: int, total_steps: int, spec: OptimizerSpec) -> float:
    """DINO's cosine weight decay at optimizer step `step` (0-based) of `total_steps`: from `weight_decay` at step 0
    towards `weight_decay_end`, end + (start - end) (1 + cos(pi step / total_steps)) / 2 (facebookresearch/dino
    utils.py `cosine_scheduler` without warm-up: the end value is approached, not reached)."""
    start, end = spec.weight_decay, spec.weight_decay_end
    return end + 0.5 * (start - end) * (1.0 + math.cos(math.pi * min(step, total_steps) / max(total_steps, 1)))


def schedule_weight_decay_(optimizer: Optimizer, step: int, total_steps: int, spec: OptimizerSpec) -> float:
    """Set the scheduled weight decay of step `step` on the groups that decay (those created with a weight decay > 0;
    the biases, normalisation parameters and online probe keep none) and return it."""
    value = weight_decay_at(step, total_steps, spec)
    for group in optimizer.param_groups:
        if group.setdefault("initial_weight_decay", group["weight_decay"]) > 0:
            group["weight_decay"] = value
    return value


@torch.no_grad()
def clip_gradients_per_parameter_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> None:
    """Rescale each gradient whose L2 norm exceeds `max_norm` to norm max_norm / (1 + 1e-6 / norm), tensor by tensor:
    grad *= max_norm / (norm + 1e-6) where that factor is below 1 (facebookresearch/dino utils.py `clip_gradients`)."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if grads:
        factors = (max_norm / (torch.stack(torch._foreach_norm(grads)) + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, list(factors.unbind()))
