import copy

import pytest
import torch

import methods.momentum as momentum_module
from methods import MoCoV2
from methods.losses import info_nce
from methods.momentum import MomentumSpec
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits, first_batch

MOCO_VIEWS = {"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}


def tiny_moco(**kwargs) -> MoCoV2:
    options = dict(
        backbone=TINY_BACKBONE,
        projector=TINY_PROJECTOR,
        queue_size=256,
        temperature=0.2,
        momentum=MomentumSpec(base=0.99, shuffle_bn=False),
        knn_k=0,
    )
    return MoCoV2(**(options | kwargs))


def test_target_encoder_starts_as_a_frozen_copy_of_the_online_encoder():
    model = tiny_moco()
    for online, target in ((model.backbone, model.target_backbone), (model.projector, model.target_projector)):
        for (name, p), (_, q) in zip(online.named_parameters(), target.named_parameters()):
            assert torch.equal(p, q), name
            assert not q.requires_grad


def test_loss_uses_the_queue_before_the_step_and_the_keys_are_enqueued_after():
    model = tiny_moco()
    batch = first_batch(digits(MOCO_VIEWS, batch_size=16))
    queue_before = model.queue.read()
    loss, _ = model.step(batch)
    with torch.no_grad():
        _, query = model.embed(batch["views"]["query"])
        key = model.target_embed(batch["views"]["key"])
    torch.testing.assert_close(loss, info_nce(query, key, queue_before, 0.2), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.queue.keys[:16], key)  # the momentum keys of this batch
    assert torch.equal(model.queue.keys[16:], queue_before[16:])
    assert model.queue.pointer.item() == 16


def test_no_gradient_reaches_the_target_branch_or_the_queue():
    model = tiny_moco()
    batch = first_batch(digits(MOCO_VIEWS, batch_size=16))
    model.training_step(batch, 0).backward()  # the method's loss and the online probe's, as the trainer runs them
    assert all(p.grad is None for p in model.target_backbone.parameters())
    assert all(p.grad is None for p in model.target_projector.parameters())
    assert model.backbone.conv1.weight.grad is not None
    assert not model.queue.keys.requires_grad


def fixed_batch_infonce(model: MoCoV2, batch: dict, negatives: torch.Tensor) -> float:
    """The method's InfoNCE on fixed views against fixed negatives (BN in batch-statistics mode, as
    in training), evaluated on a copy so that nothing is updated."""
    frozen = copy.deepcopy(model).train()
    with torch.no_grad():
        _, query = frozen.embed(batch["views"]["query"])
        return info_nce(query, frozen.target_embed(batch["views"]["key"]), negatives, frozen.temperature).item()


@pytest.mark.slow
def test_moco_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    model = tiny_moco()
    datamodule = digits(MOCO_VIEWS, batch_size=32)
    batch = first_batch(datamodule)
    initial_queue = model.queue.read()  # the negatives of the first step
    before = fixed_batch_infonce(model, batch, initial_queue)
    cpu_trainer(tmp_path, max_steps=10, limit_val_batches=0).fit(model, datamodule)
    after = fixed_batch_infonce(model, batch, initial_queue)
    assert after < 0.7 * before, (before, after)


@pytest.mark.slow
def test_momentum_update_runs_once_per_optimizer_step_under_gradient_accumulation(tmp_path, monkeypatch):
    calls = []
    original = momentum_module.ema_update_
    monkeypatch.setattr(momentum_module, "ema_update_", lambda *args: calls.append(args[2]) or original(*args))
    model = tiny_moco()
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=4, accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(model, digits(MOCO_VIEWS, batch_size=16))
    assert trainer.global_step == 2
    assert calls == [0.99] * 4  # two optimizer steps x (backbone, projector)


@pytest.mark.slow
def test_cosine_momentum_reaches_one_at_the_last_step(tmp_path, monkeypatch):
    calls = []
    original = momentum_module.ema_update_
    monkeypatch.setattr(momentum_module, "ema_update_", lambda *args: calls.append(args[2]) or original(*args))
    model = tiny_moco(momentum=MomentumSpec(base=0.9, schedule="cosine", shuffle_bn=False))
    cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=0).fit(model, digits(MOCO_VIEWS, batch_size=16))
    assert calls[::2] == pytest.approx([0.9, 0.95, 1.0])


def test_negative_temperature_and_bad_momentum_are_refused():
    with pytest.raises(ValueError, match="temperature must be > 0, got -0.1"):
        tiny_moco(temperature=-0.1)
    with pytest.raises(ValueError, match=r"momentum.base must lie in \[0, 1\], got 1.5"):
        tiny_moco(momentum=MomentumSpec(base=1.5))
    with pytest.raises(ValueError, match="momentum.schedule must be one of 'constant', 'cosine', 'cosine_byol', 'cosine_mocov3', got 'cosine_moco'"):
        tiny_moco(momentum=MomentumSpec(schedule="cosine_moco"))  # ran BYOL's cosine


def test_a_queue_smaller_than_the_global_batch_is_refused():
    model = tiny_moco(queue_size=16)
    with pytest.raises(ValueError, match=r"queue size 16 is smaller than the 32 keys enqueued per step"):
        model.check_data(digits(MOCO_VIEWS, batch_size=32), world_size=1)


def test_views_must_match_what_the_method_consumes():
    model = tiny_moco()
    with pytest.raises(ValueError, match=r"consumes the views \['query', 'key'\] but data.views provides \['weak', 'strong'\]"):
        model.check_data(digits({"weak": {"preset": "crop_flip"}, "strong": {"preset": "mocov2"}}), world_size=1)


def test_the_online_probe_never_changes_the_backbone():
    """The trunk's gradient of a training step (method loss + probe loss) is that of the method's loss alone."""
    model = tiny_moco()
    method_only = copy.deepcopy(model)
    batch = first_batch(digits(MOCO_VIEWS, batch_size=16))
    torch.manual_seed(0)  # the same shuffle-BN permutation in both
    model.training_step(batch, 0).backward()
    torch.manual_seed(0)
    method_only.step(batch)[0].backward()
    for with_probe, without in zip(model.backbone.parameters(), method_only.backbone.parameters()):
        torch.testing.assert_close(with_probe.grad, without.grad, rtol=0, atol=0)
    assert model.probe.weight.grad is not None and model.probe.weight.grad.abs().sum() > 0


def test_unlabelled_samples_are_left_out_of_the_probe_loss():
    model = tiny_moco()
    features = torch.randn(4, model.feature_dim)
    labels = torch.tensor([3, -1, 5, -1])
    expected = torch.nn.functional.cross_entropy(model.probe(features[[0, 2]]), labels[[0, 2]])
    torch.testing.assert_close(model.probe_loss(features, labels), expected)
    assert model.probe_loss(features, torch.full((4,), -1)).item() == 0.0  # no NaN on an unlabelled batch
