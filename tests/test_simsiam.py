import copy

import pytest
import torch
from helpers import SMALL_TRUNK, TINY_BACKBONE, cpu_trainer, digits, first_batch

from backbones import MLPSpec
from engine.optim import OptimizerSpec
from methods import SimSiam
from methods.losses import simsiam_loss

SIMSIAM_VIEWS = {name: {"preset": "mocov2", "blur_prob": 0.0, "scale": (0.5, 1.0)} for name in ("first", "second")}
# the official projector's form, scaled down: Linear-BN-ReLU x 2, then a Linear whose bias is kept but frozen, BN without affine
OFFICIAL_FORM_PROJECTOR = MLPSpec(hidden_dim=64, output_dim=32, num_layers=3, last_batch_norm=True, last_batch_norm_affine=False, last_bias=True)


def tiny_simsiam(**kwargs) -> SimSiam:
    options = dict(backbone=TINY_BACKBONE, projector=OFFICIAL_FORM_PROJECTOR, predictor=MLPSpec(hidden_dim=8, output_dim=32), knn_k=0)
    return SimSiam(**(options | kwargs))


def fixed_batch_loss(model: SimSiam, batch: dict) -> float:
    """SimSiam's loss of the model's predictions and projections of both views, on a copy."""
    frozen = copy.deepcopy(model).train()
    with torch.no_grad():
        (z1, p1), (z2, p2) = (frozen.project_and_predict(frozen.backbone(batch["views"][name])) for name in ("first", "second"))
    return simsiam_loss(p1, p2, z1, z2).item()


def test_loss_matches_each_views_prediction_with_the_other_views_projection():
    model = tiny_simsiam()
    batch = first_batch(digits(SIMSIAM_VIEWS, batch_size=8))
    loss, _ = model.step(batch)
    assert loss.item() == pytest.approx(fixed_batch_loss(model, batch), rel=1e-6)
    with torch.no_grad():
        copied = copy.deepcopy(model)
        (z1, p1), (z2, p2) = (copied.project_and_predict(copied.backbone(batch["views"][name])) for name in ("first", "second"))
    assert loss.item() != pytest.approx(simsiam_loss(p1, p2, z2, z1).item(), rel=1e-3)  # the same view's projection differs


def test_the_projections_are_targets_only_and_the_frozen_bias_is_not_optimised():
    model = tiny_simsiam()
    projection_output = model.projector[-2]  # the Linear before the last BN: simsiam/builder.py's frozen fc bias
    assert not projection_output.bias.requires_grad
    optimised = {id(p) for group in model.optimizer_groups() for p in group["params"]}
    assert id(projection_output.bias) not in optimised and id(projection_output.weight) in optimised
    batch = first_batch(digits(SIMSIAM_VIEWS, batch_size=8))
    (z1, p1), (z2, p2) = (model.project_and_predict(model.backbone(batch["views"][name])) for name in ("first", "second"))
    simsiam_loss(p1, p2, z1, z2).backward(inputs=[z1, z2, p1, p2], retain_graph=True)
    assert z1.grad is None and z2.grad is None  # stop-gradient: only through the predictions
    assert p1.grad.abs().sum() > 0 and p2.grad.abs().sum() > 0


@pytest.mark.slow
def test_the_predictor_keeps_its_learning_rate_while_the_rest_decays(tmp_path):
    model = tiny_simsiam(optimizer=OptimizerSpec(lr=0.05, exclude_bias_and_norm=True, fixed_lr_modules=["predictor"]))
    trainer = cpu_trainer(tmp_path, max_steps=4, limit_val_batches=0)
    trainer.fit(model, digits(SIMSIAM_VIEWS, batch_size=16))
    rates = {tuple(id(p) for p in group["params"]): group["lr"] for group in trainer.optimizers[0].param_groups}
    predictor = {id(p) for p in model.predictor.parameters()}
    assert [lr for ids, lr in rates.items() if set(ids) <= predictor] == [0.05, 0.05]  # weights, biases and BN
    assert all(lr < 0.05 for ids, lr in rates.items() if id(model.backbone.conv1.weight) in ids)


@pytest.mark.slow
def test_simsiam_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_simsiam(backbone=SMALL_TRUNK, optimizer=OptimizerSpec(lr=0.1))
    datamodule = digits(SIMSIAM_VIEWS, batch_size=32)
    batch = first_batch(datamodule)
    before = fixed_batch_loss(model, batch)
    cpu_trainer(tmp_path, max_steps=10, limit_val_batches=0).fit(model, datamodule)
    assert fixed_batch_loss(model, batch) < before - 0.05, before  # the loss lies in [-1, 1]
