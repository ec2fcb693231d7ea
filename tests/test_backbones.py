import re

import pytest
import torch
import torch.nn as nn
import torchvision
from torchvision.models import ResNet18_Weights

from backbones import BackboneSpec, MLPSpec, build_backbone, build_mlp
from backbones.cifar_resnet import ZeroPadShortcut

EXPECTED_FEATURE_DIMS = {
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "resnet101": 2048,
    "resnet152": 2048,
    "resnext50_32x4d": 2048,
    "resnext101_32x4d": 2048,
    "resnext101_32x8d": 2048,
    "resnext101_64x4d": 2048,
}


@pytest.mark.parametrize("small_input", [False, True])
@pytest.mark.parametrize("name", sorted(EXPECTED_FEATURE_DIMS))
@pytest.mark.slow
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


def test_cifar_resnet32_gives_64d_features_with_the_ldam_parameter_count():
    trunk, dim = build_backbone("cifar_resnet32")
    assert dim == 64
    assert trunk.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 64)
    # stem 3*16*9 + BN 32; stage 1: 5 blocks of 2*(16*16*9) + 2*32; stage 2: 32*16*9 + 32*32*9 + 128,
    # then 4 blocks of 2*(32*32*9) + 128; stage 3 likewise at 64 wide. LDAM-DRW's table's 0.46 M adds
    # the 10-class fc (650 -> 464,154); with CIFAR-100's fc (6,500) it is 470,004.
    assert sum(p.numel() for p in trunk.parameters()) == 463_504
    # LDAM-DRW resnet_cifar.py forward: relu(bn1(conv1(x))), the three stages, then the average over the 8 x 8 map
    seen = {}
    trunk.layer1.register_forward_pre_hook(lambda module, inputs: seen.setdefault("stem", inputs[0]))
    trunk.layer3.register_forward_hook(lambda module, inputs, output: seen.setdefault("stage3", output))
    with torch.no_grad():
        features = trunk(torch.randn(2, 3, 32, 32))
    assert seen["stem"].min() >= 0 and seen["stage3"].shape == (2, 64, 8, 8)
    torch.testing.assert_close(features, seen["stage3"].mean(dim=(2, 3)))


@pytest.mark.parametrize("depth", [20, 32, 44, 56, 110])
def test_cifar_resnets_have_6n_plus_2_layers_in_three_stages(depth):
    trunk, dim = build_backbone(f"cifar_resnet{depth}")
    blocks_per_stage = (depth - 2) // 6
    assert [len(stage) for stage in (trunk.layer1, trunk.layer2, trunk.layer3)] == [blocks_per_stage] * 3
    convolutions = [module for module in trunk.modules() if isinstance(module, nn.Conv2d)]
    assert len(convolutions) + 1 == depth  # the depth counts the classifier on top
    assert dim == 64


def test_cifar_resnet_halves_the_resolution_at_stages_2_and_3_only():
    trunk, _ = build_backbone("cifar_resnet32")
    sizes = []
    for stage in (trunk.layer1, trunk.layer2, trunk.layer3):
        stage.register_forward_hook(lambda module, inputs, output: sizes.append(tuple(output.shape[1:])) and None)
    trunk.eval()(torch.randn(1, 3, 32, 32))
    assert sizes == [(16, 32, 32), (32, 16, 16), (64, 8, 8)]


def test_option_a_shortcut_subsamples_and_zero_pads_without_parameters():
    trunk, _ = build_backbone("cifar_resnet32")
    has_shortcut = [block.downsample is not None for stage in (trunk.layer1, trunk.layer2, trunk.layer3) for block in stage]
    assert has_shortcut == [False] * 5 + [True] + [False] * 4 + [True] + [False] * 4  # first block of stages 2, 3
    for block in (trunk.layer2[0], trunk.layer3[0]):
        assert isinstance(block.downsample, ZeroPadShortcut) and list(block.downsample.parameters()) == []
    x = torch.randn(2, 32, 16, 16)
    out = trunk.layer3[0].downsample(x)
    assert out.shape == (2, 64, 8, 8)
    assert torch.equal(out[:, 16:48], x[:, :, ::2, ::2])
    assert not out[:, :16].any() and not out[:, 48:].any()


def test_cifar_resnet_convolutions_use_fan_in_kaiming_init():
    torch.manual_seed(0)
    trunk, _ = build_backbone("cifar_resnet32")
    # LDAM-DRW's init.kaiming_normal_ (fan-in): std sqrt(2/27) on the stem; fan-out would give sqrt(2/144).
    assert trunk.conv1.weight.std().item() == pytest.approx((2 / 27) ** 0.5, rel=0.15)


def test_cifar_resnet_base_width_builds_pacos_widened_variant():
    trunk, dim = build_backbone("cifar_resnet32", base_width=32)  # PaCo commit 9afe122: factor = 2
    assert dim == 128
    assert trunk.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 128)
    with pytest.raises(ValueError, match="a CIFAR ResNet's base_width must be an even number >= 2, got 15"):
        build_backbone("cifar_resnet20", base_width=15)  # would fail at the first forward: the shortcut pads 7 + 7 channels onto 15


