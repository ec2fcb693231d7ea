import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from engine.lars import LARS
from engine.config import RampSpec
from engine.optim import (
    OptimizerSpec,
    ScheduleSpec,
    build_optimizer,
    clip_gradients_per_parameter_,
    configure_optimization,
    lr_factor,
    parameter_groups,
    schedule_length,
    schedule_weight_decay_,
    weight_decay_at,
)


def ten_epochs_of_ten_steps(batch_size: int) -> SimpleNamespace:
    """The numbers `configure_optimization` reads of a trainer: one process, 10 epochs of 10 optimizer steps."""
    return SimpleNamespace(datamodule=SimpleNamespace(batch_size=batch_size), world_size=1, accumulate_grad_batches=1, gradient_clip_val=None, max_epochs=10, max_steps=-1,
                           estimated_stepping_batches=100, num_training_batches=10, print=lambda *args: None)


def test_an_epoch_of_5_batches_accumulated_by_2_has_3_optimizer_steps_as_lightning_counts_them():
    """Lightning steps on an epoch's last, short window too: with 149 steps assumed for 150 taken, the warm-up ended, the
    step decays fired and `unit: epoch` changed the lr inside an epoch, one step per epoch early."""
    trainer = SimpleNamespace(datamodule=SimpleNamespace(batch_size=8), world_size=1, accumulate_grad_batches=2, gradient_clip_val=None, max_epochs=2, max_steps=-1,
                              estimated_stepping_batches=6, num_training_batches=5, print=lambda *args: None)
    optimization = configure_optimization(trainer, parameter_groups(nn.Linear(2, 2).named_parameters(), OptimizerSpec()), OptimizerSpec(lr=1.0),
                                          ScheduleSpec(decay="step", milestones=[1], gamma=0.1, unit="epoch"))
    optimizer, scheduler = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([1.0, 1.0, 1.0, 0.1, 0.1, 0.1])  # epoch 1 starts at the 4th step


def test_with_max_steps_the_schedule_spans_max_epochs_of_lightnings_optimizer_steps_the_short_window_included():
    """A run stopped by max_steps keeps the schedule of its max_epochs (schedule_length): 2 epochs of 5 batches
    accumulated by 2 are 6 optimizer steps, not 4, so the cosine is not over at step 4."""
    trainer = SimpleNamespace(world_size=1, accumulate_grad_batches=2, max_epochs=2, max_steps=4, estimated_stepping_batches=4, num_training_batches=5)
    assert schedule_length(trainer) == 6


def test_the_learning_rate_is_scaled_by_the_global_batch_of_every_accumulated_micro_batch():
    """128 images x 2 accumulated batches are a global batch of 256: lr 0.1 per 256 images stays 0.1."""
    trainer = SimpleNamespace(datamodule=SimpleNamespace(batch_size=128), world_size=1, accumulate_grad_batches=2, gradient_clip_val=None, max_epochs=2,
                              max_steps=-1, estimated_stepping_batches=6, num_training_batches=5, print=lambda *args: None)
    optimization = configure_optimization(trainer, parameter_groups(nn.Linear(2, 2).named_parameters(), OptimizerSpec()),
                                          OptimizerSpec(lr=0.1, lr_scaling="linear"), ScheduleSpec(decay="constant"))
    assert optimization["optimizer"].param_groups[0]["lr"] == pytest.approx(0.1)


def test_linear_warmup_then_cosine_per_step():
    spec = ScheduleSpec(warmup_epochs=2, decay="cosine")
    steps_per_epoch, total = 10, 100
    assert lr_factor(0, steps_per_epoch, total, spec) == pytest.approx(1 / 20)
    assert lr_factor(19, steps_per_epoch, total, spec) == pytest.approx(1.0)
    assert lr_factor(20, steps_per_epoch, total, spec) == pytest.approx(1.0)
    assert lr_factor(60, steps_per_epoch, total, spec) == pytest.approx(0.5)
    assert lr_factor(100, steps_per_epoch, total, spec) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "shape, first, last_warmup, after",  # factors at steps 0, W-1 and W of a 20-step warm-up
    [("(s+1)/W", 1 / 20, 1.0, 1.0), ("s/W", 0.0, 19 / 20, 1.0), ("s/(W-1)", 0.0, 1.0, 1.0)],
)
def test_the_warmup_shapes_of_the_official_codes(shape, first, last_warmup, after):
    """(s+1)/W: PaCo, MoCo v2; s/W from 0: ReSSL, SimCLR, BYOL, MoCo v3; s/(W-1): eztorch (SCE)."""
    spec = ScheduleSpec(warmup_epochs=2, decay="constant", warmup_shape=shape)
    assert [lr_factor(step, 10, 100, spec) for step in (0, 19, 20)] == pytest.approx([first, last_warmup, after])
    assert lr_factor(10, 10, 100, spec) == pytest.approx({"(s+1)/W": 11 / 20, "s/W": 10 / 20, "s/(W-1)": 10 / 19}[shape])


