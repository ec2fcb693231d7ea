"""Published checkpoints into contrastlab (`interop.official`): each official layout is built here from a
torchvision / timm model renamed as the official code names it (the repositories' model definitions and
save calls, see `interop.official`), then loaded by the linear stage, a long-tail classifier and the analysis."""

import argparse
import json
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn
import torchvision

import main_linear
import main_pretrain
from analysis.__main__ import main as analyse_checkpoint
from backbones import BackboneSpec, MLPSpec
from engine.files import ForeignObject, read_checkpoint
from interop.official import convert, detect_format
from methods import CrossEntropy, LinearProbe, PaCo, PaCoRIDE
from helpers import randomised

ROOT = Path(__file__).parents[1]
IMAGES = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
SMALL_RESNET18 = BackboneSpec("resnet18", small_input=True)


def torchvision_trunk(name: str = "resnet18", small_input: bool = True) -> nn.Module:
    """A torchvision ResNet without its classifier; the small-input stem as SCE's `create_resnet` sets it."""
    model = getattr(torchvision.models, name)()
    if small_input:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    model.fc = nn.Identity()
    return randomised(model).eval()


def renamed(state: dict, prefix: str = "", **renames: str) -> dict:
    out = {}
    for key, value in state.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        out[prefix + key] = value.clone()
    return out


def head(*dims: int, generator_seed: int = 3) -> dict:
    """Linear-ReLU-Linear weights as `nn.Sequential` numbers them (MoCo v2's fc, SupContrast's head)."""
    generator = torch.Generator().manual_seed(generator_seed)
    (d_in, d_hidden, d_out) = dims
    return {
        "0.weight": torch.randn(d_hidden, d_in, generator=generator), "0.bias": torch.randn(d_hidden, generator=generator),
        "2.weight": torch.randn(d_out, d_hidden, generator=generator), "2.bias": torch.randn(d_out, generator=generator),
    }  # fmt: skip


def optimizer_state() -> dict:
    return {"state": {}, "param_groups": [{"lr": 0.03, "momentum": 0.9, "params": [0, 1]}]}


# ----------------------------------------------------------------- the official files
def moved(state: dict) -> dict:
    """A momentum copy's weights: the online ones moved, as an EMA leaves them (a file whose two encoders were equal could
    not show that the online one is read)."""
    return {key: value + 0.05 * torch.rand_like(value) if value.is_floating_point() else value for key, value in state.items()}


def moco_file(trunk: nn.Module, arch: str = "resnet18") -> dict:
    """facebookresearch/moco main_moco.py: DDP (`module.`), MoCo(encoder_q, encoder_k, queue), the v2 MLP as `fc`."""
    state = trunk.state_dict()
    return {
        "epoch": 200,
        "arch": arch,
        "state_dict": renamed(state, "module.encoder_q.") | renamed(head(512, 512, 128), "module.encoder_q.fc.")
        | renamed(moved(state), "module.encoder_k.") | renamed(head(512, 512, 128), "module.encoder_k.fc.")
        | {"module.queue": torch.randn(128, 64), "module.queue_ptr": torch.zeros(1, dtype=torch.long)},
        "optimizer": optimizer_state(),
    }


def sce_file(trunk: nn.Module) -> dict:
    """CEA-LIST/SCE: a Lightning checkpoint of the SCE module (`trunk`, `projector.layers` of MLPHead)."""
    projector = {
        "0.weight": torch.randn(512, 512), "1.weight": torch.rand(512), "1.bias": torch.randn(512),
        "1.running_mean": torch.randn(512), "1.running_var": torch.rand(512) + 0.5, "1.num_batches_tracked": torch.tensor(7),
        "3.weight": torch.randn(128, 512), "3.bias": torch.randn(128),
    }  # fmt: skip
    state = trunk.state_dict()
    return {
        "epoch": 199,
        "global_step": 78000,
        "pytorch-lightning_version": "1.5.10",
        "state_dict": renamed(state, "trunk.") | renamed(projector, "projector.layers.")
        | renamed(moved(state), "momentum_trunk.") | renamed(moved(projector), "momentum_projector.layers.")
        | {"queue": torch.randn(128, 64), "queue_ptr": torch.zeros(1, dtype=torch.long)},
        "hyper_parameters": sce_hyperparameters(),
    }


