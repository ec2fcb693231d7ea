"""The Vision Transformer trunks (backbones/vit.py): sizes, the class-token feature and MoCo v3's options."""

import math

import pytest
import torch

from backbones import BackboneSpec, build_backbone
from backbones.vit import dino_position_embedding, sincos_2d_position_embedding
from engine.optim import OptimizerSpec, parameter_groups
from methods.momentum import ema_update_

TINY = dict(img_size=32, patch_size=8, depth=2)  # 16 patches, two blocks
MOCOV3 = dict(init="mocov3", position_embedding="sincos_2d", stop_grad_conv1=True)


def test_the_2d_sincos_table_holds_sin_and_cos_of_the_row_then_of_the_column_of_each_patch():
    table = sincos_2d_position_embedding((2, 3), dim=8, temperature=100.0)
    assert table.shape == (1 + 6, 8) and torch.equal(table[0], torch.zeros(8))  # the class token's row
    row, column = 1, 2  # patch 5 in row-major order: row 1, column 2
    omega = [1.0, 100.0**-0.5]  # w_d = T^(-d / (dim / 4)), d = 0, 1
    expected = [math.sin(row * w) for w in omega] + [math.cos(row * w) for w in omega]
    expected += [math.sin(column * w) for w in omega] + [math.cos(column * w) for w in omega]
    torch.testing.assert_close(table[1 + 3 * row + column], torch.tensor(expected))


def test_sizes_are_timms_and_any_vision_transformer_argument_can_be_given():
    trunk, dim = build_backbone("vit_small", **TINY)
    assert dim == 384 and trunk.blocks[0].attn.num_heads == 6 and len(trunk.blocks) == 2
    trunk, _ = build_backbone("vit_small", num_heads=12, **TINY)  # MoCo v3's ViT-Small
    assert trunk.blocks[0].attn.num_heads == 12
    assert build_backbone("vit_tiny", **TINY)[1] == 192 and build_backbone("vit_base", **(TINY | {"depth": 1}))[1] == 768


def test_the_feature_is_the_class_token_after_the_final_layer_norm():
    trunk, _ = build_backbone("vit_tiny", **TINY)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(trunk.eval()(images), trunk.forward_features(images)[:, 0])


def test_mocov3_init_uses_xavier_bounds_with_q_k_v_apart_zero_biases_and_the_flattened_patch_for_the_projection():
    trunk, dim = build_backbone("vit_small", init="mocov3", **TINY)
    qkv, fc1 = trunk.blocks[0].attn.qkv.weight, trunk.blocks[0].mlp.fc1.weight
    for weight, bound in ((qkv, math.sqrt(6 / (dim + dim))), (fc1, math.sqrt(6 / (4 * dim + dim)))):
        assert bound * 0.99 < weight.abs().max() <= bound
    patch_bound = math.sqrt(6 / (3 * 8 * 8 + dim))
    assert patch_bound * 0.99 < trunk.patch_embed.proj.weight.abs().max() <= patch_bound
    assert all(torch.count_nonzero(p) == 0 for name, p in trunk.named_parameters() if name.endswith(".bias") and "norm" not in name)
    assert trunk.cls_token.abs().max() < 1e-5


def test_mocov3_options_freeze_the_patch_projection_and_the_fixed_position_table_which_no_optimizer_group_holds():
    trunk, _ = build_backbone("vit_tiny", **MOCOV3, **TINY)
    torch.testing.assert_close(trunk.pos_embed[0], sincos_2d_position_embedding((4, 4), 192))
    # patch (row 0, column 1), its column's sine at the second frequency: omega_1 = 10000^(-1/48) (moco-v3 vits.py)
    assert trunk.pos_embed[0, 2, 96 + 1].item() == pytest.approx(math.sin(10000 ** (-1 / 48)), abs=1e-6)
    frozen = {name for name, p in trunk.named_parameters() if not p.requires_grad}
    assert frozen == {"pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"}
    grouped = {id(p) for group in parameter_groups(trunk.named_parameters(), OptimizerSpec(name="adamw")) for p in group["params"]}
    assert not any(id(p) in grouped for p in (trunk.pos_embed, trunk.patch_embed.proj.weight))
    trainable = build_backbone("vit_tiny", **TINY)[0]
    assert all(p.requires_grad for p in trainable.parameters())