def test_a_warmup_shorter_than_one_step_takes_one_step_from_the_start_lr():
    """0.3 epochs of 1 step round to 0 steps: the warm-up still runs its first step at warmup_start_lr, as
    solo-learn's LinearWarmupCosineAnnealingLR does (its step 0 is below a warm-up of 0.3 steps)."""
    spec = ScheduleSpec(warmup_epochs=0.3, decay="constant", warmup_shape="s/(W-1)", warmup_start_lr=3e-5)
    assert [lr_factor(step, 1, 10, spec, start_fraction=3e-5 / 0.5) for step in (0, 1)] == [3e-5 / 0.5, 1.0]
    assert lr_factor(0, 1, 10, ScheduleSpec(decay="constant", warmup_shape="s/(W-1)")) == 1.0  # no warm-up: none


def test_a_warmup_of_part_of_an_epoch_is_refused_when_the_lr_changes_per_epoch():
    """(e + 1) / W with W = 0.5 would train epoch 0 at twice the peak."""
    with pytest.raises(ValueError, match="schedule.warmup_epochs must be a whole number of epochs with unit: epoch, got 0.5"):
        ScheduleSpec(warmup_epochs=0.5, unit="epoch")
    assert ScheduleSpec(warmup_epochs=2.0, unit="epoch").warmup_epochs == 2.0

def test_an_unknown_warmup_shape_names_the_key():
    with pytest.raises(ValueError, match=r"schedule.warmup_shape must be one of '\(s\+1\)/W', 's/W', 's/\(W-1\)', got 's/2'"):
        ScheduleSpec(warmup_shape="s/2")


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: OptimizerSpec(name="adam"), "optimizer.name must be one of 'sgd', 'lars', 'adamw', got 'adam'"),  # built AdamW
        (lambda: OptimizerSpec(lr_scaling="square_root"), "optimizer.lr_scaling must be one of 'none', 'linear', 'sqrt', got 'square_root'"),
        (lambda: ScheduleSpec(decay="linear"), "schedule.decay must be one of 'cosine', 'step', 'constant', got 'linear'"),  # ran a cosine
        (lambda: ScheduleSpec(unit="epochs"), "schedule.unit must be one of 'step', 'epoch', got 'epochs'"),  # ran per step
        (lambda: RampSpec(start=0.0, epochs=1, shape="cos"), "ramp.shape must be one of 'linear', 'cosine', got 'cos'"),
        (lambda: ScheduleSpec(final_lr_fraction=-0.5), r"schedule.final_lr_fraction must lie in \[0, 1\] \(of the peak lr\), got -0.5"),  # ascent at the end
        (lambda: ScheduleSpec(decay="step", milestones=[5], gamma=-1.0), "schedule.gamma must be > 0, got -1.0"),
        (lambda: ScheduleSpec(warmup_epochs=-1), "schedule.warmup_epochs must be >= 0, got -1"),
        (lambda: OptimizerSpec(momentum=1.5), r"optimizer.momentum must lie in \[0, 1\), got 1.5"),
        (lambda: OptimizerSpec(name="adamw", betas=(0.9, 1.0)), r"optimizer.betas must lie in \[0, 1\), got \(0.9, 1.0\)"),
        (lambda: OptimizerSpec(name="lars", trust_coefficient=-0.001), "optimizer.trust_coefficient must be > 0, got -0.001"),
    ],
    ids=["optimizer", "lr-scaling", "decay", "unit", "ramp-shape", "final-fraction", "gamma", "warmup", "momentum", "betas", "trust"],
)
def test_a_value_outside_a_settings_range_or_choices_is_refused_naming_it(build, message):
    """The CLI's parser checks the choices; a spec built in Python took an unknown one for another branch."""
    with pytest.raises(ValueError, match=message):
        build()


def test_cosine_can_end_at_a_fraction_of_the_peak():
    spec = ScheduleSpec(decay="cosine", final_lr_fraction=0.1)
    assert lr_factor(100, 10, 100, spec) == pytest.approx(0.1)


