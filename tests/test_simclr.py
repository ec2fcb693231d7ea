import copy

import pytest
import torch
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch

from engine.optim import OptimizerSpec
from methods import SimCLR
from methods.losses import nt_xent

SIMCLR_VIEWS = {"first": {"preset": "simclr"}, "second": {"preset": "simclr"}}


def tiny_simclr(**kwargs) -> SimCLR:
    return SimCLR(**(dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, temperature=0.5, knn_k=0) | kwargs))


def fixed_batch_loss(model: SimCLR, batch: dict) -> float:
    """NT-Xent of both views encoded in one batch (BatchNorm over all 2B images), on a copy."""
    frozen = copy.deepcopy(model).train()
    views = batch["views"]
    with torch.no_grad():
        _, embeddings = frozen.embed(torch.cat([views["first"], views["second"]]))
    return nt_xent(*embeddings.chunk(2), frozen.temperature).item()


def test_loss_is_nt_xent_of_the_two_views_encoded_in_one_batch():
    model = tiny_simclr()
    batch = first_batch(digits(SIMCLR_VIEWS, batch_size=16))
    expected = fixed_batch_loss(model, batch)
    loss, features = model.step(batch)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    with torch.no_grad():
        both_views_features = copy.deepcopy(model).backbone(torch.cat([batch["views"]["first"], batch["views"]["second"]]))
    torch.testing.assert_close(features.detach(), both_views_features)  # the probe's: the first view's rows, then the second's


@pytest.mark.parametrize("num_hard", [None, 8])
def test_the_sum_of_directions_is_twice_the_mean_loss_with_twice_its_gradients(num_hard):
    """google-research/simclr objective.py sums the means of the two directions (tests/test_losses.py checks that
    this is twice NT-Xent's mean over the 2B anchors)."""
    torch.manual_seed(0)
    mean, summed = tiny_simclr(num_hard=num_hard), tiny_simclr(num_hard=num_hard, sum_of_directions=True)
    summed.load_state_dict(mean.state_dict())
    batch = first_batch(digits(SIMCLR_VIEWS, batch_size=8))
    losses = []
    for model in (mean, summed):
        loss, _ = model.step(batch)
        loss.backward()
        losses.append(loss)
    assert losses[1].item() == pytest.approx(2 * losses[0].item(), rel=1e-6)
    torch.testing.assert_close(summed.backbone.conv1.weight.grad, 2 * mean.backbone.conv1.weight.grad)


def test_gradient_reaches_the_encoder_from_both_views():
    """The trunk's gradient is NT-Xent's with both views' embeddings differentiated, not one view's."""
    model = tiny_simclr()
    references = {"both views": copy.deepcopy(model), "first view only": copy.deepcopy(model)}
    batch = first_batch(digits(SIMCLR_VIEWS, batch_size=8))
    model.step(batch)[0].backward()
    for name, reference in references.items():
        _, embeddings = reference.embed(torch.cat([batch["views"]["first"], batch["views"]["second"]]))
        z1, z2 = embeddings.chunk(2)
        nt_xent(z1, z2 if name == "both views" else z2.detach(), reference.temperature).backward()
    torch.testing.assert_close(model.backbone.conv1.weight.grad, references["both views"].backbone.conv1.weight.grad)
    assert not torch.allclose(model.backbone.conv1.weight.grad, references["first view only"].backbone.conv1.weight.grad, rtol=1e-3)
    assert all(p.grad is not None for p in model.projector.parameters())


@pytest.mark.slow
def test_simclr_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_simclr(optimizer=OptimizerSpec(lr=0.1))
    datamodule = digits({name: {"preset": "crop_flip", "scale": (0.5, 1.0)} for name in SIMCLR_VIEWS}, batch_size=16)
    batch = first_batch(datamodule)
    before = fixed_batch_loss(model, batch)
    cpu_trainer(tmp_path, max_steps=8, limit_val_batches=0).fit(model, datamodule)
    assert fixed_batch_loss(model, batch) < 0.85 * before


def test_negative_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0, got -0.5"):
        tiny_simclr(temperature=-0.5)


def test_hard_loss_keeping_every_negative_is_nt_xent_and_fewer_negatives_lower_it():
    batch = first_batch(digits(SIMCLR_VIEWS, batch_size=8))
    ordinary = tiny_simclr()
    hard_all = tiny_simclr(num_hard=14)  # 2B - 2 negatives per anchor: all of them
    hard_all.load_state_dict(ordinary.state_dict())
    hard_few = tiny_simclr(num_hard=3)
    hard_few.load_state_dict(ordinary.state_dict())
    with torch.no_grad():
        losses = [model.step(batch)[0].item() for model in (ordinary, hard_all, hard_few)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[2] < losses[0] - 1e-3


def test_hard_loss_needs_at_least_one_negative():
    with pytest.raises(ValueError, match="model.num_hard must be >= 1, got 0"):
        tiny_simclr(num_hard=0)
