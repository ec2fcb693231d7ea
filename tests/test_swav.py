"""SwAV as a method: prototypes back on the unit sphere before every step and frozen for the first steps, codes by
Sinkhorn-Knopp over the global batch (and the queue once it is full), the swapped prediction over every other crop,
the queue filled from `queue_start_epoch` and read once full (facebookresearch/swav main_swav.py). Its 2-process
equivalence is in tests/test_distributed.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_TRUNK, TINY_BACKBONE, cpu_trainer, digits, loss_before_and_after_training
from lightning.pytorch.callbacks import Callback

from backbones import MLPSpec
from engine.optim import OptimizerSpec
from methods import SwAV
from methods.losses import sinkhorn_knopp, swav_loss

VIEWS = {"global1": {"preset": "mocov2"}, "global2": {"preset": "mocov2"}}
LOCAL = {"local": {"preset": "mocov2", "size": 16, "scale": [0.2, 0.5], "count": 2}}
HEAD = MLPSpec(hidden_dim=64, output_dim=16, num_layers=2, batch_norm=True)


def tiny_swav(**kwargs) -> SwAV:
    options = dict(backbone=TINY_BACKBONE, projector=HEAD, num_prototypes=10, freeze_prototypes_steps=0, knn_k=0,
                   optimizer=OptimizerSpec(lr=0.1, momentum=0.9))  # fmt: skip
    return SwAV(**(options | kwargs))


def first_batch(views: dict, batch_size: int = 8) -> dict:
    datamodule = digits(views, batch_size=batch_size)
    datamodule.setup()
    return next(iter(datamodule.train_dataloader()))


def test_the_loss_predicts_the_sinkhorn_codes_of_each_global_view_from_every_other_crop_batched_by_resolution():
    model, batch = tiny_swav(local_crops=["local"]), first_batch(VIEWS | LOCAL)
    with torch.no_grad():
        model.prototypes.weight.mul_(3.0)  # off the sphere: the step normalises before scoring
    reference = copy.deepcopy(model).train()
    views = batch["views"]
    with torch.no_grad():
        prototypes = F.normalize(reference.prototypes.weight, dim=1)
        features = torch.cat([reference.backbone(torch.cat([views["global1"], views["global2"]])),
                              reference.backbone(views["local"].transpose(0, 1).flatten(0, 1))])  # fmt: skip
        embeddings = F.normalize(reference.projector(features), dim=1).unflatten(0, (4, 8))  # the head on all crops at once
        scores = embeddings @ prototypes.T
        codes = torch.stack([sinkhorn_knopp(scores[view], 0.05, 3) for view in (0, 1)])
        loss, _ = model.step(batch)
    assert loss.item() == pytest.approx(swav_loss(scores, codes, 0.1).item(), rel=1e-5)
    torch.testing.assert_close(model.prototypes.weight.norm(dim=1), torch.ones(10))


class Record(Callback):
    """What changes from step to step: the queue's state before each step, then the prototypes, a trunk weight and
    the queue after it."""

    def __init__(self):
        self.states, self.prototypes, self.trunk, self.queues = [], [], [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.states.append(module.queue_state(8) if module.queues is not None else None)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.prototypes.append(module.prototypes.weight.detach().clone())
        self.trunk.append(module.backbone.conv1.weight.detach().clone())
        self.queues.append(module.queues[0].read() if module.queues is not None else None)


def train(model, tmp_path, **trainer_options) -> Record:
    record = Record()
    cpu_trainer(tmp_path, limit_val_batches=0, callbacks=[record], **trainer_options).fit(model, digits(VIEWS, batch_size=8))
    return record


@pytest.mark.slow
def test_the_prototypes_do_not_move_during_the_first_freeze_prototypes_steps_while_the_trunk_does(tmp_path):
    model = tiny_swav(freeze_prototypes_steps=2)
    initial = F.normalize(model.prototypes.weight.detach().clone(), dim=1)
    record = train(model, tmp_path, max_steps=3)
    for step in (0, 1):  # renormalised only (a unit vector normalised again moves by a rounding error)
        torch.testing.assert_close(record.prototypes[step], initial, rtol=0, atol=1e-6)
    assert not torch.allclose(record.prototypes[2], initial, atol=1e-6)  # step 3 (global step 2) moves them
    assert not torch.equal(record.trunk[0], record.trunk[1])


@pytest.mark.slow
def test_the_queue_fills_from_its_start_epoch_and_is_read_once_full(tmp_path):
    model = tiny_swav(queue_size=16, queue_start_epoch=1)  # 2 global batches of 8
    record = train(model, tmp_path, max_epochs=3, limit_train_batches=2)
    assert record.states == [(False, False)] * 2 + [(True, False)] * 2 + [(True, True)] * 2
    empty = torch.zeros(16, 16)
    assert torch.equal(record.queues[0], empty) and torch.equal(record.queues[1], empty)  # epoch 0: not started
    assert torch.count_nonzero((record.queues[2][:8].norm(dim=1) - 1).abs() < 1e-5) == 8 and torch.equal(record.queues[2][8:], empty[8:])
    torch.testing.assert_close(record.queues[3][8:], record.queues[2][:8])  # shifted by one global batch
    torch.testing.assert_close(record.queues[3].norm(dim=1), torch.ones(16))  # full: unit embeddings in every row


def test_codes_of_a_full_queue_come_from_sinkhorn_over_the_queue_and_the_batch():
    model = tiny_swav(queue_size=16)
    queued, batch = F.normalize(torch.randn(16, 16), dim=1), F.normalize(torch.randn(8, 16), dim=1)
    model.queues[0].push(queued)
    model.queue_state = lambda global_batch: (True, True)
    expected = sinkhorn_knopp(torch.cat([queued, batch]) @ model.prototypes.weight.T, 0.05, 3)[-8:]
    torch.testing.assert_close(model.codes(0, batch), expected)
    torch.testing.assert_close(model.queues[0].read(), torch.cat([batch, queued[:8]]))  # then it receives the batch
    model.queue_state = lambda global_batch: (False, False)
    torch.testing.assert_close(model.codes(0, batch), sinkhorn_knopp(batch @ model.prototypes.weight.T, 0.05, 3))


def test_a_queue_that_is_not_a_multiple_of_the_global_batch_is_refused():
    model = tiny_swav(queue_size=20)
    with pytest.raises(ValueError, match=r"model.init_args.queue_size 20 must be a multiple of the global batch 16 \(data.init_args.batch_size x .* 16"):
        model.check_data(digits(VIEWS, batch_size=8), world_size=2)


@pytest.mark.slow
def test_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    before, after = loss_before_and_after_training(tiny_swav(backbone=SMALL_TRUNK), VIEWS, tmp_path)
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("settings, warned", [
    (dict(queue_size=16, queue_start_epoch=2), ["queue_start_epoch 2 is too long for the run's 2 epochs: the queue is never filled"]),
    (dict(queue_size=16, queue_start_epoch=1, freeze_prototypes_steps=1), []),
    (dict(queue_start_epoch=5), []),  # no queue
    (dict(freeze_prototypes_steps=2), ["freeze_prototypes_steps 2 is too long for the run's 2 steps: the prototypes never train"]),
])
def test_a_queue_start_or_a_prototype_freeze_longer_than_the_run_is_a_warning(settings, warned, tmp_path, recwarn):
    cpu_trainer(tmp_path, max_epochs=2, limit_train_batches=1, limit_val_batches=0).fit(tiny_swav(**settings), digits(VIEWS, batch_size=8))
    messages = [str(warning.message) for warning in recwarn if "is too long for the run" in str(warning.message)]
    assert messages == [f"model.init_args.{text}" for text in warned]