def test_epoch_unit_holds_the_rate_within_an_epoch_like_moco_cos():
    spec = ScheduleSpec(decay="cosine", unit="epoch")
    # MoCo --cos: lr * 0.5 * (1 + cos(pi * epoch / epochs)), epochs = 10 here
    for step in (30, 35, 39):
        assert lr_factor(step, 10, 100, spec) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 10)))


def test_per_epoch_warmup_is_pacos_e_plus_one_over_w_then_its_step_decay():
    # PaCo CIFAR-LT: lr (e + 1) / 10 in epochs 0-9, then lr, x0.1 from epoch 321, x0.01 from 361 (0-based)
    spec = ScheduleSpec(warmup_epochs=10, decay="step", milestones=[321, 361], gamma=0.1, unit="epoch")
    factors = [lr_factor(epoch * 4 + 3, 4, 1600, spec) for epoch in (0, 4, 9, 10, 320, 321, 360, 361, 399)]
    assert factors == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_lagged_schedule_is_tcls_adjust_learning_rate_called_after_each_epoch():
    # TCL train.py: epoch e (0-based) trains at the lr set after epoch e - 1, i.e. the cosine of epoch
    # max(e - 1, 0): eta_min + (lr - eta_min) (1 + cos(pi k / E)) / 2 with eta_min = lr 0.1^3, E = 100
    spec = ScheduleSpec(decay="cosine", final_lr_fraction=0.001, unit="epoch", lag_epochs=1)
    official = lambda k: 0.001 + 0.999 * (1 + math.cos(math.pi * k / 100)) / 2  # noqa: E731
    for epoch in (0, 1, 2, 50, 99):
        assert lr_factor(epoch * 7 + 6, 7, 700, spec) == pytest.approx(official(max(epoch - 1, 0)))


def test_negative_lag_is_refused_naming_the_value():
    with pytest.raises(ValueError, match="schedule.lag_epochs must be >= 0, got -1"):
        ScheduleSpec(lag_epochs=-1)


@pytest.mark.parametrize("warmup, epochs", [(5, 30), (10, 400)])  # PaCo's Places-LT and ImageNet-LT/iNat runs
def test_cosine_offset_gives_pacos_adjust_learning_rate(warmup, epochs):
    def paco(epoch):  # PaCo/LT/paco_lt.py adjust_learning_rate with --cos, as a fraction of args.lr
        if epoch < warmup:
            return (epoch + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (epoch - warmup + 1) / (epochs - warmup + 1)))

    steps_per_epoch = 3
    spec = ScheduleSpec(warmup_epochs=warmup, decay="cosine", unit="epoch", cosine_offset_epochs=1)
    ours = [lr_factor(step, steps_per_epoch, epochs * steps_per_epoch, spec) for step in range(epochs * steps_per_epoch)]
    assert ours == pytest.approx([paco(step // steps_per_epoch) for step in range(epochs * steps_per_epoch)], abs=1e-12)
    without = ScheduleSpec(warmup_epochs=warmup, decay="cosine", unit="epoch")
    assert lr_factor(warmup * steps_per_epoch, steps_per_epoch, epochs * steps_per_epoch, without) == 1.0 > ours[warmup * steps_per_epoch]


def test_cosine_offset_beyond_the_warmup_is_refused():
    with pytest.raises(ValueError, match="cosine_offset_epochs must lie in \\[0, warmup_epochs = 2\\], got 3"):
        ScheduleSpec(warmup_epochs=2, cosine_offset_epochs=3)


def test_step_decay_multiplies_by_gamma_at_each_milestone_epoch():
    spec = ScheduleSpec(decay="step", milestones=[60, 80], gamma=0.1)
    assert [lr_factor(epoch * 5, 5, 500, spec) for epoch in (0, 59, 60, 79, 80, 99)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01]
    )


@pytest.mark.parametrize("scaling, expected", [("none", 0.06), ("linear", 0.06 * 2), ("sqrt", 0.06 * math.sqrt(2))])
def test_learning_rate_scaling_by_global_batch(scaling, expected):
    assert OptimizerSpec(lr=0.06, lr_scaling=scaling).effective_lr(512) == pytest.approx(expected)


def test_every_parameter_is_decayed_unless_biases_and_norm_parameters_are_excluded():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2, bias=False))
    everything = parameter_groups(model.named_parameters(), OptimizerSpec(weight_decay=5e-4))  # torch's default
    assert len(everything) == 1 and len(everything[0]["params"]) == 5 and everything[0]["weight_decay"] == 5e-4
    groups = parameter_groups(model.named_parameters(), OptimizerSpec(weight_decay=5e-4, exclude_bias_and_norm=True))
    decayed, excluded = groups
    assert [p.shape for p in decayed["params"]] == [(4, 3), (2, 4)] and decayed["weight_decay"] == 5e-4
    assert len(excluded["params"]) == 3 and excluded["weight_decay"] == 0.0 and excluded["lars_exclude"]


