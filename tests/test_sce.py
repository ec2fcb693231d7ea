"""SCE and ReSSL: the views each branch sees, the losses they call, what is enqueued, and training."""

import pytest
import torch
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch, fixed_batch_loss

from backbones import MLPSpec
from engine.config import RampSpec
from methods import SCE, MoCoV2, ReSSL
from methods.losses import ressl_loss, sce_loss
from methods.momentum import MomentumSpec

WEAK_STRONG = {"weak": {"preset": "crop_flip"}, "strong": {"preset": "mocov2"}}
COMMON = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=256, knn_k=0,
              momentum=MomentumSpec(base=0.99, shuffle_bn=False))


def tiny(method, **kwargs):
    return method(**(COMMON | kwargs))


def step_with_its_inputs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss of one step of a weak/strong model on `batch`, with its query, key and the queue before the step."""
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    with torch.no_grad():
        _, query = model.embed(batch["views"]["strong"])
        key = model.target_embed(batch["views"]["weak"])
    return loss, query, key, queue_before


def test_sce_with_coeff_one_is_moco_v2_on_the_same_batch_and_state():
    moco = tiny(MoCoV2, temperature=0.2)
    sce = tiny(SCE, temperature=0.2, temperature_momentum=0.05, coeff=1.0)
    sce.load_state_dict(moco.state_dict())
    batch = first_batch(digits(WEAK_STRONG, batch_size=16))
    views = batch["views"]
    moco_loss, _ = moco.step(batch | {"views": {"query": views["strong"], "key": views["weak"]}})
    sce_loss_value, _ = sce.step(batch)
    torch.testing.assert_close(sce_loss_value, moco_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sce.queue.keys, moco.queue.keys)


def test_weak_view_feeds_the_target_and_strong_view_the_online_branch_then_keys_are_enqueued():
    model = tiny(SCE, temperature=0.1, temperature_momentum=0.05, coeff=0.5)
    loss, query, key, queue_before = step_with_its_inputs(model, first_batch(digits(WEAK_STRONG, batch_size=16)))
    torch.testing.assert_close(loss, sce_loss(query, key, queue_before, 0.1, 0.05, 0.5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.queue.keys[:16], key)
    assert torch.equal(model.queue.keys[16:], queue_before[16:])


def test_symmetric_loss_averages_both_directions_and_enqueues_both_global_keys():
    views = {"global1": {"preset": "mocov2"}, "global2": {"preset": "mocov2"}}
    model = tiny(SCE, symmetric=True, temperature=0.1, temperature_momentum=0.07)
    assert model.views == ("global1", "global2") and model.keys_per_sample == 2
    batch = first_batch(digits(views, batch_size=16))
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    with torch.no_grad():
        (_, q1), (_, q2) = model.embed(batch["views"]["global1"]), model.embed(batch["views"]["global2"])
        z1, z2 = model.target_embed(batch["views"]["global1"]), model.target_embed(batch["views"]["global2"])
    expected = (sce_loss(q2, z1, queue_before, 0.1, 0.07, 0.5) + sce_loss(q1, z2, queue_before, 0.1, 0.07, 0.5)) / 2
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.queue.keys[:32], torch.cat([z1, z2]))
    assert model.queue.pointer.item() == 32


def test_local_crops_are_each_predicted_from_the_weak_view():
    views = WEAK_STRONG | {"local": {"preset": "mocov2", "size": 16, "count": 2}}
    model = tiny(SCE, local_crops=["local"])
    assert model.views == ("weak", "strong") and model.local_crops == ("local",)
    batch = first_batch(digits(views, batch_size=16))
    assert batch["views"]["local"].shape == (16, 2, 3, 16, 16)
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    with torch.no_grad():
        key = model.target_embed(batch["views"]["weak"])
        crops = [batch["views"]["strong"], batch["views"]["local"][:, 0], batch["views"]["local"][:, 1]]
        expected = torch.stack([sce_loss(model.embed(crop)[1], key, queue_before, 0.1, 0.05, 0.5) for crop in crops]).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", [SCE, ReSSL])
def test_no_gradient_reaches_the_target_branch_or_the_queue(method):
    model = tiny(method)
    batch = first_batch(digits(WEAK_STRONG, batch_size=16))
    loss, _ = model.step(batch)
    loss.backward()
    assert all(p.grad is None for p in [*model.target_backbone.parameters(), *model.target_projector.parameters()])
    assert model.backbone.conv1.weight.grad.abs().sum() > 0
    assert not model.queue.keys.requires_grad


def test_ressl_matches_the_teacher_relations_of_the_weak_view_over_the_queue():
    model = tiny(ReSSL, temperature=0.1, temperature_momentum=0.04)
    loss, query, key, queue_before = step_with_its_inputs(model, first_batch(digits(WEAK_STRONG, batch_size=16)))
    torch.testing.assert_close(loss, ressl_loss(query, key, queue_before, 0.1, 0.04), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.queue.keys[:16], key)


def test_the_predictor_is_online_only():
    model = tiny(SCE, predictor=MLPSpec(hidden_dim=16, output_dim=TINY_PROJECTOR.output_dim))
    images = torch.randn(8, 3, 32, 32)
    features, projection = model.embed(images)
    torch.testing.assert_close(projection, torch.nn.functional.normalize(model.predictor(model.projector(features)), dim=1))
    assert not any(name.startswith("target_predictor") for name, _ in model.named_modules())
    assert model.target_projector[-1].out_features == TINY_PROJECTOR.output_dim


def test_warmups_ramp_tau_m_and_coeff_from_their_start_values(monkeypatch):
    model = tiny(SCE, temperature_momentum=0.05, coeff=0.5,
                 temperature_momentum_warmup=RampSpec(start=0.1, epochs=10),
                 coeff_warmup=RampSpec(start=1.0, epochs=10, shape="cosine"))
    for epochs, expected in [(0.0, (0.1, 1.0)), (5.0, (0.075, 0.75)), (10.0, (0.05, 0.5)), (30.0, (0.05, 0.5))]:
        monkeypatch.setattr(SCE, "epochs_done", property(lambda self, value=epochs: value))
        assert model.scheduled() == pytest.approx(expected)


def test_the_step_takes_tau_m_and_coeff_at_their_warm_up_points(monkeypatch):
    model = tiny(SCE, temperature=0.1, temperature_momentum=0.05, coeff=0.5,
                 temperature_momentum_warmup=RampSpec(start=0.1, epochs=10), coeff_warmup=RampSpec(start=1.0, epochs=10))
    monkeypatch.setattr(SCE, "epochs_done", property(lambda self: 5.0))  # half-way: tau_m 0.075, coeff 0.75
    loss, query, key, queue_before = step_with_its_inputs(model, first_batch(digits(WEAK_STRONG, batch_size=16)))
    torch.testing.assert_close(loss, sce_loss(query, key, queue_before, 0.1, 0.075, 0.75), rtol=1e-5, atol=1e-6)


def test_bad_sce_settings_are_refused_with_their_values():
    with pytest.raises(ValueError, match="temperature_momentum must be > 0, got 0.0"):
        tiny(SCE, temperature_momentum=0.0)
    with pytest.raises(ValueError, match=r"coeff must lie in \[0, 1\], got 1.5"):
        tiny(SCE, coeff=1.5)
    # a ramp's start and length, before anything is written (they failed at the first training step)
    with pytest.raises(ValueError, match=r"^model.temperature_momentum_warmup.start as temperature_momentum must be > 0, got 0.0$"):
        tiny(SCE, temperature_momentum_warmup={"start": 0.0, "epochs": 5})
    with pytest.raises(ValueError, match=r"^model.coeff_warmup.start as coeff must lie in \[0, 1\], got 1.5$"):
        tiny(SCE, coeff_warmup={"start": 1.5, "epochs": 5})
    with pytest.raises(ValueError, match=r"^a ramp needs epochs > 0, got 0$"):
        tiny(SCE, coeff_warmup={"start": 1.0, "epochs": 0})
    with pytest.raises(ValueError, match=r"consumes the views \['global1', 'global2'\] but data.views provides \['weak', 'strong'\]"):
        tiny(SCE, symmetric=True).check_data(digits(WEAK_STRONG), world_size=1)


@pytest.mark.parametrize("method", [SCE, ReSSL])
@pytest.mark.slow
def test_training_steps_lower_the_loss_on_the_embedded_data(method, tmp_path):
    model = tiny(method)
    datamodule = digits(WEAK_STRONG, batch_size=32)
    batch = first_batch(datamodule)
    queue = model.queue.read()
    before = fixed_batch_loss(model, batch, queue)
    cpu_trainer(tmp_path, max_steps=10, limit_val_batches=0).fit(model, datamodule)
    after = fixed_batch_loss(model, batch, queue)
    assert after < before - 0.1 * abs(before), (before, after)
