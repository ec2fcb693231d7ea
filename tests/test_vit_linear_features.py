"""DINO's linear-evaluation feature of a ViT trunk (backbones/vit.py `features`): the final norm applied to the tokens
of each of the last n blocks, their class tokens concatenated, optionally with the mean of the patch tokens
(facebookresearch/dino eval_linear.py, vision_transformer.py `get_intermediate_layers`), and the linear stage of
configs/linear_dino_vit_small_imagenet.yaml on a tiny DINO checkpoint."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import cpu_trainer, digits
from jsonargparse import Namespace
from timm.models.vision_transformer import VisionTransformer

from backbones import BackboneSpec, MLPSpec, build_backbone
from backbones.vit import timm_arguments
from engine.optim import OptimizerSpec, ScheduleSpec
from interop.export import export
from methods import DINO, LinearProbe
from methods.momentum import MomentumSpec

TINY = dict(img_size=32, patch_size=8, depth=4)  # 16 patches, four blocks
DINO_OPTIONS = dict(init="dino", position_interpolation="dino")
CONFIG = Path(__file__).parents[1] / "configs/linear_dino_vit_small_imagenet.yaml"


def randomised_norms(trunk: torch.nn.Module) -> torch.nn.Module:
    """LayerNorm scales and shifts away from 1 and 0, so that a norm applied or left out shows in the feature."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in trunk.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(1.0 + 0.5 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=generator))
    return trunk.eval()


def normed_block_outputs(trunk, images: torch.Tensor) -> list[torch.Tensor]:
    """(B, 1 + patches, D) per block: the final norm of each block's output tokens, written out by hand."""
    projection = trunk.patch_embed.proj
    patches = F.conv2d(images, projection.weight, projection.bias, stride=projection.stride).flatten(2).transpose(1, 2)
    tokens = torch.cat([trunk.cls_token.expand(len(images), -1, -1), patches], dim=1) + trunk.pos_embed
    outputs = []
    for block in trunk.blocks:
        tokens = block(tokens)
        outputs.append(trunk.norm(tokens))
    return outputs


def test_the_last_blocks_feature_concatenates_the_class_tokens_of_the_last_blocks_after_the_final_norm():
    torch.manual_seed(0)
    trunk, dim = build_backbone("vit_tiny", features={"last_blocks": 3}, **DINO_OPTIONS, **TINY)
    images = torch.randn(2, 3, 32, 32)
    outputs = normed_block_outputs(randomised_norms(trunk), images)
    expected = torch.cat([output[:, 0] for output in outputs[-3:]], dim=-1)  # blocks 2, 3, 4 in that order
    with torch.no_grad():
        feature = trunk(images)
    assert dim == 3 * 192 and feature.shape == (2, dim)
    torch.testing.assert_close(feature, expected)


def test_the_average_patch_token_feature_interleaves_the_class_token_and_the_patch_mean_as_eval_linear_flattens_them():
    torch.manual_seed(0)
    trunk, dim = build_backbone("vit_tiny", features={"last_blocks": 1, "average_patch_tokens": True}, **TINY)
    images = torch.randn(2, 3, 32, 32)
    last = normed_block_outputs(randomised_norms(trunk), images)[-1]
    class_token, patch_mean = last[:, 0], last[:, 1:].mean(dim=1)
    # eval_linear.py: cat((output.unsqueeze(-1), mean.unsqueeze(-1)), dim=-1).reshape(B, -1)
    expected = torch.cat([class_token.unsqueeze(-1), patch_mean.unsqueeze(-1)], dim=-1).reshape(2, -1)
    with torch.no_grad():
        feature = trunk(images)
    assert dim == 2 * 192 and feature.shape == (2, dim)
    torch.testing.assert_close(feature, expected)
    torch.testing.assert_close(feature[:, 0::2], class_token)


def test_the_feature_dimension_is_the_embedding_dimension_times_the_tokens_concatenated():
    with torch.device("meta"):  # shapes only
        assert build_backbone("vit_small", features={"last_blocks": 4})[1] == 1536  # DINO's ViT-S/16 protocol
        assert build_backbone("vit_base", features={"last_blocks": 1, "average_patch_tokens": True})[1] == 1536  # its ViT-B
        assert BackboneSpec("vit_small", kwargs={"features": {"last_blocks": 2}}).build()[1] == 768
        assert build_backbone("vit_small")[1] == 384