def test_frozen_parameters_are_left_out_of_the_groups():
    model = nn.Linear(3, 4)
    model.bias.requires_grad_(False)
    groups = parameter_groups(model.named_parameters(), OptimizerSpec())
    assert sum(len(g["params"]) for g in groups) == 1


def test_lars_scales_the_update_by_the_trust_ratio_and_skips_excluded_groups():
    weight = nn.Parameter(torch.tensor([[3.0, 4.0]]))  # norm 5
    bias = nn.Parameter(torch.tensor([1.0]))
    weight.grad, bias.grad = torch.tensor([[0.6, 0.8]]), torch.tensor([0.5])
    optimizer = LARS(
        [{"params": [weight], "weight_decay": 0.0, "lars_exclude": False}, {"params": [bias], "weight_decay": 0.0, "lars_exclude": True}],
        lr=0.1,
        momentum=0.9,
        trust_coefficient=0.001,
    )
    optimizer.step()
    # update = grad * eta * ||w|| / ||grad|| = grad * 0.001 * 5 / 1
    torch.testing.assert_close(weight, torch.tensor([[3.0, 4.0]]) - 0.1 * 0.005 * torch.tensor([[0.6, 0.8]]))
    torch.testing.assert_close(bias, torch.tensor([1.0 - 0.1 * 0.5]))
    optimizer.step()  # momentum buffer: second update is (0.9 + 1) x the (re-scaled) first
    assert optimizer.state[bias]["momentum_buffer"].item() == pytest.approx(0.5 * 1.9)


def test_optimizer_factory_builds_each_kind():
    groups = lambda: parameter_groups(nn.Linear(2, 2).named_parameters(), OptimizerSpec())  # noqa: E731
    assert isinstance(build_optimizer(groups(), OptimizerSpec(name="sgd"), 0.1), torch.optim.SGD)
    assert isinstance(build_optimizer(groups(), OptimizerSpec(name="lars"), 0.1), LARS)
    assert isinstance(build_optimizer(groups(), OptimizerSpec(name="adamw"), 0.1), torch.optim.AdamW)


def lars_reference_step(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], lr, momentum, weight_decay, eta, exclude):
    """LARS one parameter at a time, as the update rule is written (the optimizer runs it multi-tensor)."""
    for param, grad, buffer in zip(params, grads, buffers):
        update = grad + weight_decay * param
        if not exclude and param.norm() > 0 and update.norm() > 0:
            update = update * eta * param.norm() / update.norm()
        buffer.mul_(momentum).add_(update)
        param.sub_(lr * buffer)


def test_multi_tensor_lars_equals_the_per_parameter_rule_with_weight_decay_and_zero_norms():
    generator = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2, 3)]
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    start[1].zero_()  # ||p|| = 0: trust ratio 1
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(3)]
    for exclude in (False, True):
        params = [nn.Parameter(tensor.clone()) for tensor in start]
        optimizer = LARS([{"params": params, "weight_decay": 1e-2, "lars_exclude": exclude}], lr=0.5, momentum=0.9, trust_coefficient=0.02)
        expected, buffers = [tensor.clone() for tensor in start], [torch.zeros(shape) for shape in shapes]
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optimizer.step()
            lars_reference_step(expected, step_grads, buffers, 0.5, 0.9, 1e-2, 0.02, exclude)
        for param, reference in zip(params, expected):
            torch.testing.assert_close(param.detach(), reference)


def solo_learn_lars_step(params, grads, buffers, lr, momentum, weight_decay, eta):
    """solo-learn's LARS (solo/utils/lars.py) with clip_lr and exclude_bias_n_norm, one parameter at a
    time as written there: 1-d parameters take the plain gradient, no weight decay."""
    for param, grad, buffer in zip(params, grads, buffers):
        update = grad
        if param.ndim != 1 and param.norm() != 0 and grad.norm() != 0:
            lars_lr = eta * param.norm() / (grad.norm() + param.norm() * weight_decay + 1e-8)
            update = (grad + weight_decay * param) * min(lars_lr / lr, 1)
        buffer.mul_(momentum).add_(update)
        param.sub_(lr * buffer)


