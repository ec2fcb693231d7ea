import copy
import math

import pytest
import torch
from helpers import SMALL_TRUNK, TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch
from momentum_steps import RecordEMA

from backbones import MLPSpec
from engine.optim import OptimizerSpec
from methods import BYOL
from methods.losses import byol_loss
from methods.momentum import MomentumSpec

BYOL_VIEWS = {"first": {"preset": "byol1", "blur_prob": 0.0}, "second": {"preset": "byol2", "blur_prob": 0.0}}
TINY_PREDICTOR = MLPSpec(hidden_dim=64, output_dim=32, last_bias=False)


def tiny_byol(**kwargs) -> BYOL:
    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, predictor=TINY_PREDICTOR, knn_k=0,
                   momentum=MomentumSpec(base=0.9, schedule="cosine_byol", shuffle_bn=False))
    return BYOL(**(options | kwargs))


def fixed_batch_loss(model: BYOL, batch: dict) -> float:
    """BYOL's loss of the model's online predictions and target projections of both views, on a copy."""
    frozen = copy.deepcopy(model).train()
    first, second = batch["views"]["first"], batch["views"]["second"]
    with torch.no_grad():
        predictions = [frozen.embed(view)[1] for view in (first, second)]
        targets = [frozen.target_embed(view) for view in (first, second)]
    return byol_loss(*predictions, *targets).item()


def test_loss_regresses_each_views_prediction_on_the_other_views_target():
    model = tiny_byol()
    batch = first_batch(digits(BYOL_VIEWS, batch_size=8))
    expected = fixed_batch_loss(model, batch)
    loss, _ = model.step(batch)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    swapped = copy.deepcopy(model)
    swapped.target_backbone, swapped.target_projector = swapped.backbone, swapped.projector  # a target that is the online net
    assert swapped.step(batch)[0].item() != pytest.approx(expected, rel=1e-3)


def test_the_target_starts_from_its_own_initialisation_or_as_a_copy_when_asked():
    torch.manual_seed(0)
    independent = tiny_byol()
    torch.manual_seed(0)
    copied = tiny_byol(independent_target_init=False)
    assert not torch.equal(independent.target_backbone.conv1.weight, independent.backbone.conv1.weight)
    assert not torch.equal(independent.target_projector[0].weight, independent.projector[0].weight)
    assert torch.equal(copied.target_backbone.conv1.weight, copied.backbone.conv1.weight)
    assert all(not p.requires_grad for p in independent.target_backbone.parameters())


def test_no_gradient_reaches_the_target_network():
    model = tiny_byol()
    loss, _ = model.step(first_batch(digits(BYOL_VIEWS, batch_size=8)))
    loss.backward()
    assert all(p.grad is None for p in [*model.target_backbone.parameters(), *model.target_projector.parameters()])
    assert model.backbone.conv1.weight.grad.abs().sum() > 0 and model.predictor[0].weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_target_follows_byols_cosine_momentum_at_the_first_middle_and_last_step(tmp_path):
    """tau_k = 1 - (1 - tau_base)(cos(pi k / K) + 1) / 2 after optimizer step k of K (paper section 3.1)."""
    recorder = RecordEMA()
    cpu_trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[recorder]).fit(tiny_byol(), digits(BYOL_VIEWS, batch_size=16))
    for step in (0, 2, 3):
        tau = 1 - 0.1 * (math.cos(math.pi * step / 4) + 1) / 2
        assert recorder.largest_deviation(step, tau) < 1e-6, step
        assert recorder.largest_deviation(step, 0.9 if step else 0.95) > 1e-5, step  # another momentum is seen


@pytest.mark.slow
def test_byol_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_byol(backbone=SMALL_TRUNK, optimizer=OptimizerSpec(lr=0.1))
    datamodule = digits(BYOL_VIEWS, batch_size=32)
    batch = first_batch(datamodule)
    before = fixed_batch_loss(model, batch)
    cpu_trainer(tmp_path, max_steps=10, limit_val_batches=0).fit(model, datamodule)
    assert fixed_batch_loss(model, batch) < 0.7 * before, before