def sce_hyperparameters():
    """What CEA-LIST/SCE's Lightning module saves as its hyperparameters: its Hydra config, OmegaConf containers
    (their pickles name omegaconf's classes and builtins.dict / list / int as the types of their nodes)."""
    from omegaconf import OmegaConf  # a dev dependency: the official file's own objects, not a stand-in class

    return OmegaConf.create({
        "trunk": {"_target_": "sce.models.trunks.create_resnet", "name": "resnet18", "small_input": True, "num_classes": 0},
        "projector": {"_target_": "sce.models.heads.MLPHead", "input_dim": 512, "hidden_dims": [512], "output_dim": 128},
        "optimizer": {"initial_lr": 0.3, "batch_size": 256, "params": {"weight_decay": 1.0e-6, "momentum": 0.9}, "exclude_wd_norm": False},
        "queue": {"size": 65536, "feature_dim": 128}, "temp": 0.1, "temp_m": 0.07, "coeff": 0.5, "num_devices": 8,
    })  # fmt: skip


def paco_file(trunk: nn.Module, centres: nn.Linear) -> dict:
    """PaCo/LT/paco_lt.py: DDP, MoCo(encoder_q, encoder_k, linear, linear_k, queue, queue_l), fc = Linear-BN-ReLU-Linear."""
    state = trunk.state_dict()
    mlp = {
        "0.weight": torch.randn(512, 512), "0.bias": torch.randn(512), "1.weight": torch.rand(512), "1.bias": torch.randn(512),
        "1.running_mean": torch.randn(512), "1.running_var": torch.rand(512) + 0.5, "1.num_batches_tracked": torch.tensor(3),
        "3.weight": torch.randn(128, 512), "3.bias": torch.randn(128),
    }  # fmt: skip
    return {
        "epoch": 400,
        "arch": "resnet18",
        "acc": 55.3,
        "state_dict": renamed(state, "module.encoder_q.") | renamed(mlp, "module.encoder_q.fc.")
        | renamed(moved(state), "module.encoder_k.") | renamed(moved(mlp), "module.encoder_k.fc.")
        | renamed(centres.state_dict(), "module.linear.") | renamed(moved(centres.state_dict()), "module.linear_k.")
        | {"module.queue": torch.randn(64, 128), "module.queue_l": torch.randint(0, 10, (64,)), "module.queue_ptr": torch.zeros(1, dtype=torch.long)},
        "optimizer": optimizer_state(),
    }


def supcon_file(trunk: nn.Module, data_parallel: bool = True) -> dict:
    """SupContrast util.save_model: {opt, model, optimizer, epoch}; resnet_big names the shortcut `shortcut`;
    main_supcon wraps `model.encoder` in DataParallel on several GPUs (`encoder.module.`)."""
    prefix = "encoder.module." if data_parallel else "encoder."
    return {
        "opt": argparse.Namespace(model="resnet18", temp=0.1, method="SupCon"),
        "model": renamed(trunk.state_dict(), prefix, downsample="shortcut") | renamed(head(512, 512, 128), "head."),
        "optimizer": optimizer_state(),
        "epoch": 1000,
    }


def npid_file(trunk: nn.Module, cifar: bool = True) -> dict:
    """WangFeng18/UnsupervisedLearningCodes main.py: DataParallel (`module.`); models/resnet_cifar.py names the
    shortcut `shortcut` and the head `linear`, models/resnet.py the head `fc`."""
    state = renamed(trunk.state_dict(), "module.", **({"downsample": "shortcut"} if cifar else {}))
    head_name = "module.linear." if cifar else "module.fc."
    return {
        "epoch": 200,
        "state_dict": state | {f"{head_name}weight": torch.randn(128, 512), f"{head_name}bias": torch.randn(128)},
        "optimizer": optimizer_state(),
        "memory_banks": torch.randn(100, 128),
        "neigh": torch.zeros(100, 1, dtype=torch.long),
    }


def bn_head(*dims: int, last_affine: bool = False, generator_seed: int = 4) -> dict:
    """Linear-BN-ReLU-...-Linear-BN weights without Linear biases, as moco-v3 moco/builder.py `_build_mlp` and
    simsiam/builder.py number them (the last BN without affine parameters unless `last_affine`)."""
    generator = torch.Generator().manual_seed(generator_seed)
    state = {}
    for layer, (d_in, d_out) in enumerate(zip(dims, dims[1:])):
        linear, norm = 3 * layer, 3 * layer + 1
        state[f"{linear}.weight"] = torch.randn(d_out, d_in, generator=generator)
        if layer < len(dims) - 2 or last_affine:
            state |= {f"{norm}.weight": torch.rand(d_out, generator=generator), f"{norm}.bias": torch.randn(d_out, generator=generator)}
        state |= {f"{norm}.running_mean": torch.randn(d_out, generator=generator), f"{norm}.running_var": torch.rand(d_out, generator=generator) + 0.5,
                  f"{norm}.num_batches_tracked": torch.tensor(5)}
    return state