def test_lars_with_norm_sum_and_clipped_rate_is_solo_learns_optimizer():
    generator = torch.Generator().manual_seed(1)
    shapes = [(4, 3), (5,), (2, 2, 3)]
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    params = [nn.Parameter(tensor.clone()) for tensor in start]
    # weight decay 0.5, so that ||g + wd p|| and ||g|| + wd ||p|| differ visibly
    spec = OptimizerSpec(name="lars", weight_decay=0.5, momentum=0.9, trust_coefficient=0.02, exclude_bias_and_norm=True,
                         lars_trust_denominator="norm_sum", lars_clip_lr=True)
    optimizer = build_optimizer(parameter_groups([(str(i), p) for i, p in enumerate(params)], spec), spec, lr=0.4)
    expected, buffers = [tensor.clone() for tensor in start], [torch.zeros(shape) for shape in shapes]
    # the ratio is at most eta / wd = 0.04: below the lr 0.4 (not clipped), above the lr 0.01 (clipped: SGD at the lr);
    # last, a tensor whose gradient is exactly zero takes no weight decay (it moves by its momentum only)
    for lr, scale, zero_first in ((0.4, 1e-3, False), (0.4, 1.0, False), (0.01, 1.0, False), (0.4, 1.0, True)):
        grads = [scale * torch.randn(shape, generator=generator) for shape in shapes]
        grads[0] = torch.zeros_like(grads[0]) if zero_first else grads[0]
        for group in optimizer.param_groups:
            group["lr"] = lr
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()
        solo_learn_lars_step(expected, grads, buffers, lr, 0.9, 0.5, 0.02)
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param.detach(), reference)


def simclr_lars_step(params, grads, buffers, lr, momentum, weight_decay, eta, excluded):
    """google-research/simclr lars_optimizer.py with classic_momentum, one parameter at a time as written there:
    the excluded parameters (biases, BN) have neither weight decay nor adaptation; v = m v + lr trust g; p -= v."""
    for param, grad, buffer, exclude in zip(params, grads, buffers, excluded):
        update = grad if exclude else grad + weight_decay * param
        trust = 1.0 if exclude or param.norm() == 0 or update.norm() == 0 else eta * param.norm() / update.norm()
        buffer.mul_(momentum).add_(lr * trust * update)
        param.sub_(buffer)


def test_lars_with_the_lr_in_the_momentum_is_simclrs_optimizer_and_differs_only_while_the_lr_changes():
    generator = torch.Generator().manual_seed(2)
    shapes = [(4, 3), (5,), (2, 2, 3)]
    start = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes] for _ in range(3)]

    def train(lr_in_momentum: bool, lrs: tuple[float, ...]) -> list[torch.Tensor]:
        params = [nn.Parameter(tensor.clone()) for tensor in start]
        spec = OptimizerSpec(name="lars", weight_decay=0.1, momentum=0.9, trust_coefficient=0.02, exclude_bias_and_norm=True,
                             lars_lr_in_momentum=lr_in_momentum)
        optimizer = build_optimizer(parameter_groups([(str(i), p) for i, p in enumerate(params)], spec), spec, lr=lrs[0])
        for lr, step_grads in zip(lrs, grads):
            for group in optimizer.param_groups:
                group["lr"] = lr
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optimizer.step()
        return [param.detach() for param in params]

    warming_up = (0.1, 0.2, 0.3)
    expected, buffers = [tensor.clone() for tensor in start], [torch.zeros_like(tensor) for tensor in start]
    for lr, step_grads in zip(warming_up, grads):
        simclr_lars_step(expected, step_grads, buffers, lr, 0.9, 0.1, 0.02, [tensor.ndim <= 1 for tensor in start])
    for param, reference in zip(train(True, warming_up), expected):
        torch.testing.assert_close(param, reference, rtol=1e-13, atol=1e-15)
    assert not torch.allclose(train(False, warming_up)[0], expected[0], rtol=1e-6)  # the lr after the momentum: other steps
    for inside, after in zip(train(True, (0.2, 0.2, 0.2)), train(False, (0.2, 0.2, 0.2))):  # at a constant lr: one rule
        torch.testing.assert_close(inside, after, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_fused_optimizers_take_the_same_steps_and_are_chosen_only_for_cuda_parameters_by_default(name):
    def train(fused):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))  # no BatchNorm: Adam would scale up the rounding noise of gradients it cancels
        optimizer = build_optimizer(parameter_groups(model.named_parameters(), OptimizerSpec(name=name, weight_decay=1e-3, fused=fused)), OptimizerSpec(name=name, fused=fused), 0.05)
        inputs = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()
        return model, optimizer

    fused_model, fused_optimizer = train(True)
    default_model, default_optimizer = train(None)
    assert fused_optimizer.defaults["fused"] and not default_optimizer.defaults["fused"]  # CPU parameters: not fused by default
    for fused_param, param in zip(fused_model.parameters(), default_model.parameters()):
        torch.testing.assert_close(fused_param, param, rtol=1e-5, atol=1e-6)


