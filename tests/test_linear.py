import logging
import warnings

import pytest
import torch
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits

from backbones import BackboneSpec
from engine.checkpoint_record import CheckpointMismatch
from engine.optim import OptimizerSpec, ScheduleSpec
from methods import FineTune, LinearProbe, MoCoV2
from methods.momentum import MomentumSpec
from methods.probed_trunk import trunk_as_trained

LINEAR_VIEWS = {"image": {"preset": "crop_pad_flip"}}


@pytest.fixture(scope="module")
def pretrained_checkpoint(tmp_path_factory):
    """A real (one-step) MoCo v2 pretraining checkpoint written by Lightning."""
    directory = tmp_path_factory.mktemp("pretrain")
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)
    trainer = cpu_trainer(directory, max_steps=1, limit_val_batches=0)
    trainer.fit(model, digits({"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}, batch_size=16))
    path = directory / "pretrain.ckpt"
    trainer.save_checkpoint(path)
    return path, {key: value.clone() for key, value in model.backbone.state_dict().items()}


@pytest.mark.slow
def test_backbone_is_loaded_from_the_checkpoint_with_its_recorded_spec(pretrained_checkpoint):
    path, weights = pretrained_checkpoint
    probe = LinearProbe(pretrained_ckpt=str(path))
    for key, value in probe.backbone.state_dict().items():
        assert torch.equal(value, weights[key]), key


@pytest.mark.parametrize(
    "backbone, message",
    [
        (BackboneSpec("resnet34"), r"model.backbone.name 'resnet34', but model.pretrained_ckpt '.*' was trained with 'resnet18'"),
        (BackboneSpec("resnet18", small_input=True), "model.backbone.small_input True, but .* was trained with False"),
        (BackboneSpec("resnet18", kwargs={"zero_init_residual": True}), r"model.backbone.kwargs.zero_init_residual True, but .* was trained without it: the trunk is probed as it was trained"),
    ],
)
def test_a_backbone_other_than_the_one_the_checkpoint_was_trained_with_is_refused(pretrained_checkpoint, backbone, message):
    with pytest.raises(ValueError, match=message):
        LinearProbe(pretrained_ckpt=str(pretrained_checkpoint[0]), backbone=backbone)


def test_a_small_input_stem_other_than_the_trained_one_is_refused():
    """Both stems have the same tensor shapes (solo-learn's pads by 2): the weights would load strictly into the other."""
    with pytest.raises(CheckpointMismatch, match="model.backbone.small_input_stem 'solo_learn', but run.ckpt was trained with 'sce'"):
        trunk_as_trained(BackboneSpec("resnet18", small_input=True), BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn"), "run.ckpt")
    assert trunk_as_trained(BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn"), BackboneSpec(), "run.ckpt").small_input_stem == "solo_learn"


def test_a_vit_checkpoint_is_probed_with_its_own_head_count_and_the_configs_features(tmp_path):
    """A ViT's head count changes no tensor shape: the config's trunk would load strictly into another network."""
    trained = BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=1, num_heads=12))
    model = MoCoV2(backbone=trained, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)
    path = tmp_path / "vit.ckpt"
    trainer = cpu_trainer(tmp_path, max_steps=0)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    features = {"last_blocks": 1, "average_patch_tokens": True}
    probe = LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=1, features=features)))
    assert probe.backbone_spec.kwargs == trained.kwargs | {"features": features} and probe.backbone.blocks[0].attn.num_heads == 12
    only_features = LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec(kwargs={"features": features}))  # the parser's default name
    assert only_features.backbone_spec.name == "vit_small" and only_features.backbone_spec.kwargs == probe.backbone_spec.kwargs
    with pytest.raises(ValueError, match="model.backbone.kwargs.num_heads 6, but .* was trained with 12"):
        LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=1, num_heads=6)))


def test_a_file_without_backbone_weights_is_refused(tmp_path):
    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"encoder.weight": torch.zeros(2)}}, path)
    with pytest.raises(ValueError, match="holds no 'backbone.\\*' weights"):
        LinearProbe(pretrained_ckpt=str(path))
    with pytest.raises(ValueError, match="is not an existing file"):
        LinearProbe(pretrained_ckpt=str(tmp_path / "missing.ckpt"))


def test_exactly_one_of_checkpoint_or_random_init():
    with pytest.raises(ValueError, match="give exactly one of"):
        LinearProbe()
    probe = LinearProbe(random_init=True, backbone=TINY_BACKBONE)
    assert not any(p.requires_grad for p in probe.backbone.parameters())


def test_frozen_backbone_is_bit_identical_after_a_linear_probe_epoch(pretrained_checkpoint, tmp_path):
    path, weights = pretrained_checkpoint
    probe = LinearProbe(
        pretrained_ckpt=str(path),
        optimizer=OptimizerSpec(lr=1.0, weight_decay=0.0),
        schedule=ScheduleSpec(decay="constant"),
        knn_k=0,
    )
    probe_before = probe.probe.weight.clone()
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=5, limit_val_batches=2)
    trainer.fit(probe, digits(LINEAR_VIEWS, batch_size=32))
    state = probe.backbone.state_dict()  # parameters and BatchNorm running statistics
    assert all(torch.equal(state[key], weights[key]) for key in weights)
    assert not probe.backbone.training  # BN kept in eval mode through training and validation
    assert not torch.equal(probe.probe.weight, probe_before)
    assert "val/probe_top1" in trainer.callback_metrics