def mocov3_file(trunk: nn.Module, classifier_name: str, arch: str) -> dict:
    """facebookresearch/moco-v3 main_moco.py: DDP (`module.`), MoCo(base_encoder, momentum_encoder, predictor); the
    projector replaces the trunk's classifier (`fc` for a ResNet, `head` for a ViT, moco/builder.py)."""
    state, width = trunk.state_dict(), trunk.num_features if hasattr(trunk, "num_features") else 512
    projector, predictor = bn_head(width, 32, 16), bn_head(16, 32, 16)
    predictor = {key: value for key, value in predictor.items() if not key.startswith("4.")}  # the ResNet's predictor has no last BN
    return {
        "epoch": 100,
        "arch": arch,
        "state_dict": renamed(state, "module.base_encoder.") | renamed(projector, f"module.base_encoder.{classifier_name}.")
        | renamed(moved(state), "module.momentum_encoder.") | renamed(moved(projector), f"module.momentum_encoder.{classifier_name}.")
        | renamed(predictor, "module.predictor."),
        "optimizer": optimizer_state(),
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 0},
    }


def simsiam_file(trunk: nn.Module) -> dict:
    """facebookresearch/simsiam main_simsiam.py: DDP (`module.`), SimSiam(encoder, predictor); the encoder's `fc` is the
    projector (simsiam/builder.py), its layer 6 the ResNet's own fc with its (frozen) bias."""
    projector = bn_head(512, 64, 64, 64) | {"6.bias": torch.randn(64)}
    predictor = bn_head(64, 16, 64)
    predictor = {key: value for key, value in predictor.items() if not key.startswith("4.")} | {"3.bias": torch.randn(64)}
    return {
        "epoch": 100,
        "arch": "resnet18",
        "state_dict": renamed(trunk.state_dict(), "module.encoder.") | renamed(projector, "module.encoder.fc.") | renamed(predictor, "module.predictor."),
        "optimizer": optimizer_state(),
    }


MOCOV3_SMALL_VIT = dict(img_size=16, patch_size=8, embed_dim=96, depth=1, num_heads=12)  # a vit_small of moco-v3's 12 heads, shrunk