class OnCuda(nn.Parameter):
    """A parameter that says it is on a GPU (`is_cuda`), as the optimizer's default reads it on a machine without one."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.mark.parametrize("name, constructor", [("sgd", "SGD"), ("adamw", "AdamW")])
def test_the_default_fuses_the_optimizer_exactly_when_every_parameter_is_on_cuda(name, constructor, monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.optim, constructor, lambda groups, **options: chosen.append(options["fused"]))
    for params in ([OnCuda(torch.zeros(2)), OnCuda(torch.zeros(3))], [OnCuda(torch.zeros(2)), nn.Parameter(torch.zeros(3))], [nn.Parameter(torch.zeros(2))]):
        build_optimizer([{"params": params}], OptimizerSpec(name=name), 0.1)
    assert chosen == [True, None, None]  # every parameter on the GPU: fused; any on the CPU: torch's default
    # trainer.gradient_clip_val: Lightning refuses to clip for a fused step under mixed precision (a RuntimeError at the first step)
    build_optimizer([{"params": [OnCuda(torch.zeros(2))]}], OptimizerSpec(name=name), 0.1, clipped=True)
    assert chosen[-1] is None


@pytest.mark.parametrize("name, constructor", [("sgd", "SGD"), ("adamw", "AdamW")])
def test_per_parameter_clipping_is_never_fused_since_a_fused_step_unscales_the_gradients_after_the_clip(name, constructor, monkeypatch):
    """DINO's clip to 3 per tensor (facebookresearch/dino main_dino.py: `fp16_scaler.unscale_` first): with a fused step,
    Lightning leaves 16-mixed gradients loss-scaled until the step, and the clip cut them to 3 / 65536 of DINO's."""
    chosen = []
    monkeypatch.setattr(torch.optim, constructor, lambda groups, **options: chosen.append(options["fused"]))
    build_optimizer([{"params": [OnCuda(torch.zeros(2))]}], OptimizerSpec(name=name, clip_grad_per_parameter=3.0), 0.1)
    assert chosen == [None]
    with pytest.raises(ValueError, match="optimizer.fused: true with optimizer.clip_grad_per_parameter: a fused step unscales 16-mixed gradients itself"):
        OptimizerSpec(name=name, fused=True, clip_grad_per_parameter=3.0)


def test_lars_refuses_to_be_fused_with_the_way_out_when_the_config_is_read():
    with pytest.raises(ValueError, match="optimizer.fused: true, but LARS has no fused kernel .* set optimizer.fused: null"):
        OptimizerSpec(name="lars", fused=True)


def test_fixed_lr_modules_keep_the_peak_rate_while_the_other_groups_follow_the_schedule():
    """SimSiam's --fix-pred-lr (facebookresearch/simsiam main_simsiam.py): the predictor keeps init_lr at every epoch."""
    model = nn.ModuleDict({"backbone": nn.Linear(3, 3), "predictor": nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))})
    spec = OptimizerSpec(lr=0.05, lr_scaling="linear", weight_decay=1e-4, exclude_bias_and_norm=True, fixed_lr_modules=["predictor"])
    groups = parameter_groups(model.named_parameters(), spec)
    assert [(len(g["params"]), g["weight_decay"], g.get("fixed_lr", False)) for g in groups] == [(1, 1e-4, False), (1, 0.0, False), (1, 1e-4, True), (3, 0.0, True)]
    trainer = ten_epochs_of_ten_steps(batch_size=512)
    optimization = configure_optimization(trainer, groups, spec, ScheduleSpec(decay="cosine", unit="epoch"))
    scheduler = optimization["lr_scheduler"]["scheduler"]
    for _ in range(50):  # to epoch 5 of 10: the cosine is at half the peak
        optimization["optimizer"].step()
        scheduler.step()
    assert [group["lr"] for group in optimization["optimizer"].param_groups] == pytest.approx([0.05, 0.05, 0.1, 0.1])


def test_a_fixed_lr_module_without_trainable_parameters_is_refused_naming_it():
    model = nn.ModuleDict({"backbone": nn.Linear(3, 3)})
    with pytest.raises(ValueError, match="optimizer.fixed_lr_modules names 'predictr', which holds no trainable parameter of the model"):
        parameter_groups(model.named_parameters(), OptimizerSpec(fixed_lr_modules=["predictr"]))