def test_frozen_parameters_copied_into_the_momentum_encoder_stay_as_they_are_under_its_update():
    """The update moves every parameter, frozen ones too, as facebookresearch/moco-v3 moco/builder.py
    `_update_momentum_encoder` does; MoCo v3's target starts as a copy, so its frozen patch projection and its fixed
    position table stay the online network's."""
    online, _ = build_backbone("vit_tiny", **MOCOV3, **TINY)
    target, _ = build_backbone("vit_tiny", **MOCOV3, **TINY)
    target.patch_embed.proj.load_state_dict(online.patch_embed.proj.state_dict())
    frozen = target.patch_embed.proj.weight.clone()
    ema_update_(online, target, 0.37)
    assert torch.equal(target.patch_embed.proj.weight, frozen) and torch.equal(target.pos_embed, online.pos_embed)


def test_a_spec_builds_a_vit_with_its_options_and_bad_options_are_one_error_naming_them():
    trunk, _ = BackboneSpec(name="vit_tiny", kwargs=MOCOV3 | TINY).build()
    assert not trunk.patch_embed.proj.weight.requires_grad
    with pytest.raises(ValueError, match="small_input=True is only defined for the ResNets; a ViT for small images sets kwargs img_size and patch_size"):
        build_backbone("vit_tiny", small_input=True)
    with pytest.raises(ValueError, match="position_embedding must be 'learned' or 'sincos_2d', got 'sincos'"):
        build_backbone("vit_tiny", position_embedding="sincos", **TINY)
    with pytest.raises(ValueError, match=r"backbone 'vit_tiny' rejected its keyword arguments \{'heads': 2\}"):
        build_backbone("vit_tiny", heads=2)
    with pytest.raises(ValueError, match="torchvision publishes no weights for backbone 'vit_small'"):
        build_backbone("vit_small", weights="DEFAULT")


DINO = dict(init="dino", position_interpolation="dino")


def test_dino_init_draws_the_class_token_like_the_other_weights_and_timm_init_keeps_it_tiny():
    torch.manual_seed(0)
    dino, _ = build_backbone("vit_small", **DINO, **TINY)
    timm_init, _ = build_backbone("vit_small", **TINY)
    assert 0.015 < dino.cls_token.std() < 0.025  # normal, std 0.02, truncated at +-2 (absolute, as DINO's trunc_normal_)
    assert timm_init.cls_token.abs().max() < 1e-5


def test_dino_interpolation_keeps_the_table_at_the_trained_size_and_resizes_it_by_the_scale_factor_elsewhere():
    table = torch.randn(1, 1 + 16, 8)
    assert dino_position_embedding(table, 4, 4) is table
    resized = dino_position_embedding(table, 2, 2)
    grid = table[:, 1:].reshape(1, 4, 4, 8).permute(0, 3, 1, 2)
    by_scale = torch.nn.functional.interpolate(grid, scale_factor=(2.1 / 4, 2.1 / 4), mode="bicubic")
    by_size = torch.nn.functional.interpolate(grid, size=(2, 2), mode="bicubic", antialias=True)  # timm's resampling
    assert resized.shape == (1, 1 + 4, 8) and torch.equal(resized[:, 0], table[:, 0])  # the class token's row kept
    torch.testing.assert_close(resized[0, 1:], by_scale.permute(0, 2, 3, 1).reshape(4, 8))
    assert not torch.allclose(resized[0, 1:], by_size.permute(0, 2, 3, 1).reshape(4, 8), atol=1e-3)
    constant = torch.ones(1, 1 + 16, 8)
    torch.testing.assert_close(dino_position_embedding(constant, 3, 3), torch.ones(1, 1 + 9, 8))


def test_a_dino_vit_takes_local_crops_with_the_dino_table_and_equals_timms_vit_at_its_own_size():
    torch.manual_seed(0)
    dino, _ = build_backbone("vit_tiny", **DINO, **TINY)
    timm_vit, _ = build_backbone("vit_tiny", dynamic_img_size=True, **TINY)
    timm_vit.load_state_dict(dino.state_dict())
    dino.eval(), timm_vit.eval()
    full, local = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(dino(full), timm_vit(full))
    patches = dino.patch_embed(local)  # (B, 2, 2, D): dynamic_img_size keeps the grid
    tokens = torch.cat([dino.cls_token.expand(2, -1, -1), patches.flatten(1, 2)], dim=1) + dino_position_embedding(dino.pos_embed, 2, 2)
    torch.testing.assert_close(dino(local), dino.norm(dino.blocks(tokens))[:, 0])
    assert not torch.allclose(dino(local), timm_vit(local), atol=1e-3)
    with pytest.raises(ValueError, match="position_interpolation must be 'timm' or 'dino', got 'bicubic'"):
        build_backbone("vit_tiny", position_interpolation="bicubic", **TINY)