def solo_learn_file(trunk: nn.Module) -> dict:
    """vturrisi/solo-learn main_pretrain.py: a Lightning checkpoint of a method without saved hyperparameters, the online
    `backbone`, its `momentum_backbone` (BYOL, MoCo, DINO), a `projector` and the online linear `classifier`."""
    momentum = randomised(BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn").build()[0])
    return {
        "epoch": 999, "global_step": 390000, "pytorch-lightning_version": "2.0.2", "optimizer_states": [], "lr_schedulers": [],
        "state_dict": renamed(trunk.state_dict(), "backbone.") | renamed(momentum.state_dict(), "momentum_backbone.")
        | renamed(head(512, 2048, 256), "projector.") | {"classifier.weight": torch.randn(10, 512), "classifier.bias": torch.zeros(10)},
    }  # fmt: skip


def timm_vit_trunk() -> nn.Module:
    """moco-v3 vits.py's VisionTransformerMoCo is timm's VisionTransformer under the same names; a small one at 16 px."""
    torch.manual_seed(5)
    return timm.models.vision_transformer.VisionTransformer(**MOCOV3_SMALL_VIT, num_classes=0).eval()


def swav_file(trunk: nn.Module) -> dict:
    """facebookresearch/swav's released `*_pretrain.pth.tar`: the DDP model's flat state dict, trunk (torchvision's
    names, src/resnet50.py), projection head Linear-BN-ReLU-Linear with biases, prototypes."""
    generator = torch.Generator().manual_seed(4)
    projection = {"0.weight": torch.randn(64, 512, generator=generator), "0.bias": torch.randn(64, generator=generator),
                  "1.weight": torch.ones(64), "1.bias": torch.zeros(64), "1.running_mean": torch.zeros(64),
                  "1.running_var": torch.ones(64), "1.num_batches_tracked": torch.tensor(5),
                  "3.weight": torch.randn(16, 64, generator=generator), "3.bias": torch.randn(16, generator=generator)}  # fmt: skip
    return renamed(trunk.state_dict(), "module.") | renamed(projection, "module.projection_head.") | {"module.prototypes.weight": torch.randn(30, 16)}


def dino_head(dim: int) -> dict:
    """facebookresearch/dino vision_transformer.py DINOHead(dim, 20, hidden_dim=32, bottleneck_dim=8): GELU MLP, then
    the weight-normalised last layer."""
    generator = torch.Generator().manual_seed(5)
    mlp = {f"mlp.{index}.{kind}": torch.randn(*((out, into) if kind == "weight" else (out,)), generator=generator)
           for index, (into, out) in {0: (dim, 32), 2: (32, 32), 4: (32, 8)}.items() for kind in ("weight", "bias")}  # fmt: skip
    return mlp | {"last_layer.weight_g": torch.ones(20, 1), "last_layer.weight_v": torch.randn(20, 8, generator=generator)}


def dino_file(teacher: nn.Module, vit: bool) -> dict:
    """facebookresearch/dino main_dino.py checkpoint.pth: the DDP student (`module.`), the teacher (DDP-wrapped only
    when it has BatchNorm: a ResNet), the centre under `dino_loss`, the arguments as an argparse.Namespace."""
    dim = 192 if vit else 512
    student = torchvision_trunk(small_input=False) if not vit else teacher
    teacher_prefix = "" if vit else "module."
    return {
        "student": renamed(student.state_dict(), "module.backbone.") | renamed(dino_head(dim), "module.head."),
        "teacher": renamed(teacher.state_dict(), f"{teacher_prefix}backbone.") | renamed(dino_head(dim), f"{teacher_prefix}head."),
        "optimizer": optimizer_state(), "epoch": 100, "args": argparse.Namespace(arch="vit_tiny" if vit else "resnet18"),
        "dino_loss": {"center": torch.zeros(1, 20)}, "fp16_scaler": None,
    }  # fmt: skip


def full_torchvision_resnet18() -> tuple[nn.Module, nn.Module]:
    model = randomised(torchvision.models.resnet18()).eval()
    trunk = torchvision.models.resnet18()
    trunk.load_state_dict(model.state_dict())
    trunk.fc = nn.Identity()
    return model, trunk.eval()


def full_timm_test_resnet() -> tuple[nn.Module, nn.Module]:
    model = randomised(timm.create_model("test_resnet")).eval()
    trunk = timm.create_model("test_resnet", num_classes=0)
    trunk.load_state_dict({key: value for key, value in model.state_dict().items() if not key.startswith("fc.")})
    return model, trunk.eval()


def official_case(format: str):
    """(the checkpoint object, the source trunk, the backbone to give, or None to infer it)."""
    if format == "moco":
        trunk = torchvision_trunk()
        return moco_file(trunk), trunk, None
    if format == "sce":
        trunk = torchvision_trunk()
        return sce_file(trunk), trunk, None
    if format == "paco":
        trunk = torchvision_trunk()
        return paco_file(trunk, nn.Linear(512, 10)), trunk, None
    if format in ("supcon", "supcon_one_gpu"):
        trunk = torchvision_trunk()
        return supcon_file(trunk, data_parallel=format == "supcon"), trunk, None
    if format in ("npid", "npid_imagenet"):
        trunk = torchvision_trunk(small_input=format == "npid")
        return npid_file(trunk, cifar=format == "npid"), trunk, None
    if format == "mocov3":
        trunk = torchvision_trunk(small_input=False)
        return mocov3_file(trunk, "fc", "resnet18"), trunk, None
    if format == "mocov3_vit":
        trunk = timm_vit_trunk()
        return mocov3_file(trunk, "head", "vit_small"), trunk, BackboneSpec("vit_small", kwargs=MOCOV3_SMALL_VIT)
    if format == "simsiam":
        trunk = torchvision_trunk(small_input=False)
        return simsiam_file(trunk), trunk, None
    if format == "torchvision":
        model, trunk = full_torchvision_resnet18()
        return model.state_dict(), trunk, None
    if format == "barlow_twins":  # facebookresearch/barlowtwins main.py and vicreg main_vicreg.py save backbone.state_dict()
        trunk = torchvision_trunk(small_input=False)
        return trunk.state_dict(), trunk, None
    if format in ("swav", "swav_training", "swav_multi_prototypes"):  # the released file, a training run's checkpoint.pth.tar (main_swav.py)
        trunk = torchvision_trunk(small_input=False)
        if format == "swav_multi_prototypes":  # --nmb_prototypes given as a list: MultiPrototypes, heads prototypes<i>
            heads = {key: value for key, value in swav_file(trunk).items() if not key.startswith("module.prototypes.")}
            return heads | {f"module.prototypes.prototypes{i}.weight": torch.randn(30, 16) for i in range(2)}, trunk, None
        return (swav_file(trunk) if format == "swav" else {"epoch": 400, "state_dict": swav_file(trunk), "optimizer": {}}), trunk, None
    if format == "solo_learn":  # a CIFAR ResNet-18 of solo-learn's stem: padding 2, which only the format tells
        trunk = randomised(BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn").build()[0]).eval()
        return solo_learn_file(trunk), trunk, None
    if format == "dino":
        teacher = torchvision_trunk(small_input=False)
        return dino_file(teacher, vit=False), teacher, None
    if format == "dino_vit":
        spec = BackboneSpec("vit_tiny", kwargs={"img_size": 16, "patch_size": 8, "depth": 1})
        teacher = spec.build()[0].eval()
        return dino_file(teacher, vit=True), teacher, spec
    model, trunk = full_timm_test_resnet()
    return model.state_dict(), trunk, BackboneSpec("timm:test_resnet")


CASES = ["moco", "sce", "paco", "supcon", "supcon_one_gpu", "npid", "npid_imagenet", "torchvision", "timm", "mocov3", "mocov3_vit", "simsiam",
         "barlow_twins", "swav", "swav_training", "swav_multi_prototypes", "dino", "dino_vit", "solo_learn"]
DETECTED = {"supcon_one_gpu": "supcon", "npid_imagenet": "npid", "mocov3_vit": "mocov3", "barlow_twins": "torchvision", "dino_vit": "dino",
            "swav_training": "swav", "swav_multi_prototypes": "swav"}


@pytest.mark.parametrize("case", CASES)
def test_an_official_checkpoint_loads_strictly_and_gives_the_source_trunk_features(case, tmp_path):
    checkpoint, source, backbone = official_case(case)
    path = tmp_path / "official.pth"
    torch.save(checkpoint, path)
    format = DETECTED.get(case, case)
    assert detect_format(read_checkpoint(path, "test"), backbone and backbone.name, "test") == format  # what no flag reads
    probe = LinearProbe(pretrained_ckpt=str(path), pretrained_format=format, backbone=backbone)
    with torch.no_grad():
        assert torch.equal(probe.backbone(IMAGES), source(IMAGES))


def test_the_probe_of_an_official_dino_file_records_the_teacher_it_reads_and_refuses_the_student(tmp_path):
    """DINO's release is read as its teacher (eval_linear.py): config.yaml said `online` for it, and an explicit
    `online` probed the teacher all the same."""
    for case, encoder in (("dino", "momentum"), ("moco", "online")):
        checkpoint, _, _ = official_case(case)
        torch.save(checkpoint, tmp_path / f"{case}.pth")
        init_args = {"pretrained_ckpt": str(tmp_path / f"{case}.pth"), "pretrained_encoder": None}
        LinearProbe.settle_arguments(init_args)
        assert init_args["pretrained_encoder"] == encoder, case
    with pytest.raises(ValueError, match=r"\(format dino\) is read as its teacher, the momentum trunk, .* give --model.pretrained_encoder momentum"):
        LinearProbe(pretrained_ckpt=str(tmp_path / "dino.pth"), pretrained_encoder="online")
    assert LinearProbe(pretrained_ckpt=str(tmp_path / "dino.pth"), pretrained_encoder="momentum").feature_dim == 512


def test_a_vit_of_another_head_count_than_the_official_architecture_s_is_one_error(tmp_path):
    """moco-v3's vit_small has 12 heads, DINO's 6: the same tensor shapes, so only the checkpoint's arch tells."""
    checkpoint, _, _ = official_case("mocov3_vit")
    path = tmp_path / "mocov3.pth.tar"
    torch.save(checkpoint, path)
    six_heads = BackboneSpec("vit_small", kwargs={key: value for key, value in MOCOV3_SMALL_VIT.items() if key != "num_heads"} | {"num_heads": 6})
    with pytest.raises(ValueError, match=r"is mocov3's vit_small, a ViT of 12 heads; model.backbone 'vit_small' builds 6: give model.backbone.kwargs.num_heads 12"):
        LinearProbe(pretrained_ckpt=str(path), backbone=six_heads)
    dino, teacher, spec = official_case("dino_vit")  # DINO's vit_tiny: 3 heads, as timm's
    torch.save(dino, path)
    LinearProbe(pretrained_ckpt=str(path), pretrained_encoder="momentum", backbone=spec)
    with pytest.raises(ValueError, match="is dino's vit_tiny, a ViT of 3 heads; model.backbone 'vit_tiny' builds 1"):
        LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec("vit_tiny", kwargs=spec.kwargs | {"num_heads": 1}))


def test_a_timm_vit_of_another_head_count_than_the_official_architecture_s_is_one_error(tmp_path):
    """timm's vit_small_patch16_224 has DeiT's 6 heads: moco-v3's vit_small weights load into it, as another network."""
    checkpoint, source, _ = official_case("mocov3_vit")
    path = tmp_path / "mocov3.pth.tar"
    torch.save(checkpoint, path)
    shrunk = {key: value for key, value in MOCOV3_SMALL_VIT.items() if key != "num_heads"}
    with pytest.raises(ValueError, match=r"is mocov3's vit_small, a ViT of 12 heads; model.backbone 'timm:vit_small_patch16_224' builds 6: give model.backbone.kwargs.num_heads 12"):
        LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec("timm:vit_small_patch16_224", kwargs=shrunk))
    probe = LinearProbe(pretrained_ckpt=str(path), backbone=BackboneSpec("timm:vit_small_patch16_224", kwargs=shrunk | {"num_heads": 12}))
    with torch.no_grad():
        assert torch.equal(probe.backbone(IMAGES), source(IMAGES))


