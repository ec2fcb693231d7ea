"""DINO as a method: the student sees every crop, the teacher the global views; the teacher's outputs are centred by
an EMA over the global batch (updated after the loss) and sharpened by a temperature warmed up per epoch; the last
layer is frozen in the first epoch; the teacher follows the student by EMA (facebookresearch/dino main_dino.py).
Its 2-process equivalence is in tests/test_distributed.py."""

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import SMALL_TRUNK, TINY_BACKBONE, cpu_trainer, digits, first_batch, loss_before_and_after_training
from lightning.pytorch.callbacks import Callback

from backbones import MLPSpec
from engine.optim import OptimizerSpec, ScheduleSpec
from methods import DINO
from methods.losses import dino_loss
from methods.momentum import MomentumSpec

VIEWS = {"global1": {"preset": "mocov2"}, "global2": {"preset": "mocov2"}}
LOCAL = {"local": {"preset": "mocov2", "size": 16, "scale": [0.2, 0.5], "count": 2}}
HEAD = MLPSpec(hidden_dim=32, output_dim=16, num_layers=3, batch_norm=False, activation="gelu")


def tiny_dino(**kwargs) -> DINO:
    options = dict(backbone=TINY_BACKBONE, projector=HEAD, out_dim=20, knn_k=0, schedule=ScheduleSpec(decay="constant"),
                   optimizer=OptimizerSpec(lr=0.1, momentum=0.9, clip_grad_per_parameter=3.0),
                   momentum=MomentumSpec(base=0.9, schedule="constant", shuffle_bn=False))  # fmt: skip
    return DINO(**(options | kwargs))


def outputs(model: DINO, crops: list[torch.Tensor], teacher: bool) -> torch.Tensor:
    """(V, B, K): the crops through the teacher or the student, batched by resolution, on a copy."""
    copied = copy.deepcopy(model).train()
    prefix = "target_" if teacher else ""
    trunk, projector, last_layer = (getattr(copied, prefix + name) for name in ("backbone", "projector", "last_layer"))
    runs = [torch.cat(crops[:2])] + ([torch.cat(crops[2:])] if len(crops) > 2 else [])
    with torch.no_grad():
        logits = last_layer(torch.nn.functional.normalize(projector(torch.cat([trunk(run) for run in runs])), dim=-1))
    return logits.unflatten(0, (len(crops), -1))


def test_the_student_sees_every_crop_the_teacher_the_global_views_and_the_centre_moves_after_the_loss():
    model, batch = tiny_dino(local_crops=["local"]), first_batch(digits(VIEWS | LOCAL, batch_size=8))
    views = batch["views"]
    crops = [views["global1"], views["global2"], *views["local"].unbind(1)]
    student, teacher = outputs(model, crops, teacher=False), outputs(model, crops[:2], teacher=True)
    with torch.no_grad():
        first, _ = model.step(batch)
    assert first.item() == pytest.approx(dino_loss(student, teacher, torch.zeros(1, 20), 0.1, 0.04).item(), rel=1e-5)
    assert not model.center.any()  # the centre moves with the optimizer step
    model.update_center()
    center = 0.1 * teacher.flatten(0, 1).mean(dim=0, keepdim=True)  # 0.9 x 0 + 0.1 x the batch mean
    torch.testing.assert_close(model.center, center)
    with torch.no_grad():
        second, _ = model.step(batch)  # the same views: now centred
    assert second.item() == pytest.approx(dino_loss(student, teacher, center, 0.1, 0.04).item(), rel=1e-5)
    model.update_center()
    torch.testing.assert_close(model.center, 0.9 * center + 0.1 * teacher.flatten(0, 1).mean(dim=0, keepdim=True))


def test_with_accumulated_batches_the_centre_moves_once_per_optimizer_step_towards_their_mean():
    """main_dino.py updates the centre once per iteration from its global batch: two accumulated batches move it once,
    by the mean of both (it took an EMA step per batch, 0.9^2 per optimizer step)."""
    model, batch = tiny_dino(), first_batch(digits(VIEWS, batch_size=8))
    views = batch["views"]
    other = {"views": {name: view.flip(-1) for name, view in views.items()}, "label": batch["label"]}
    teachers = [outputs(model, [b["views"]["global1"], b["views"]["global2"]], teacher=True) for b in (batch, other)]
    with torch.no_grad():
        model.step(batch)
        model.step(other)
    model.update_center()
    both = torch.cat([teacher.flatten(0, 1) for teacher in teachers]).mean(dim=0, keepdim=True)
    torch.testing.assert_close(model.center, 0.1 * both)


