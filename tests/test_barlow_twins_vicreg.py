"""Barlow Twins and VICReg as methods: each view through the network on its own (BatchNorm per view, as their
official forwards), the loss of the library on the two projections, local crops as extra (global, local) pairs, and
training lowers the loss on Digits-M. Their 2-process equivalence is in tests/test_distributed.py."""

import copy

import pytest
import torch
from helpers import SMALL_TRUNK, TINY_BACKBONE, digits, first_batch, loss_before_and_after_training

from backbones import MLPSpec
from engine.optim import OptimizerSpec
from methods import VICReg, BarlowTwins
from methods.losses import barlow_twins_loss, vicreg_loss

VIEWS = {"global1": {"preset": "mocov2"}, "global2": {"preset": "mocov2"}}
LOCAL = {"local": {"preset": "mocov2", "size": 16, "scale": [0.2, 0.5], "count": 2}}
PROJECTOR = MLPSpec(hidden_dim=64, output_dim=32, num_layers=3, batch_norm=True, last_bias=False)
LOSSES = {BarlowTwins: barlow_twins_loss, VICReg: vicreg_loss}


def tiny(method, **kwargs):
    return method(**(dict(backbone=TINY_BACKBONE, projector=PROJECTOR, knn_k=0) | kwargs))


def projections_view_by_view(model, crops) -> list[torch.Tensor]:
    """Each crop through trunk and projector in a batch of its own, on a copy."""
    frozen = copy.deepcopy(model).train()
    with torch.no_grad():
        return [frozen.projector(frozen.backbone(crop)) for crop in crops]


@pytest.mark.parametrize("method", [BarlowTwins, VICReg])
def test_the_loss_is_the_library_loss_of_the_views_encoded_one_by_one(method):
    model, batch = tiny(method), first_batch(digits(VIEWS, batch_size=8))
    first, second = projections_view_by_view(model, [batch["views"]["global1"], batch["views"]["global2"]])
    jointly = copy.deepcopy(model).train()
    with torch.no_grad():  # both views in one batch: other BatchNorm statistics, another loss
        both = jointly.projector(jointly.backbone(torch.cat([batch["views"]["global1"], batch["views"]["global2"]])))
    loss, features = model.step(batch)
    assert loss.item() == pytest.approx(LOSSES[method](first, second).item(), rel=1e-5)
    assert loss.item() != pytest.approx(LOSSES[method](*both.chunk(2)).item(), rel=1e-3)
    assert features.shape == (8, model.feature_dim)


def test_barlow_twins_scales_its_loss_and_takes_lambda():
    batch = first_batch(digits(VIEWS, batch_size=8))
    plain = tiny(BarlowTwins)
    scaled = tiny(BarlowTwins, loss_scale=0.1, off_diagonal_weight=0.01)
    scaled.load_state_dict(plain.state_dict())
    first, second = projections_view_by_view(plain, [batch["views"]["global1"], batch["views"]["global2"]])
    with torch.no_grad():
        assert scaled.step(batch)[0].item() == pytest.approx(0.1 * barlow_twins_loss(first, second, 0.01).item(), rel=1e-5)


@pytest.mark.parametrize("method", [BarlowTwins, VICReg])
def test_local_crops_add_the_pairs_of_each_global_view_with_every_other_crop(method):
    model, batch = tiny(method, local_crops=["local"]), first_batch(digits(VIEWS | LOCAL, batch_size=8))
    crops = [batch["views"]["global1"], batch["views"]["global2"], *batch["views"]["local"].unbind(1)]
    projections = projections_view_by_view(model, crops)
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    expected = sum(LOSSES[method](projections[a], projections[b]).item() for a, b in pairs) / len(pairs)
    with torch.no_grad():
        assert model.step(batch)[0].item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method, lr", [(BarlowTwins, 0.05), (VICReg, 0.01)])  # VICReg diverges at 0.05 without LARS
def test_training_steps_lower_the_loss_on_the_embedded_data(method, lr, tmp_path):
    before, after = loss_before_and_after_training(tiny(method, backbone=SMALL_TRUNK, optimizer=OptimizerSpec(lr=lr, momentum=0.9)), VIEWS, tmp_path)
    assert after < 0.9 * before, (before, after)