def test_the_bias_and_norm_lr_ratio_gives_those_groups_barlow_twins_bias_rate_through_the_schedule():
    """facebookresearch/barlowtwins main.py: --learning-rate-weights 0.2, --learning-rate-biases 0.0048 (ratio 0.024)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    spec = OptimizerSpec(lr=0.2, lr_scaling="linear", exclude_bias_and_norm=True, bias_and_norm_lr_ratio=0.024)
    trainer = ten_epochs_of_ten_steps(batch_size=512)
    optimization = configure_optimization(trainer, parameter_groups(model.named_parameters(), spec), spec, ScheduleSpec(decay="cosine"))
    assert [group["lr"] for group in optimization["optimizer"].param_groups] == pytest.approx([0.4, 0.4 * 0.024])
    for _ in range(50):
        optimization["optimizer"].step()
        optimization["lr_scheduler"]["scheduler"].step()
    assert [group["lr"] for group in optimization["optimizer"].param_groups] == pytest.approx([0.2, 0.2 * 0.024])
    with pytest.raises(ValueError, match="optimizer.bias_and_norm_lr_ratio 0.024 needs exclude_bias_and_norm: true"):
        OptimizerSpec(bias_and_norm_lr_ratio=0.024)


def test_the_bias_and_norm_lr_ratio_applies_inside_a_fixed_lr_module_too():
    model = nn.ModuleDict({"backbone": nn.Linear(3, 3), "predictor": nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))})
    spec = OptimizerSpec(lr=0.2, exclude_bias_and_norm=True, bias_and_norm_lr_ratio=0.024, fixed_lr_modules=["predictor"])
    optimization = configure_optimization(ten_epochs_of_ten_steps(batch_size=256), parameter_groups(model.named_parameters(), spec), spec, ScheduleSpec())
    groups = optimization["optimizer"].param_groups  # trunk weights, trunk biases, predictor weights, predictor biases and norms
    assert [(len(group["params"]), group.get("fixed_lr", False)) for group in groups] == [(1, False), (1, False), (1, True), (3, True)]
    assert [group["lr"] for group in groups] == pytest.approx([0.2, 0.2 * 0.024, 0.2, 0.2 * 0.024])


def test_the_weight_decay_follows_dinos_cosine_from_start_towards_end_on_the_decayed_groups_only():
    """facebookresearch/dino utils.py cosine_scheduler(0.04, 0.4, epochs, niter): end + (start - end)(1 + cos(pi i / N)) / 2."""
    spec = OptimizerSpec(name="adamw", weight_decay=0.04, weight_decay_end=0.4, exclude_bias_and_norm=True)
    assert [weight_decay_at(step, 10, spec) for step in (0, 5, 9)] == pytest.approx([0.04, 0.22, 0.4 + 0.5 * (0.04 - 0.4) * (1 + math.cos(math.pi * 0.9))])
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    optimizer = build_optimizer(parameter_groups(model.named_parameters(), spec), spec, 1e-3)
    assert schedule_weight_decay_(optimizer, 5, 10, spec) == pytest.approx(0.22)
    assert [group["weight_decay"] for group in optimizer.param_groups] == pytest.approx([0.22, 0.0])
    with pytest.raises(ValueError, match="optimizer.weight_decay_end 0.4 needs a value >= 0 and optimizer.weight_decay > 0"):
        OptimizerSpec(weight_decay=0.0, weight_decay_end=0.4)


def test_gradients_are_clipped_tensor_by_tensor_as_dinos_clip_gradients():
    small, large = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    small.grad, large.grad = torch.tensor([0.3, 0.4]), torch.tensor([30.0, 40.0])  # norms 0.5 and 50
    clip_gradients_per_parameter_([small, large, nn.Parameter(torch.zeros(1))], 3.0)  # a parameter without gradient too
    torch.testing.assert_close(small.grad, torch.tensor([0.3, 0.4]))  # under the norm: untouched (no global norm)
    torch.testing.assert_close(large.grad, torch.tensor([30.0, 40.0]) * 3.0 / (50.0 + 1e-6))
    with pytest.raises(ValueError, match="optimizer.clip_grad_per_parameter must be > 0, got 0"):
        OptimizerSpec(clip_grad_per_parameter=0.0)


def test_the_warmup_from_a_start_lr_is_solo_learns_linear_warmup_cosine_for_every_group():
    """vturrisi/solo-learn solo/utils/lr_scheduler.py LinearWarmupCosineAnnealingLR, stepped per optimizer step as
    solo/methods/base.py configures it: warmup_start_lr 3e-5 for every group, each group's lr rising by
    (its lr - 3e-5) / (W - 1) a step to its own lr at step W - 1, then (1 + cos(pi (s - W) / (T - W))) / 2 of it.
    The reference is that scheduler's recurrence, written out for two groups of different peaks (trunk, classifier)."""
    model = nn.ModuleDict({"backbone": nn.Linear(3, 3), "probe": nn.Linear(3, 2)})
    spec = OptimizerSpec(lr=1.0, lr_scaling="linear")
    groups = parameter_groups(model["backbone"].named_parameters(), spec) + [{"params": list(model["probe"].parameters()), "lr": 0.1}]
    trainer = ten_epochs_of_ten_steps(batch_size=256)
    optimization = configure_optimization(trainer, groups, spec, ScheduleSpec(warmup_epochs=2, warmup_shape="s/(W-1)", warmup_start_lr=3e-5))
    optimizer, scheduler = optimization["optimizer"], optimization["lr_scheduler"]["scheduler"]
    warmup, total, start = 20, 100, 3e-5
    expected = []
    for peak in (1.0, 0.1):
        rates = [start]
        for step in range(1, total):
            if step < warmup:
                rates.append(rates[-1] + (peak - start) / (warmup - 1))
            elif step == warmup:
                rates.append(peak)
            else:  # the recurrence of the cosine: the ratio of consecutive cosine values
                ratio = (1 + math.cos(math.pi * (step - warmup) / (total - warmup))) / (1 + math.cos(math.pi * (step - warmup - 1) / (total - warmup)))
                rates.append(ratio * rates[-1])
        expected.append(rates)
    found = [[], []]
    for _ in range(total):
        for rates, group in zip(found, optimizer.param_groups):
            rates.append(group["lr"])
        optimizer.step()
        scheduler.step()
    assert found[0][:3] == pytest.approx([3e-5, 3e-5 + (1.0 - 3e-5) / 19, 3e-5 + 2 * (1.0 - 3e-5) / 19], rel=1e-12)
    assert found[1][0] == pytest.approx(3e-5, rel=1e-12) and found[1][19] == pytest.approx(0.1, rel=1e-12)
    for rates, reference in zip(found, expected):
        assert rates == pytest.approx(reference, rel=1e-9, abs=1e-15)