@pytest.mark.parametrize("warmup_epochs, expected", [(3, 0.04), (0, 0.07)])
def test_the_step_sharpens_the_teacher_with_the_temperature_of_its_epoch(warmup_epochs, expected):
    """Epoch 0: the warm-up's start, or the final temperature without a warm-up (the later epochs: below)."""
    model = tiny_dino(warmup_teacher_temperature=0.04, teacher_temperature=0.07, warmup_teacher_temperature_epochs=warmup_epochs)
    batch = first_batch(digits(VIEWS, batch_size=8))
    crops = [batch["views"]["global1"], batch["views"]["global2"]]
    student, teacher = outputs(model, crops, teacher=False), outputs(model, crops, teacher=True)
    with torch.no_grad():
        loss, _ = model.step(batch)
    assert loss.item() == pytest.approx(dino_loss(student, teacher, torch.zeros(1, 20), 0.1, expected).item(), rel=1e-5)
    assert loss.item() != pytest.approx(dino_loss(student, teacher, torch.zeros(1, 20), 0.1, 0.11 - expected).item(), rel=1e-5)


@pytest.mark.parametrize("settings, warned", [
    (dict(warmup_teacher_temperature_epochs=3), ["warmup_teacher_temperature_epochs 3 is too long for the run's 2 epochs"]),
    (dict(warmup_teacher_temperature_epochs=2, freeze_last_layer_epochs=1), []),  # the last epoch at 0.07, the last layer trained in it
    (dict(freeze_last_layer_epochs=2), ["freeze_last_layer_epochs 2 is too long for the run's 2 epochs: the last layer never trains"]),
])
def test_warm_ups_and_freezes_longer_than_the_run_are_warnings(settings, warned, tmp_path, recwarn):
    """main_dino.py refuses a teacher warm-up longer than the run (np.ones of a negative length)."""
    model = tiny_dino(warmup_teacher_temperature=0.04, teacher_temperature=0.07, **settings)
    cpu_trainer(tmp_path, max_epochs=2, limit_train_batches=1, limit_val_batches=0).fit(model, digits(VIEWS, batch_size=8))
    messages = [str(warning.message) for warning in recwarn if "is too long for the run" in str(warning.message)]
    assert len(messages) == len(warned) and all(message.startswith(f"model.init_args.{text}") for message, text in zip(messages, warned))


def test_a_head_with_batchnorm_has_no_biases_before_its_norms_and_builds():
    model = tiny_dino(projector=MLPSpec(hidden_dim=32, output_dim=16, num_layers=3, batch_norm=True, activation="gelu"))
    assert any(isinstance(layer, torch.nn.BatchNorm1d) for layer in model.projector.modules())


def test_the_last_layer_is_weight_normalised_with_unit_norms_that_only_train_without_norm_last_layer():
    normed, free = tiny_dino(), tiny_dino(norm_last_layer=False)
    torch.testing.assert_close(normed.last_layer.weight.norm(dim=1), torch.ones(20))
    assert not normed.last_layer.parametrizations.weight.original0.requires_grad
    assert free.last_layer.parametrizations.weight.original0.requires_grad