@pytest.mark.parametrize("case", ["mocov3", "mocov3_vit", "simsiam"])
def test_mocov3_and_simsiam_heads_are_read_in_the_numbering_of_contrastlab_s_mlps(case):
    checkpoint, _, backbone = official_case(case)
    weights = convert(checkpoint, DETECTED.get(case, case), backbone and backbone.name, "test")
    state = checkpoint["state_dict"]
    encoder, projector_prefix = ("module.encoder.", "module.encoder.fc.") if case == "simsiam" else \
        ("module.base_encoder.", f"module.base_encoder.{'head' if case == 'mocov3_vit' else 'fc'}.")
    assert set(weights.heads) == {"projector", "predictor"}
    assert weights.heads["projector"] == {key.removeprefix(projector_prefix): value for key, value in state.items() if key.startswith(projector_prefix)}
    assert weights.heads["predictor"] == {key.removeprefix("module.predictor."): value for key, value in state.items() if key.startswith("module.predictor.")}
    assert not any(key.startswith(("fc.", "head.")) for key in weights.trunk) and len(weights.trunk) == sum(
        key.startswith(encoder) and not key.startswith(projector_prefix) for key in state)


def test_jcl_is_read_as_the_moco_layout_it_is(tmp_path):
    """caiqi/Joint-Contrastive-Learning builds and saves its model as MoCo's main_moco.py does."""
    trunk = torchvision_trunk()
    path = tmp_path / "checkpoint_0199.pth.tar"
    torch.save(moco_file(trunk), path)
    assert detect_format(read_checkpoint(path, "test"), None, "test") == "moco"
    probe = LinearProbe(pretrained_ckpt=str(path), pretrained_format="jcl")
    with torch.no_grad():
        assert torch.equal(probe.backbone(IMAGES), trunk(IMAGES))