def test_without_the_option_the_trunk_is_timms_own_and_one_block_gives_its_class_token_bit_for_bit():
    torch.manual_seed(0)
    default, dim = build_backbone("vit_tiny", **TINY)
    one_block, one_block_dim = build_backbone("vit_tiny", features={"last_blocks": 1}, **TINY)
    one_block.load_state_dict(randomised_norms(default).state_dict())
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feature = default(images)
        assert type(default) is VisionTransformer and dim == one_block_dim == 192
        assert torch.equal(feature, default.forward_features(images)[:, 0])
        assert torch.equal(one_block.eval()(images), feature)


def test_the_option_changes_no_weight_and_is_no_timm_argument_of_an_export():
    with torch.device("meta"):
        plain, with_features = build_backbone("vit_small", **TINY)[0], build_backbone("vit_small", features={"last_blocks": 4}, **TINY)[0]
    assert {key: value.shape for key, value in plain.state_dict().items()} == {key: value.shape for key, value in with_features.state_dict().items()}
    assert timm_arguments("vit_small", TINY | {"features": {"last_blocks": 4}}) == timm_arguments("vit_small", TINY)


@pytest.mark.parametrize(
    "features, message",
    [
        ({"blocks": 4}, "must be a mapping of average_patch_tokens, last_blocks"),
        ({"last_blocks": 5}, "last_blocks must be an integer from 1 to the depth, 4"),
        ({"last_blocks": 0}, "last_blocks must be an integer from 1 to the depth, 4"),
        ({"last_blocks": True}, "last_blocks must be an integer from 1 to the depth, 4"),
        ({"average_patch_tokens": "yes"}, "average_patch_tokens must be true or false"),
        ({"last_blocks": 4, "average_patch_tokens": True}, "average_patch_tokens needs last_blocks 1, the only case DINO's eval_linear.py defines"),
    ],
)
def test_a_bad_features_option_is_one_error_naming_it(features, message):
    with pytest.raises(ValueError, match=f"^backbone 'vit_tiny': features {re.escape(repr(features))}:? {message}$"):
        build_backbone("vit_tiny", features=features, **TINY)


def test_the_feature_needs_a_class_token():
    with pytest.raises(ValueError, match="^backbone 'vit_tiny': features {'last_blocks': 2} concatenate class tokens, and this ViT has none"):
        build_backbone("vit_tiny", features={"last_blocks": 2}, class_token=False, global_pool="avg", **TINY)


@pytest.fixture(scope="module")
def dino_checkpoint(tmp_path_factory) -> Path:
    """A real one-step DINO pretraining checkpoint of a tiny ViT on Digits-M, written by Lightning."""
    directory = tmp_path_factory.mktemp("dino_vit") / "run"
    model = DINO(
        backbone=BackboneSpec("vit_tiny", kwargs=DINO_OPTIONS | TINY), out_dim=20, knn_k=0,
        projector=MLPSpec(hidden_dim=32, output_dim=16, num_layers=3, batch_norm=False, activation="gelu"),
        optimizer=OptimizerSpec(lr=0.1), schedule=ScheduleSpec(decay="constant"),
        momentum=MomentumSpec(base=0.9, schedule="constant", shuffle_bn=False),
    )  # fmt: skip
    trainer = cpu_trainer(directory, max_steps=1, limit_val_batches=0)
    trainer.fit(model, digits({"global1": {"preset": "mocov2"}, "global2": {"preset": "mocov2"}}, batch_size=8))
    path = directory / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    student, teacher = model.backbone.blocks[0].attn.qkv.weight, model.target_backbone.blocks[0].attn.qkv.weight
    assert not torch.equal(student, teacher)  # so that a probe of the wrong one shows
    return path