def test_a_warmup_start_lr_without_a_warmup_or_below_zero_is_refused_naming_both_values():
    with pytest.raises(ValueError, match="schedule.warmup_start_lr must be >= 0, and 0 without warmup_epochs, got 3e-05 with warmup_epochs 0"):
        ScheduleSpec(warmup_start_lr=3e-5)
    with pytest.raises(ValueError, match="got -1.0 with warmup_epochs 10"):
        ScheduleSpec(warmup_epochs=10, warmup_start_lr=-1.0)


def test_a_group_at_lr_0_stays_at_0_through_a_warmup_from_a_start_lr():
    model = nn.ModuleDict({"backbone": nn.Linear(3, 3), "frozen_head": nn.Linear(3, 2)})
    spec = OptimizerSpec(lr=1.0, lr_scaling="none")
    groups = parameter_groups(model["backbone"].named_parameters(), spec) + [{"params": list(model["frozen_head"].parameters()), "lr": 0.0}]
    trainer = ten_epochs_of_ten_steps(batch_size=256)
    optimization = configure_optimization(trainer, groups, spec, ScheduleSpec(warmup_epochs=2, warmup_shape="s/(W-1)", warmup_start_lr=3e-5))
    assert [group["lr"] for group in optimization["optimizer"].param_groups] == [3e-5, 0.0]


@pytest.mark.slow
def test_a_run_of_max_steps_without_max_epochs_counts_its_epochs_in_its_own_batches(tmp_path):
    """Lightning counts the training batches before `configure_optimizers` only for a run with `max_epochs`: a run of
    `max_steps` alone took 1 step per epoch, so moco_digits' 1-epoch warm-up of 2 batches ended after 1 step."""
    import main_pretrain
    from test_cli import PRETRAIN_DIGITS, TINY_RUN

    cli = main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_epochs=-1", "--trainer.max_steps=3",
                                  "--trainer.logger=false", "--trainer.precision=32-true", f"--trainer.default_root_dir={tmp_path}"])
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    # the warm-up over the epoch's 2 steps ((s + 1) / W), then the cosine from the peak over the rest of max_steps
    # (1 step per epoch gave 1.0, 1.0, 0.5: a 1-step warm-up and the cosine from the 2nd step)
    assert [scheduler.lr_lambdas[0](step) for step in range(3)] == pytest.approx([0.5, 1.0, 1.0])
