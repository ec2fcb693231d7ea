import copy

import pytest
import torch
from helpers import SMALL_TRUNK, TINY_BACKBONE, cpu_trainer, digits, first_batch

from backbones import MLPSpec
from engine.optim import OptimizerSpec
from methods import NNCLR
from methods.losses import nnclr_loss

NNCLR_VIEWS = {"first": {"preset": "byol1", "blur_prob": 0.0}, "second": {"preset": "byol2", "blur_prob": 0.0}}


def tiny_nnclr(**kwargs) -> NNCLR:
    options = dict(backbone=TINY_BACKBONE, projector=MLPSpec(hidden_dim=64, output_dim=32, last_batch_norm=True),
                   predictor=MLPSpec(hidden_dim=64, output_dim=32), queue_size=64, temperature=0.2, knn_k=0)
    return NNCLR(**(options | kwargs))


def fixed_batch_loss(model: NNCLR, batch: dict, support: torch.Tensor) -> float:
    """The mean of NNCLR's two terms against a fixed support set, on a copy (nothing is enqueued)."""
    frozen = copy.deepcopy(model).train()
    with torch.no_grad():
        (z1, p1), (z2, p2) = (frozen.project_and_predict(frozen.backbone(batch["views"][name])) for name in ("first", "second"))
    return ((nnclr_loss(z1, p2, support, frozen.temperature) + nnclr_loss(z2, p1, support, frozen.temperature)) / 2).item()


def test_neighbours_come_from_the_support_set_before_the_step_and_the_first_views_projections_are_enqueued_after():
    model = tiny_nnclr()
    batch = first_batch(digits(NNCLR_VIEWS, batch_size=16))
    support_before = model.support_set.read()
    expected = fixed_batch_loss(model, batch, support_before)
    with torch.no_grad():
        copied = copy.deepcopy(model)
        z1, _ = copied.project_and_predict(copied.backbone(batch["views"]["first"]))
    loss, _ = model.step(batch)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(model.support_set.keys[:16], z1)
    assert torch.equal(model.support_set.keys[16:], support_before[16:])
    assert model.support_set.pointer.item() == 16


def test_gradient_reaches_the_predictions_and_the_trunk_but_not_the_support_set():
    model = tiny_nnclr()
    loss, _ = model.step(first_batch(digits(NNCLR_VIEWS, batch_size=8)))
    loss.backward()
    assert model.backbone.conv1.weight.grad.abs().sum() > 0 and model.predictor[0].weight.grad.abs().sum() > 0
    assert not model.support_set.keys.requires_grad


def test_a_support_set_smaller_than_the_global_batch_is_refused():
    with pytest.raises(ValueError, match=r"support_set size 16 is smaller than the 32 keys enqueued per step"):
        tiny_nnclr(queue_size=16).check_data(digits(NNCLR_VIEWS, batch_size=16), world_size=2)


@pytest.mark.slow
def test_nnclr_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_nnclr(backbone=SMALL_TRUNK, optimizer=OptimizerSpec(lr=0.1))
    datamodule = digits(NNCLR_VIEWS, batch_size=32)
    batch = first_batch(datamodule)
    support = model.support_set.read()
    before = fixed_batch_loss(model, batch, support)
    cpu_trainer(tmp_path, max_steps=10, limit_val_batches=0).fit(model, datamodule)
    assert fixed_batch_loss(model, batch, support) < 0.97 * before, before  # 10 steps at batch 32: 3.54 -> 3.17