@pytest.mark.slow
@pytest.mark.parametrize("encoder", [None, "exported", "online"], ids=["default", "exported", "online"])
def test_the_config_probes_a_tiny_dino_vit_on_its_last_four_class_tokens_and_trains_a_step(encoder, dino_checkpoint, tmp_path):
    """The config's model settings and views, with a Digits-M-size ViT-Tiny: the teacher, as eval_linear.py probes it
    (the default: the encoder DINO evaluates), straight from the checkpoint or through its export (whose default is
    the same trunk); the student on request."""
    config = yaml.safe_load(CONFIG.read_text())
    settings, views = config["model"]["init_args"], config["data"]["init_args"]["views"]
    assert "pretrained_encoder" not in settings
    backbone = settings["backbone"] | {"name": "vit_tiny", "kwargs": settings["backbone"]["kwargs"] | TINY}
    if encoder == "exported":
        settings = settings | {"pretrained_ckpt": str(export(dino_checkpoint, "timm", tmp_path / "teacher")[0])}
    else:
        settings = settings | {"pretrained_ckpt": str(dino_checkpoint)} | ({"pretrained_encoder": encoder} if encoder else {})
    probe = LinearProbe(**(settings | {"backbone": backbone, "knn_k": 0}))
    prefix = "backbone." if encoder == "online" else "target_backbone."
    saved = torch.load(dino_checkpoint, weights_only=True)["state_dict"]
    pretrained_trunk = {key.removeprefix(prefix): value for key, value in saved.items() if key.startswith(prefix)}
    assert probe.feature_dim == 4 * 192 and probe.probe.in_features == 4 * 192
    assert probe.probe.weight.std().item() == pytest.approx(0.01, rel=0.1) and not probe.probe.bias.any()
    probe_before = probe.probe.weight.clone()
    cpu_trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(probe, digits(views, batch_size=16))
    assert all(torch.equal(value, pretrained_trunk[key]) for key, value in probe.backbone.state_dict().items())
    assert not torch.equal(probe.probe.weight, probe_before)


@pytest.mark.slow
def test_the_run_records_the_encoder_a_null_pretrained_encoder_probes(dino_checkpoint, tmp_path):
    """config.yaml says which trunk was probed (`LinearProbe.settle_arguments`): DINO's teacher, `online` for a file
    whose method names none (an export); a given value and an unreadable file are left as they are."""
    exported = export(dino_checkpoint, "timm", tmp_path / "teacher")[0]
    for path, expected in ((dino_checkpoint, "momentum"), (exported, "online"), (tmp_path / "missing.ckpt", None)):
        init_args = {"pretrained_ckpt": str(path), "pretrained_encoder": None}
        LinearProbe.settle_arguments(init_args)
        assert init_args["pretrained_encoder"] == expected, path
    given = {"pretrained_ckpt": str(dino_checkpoint), "pretrained_encoder": "online"}
    LinearProbe.settle_arguments(given)
    assert given["pretrained_encoder"] == "online"


@pytest.mark.slow
@pytest.mark.parametrize("as_parsed", [dict, Namespace], ids=["dict", "namespace"])
def test_the_run_records_the_trunk_it_probes_not_the_defaults_the_parser_fills_into_a_given_backbone(as_parsed, dino_checkpoint, tmp_path):
    """`--model.backbone.kwargs.features ...` alone reaches the model as a BackboneSpec of that and the defaults
    (name resnet18): config.yaml and the probe's checkpoint record the trunk probed, the checkpoint's or export's
    ViT with those features, as `__init__` builds it. A null backbone stays null (the checkpoint's trunk)."""
    features = {"last_blocks": 2}
    probed = {"name": "vit_tiny", "small_input": False, "weights": None, "kwargs": DINO_OPTIONS | TINY | {"features": features},
              "small_input_stem": "sce"}
    exported = export(dino_checkpoint, "timm", tmp_path / "teacher")[0]
    for path in (dino_checkpoint, exported):
        init_args = {"pretrained_ckpt": str(path), "pretrained_encoder": None, "backbone": as_parsed(dataclasses.asdict(BackboneSpec(kwargs={"features": features})))}
        LinearProbe.settle_arguments(init_args)
        recorded = init_args["backbone"]
        assert isinstance(recorded, as_parsed) and dict(recorded) == probed, path
        assert dataclasses.asdict(LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec(**probed), knn_k=0).backbone_spec) == probed
    unset = {"pretrained_ckpt": str(dino_checkpoint), "pretrained_encoder": None, "backbone": None}
    LinearProbe.settle_arguments(unset)
    assert unset["backbone"] is None


@pytest.mark.slow
def test_the_momentum_trunk_of_a_file_that_holds_none_is_refused_in_one_line(dino_checkpoint, tmp_path):
    """An export holds one trunk: `pretrained_encoder: momentum` on it would probe another trunk than asked."""
    exported = export(dino_checkpoint, "timm", tmp_path / "teacher")[0]
    backbone = {"name": "vit_tiny", "kwargs": DINO_OPTIONS | TINY}
    with pytest.raises(ValueError, match=r"\(format \w+\) is read as its online trunk, which its official linear evaluation probes \(a momentum encoder it may hold is not read\): give --model.pretrained_encoder online"):
        LinearProbe(pretrained_ckpt=str(exported), backbone=backbone, pretrained_encoder="momentum", knn_k=0)
    assert LinearProbe(pretrained_ckpt=str(exported), backbone=backbone, pretrained_encoder="online", knn_k=0).feature_dim == 192