def test_a_trunk_in_train_mode_keeps_its_weights_updates_its_batchnorm_statistics_and_evaluates_with_them(pretrained_checkpoint, tmp_path):
    """`trunk_mode: train`, as TCL's train.py (`model.train()`, the trunk's requires_grad False): BatchNorm normalises
    the probe's training batches with their own statistics and follows them in its running ones; validation runs the
    trunk in eval mode, with those; no weight moves."""
    path, weights = pretrained_checkpoint
    probe = LinearProbe(pretrained_ckpt=str(path), trunk_mode="train", optimizer=OptimizerSpec(lr=1.0, weight_decay=0.0),
                        schedule=ScheduleSpec(decay="constant"), knn_k=0)
    modes = []  # (the trainer is training, the trunk is in train mode) at each of its forward passes
    probe.backbone.register_forward_hook(lambda module, args, output: modes.append((probe.trainer.training, module.training)))
    trainer = cpu_trainer(tmp_path, max_epochs=1, limit_train_batches=5, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(probe, digits(LINEAR_VIEWS, batch_size=32))
    assert set(modes) == {(True, True), (False, False)}
    state, parameters = probe.backbone.state_dict(), dict(probe.backbone.named_parameters())
    assert parameters and all(torch.equal(state[key], weights[key]) for key in parameters)
    running = [key for key in weights if key.endswith(("running_mean", "running_var"))]
    assert running and all(not torch.equal(state[key], weights[key]) for key in running)
    with pytest.raises(ValueError, match="model.trunk_mode 'train' is the mode of a frozen trunk"):
        FineTune(pretrained_ckpt=str(path), trunk_mode="train")


@pytest.mark.parametrize(
    "pretraining_data, warning",
    [
        ("datamodules.DigitsDataModule", None),
        ("datamodules.CIFAR10DataModule", "was pretrained on CIFAR10DataModule at 32 px, this probe runs on DigitsDataModule at 32 px"),
        ("datamodules.ImageNet100DataModule", "was pretrained on ImageNet100DataModule at 224 px, this probe runs on DigitsDataModule at 32 px"),
    ],
    ids=["same-dataset", "other-dataset", "other-dataset-and-image-size"],
)
def test_the_probe_says_what_it_loaded_and_warns_when_the_pretraining_dataset_or_image_size_differs(pretraining_data, warning, pretrained_checkpoint, tmp_path, caplog):
    checkpoint = torch.load(pretrained_checkpoint[0], weights_only=True)
    image_size = {"datamodules.ImageNet100DataModule": {"image_size": 224}}.get(pretraining_data, {})
    checkpoint["contrastlab"]["config"] = {"data": {"class_path": pretraining_data, "init_args": image_size}}  # what the CLI records
    path = tmp_path / "pretrain.ckpt"
    torch.save(checkpoint, path)
    probe = LinearProbe(pretrained_ckpt=str(path))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        probe.check_data(digits(LINEAR_VIEWS), world_size=1)
    dataset, size = pretraining_data.removeprefix("datamodules."), image_size.get("image_size", 32)
    assert (f"probing model.pretrained_ckpt '{path}': methods.moco.MoCoV2, trunk resnet18, pretrained on {dataset} ({size} px), "
            f"epoch {checkpoint['epoch']}, step 1") in caplog.text
    assert [str(warning.message) for warning in caught] == ([f"model.pretrained_ckpt '{path}' {warning}"] if warning else [])
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):  # `setup` checks again: said once only
        warnings.simplefilter("always")
        probe.check_data(digits(LINEAR_VIEWS), world_size=1)
    assert "probing" not in caplog.text and caught == []


@pytest.mark.slow
def test_the_momentum_encoder_is_probed_on_request(pretrained_checkpoint):
    """DINO's eval_linear.py probes the teacher (`--checkpoint_key teacher`): `pretrained_encoder: momentum`."""
    path, online = pretrained_checkpoint
    saved = torch.load(path, weights_only=True)["state_dict"]
    probe = LinearProbe(pretrained_ckpt=str(path), pretrained_encoder="momentum")
    for key, value in probe.backbone.state_dict().items():
        assert torch.equal(value, saved[f"target_backbone.{key}"]), key
    assert any(not torch.equal(value, online[key]) for key, value in probe.backbone.state_dict().items())


@pytest.mark.slow
def test_probing_the_momentum_encoder_of_a_method_without_one_is_one_error(pretrained_checkpoint, tmp_path):
    checkpoint = torch.load(pretrained_checkpoint[0], weights_only=True)
    checkpoint["state_dict"] = {key: value for key, value in checkpoint["state_dict"].items() if not key.startswith("target_")}
    path = tmp_path / "without_momentum_encoder.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=r"holds no 'target_backbone.\*' weights: its method has no momentum encoder \(model.pretrained_encoder\)"):
        LinearProbe(pretrained_ckpt=str(path), pretrained_encoder="momentum")
    with pytest.raises(ValueError, match=r"model.pretrained_encoder 'teacher' is none of \['online', 'momentum'\]"):
        LinearProbe(pretrained_ckpt=str(path), pretrained_encoder="teacher")