def test_a_legacy_format_file_with_foreign_objects_is_read_without_running_them(tmp_path):
    """The 2020 releases were written before torch's zip format; SupContrast's holds an argparse.Namespace."""
    trunk = torchvision_trunk()
    path = tmp_path / "supcon_last.pth"
    torch.save(supcon_file(trunk), path, _use_new_zipfile_serialization=False)
    probe = LinearProbe(pretrained_ckpt=str(path))
    assert probe.hparams.backbone is None and probe.backbone.conv1.kernel_size == (3, 3)
    with torch.no_grad():
        assert torch.equal(probe.backbone(IMAGES), trunk(IMAGES))


def write_marker(path: str) -> None:
    """What unpickling a `RunsCodeWhenLoaded` calls: pickle names this function, torch.load(weights_only=False) runs it."""
    Path(path).write_text("ran")


class RunsCodeWhenLoaded:
    """An object whose unpickling calls a function of the file's choosing, as a malicious checkpoint's would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return write_marker, (str(self.marker),)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_checkpoint_whose_objects_would_run_code_when_loaded_is_read_without_running_it(zip_format, tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "checkpoint.pth"
    torch.save({"state_dict": {"weight": torch.ones(2)}, "args": RunsCodeWhenLoaded(marker)}, path, _use_new_zipfile_serialization=zip_format)
    loaded = read_checkpoint(path, "test")
    assert not marker.exists() and isinstance(loaded["args"], ForeignObject) and torch.equal(loaded["state_dict"]["weight"], torch.ones(2))
    torch.load(path, weights_only=False)  # what loading it unsafely does: the file's function runs
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
@pytest.mark.slow
def test_torchvision_weights_are_read_from_pth_and_safetensors_files(suffix, tmp_path):
    from safetensors.torch import save_file

    model, trunk = full_torchvision_resnet18()
    path = tmp_path / f"resnet18{suffix}"
    (torch.save if suffix == ".pth" else save_file)(model.state_dict(), str(path))
    probe = LinearProbe(pretrained_ckpt=str(path))
    with torch.no_grad():
        assert torch.equal(probe.backbone(IMAGES), trunk(IMAGES))


@pytest.mark.parametrize("name, small_input", [("resnet18", True), ("resnet34", True), ("resnet50", False), ("resnext50_32x4d", False)])
@pytest.mark.slow
def test_the_trunk_is_read_from_the_names_and_shapes_of_the_weights(name, small_input, tmp_path):
    weights = torchvision_trunk(name, small_input).state_dict()
    path = tmp_path / "weights.pth"
    torch.save(weights, path)
    probe = LinearProbe(pretrained_ckpt=str(path), pretrained_format="torchvision")
    assert probe.hparams.backbone is None  # nothing given: every key and shape matched the inferred trunk
    loaded = probe.backbone.state_dict()
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[key], weights[key]) for key in weights)


def partial(checkpoint: dict) -> dict:
    del checkpoint["state_dict"]["module.encoder_q.layer4.1.bn2.running_var"]
    return checkpoint


def with_extra_key(checkpoint: dict) -> dict:
    checkpoint["state_dict"]["module.encoder_q.attnpool.weight"] = torch.zeros(3)
    return checkpoint


@pytest.mark.parametrize(
    "make, format, backbone, message",
    [
        (lambda: partial(moco_file(torchvision_trunk())), "moco", None, r"missing keys \['layer4.1.bn2.running_var'\], unexpected keys \[\]"),
        (lambda: partial(moco_file(torchvision_trunk())), "moco", SMALL_RESNET18, r"missing keys \['layer4.1.bn2.running_var'\]"),
        (lambda: with_extra_key(moco_file(torchvision_trunk())), None, SMALL_RESNET18, r"unexpected keys \['attnpool.weight'\]"),
        (lambda: moco_file(torchvision_trunk()), "moco", BackboneSpec("resnet18"), "does not fit backbone 'resnet18' \\(small_input=False\\)"),
        (lambda: supcon_file(torchvision_trunk()), "moco", None, "\\(format moco\\) holds no state dict under 'state_dict'"),
        (lambda: npid_file(torchvision_trunk()), "paco", None, "\\(format paco\\) holds no 'module.encoder_q.\\*' weights under 'state_dict'"),
        (lambda: {"weights": {"conv.weight": torch.zeros(1)}}, None, None, "is in no known format: it holds no 'backbone.\\*' weights"),
        (lambda: torchvision.models.resnet18().state_dict(), "timm", None, "give the timm trunk it holds as model.backbone"),
        (lambda: moco_file(torchvision_trunk()), "byol", None, "model.pretrained_format 'byol' is not a known checkpoint format"),
        (lambda: {"state_dict": {"module.encoder_q.conv1.weight": torch.zeros(64, 3, 7, 7)}}, None, None, "is no backbone contrastlab builds; give model.backbone"),
    ],
    ids=["partial", "partial-backbone-given", "extra-key", "other-stem", "wrong-container", "wrong-layout", "unknown", "timm-without-backbone", "bad-format", "no-resnet"],
)
def test_a_wrong_or_partial_official_file_is_one_error_naming_what_does_not_match(make, format, backbone, message, tmp_path):
    path = tmp_path / "official.pth"
    torch.save(make(), path)
    with pytest.raises(ValueError, match=message) as error:
        LinearProbe(pretrained_ckpt=str(path), pretrained_format=format, backbone=backbone)
    assert "\n" not in str(error.value) and str(error.value).startswith("model.pretrained_")


@pytest.mark.slow
def test_the_linear_stage_command_ends_a_partial_file_with_one_error_line(tmp_path, capsys):
    path = tmp_path / "moco_v2.pth.tar"
    torch.save(partial(moco_file(torchvision_trunk())), path)
    with pytest.raises(SystemExit):
        main_linear.cli_main(["fit", "--config", str(ROOT / "configs/linear_digits.yaml"), f"--model.pretrained_ckpt={path}",
                              "--model.pretrained_format=moco", f"--trainer.default_root_dir={tmp_path / 'run'}"])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: model.init_args.pretrained_ckpt") and "missing keys ['layer4.1.bn2.running_var']" in lines[-1]
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------- long-tail classifiers and the analysis
@pytest.mark.slow
def test_paco_import_predicts_the_classes_of_the_source_classifier(tmp_path):
    trunk, centres = torchvision_trunk(), nn.Linear(512, 10)
    with torch.no_grad():
        features = trunk(IMAGES)
        centred = features - features.mean(dim=0)  # centre i scores (f - mean) . (f_i - mean): image i in class i
        centres.weight[: len(IMAGES)] = 100 * centred
        centres.bias[: len(IMAGES)] = -100 * features.mean(dim=0) @ centred.T
        logits = centres(features)  # PaCo's _inference: linear on the pooled encoder_q feature
        expected = logits.argmax(dim=1)
    assert len(expected.unique()) > 1
    path = tmp_path / "paco_r18.pth"
    torch.save(paco_file(trunk, centres), path)
    for model_class in (CrossEntropy, PaCo, PaCoRIDE):  # PaCoRIDE on a plain trunk is PaCo: one expert, the release's centres
        model = model_class(backbone=SMALL_RESNET18, num_classes=10, pretrained_ckpt=str(path)).eval()
        with torch.no_grad():
            assert torch.equal(model.classify(IMAGES).argmax(dim=1), expected)
            torch.testing.assert_close(model.classify(IMAGES), logits)  # the online centres (`linear`), not the momentum ones


def test_a_file_without_a_classifier_is_refused_by_a_long_tail_classifier(tmp_path):
    path = tmp_path / "moco.pth"
    torch.save(moco_file(torchvision_trunk()), path)
    with pytest.raises(ValueError, match="\\(format moco\\) holds no classifier .* probe its trunk with main_linear.py"):
        CrossEntropy(backbone=SMALL_RESNET18, num_classes=10, pretrained_ckpt=str(path))


@pytest.mark.slow
def test_validate_reports_the_shot_metrics_of_a_released_paco_model(tmp_path, capsys):
    path = tmp_path / "paco.pth"
    torch.save(paco_file(torchvision_trunk(), nn.Linear(512, 10)), path)
    main_pretrain.cli_main([
        "validate", "--config", str(ROOT / "configs/paco_digits_lt.yaml"), f"--model.init_args.pretrained_ckpt={path}",
        "--model.init_args.backbone.name=resnet18", "--model.init_args.backbone.small_input=true",
        "--model.init_args.projector.hidden_dim=32", "--model.init_args.queue_size=64", "--data.init_args.batch_size=16",
        "--trainer.limit_val_batches=2", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    assert "val results: top1" in capsys.readouterr().out
    logged = json.loads((tmp_path / "run" / "results_validate.json").read_text())["metrics"]
    assert {"val/top1", "val/many_top1", "val/medium_top1", "val/few_top1"} <= set(logged)


def test_the_analysis_of_an_official_dino_file_reads_its_teacher_in_every_encoder_of_the_model():
    """DINO's evaluated trunk is its momentum copy (the teacher, `evaluated_trunk`), which the few-shot probes and the
    kNN read: the release's teacher must be there, not the copy's random initialisation."""
    from interop import load_official_encoder
    from methods import DINO

    checkpoint, teacher, _ = official_case("dino")
    model = DINO(backbone=BackboneSpec("resnet18"), out_dim=20, knn_k=0,
                 projector=MLPSpec(hidden_dim=32, output_dim=8, num_layers=3, batch_norm=False, activation="gelu")).eval()
    assert load_official_encoder(model, checkpoint, "dino", "test") == "dino"
    with torch.no_grad():
        for trunk in (model.backbone, model.target_backbone, model.evaluated_trunk()):
            assert torch.equal(trunk(IMAGES), teacher.eval()(IMAGES))
    head = {key.removeprefix("module.head.mlp."): value for key, value in checkpoint["teacher"].items() if key.startswith("module.head.mlp.")}
    for projector in (model.projector, model.target_projector):
        assert all(torch.equal(value, head[key]) for key, value in projector.state_dict().items())


@pytest.mark.slow
def test_the_analysis_reads_an_official_trunk_and_head(tmp_path, capsys):
    """WangFeng18's CIFAR NPID (ResNet-18, small stem, one Linear to 128) into configs/npid_cifar10.yaml's NPID."""
    from interop import load_official_encoder
    from methods import NPID

    trunk = torchvision_trunk()
    checkpoint = npid_file(trunk)
    path = tmp_path / "npid_cifar10.pth"
    torch.save(checkpoint, path)
    model = NPID(backbone=SMALL_RESNET18, projector={"output_dim": 128, "num_layers": 1}, knn_k=0).eval()
    assert load_official_encoder(model, read_checkpoint(path, "test"), None, "test") == "npid"
    with torch.no_grad():
        features, projection = model.embed(IMAGES)
        head = checkpoint["state_dict"]["module.linear.weight"], checkpoint["state_dict"]["module.linear.bias"]
        assert torch.equal(features, trunk(IMAGES))
        assert torch.equal(projection, torch.nn.functional.normalize(nn.functional.linear(trunk(IMAGES), *head), dim=1))

    out = tmp_path / "analysis"
    overrides = ["--model.init_args.backbone.name=resnet18", "--model.init_args.backbone.small_input=true",
                 "--data.init_args.batch_size=16", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]  # fmt: skip
    analyse_checkpoint([str(path), "--format", "npid", "--config", str(ROOT / "configs/npid_digits.yaml"), "--max-samples", "20",
                        "--out", str(out), "--device", "cpu", "--", *overrides])  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["format"] == "npid" and metrics["samples"] == 20


def test_the_analysis_refuses_an_official_file_without_a_projection_head(tmp_path):
    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    with pytest.raises(SystemExit, match="holds no projection head"):
        analyse_checkpoint([str(path), "--config", str(ROOT / "configs/npid_digits.yaml"), "--device", "cpu",
                            "--", "--model.init_args.backbone.name=resnet18"])  # fmt: skip