class Record(Callback):
    def __init__(self):
        self.temperatures, self.last_layer, self.trunk, self.teacher = [], [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.temperatures.append(trainer.callback_metrics["train/teacher_temperature"].item())  # as the step used it
        self.last_layer.append(module.last_layer.parametrizations.weight.original1.detach().clone())
        self.trunk.append(module.backbone.conv1.weight.detach().clone())
        self.teacher.append(module.target_backbone.conv1.weight.detach().clone())


@pytest.mark.slow
def test_teacher_temperature_warms_up_per_epoch_and_the_last_layer_moves_from_the_second_epoch(tmp_path):
    model = tiny_dino(warmup_teacher_temperature=0.04, teacher_temperature=0.07, warmup_teacher_temperature_epochs=3)
    initial_last_layer = model.last_layer.parametrizations.weight.original1.detach().clone()
    initial_teacher = model.target_backbone.conv1.weight.detach().clone()
    initial_student = model.backbone.conv1.weight.detach().clone()
    record = Record()
    cpu_trainer(tmp_path, max_epochs=4, limit_train_batches=2, limit_val_batches=0, callbacks=[record]).fit(model, digits(VIEWS, batch_size=8))
    per_epoch = np.concatenate([np.linspace(0.04, 0.07, 3), [0.07]])  # main_dino.py DINOLoss.teacher_temp_schedule
    assert record.temperatures == pytest.approx(np.repeat(per_epoch, 2).tolist())
    assert torch.equal(record.last_layer[0], initial_last_layer) and torch.equal(record.last_layer[1], initial_last_layer)
    assert not torch.equal(record.last_layer[2], record.last_layer[1])  # epoch 1: trained
    assert not torch.equal(record.trunk[0], initial_student)  # the trunk trains from the first step
    first_student = record.trunk[0]
    torch.testing.assert_close(record.teacher[0], 0.9 * initial_teacher + 0.1 * first_student)  # EMA after the step


@pytest.mark.slow
def test_training_steps_lower_the_loss_on_the_embedded_data(tmp_path):
    before, after = loss_before_and_after_training(tiny_dino(backbone=SMALL_TRUNK, freeze_last_layer_epochs=0), VIEWS, tmp_path)
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("interpolation, local_size, refused", [
    ("timm", 32, None), ("timm", 16, "data.init_args.views.local gives 16 px images, but the ViT trunk takes 32 px ones only"),
    ("dino", 16, None), ("dino", 18, "data.init_args.views.local gives 18 px images, which the ViT trunk's 8 px patches do not divide"),
])
def test_crops_a_vit_trunk_cannot_take_are_refused_before_anything_is_written(interpolation, local_size, refused):
    """timm's patch embedding takes its img_size only, or with DINO's interpolation any multiple of the patch: another
    crop failed at the first training step, after the run's files were written."""
    vit = {"name": "vit_tiny", "kwargs": {"img_size": 32, "patch_size": 8, "depth": 1, "position_interpolation": interpolation}}
    model = tiny_dino(backbone=vit, local_crops=["local"])
    datamodule = digits(VIEWS | {"local": {"preset": "mocov2", "size": local_size, "scale": [0.2, 0.5], "count": 2}}, batch_size=8)
    if refused is None:
        model.check_data(datamodule, world_size=1)
        first = first_batch(datamodule)
        with torch.no_grad():
            model.step(first)  # the accepted crops do pass the trunk
    else:
        with pytest.raises(ValueError, match="^" + re.escape(refused)):
            model.check_data(datamodule, world_size=1)


@pytest.mark.parametrize("momentum", [{"shuffle_bn": True, "split_bn": 1}, {"shuffle_bn": False, "split_bn": 4}, {"shuffle_bn": True, "split_bn": 8}])
def test_a_shuffled_or_split_batchnorm_teacher_is_refused_as_dino_never_shuffles_its_views(momentum):
    with pytest.raises(ValueError, match=rf"model.momentum: DINO's teacher sees the views unshuffled .*, got {momentum['shuffle_bn']} and {momentum['split_bn']}$"):
        tiny_dino(momentum=MomentumSpec(base=0.9, schedule="constant", **momentum))


def test_the_knn_monitor_votes_with_the_teacher():
    """facebookresearch/dino eval_knn.py reads the teacher (--checkpoint_key teacher), for the bank and the queries."""
    model = tiny_dino(knn_k=5).eval()
    with torch.no_grad():
        for param in model.target_backbone.parameters():
            param.add_(0.1)  # a teacher that differs from the student
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        batch = {"image": images, "label": labels, "index": torch.arange(4)}  # an evaluation batch (datamodules.base)
        model._evaluation_step(batch, 0)
        model._evaluation_step(batch, 1)
        teacher, student = F.normalize(model.target_backbone(images), dim=1), model.backbone(images)
    for name in ("features", "bank_features"):
        torch.testing.assert_close(torch.cat(model._collected[name]), teacher)
    assert not torch.allclose(F.normalize(student, dim=1), teacher)  # else the test could not tell them apart
