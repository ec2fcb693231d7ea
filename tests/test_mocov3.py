import copy
import math

import pytest
import torch
from helpers import SMALL_TRUNK, TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch
from momentum_steps import RecordEMA

from backbones import BackboneSpec, MLPSpec
from engine.optim import OptimizerSpec
from methods import MoCoV3
from methods.losses import mocov3_loss
from methods.momentum import MomentumSpec

MOCOV3_VIEWS = {"first": {"preset": "byol1", "blur_prob": 0.0}, "second": {"preset": "byol2", "blur_prob": 0.0}}
TINY_PREDICTOR = MLPSpec(hidden_dim=64, output_dim=32, last_bias=False)
# moco-v3 vits.py's options on a 2-block ViT for 32 px images
TINY_VIT = BackboneSpec(name="vit_tiny", kwargs=dict(img_size=32, patch_size=8, depth=2, init="mocov3", position_embedding="sincos_2d", stop_grad_conv1=True))


def tiny_mocov3(**kwargs) -> MoCoV3:
    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, predictor=TINY_PREDICTOR, temperature=0.2, knn_k=0,
                   momentum=MomentumSpec(base=0.9, schedule="cosine_mocov3", shuffle_bn=False))
    return MoCoV3(**(options | kwargs))


def fixed_batch_loss(model: MoCoV3, batch: dict) -> float:
    """The sum of the two 2-tau InfoNCE terms, each view's queries against the other view's keys, on a copy."""
    frozen = copy.deepcopy(model).train()
    first, second = batch["views"]["first"], batch["views"]["second"]
    with torch.no_grad():
        (_, q1), (_, q2) = frozen.embed(first), frozen.embed(second)
        k1, k2 = frozen.target_embed(first), frozen.target_embed(second)
    return (mocov3_loss(q1, k2, frozen.temperature) + mocov3_loss(q2, k1, frozen.temperature)).item()


def test_loss_sums_the_two_symmetric_terms_of_queries_against_the_other_views_keys():
    model = tiny_mocov3()
    batch = first_batch(digits(MOCOV3_VIEWS, batch_size=8))
    loss, _ = model.step(batch)
    assert loss.item() == pytest.approx(fixed_batch_loss(model, batch), rel=1e-6)
    assert 0 < loss.item() < 2 * 2 * 0.2 * math.log(8) + 1  # two terms of 2 tau CE over 8 keys, not averaged


def test_no_gradient_reaches_the_momentum_encoder():
    model = tiny_mocov3()
    loss, _ = model.step(first_batch(digits(MOCOV3_VIEWS, batch_size=8)))
    loss.backward()
    assert all(p.grad is None for p in [*model.target_backbone.parameters(), *model.target_projector.parameters()])
    assert model.backbone.conv1.weight.grad.abs().sum() > 0 and model.predictor[0].weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_momentum_encoder_follows_the_official_cosine_at_the_first_middle_and_last_step(tmp_path):
    """m = 1 - (1 - m_0)(cos(pi e / E) + 1) / 2 at e = epoch + i / iters, applied before the keys of step i
    (moco-v3 main_moco.py): here after optimizer step s, with the m of step s + 1; 1 after the last."""
    recorder = RecordEMA()
    model = tiny_mocov3()
    for module in model.target_projector.modules():  # a target that is not the online copy, so every momentum is visible
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    cpu_trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[recorder]).fit(model, digits(MOCOV3_VIEWS, batch_size=16))
    for step, momentum in ((0, 1 - 0.1 * (math.cos(math.pi / 4) + 1) / 2), (1, 0.95), (3, 1.0)):
        assert recorder.largest_deviation(step, momentum) < 1e-6, step
        assert recorder.largest_deviation(step, 0.9) > 1e-5, step  # a constant momentum is told apart


@pytest.mark.slow
def test_a_vit_keeps_its_random_patch_projection_and_fixed_positions_in_both_encoders(tmp_path):
    model = tiny_mocov3(backbone=TINY_VIT, optimizer=OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.1))
    before = copy.deepcopy(model.state_dict())
    cpu_trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(model, digits(MOCOV3_VIEWS, batch_size=16))
    after = model.state_dict()
    for prefix in ("backbone.", "target_backbone."):
        for name in ("patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed"):
            torch.testing.assert_close(after[prefix + name], before[prefix + name], rtol=0, atol=1e-7)
    assert not torch.equal(after["backbone.blocks.0.attn.qkv.weight"], before["backbone.blocks.0.attn.qkv.weight"])


@pytest.mark.slow
def test_mocov3_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_mocov3(backbone=SMALL_TRUNK, optimizer=OptimizerSpec(lr=0.1))
    datamodule = digits(MOCOV3_VIEWS, batch_size=32)
    batch = first_batch(datamodule)
    before = fixed_batch_loss(model, batch)
    cpu_trainer(tmp_path, max_steps=10, limit_val_batches=0).fit(model, datamodule)
    assert fixed_batch_loss(model, batch) < 0.97 * before, before  # 10 steps at batch 32: 2.89 -> 2.48