def test_solo_learns_small_input_stem_pads_by_2_and_keeps_nn_conv2ds_initialisation():
    """vturrisi/solo-learn solo/methods/base.py replaces conv1 of torchvision's resnet18 after its constructor by
    nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=2, bias=False) and max-pool by Identity: built the same way
    from the same seed, the trunk has the same weights and features, and a 32 px image gives a 34 x 34 first map."""
    torch.manual_seed(0)
    trunk, dim = build_backbone("resnet18", small_input=True, small_input_stem="solo_learn")
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    reference.fc, reference.maxpool = nn.Identity(), nn.Identity()
    reference.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=2, bias=False)
    state, expected_state = trunk.state_dict(), reference.state_dict()
    assert dim == 512 and state.keys() == expected_state.keys()
    assert all(torch.equal(state[key], expected_state[key]) for key in state)
    sizes = []
    trunk.conv1.register_forward_hook(lambda module, inputs, output: sizes.append(output.shape[-1]) and None)
    image = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(trunk.eval()(image), reference.eval()(image))
    assert sizes == [34]


@pytest.mark.parametrize("stem", ["sce", "kaiming"])
def test_the_padding_1_stems_draw_their_official_codes_initialisation(stem):
    """CEA-LIST/SCE sce/models/trunks/resnet.py create_resnet replaces conv1 by nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    after torchvision's constructor and keeps its initialisation (`sce`); NPID's and SupContrast's CIFAR ResNets draw
    every convolution kaiming-normal fan-out (`kaiming`, WangFeng18 models/resnet_cifar.py, networks/resnet_big.py)."""
    torch.manual_seed(0)
    trunk = build_backbone("resnet18", small_input=True, small_input_stem=stem)[0]
    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    reference.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    if stem == "kaiming":
        nn.init.kaiming_normal_(reference.conv1.weight, mode="fan_out", nonlinearity="relu")
    assert trunk.conv1.padding == (1, 1) and torch.equal(trunk.conv1.weight, reference.conv1.weight)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"name": "resnet18", "small_input_stem": "solo_learn"}, "backbone.small_input_stem 'solo_learn' is a stem of the torchvision ResNets with small_input: true, not of 'resnet18' with small_input: false"),
        ({"name": "cifar_resnet32", "small_input_stem": "solo_learn"}, "not of 'cifar_resnet32' with small_input: false"),
        ({"name": "vit_tiny", "small_input": True, "small_input_stem": "solo_learn"}, "not of 'vit_tiny' with small_input: true"),
        ({"name": "resnet18", "small_input": True, "small_input_stem": "solo-learn"}, "backbone.small_input_stem must be one of sce, solo_learn, kaiming, got 'solo-learn'"),
    ],
)
def test_a_small_input_stem_the_trunk_cannot_have_is_refused_naming_it(arguments, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_backbone(**arguments)


def test_small_input_is_refused_for_cifar_resnets():
    with pytest.raises(ValueError, match="small_input=True is meaningless for 'cifar_resnet32'"):
        build_backbone("cifar_resnet32", small_input=True)


def test_resnext101_32x4d_has_32_groups_of_width_4_and_the_published_parameter_count():
    trunk, dim = build_backbone("resnext101_32x4d")
    assert dim == 2048
    assert [len(stage) for stage in (trunk.layer1, trunk.layer2, trunk.layer3, trunk.layer4)] == [3, 4, 23, 3]
    for stage, width in ((trunk.layer1, 128), (trunk.layer4, 1024)):  # 32 groups x 4 channels, doubling
        assert stage[0].conv2.groups == 32 and stage[0].conv2.in_channels == stage[0].conv2.out_channels == width
    # timm's resnext101_32x4d: 44,177,704 parameters (44.18 M) with the 1000-class fc.
    assert sum(p.numel() for p in trunk.parameters()) + 2048 * 1000 + 1000 == 44_177_704


@pytest.mark.parametrize("name", ["cifar_resnet20", "resnet18"])
def test_weights_from_a_local_file_are_loaded_into_the_trunk(tmp_path, name):
    source, _ = build_backbone(name)
    path = tmp_path / "trunk.pth"
    torch.save(source.state_dict(), path)
    trunk, _ = BackboneSpec(name=name, weights=str(path)).build()
    assert trunk.state_dict().keys() == source.state_dict().keys()
    assert all(torch.equal(value, source.state_dict()[key]) for key, value in trunk.state_dict().items())


def test_a_torchvision_checkpoint_with_its_classifier_loads_into_the_trunk(tmp_path):
    full = torchvision.models.resnet18()
    path = tmp_path / "resnet18-f37072fd.pth"
    torch.save(full.state_dict(), path)
    trunk, _ = build_backbone("resnet18", weights=str(path))
    assert torch.equal(trunk.layer4[1].conv2.weight, full.layer4[1].conv2.weight)


def test_a_torchvision_weights_name_is_resolved_and_loaded_strictly(monkeypatch):
    published = torchvision.models.resnet18().state_dict()
    monkeypatch.setattr(ResNet18_Weights, "get_state_dict", lambda self, *args, **kwargs: published)
    trunk, _ = build_backbone("resnet18", weights="IMAGENET1K_V1")
    assert torch.equal(trunk.conv1.weight, published["conv1.weight"])


def test_no_weights_keeps_the_random_init_without_fetching_anything(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("weights=None must not fetch torchvision weights")

    monkeypatch.setattr(ResNet18_Weights, "get_state_dict", refuse)
    assert BackboneSpec(name="resnet18").weights is None
    torch.manual_seed(0)
    first, _ = BackboneSpec(name="resnet18").build()
    torch.manual_seed(1)
    second, _ = BackboneSpec(name="resnet18").build()
    assert not torch.equal(first.conv1.weight, second.conv1.weight)


@pytest.mark.parametrize(
    "name, small_input, weights, message",
    [
        ("resnet18", False, "IMAGENET1K_V9", "='IMAGENET1K_V9' is not a torchvision weights name of 'resnet18'; "
         "choose one of IMAGENET1K_V1, DEFAULT"),
        ("resnet18", True, "IMAGENET1K_V1", "='IMAGENET1K_V1' cannot be combined with small_input=True"),
        ("resnext101_32x4d", False, "DEFAULT", "='DEFAULT': torchvision publishes no weights for backbone 'resnext101_32x4d'"),
        ("cifar_resnet32", False, "DEFAULT", "='DEFAULT': torchvision publishes no weights for backbone 'cifar_resnet32'"),
        ("timm:resnet10t", False, "DEFAULT", "='DEFAULT': torchvision publishes no weights for backbone 'timm:resnet10t'"),
        ("resnet18", False, "missing/trunk.pth", ": file 'missing/trunk.pth' is not an existing file"),
    ],
)
def test_unusable_weights_raise_an_error_naming_the_config_key(name, small_input, weights, message):
    with pytest.raises(ValueError, match=re.escape(f"model.init_args.backbone.weights{message}")):
        build_backbone(name, small_input=small_input, weights=weights)


def test_a_weights_file_of_another_architecture_names_the_file_and_the_mismatch(tmp_path):
    smaller, wider, not_a_state_dict = tmp_path / "r20.pth", tmp_path / "wide.pth", tmp_path / "run.pth"
    torch.save(build_backbone("cifar_resnet20")[0].state_dict(), smaller)
    torch.save(build_backbone("cifar_resnet32", base_width=32)[0].state_dict(), wider)
    torch.save({"epoch": 3}, not_a_state_dict)
    expected = {
        smaller: "does not match backbone 'cifar_resnet32': missing keys ['layer1.3",
        wider: "does not fit backbone 'cifar_resnet32'",
        not_a_state_dict: "is not a state dict",
    }
    for path, message in expected.items():
        with pytest.raises(ValueError, match=re.escape(f"model.init_args.backbone.weights: file '{path}' {message}")):
            build_backbone("cifar_resnet32", weights=str(path))


@pytest.mark.parametrize("name, features", [("timm:resnet10t", 512), ("timm:mobilenetv3_small_050", 1024)])
def test_timm_models_are_built_by_name_without_classifier_and_say_the_size_of_what_they_return(name, features):
    """A head with a pre-logits layer (MobileNetV3) returns head_hidden_size features, not num_features (288)."""
    trunk, dim = build_backbone(name)
    assert dim == features
    assert trunk.eval()(torch.randn(2, 3, 32, 32)).shape == (2, features)


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("resnet19", {}, "unknown backbone name 'resnet19'"),
        ("timm:not_a_model", {}, "unknown timm model 'not_a_model'"),
        ("resnet18", {"no_such_option": 1}, "rejected its keyword arguments"),
        ("timm:resnet10t", {"num_classes": 5}, "backbone 'timm:resnet10t' rejected its keyword arguments {'num_classes': 5}"),
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


def test_an_output_batch_norm_without_shift_learns_its_scale_and_keeps_a_zero_shift_under_sgd_with_weight_decay():
    """SimCLR's projection head ends in a BN with center=False, scale=True (google-research/simclr model_util.py)."""
    torch.manual_seed(0)
    head = build_mlp(6, MLPSpec(8, 4, num_layers=2, last_batch_norm=True, last_batch_norm_shift=False))
    norm = head[-1]
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        (head(torch.randn(16, 6)) * torch.arange(4.0)).sum().backward()
        optimizer.step()
    assert torch.equal(norm.bias, torch.zeros(4)) and not norm.bias.requires_grad
    assert not torch.equal(norm.weight, torch.ones(4))  # the scale trains
    with pytest.raises(ValueError, match="last_batch_norm_shift: false needs last_batch_norm: true and last_batch_norm_affine: true"):
        build_mlp(6, MLPSpec(8, 4, last_batch_norm=True, last_batch_norm_affine=False, last_batch_norm_shift=False))


def test_mlp_refuses_zero_layers_and_an_unknown_activation():
    with pytest.raises(ValueError, match="num_layers >= 1"):
        build_mlp(8, MLPSpec(num_layers=0))
    with pytest.raises(ValueError, match="MLP head activation must be 'relu' or 'gelu', got 'tanh'"):
        build_mlp(8, MLPSpec(activation="tanh"))
