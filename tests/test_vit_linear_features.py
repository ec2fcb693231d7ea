"""DINO's linear-evaluation feature of a ViT trunk (backbones/vit.py `features`): the final norm applied to the tokens
of each of the last n blocks, their class tokens concatenated, optionally with the mean of the patch tokens
(facebookresearch/dino eval_linear.py, vision_transformer.py `get_intermediate_layers`)."""

import re

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from backbones import BackboneSpec, build_backbone
from backbones.vit import timm_arguments

TINY = dict(img_size=32, patch_size=8, depth=4)  # 16 patches, four blocks
DINO_OPTIONS = dict(init="dino", position_interpolation="dino")


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
