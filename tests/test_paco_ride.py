"""RIDE multi-expert trunks (backbones/ride.py) and PaCo on them (methods/longtail/paco_ride.py)."""

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import main_pretrain
from backbones import BackboneSpec, build_backbone
from methods import PaCo, PaCoRIDE
from methods.losses import paco_loss
from test_paco import COUNTS, tiny

PLAIN_TRUNK = BackboneSpec("timm:test_resnet")


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: on the shared 2-core machine two intra-op threads made a 32 px forward of a
    RIDE trunk take ~2 s instead of ~0.01 s (each parallel region waits for a descheduled thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def narrow(num_experts: int) -> BackboneSpec:
    return BackboneSpec("ride_resnet8_narrow", kwargs={"num_experts": num_experts})


def random_batch(size: int = 16) -> dict:
    images = lambda: torch.randn(size, 3, 32, 32)  # noqa: E731
    return {"views": {"query": images(), "key": images()}, "label": torch.randint(0, 10, (size,))}


RIDE_FEATURE_DIMS = {"ride_resnet50": 1536, "ride_resnext50": 1536, "ride_resnet32": 48, "ride_resnet8_narrow": 24}


@pytest.mark.parametrize("num_experts", [1, 2, 3])
@pytest.mark.parametrize("name", list(RIDE_FEATURE_DIMS))
def test_every_ride_trunk_gives_one_pooled_feature_per_expert(name, num_experts):
    torch.manual_seed(0)
    trunk, feature_dim = build_backbone(name, num_experts=num_experts)
    with torch.no_grad():
        features = trunk.eval()(torch.randn(2, 3, 32, 32))
    assert feature_dim == RIDE_FEATURE_DIMS[name] and trunk.num_experts == num_experts
    assert features.shape == (2, num_experts, feature_dim)
    if num_experts > 1:  # distinct branches compute distinct features from the same shared map
        assert not torch.allclose(features[:, 0], features[:, 1])


@pytest.mark.parametrize("name", ["ride_resnet50", "ride_resnext50"])
def test_imagenet_experts_have_ride_reduced_widths_after_shared_stem_layer1_and_layer2(name):
    trunk, _ = build_backbone(name, num_experts=2)
    assert [name for name, _ in trunk.shared.named_children()] == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2"]
    for expert in trunk.experts:
        assert (len(expert.layer3), len(expert.layer4)) == (6, 3)
        assert expert.layer3[0].conv3.out_channels == 4 * 192 and expert.layer4[0].conv3.out_channels == 4 * 384
        assert expert.layer3[0].conv2.groups == (32 if name == "ride_resnext50" else 1)


def test_shared_stages_get_gradient_from_every_expert_and_each_branch_only_from_its_own():
    torch.manual_seed(0)
    trunk, _ = build_backbone("ride_resnet8_narrow", num_experts=3)
    trunk(torch.randn(4, 3, 32, 32))[:, 1].sum().backward()
    reached = lambda module: any(parameter.grad.abs().sum() > 0 for parameter in module.parameters())  # noqa: E731
    assert reached(trunk.shared) and [reached(expert) for expert in trunk.experts] == [False, True, False]
    shared_ids = {id(parameter) for parameter in trunk.shared.parameters()}
    expert_ids = [{id(parameter) for parameter in expert.parameters()} for expert in trunk.experts]
    assert not shared_ids & set().union(*expert_ids)
    assert all(not expert_ids[a] & expert_ids[b] for a, b in itertools.combinations(range(3), 2))  # no two experts share one


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("ride_resnet50", dict(num_experts=0), "model.init_args.backbone.kwargs.num_experts must be >= 1, got 0"),
        ("ride_resnet32", dict(expert_widths=[24, 47]), "widen the previous one .* by an even number"),
        ("ride_resnext50", dict(expert_widths=[8, 384]), "ResNeXt-50 32x4d needs expert widths >= 16"),
        ("ride_resnet32", dict(small_input=True), "small_input=True is meaningless for 'ride_resnet32'"),
        ("ride_resnext50", dict(weights="IMAGENET1K_V1"), "publishes no weights for backbone 'ride_resnext50'"),
    ],
)
def test_bad_ride_trunk_settings_are_one_clear_error(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_backbone(name, **kwargs)


def paco_on(model: PaCoRIDE, trunk_output_to_features: nn.Module) -> PaCo:
    """A PaCo whose trunk, heads, centres and queue are those of a one-expert PaCoRIDE."""
    paco = tiny(PaCo, backbone=model.hparams.backbone, alpha=model.alpha, temperature=model.temperature)
    paco.backbone = nn.Sequential(model.backbone, trunk_output_to_features)
    paco.target_backbone = nn.Sequential(model.target_backbone, trunk_output_to_features)
    paco.projector, paco.target_projector = model.projector.experts[0], model.target_projector.experts[0]
    paco.classifier = model.classifier.experts[0]
    paco.queue.load_state_dict(model.queue.state_dict())
    return paco


@pytest.mark.parametrize(
    "backbone, trunk_output_to_features",
    [(narrow(1), nn.Flatten()), (PLAIN_TRUNK, nn.Identity())],  # (B, 1, D) RIDE features; a plain trunk is one expert
    ids=["ride_trunk_with_one_expert", "plain_trunk"],
)
def test_one_expert_paco_ride_is_paco_on_the_same_trunk_loss_gradients_and_queue(backbone, trunk_output_to_features):
    torch.manual_seed(0)
    model = tiny(PaCoRIDE, backbone=backbone, alpha=0.05, temperature=0.2).train()
    paco = paco_on(model, trunk_output_to_features)
    batch = random_batch()
    loss = model.step(batch)[0]
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    gradients = torch.autograd.grad(loss, trained, allow_unused=True)
    paco_loss_value = paco.step(batch)[0]
    paco_gradients = torch.autograd.grad(paco_loss_value, trained, allow_unused=True)
    torch.testing.assert_close(loss, paco_loss_value)
    for gradient, paco_gradient in zip(gradients, paco_gradients, strict=True):
        assert (gradient is None) == (paco_gradient is None)
        if gradient is not None:
            torch.testing.assert_close(gradient, paco_gradient)
    torch.testing.assert_close(model.queue.keys, paco.queue.keys)  # both enqueued the same normalised keys
    assert torch.equal(model.queue.labels, paco.queue.labels)


def test_loss_is_the_mean_over_experts_of_paco_loss_on_each_experts_query_key_queue_and_centres():
    torch.manual_seed(0)
    model = tiny(PaCoRIDE, backbone=narrow(3), alpha=0.05, temperature=0.2).train()
    batch = random_batch()
    queue, queue_labels = model.queue.read().view(48, 3, -1), model.queue.read_labels()
    loss = model.step(batch)[0]
    features = model.backbone(batch["views"]["query"])
    with torch.no_grad():
        keys = model.target_projector(model.target_backbone(batch["views"]["key"]))
    prior = COUNTS / COUNTS.sum()
    expert_losses = torch.stack(
        [
            paco_loss(
                F.normalize(model.projector.experts[e](features[:, e]), dim=1),
                F.normalize(keys[:, e], dim=1),
                queue[:, e],
                batch["label"],
                queue_labels,
                model.classifier.experts[e](features[:, e]),
                0.05,
                0.2,
                class_prior=prior,
            )
            for e in range(3)
        ]
    )
    assert expert_losses.std() > 1e-3  # the experts really differ, so the mean is not any one of them
    torch.testing.assert_close(loss, expert_losses.mean(), rtol=1e-5, atol=1e-6)


def test_queue_row_holds_every_experts_unit_key_with_the_sample_label():
    torch.manual_seed(0)
    model = tiny(PaCoRIDE, backbone=narrow(2))
    assert torch.allclose(model.queue.keys.view(48, 2, -1).norm(dim=-1), torch.ones(48, 2))  # unit keys from the start
    batch = random_batch()
    model.step(batch)[0]
    with torch.no_grad():
        keys = F.normalize(model.target_projector(model.target_backbone(batch["views"]["key"])), dim=-1)
    torch.testing.assert_close(model.queue.keys[:16].view(16, 2, -1), keys, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.queue.labels[:16], batch["label"])


def test_prediction_averages_the_experts_raw_centre_logits():
    model = tiny(PaCoRIDE, backbone=narrow(3)).eval()
    images = random_batch()["views"]["query"]
    with torch.no_grad():
        features = model.backbone(images)
        expert_logits = [model.classifier.experts[e](features[:, e]) for e in range(3)]
        torch.testing.assert_close(model.classify(images), sum(expert_logits) / 3)


def test_digits_config_trains_a_step_on_its_ride_trunk_with_two_experts(tmp_path):
    config = Path(__file__).resolve().parents[1] / "configs" / "paco_ride_digits_lt.yaml"
    cli = main_pretrain.cli_main(
        [
            "fit", "--config", str(config),
            "--model.init_args.backbone.kwargs={num_experts: 2}",
            "--model.init_args.queue_size=16",
            "--data.init_args.batch_size=8",
            "--trainer.fast_dev_run=1",
            "--trainer.precision=32-true",
            f"--trainer.default_root_dir={tmp_path}",
        ]
    )  # fmt: skip
    assert cli.model.num_experts == 2 and cli.model.queue.keys.shape == (16, 2 * 32)
    assert cli.trainer.global_step == 1 and torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert "val/few_top1" in cli.trainer.callback_metrics
