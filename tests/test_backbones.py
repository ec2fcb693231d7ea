import pytest
import torch
import torch.nn as nn

from backbones import MLPSpec, build_backbone, build_mlp

EXPECTED_FEATURE_DIMS = {
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "resnet101": 2048,
    "resnet152": 2048,
    "resnext50_32x4d": 2048,
    "resnext101_32x8d": 2048,
    "resnext101_64x4d": 2048,
}


@pytest.mark.parametrize("small_input", [False, True])
@pytest.mark.parametrize("name", sorted(EXPECTED_FEATURE_DIMS))
def test_torchvision_trunks_return_pooled_features_of_the_stated_dim(name, small_input):
    trunk, dim = build_backbone(name, small_input=small_input)
    assert dim == EXPECTED_FEATURE_DIMS[name]
    with torch.no_grad():
        out = trunk.eval()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, dim)


def test_small_input_stem_is_a_3x3_stride_1_conv_without_max_pool():
    trunk, _ = build_backbone("resnet18", small_input=True)
    assert trunk.conv1.kernel_size == (3, 3) and trunk.conv1.stride == (1, 1) and trunk.conv1.bias is None
    assert isinstance(trunk.maxpool, nn.Identity)
    # The stem keeps the resolution: a 32 px image reaches layer4 at 4x4 (ImageNet stem: 1x1).
    sizes = []
    trunk.layer4.register_forward_hook(lambda module, inputs, output: sizes.append(output.shape[-1]) and None)
    trunk.eval()(torch.randn(1, 3, 32, 32))
    assert sizes == [4]


def test_timm_models_are_built_by_name_without_classifier():
    trunk, dim = build_backbone("timm:resnet10t")
    assert dim == 512
    assert trunk.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 512)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("resnet19", {}, "unknown backbone name 'resnet19'"),
        ("timm:not_a_model", {}, "unknown timm model 'not_a_model'"),
        ("resnet18", {"no_such_option": 1}, "rejected its keyword arguments"),
    ],
)
def test_bad_backbone_names_and_options_raise_a_clear_error(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_backbone(name, **kwargs)


def test_small_input_is_refused_for_timm_models():
    with pytest.raises(ValueError, match="small_input=True is only defined"):
        build_backbone("timm:resnet10t", small_input=True)


def test_mlp_heads_follow_each_papers_layout():
    moco = build_mlp(2048, MLPSpec(hidden_dim=2048, output_dim=128, batch_norm=False))
    assert [type(layer) for layer in moco] == [nn.Linear, nn.ReLU, nn.Linear]
    assert moco[0].bias is not None and moco[2].bias is not None

    sce_small = build_mlp(512, MLPSpec(hidden_dim=512, output_dim=256))
    assert [type(layer) for layer in sce_small] == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert sce_small[0].bias is None and sce_small[3].bias is not None  # no bias right before a BN

    sce_imagenet = build_mlp(2048, MLPSpec(4096, 256, num_layers=3, last_batch_norm=True, last_batch_norm_affine=False))
    assert [type(layer) for layer in sce_imagenet] == [nn.Linear, nn.BatchNorm1d, nn.ReLU] * 2 + [nn.Linear, nn.BatchNorm1d]
    assert sce_imagenet[-2].bias is None and sce_imagenet[-1].weight is None
    sce_predictor = build_mlp(256, MLPSpec(4096, 256, last_bias=False))
    assert sce_predictor[0].bias is None and sce_predictor[-1].bias is None  # eztorch's predictor has no bias

    npid = build_mlp(512, MLPSpec(output_dim=128, num_layers=1))
    assert len(npid) == 1 and npid[0].in_features == 512 and npid[0].out_features == 128


def test_mlp_refuses_zero_layers():
    with pytest.raises(ValueError, match="num_layers >= 1"):
        build_mlp(8, MLPSpec(num_layers=0))
