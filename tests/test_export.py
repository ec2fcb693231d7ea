"""Trunks out of contrastlab (`python -m interop.export`): each export is loaded strictly by the library it
targets, built there as a user would build it, and gives contrastlab's features or predictions bit for bit."""

import errno
import functools
import hashlib
import json
import pickle
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
import torchvision
from safetensors.torch import load_file

import main_linear
import main_pretrain
from backbones import BackboneSpec, MLPSpec
from engine.checkpoint_record import VERSION
from helpers import TINY_PROJECTOR, randomised
from datamodules import DigitsDataModule
from interop.export import data_facts, detectron2_config, export, main as export_command
from interop.official import exported_backbone
from methods import BYOL, DINO, NNCLR, BarlowTwins, CrossEntropy, LinearProbe, MoCoV2, MoCoV3, PaCo, PaCoRIDE, SimCLR, SimSiam, SwAV, VICReg
from methods.longtail import tau_normalised

ROOT = Path(__file__).parents[1]
IMAGES = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def saved(model: L.LightningModule, path: Path) -> Path:
    """A Lightning checkpoint of `model` as the trainer writes it (hyperparameters and contrastlab record included)."""
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    return path


def moco(backbone: BackboneSpec) -> MoCoV2:
    model = MoCoV2(backbone=backbone, projector=TINY_PROJECTOR, queue_size=64, knn_k=0)
    randomised(model.backbone)
    randomised(model.target_backbone, seed=3)  # the momentum encoder differs from the online one
    return model


def torchvision_model(name: str, small_input: bool, num_classes: int | None = None, padding: int = 1) -> nn.Module:
    """The torchvision model of the name, built as the README says (small stem: 3x3 conv1, no max-pool)."""
    model = getattr(torchvision.models, name)(**({"num_classes": num_classes} if num_classes else {}))
    if small_input:
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=padding, bias=False)
        model.maxpool = nn.Identity()
    if num_classes is None:
        model.fc = nn.Identity()
    return model


@pytest.mark.parametrize("name, small_input, stem", [("resnet18", True, "sce"), ("resnet18", True, "solo_learn"), ("resnet50", False, "sce"), ("resnext50_32x4d", False, "sce")])
@pytest.mark.slow
def test_an_exported_trunk_loads_strictly_into_torchvision_and_gives_the_same_features(name, small_input, stem, tmp_path, monkeypatch):
    model = SimCLR(backbone=BackboneSpec(name, small_input=small_input, small_input_stem=stem), projector=TINY_PROJECTOR, knn_k=0)
    randomised(model.backbone)
    files = export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "export" / "trunk")
    assert [file.name for file in files] == ["trunk.pth", "trunk.safetensors", "trunk.json"]
    image = IMAGES[:1]  # a deterministic CPU convolution costs per image
    with torch.no_grad():
        expected = model.backbone.eval()(image)
        for state in (torch.load(files[0], weights_only=True), load_file(files[1])):
            exported = torchvision_model(name, small_input, padding=2 if stem == "solo_learn" else 1)
            exported.load_state_dict(state, strict=True)
            assert torch.equal(exported.eval()(image), expected)
        recipe = {"torch": torch, "torchvision": torchvision, "safetensors": __import__("safetensors.torch")}
        monkeypatch.chdir(files[0].parent)
        exec(json.loads(files[2].read_text())["load"], recipe)  # the record's own instructions
        assert torch.equal(recipe["model"].eval()(image), expected)


@pytest.mark.parametrize("stem", ["sce", "solo_learn"])
def test_the_linear_stage_probes_an_exported_trunk_with_the_stem_its_record_names(stem, tmp_path):
    """The weights of the two 3x3 stems are alike (padding is no weight): the export's record tells them apart."""
    model = SimCLR(backbone=BackboneSpec("resnet18", small_input=True, small_input_stem=stem), projector=TINY_PROJECTOR, knn_k=0)
    randomised(model.backbone)
    pth, safetensors, record = export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "trunk")
    with torch.no_grad():
        expected = model.backbone.eval()(IMAGES[:1])
        for file in (pth, safetensors):
            probe = LinearProbe(pretrained_ckpt=str(file), pretrained_format="torchvision")
            assert probe.backbone.conv1.padding == ((2, 2) if stem == "solo_learn" else (1, 1))
            assert torch.equal(probe.backbone(IMAGES[:1]), expected)
    record.write_text("{")
    with pytest.raises(ValueError, match=rf"model.pretrained_ckpt '{pth}': its export record '{record}' is unreadable \(JSONDecodeError"):
        LinearProbe(pretrained_ckpt=str(pth))


def test_an_exported_timm_trunk_loads_strictly_into_timm_and_gives_the_same_features(tmp_path):
    model = moco(BackboneSpec("timm:test_resnet"))
    pth, safetensors, record = export(saved(model, tmp_path / "last.ckpt"), "timm", tmp_path / "trunk")
    with torch.no_grad():
        expected = model.backbone.eval()(IMAGES)
        for state in (torch.load(pth, weights_only=True), load_file(safetensors)):
            exported = timm.create_model("test_resnet", num_classes=0)
            exported.load_state_dict(state, strict=True)
            assert torch.equal(exported.eval()(IMAGES), expected)
        overlaid = timm.create_model("test_resnet", pretrained=True, pretrained_cfg_overlay={"file": str(safetensors)}, num_classes=0)
        assert torch.equal(overlaid.eval()(IMAGES), expected)
    assert json.loads(record.read_text())["trunk"] == {"name": "timm:test_resnet", "small_input": False, "small_input_stem": "sce", "kwargs": {}, "feature_dim": 96}


PREDICTOR = MLPSpec(hidden_dim=32, output_dim=TINY_PROJECTOR.output_dim)
NEW_METHODS = {
    "BYOL": lambda backbone: BYOL(backbone=backbone, projector=TINY_PROJECTOR, predictor=PREDICTOR, knn_k=0),
    "SimSiam": lambda backbone: SimSiam(backbone=backbone, projector=TINY_PROJECTOR, predictor=PREDICTOR, knn_k=0),
    "MoCoV3": lambda backbone: MoCoV3(backbone=backbone, projector=TINY_PROJECTOR, predictor=PREDICTOR, knn_k=0),
    "NNCLR": lambda backbone: NNCLR(backbone=backbone, projector=TINY_PROJECTOR, predictor=PREDICTOR, queue_size=64, knn_k=0),
}


@pytest.mark.parametrize("method", NEW_METHODS)
def test_the_trunks_of_byol_simsiam_mocov3_and_nnclr_export_to_torchvision(method, tmp_path):
    model = NEW_METHODS[method](BackboneSpec("resnet18", small_input=True))
    randomised(model.backbone)
    pth, _, _ = export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "trunk")
    exported = torchvision_model("resnet18", small_input=True)
    exported.load_state_dict(torch.load(pth, weights_only=True), strict=True)
    with torch.no_grad():
        assert torch.equal(exported.eval()(IMAGES[:1]), model.backbone.eval()(IMAGES[:1]))


def test_a_mocov3_vit_exports_to_timm_s_vision_transformer_with_its_fixed_positions_and_patch_projection(tmp_path, monkeypatch):
    vit = BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=1, num_heads=12, init="mocov3",
                                                position_embedding="sincos_2d", stop_grad_conv1=True))
    model = NEW_METHODS["MoCoV3"](vit)
    pth, safetensors, record = export(saved(model, tmp_path / "last.ckpt"), "timm", tmp_path / "trunk")
    with torch.no_grad():
        expected = model.backbone.eval()(IMAGES)
        exported = timm.models.vision_transformer.VisionTransformer(img_size=16, patch_size=8, embed_dim=384, depth=1, num_heads=12, num_classes=0)
        exported.load_state_dict(torch.load(pth, weights_only=True), strict=True)
        assert torch.equal(exported.eval()(IMAGES), expected)
        recipe = {"torch": torch, "timm": timm, "functools": functools, "safetensors": __import__("safetensors.torch")}
        monkeypatch.chdir(safetensors.parent)
        exec(json.loads(record.read_text())["load"], recipe)  # the record's own instructions
        assert torch.equal(recipe["model"].eval()(IMAGES), expected)


@pytest.mark.slow
def test_the_momentum_encoder_is_exported_on_request_and_refused_where_there_is_none(tmp_path):
    model = moco(BackboneSpec("resnet18", small_input=True))
    checkpoint = saved(model, tmp_path / "moco.ckpt")
    online = torch.load(export(checkpoint, "torchvision", tmp_path / "online")[0], weights_only=True)
    momentum = torch.load(export(checkpoint, "torchvision", tmp_path / "momentum", encoder="momentum")[0], weights_only=True)
    assert all(torch.equal(momentum[key], value) for key, value in model.target_backbone.state_dict().items())
    assert not torch.equal(online["bn1.running_mean"], momentum["bn1.running_mean"])
    simclr = saved(SimCLR(backbone=BackboneSpec("resnet18", small_input=True), projector=TINY_PROJECTOR, knn_k=0), tmp_path / "simclr.ckpt")
    with pytest.raises(ValueError, match="has no momentum encoder \\('target_backbone.\\*'\\)"):
        export(simclr, "torchvision", tmp_path / "simclr", encoder="momentum")


ISSUE_34_METHODS = {
    "barlow_twins": lambda trunk: BarlowTwins(backbone=trunk, projector=TINY_PROJECTOR, knn_k=0),
    "vicreg": lambda trunk: VICReg(backbone=trunk, projector=TINY_PROJECTOR, knn_k=0),
    "swav": lambda trunk: SwAV(backbone=trunk, projector=TINY_PROJECTOR, num_prototypes=10, knn_k=0),
    "dino": lambda trunk: DINO(backbone=trunk, projector=TINY_PROJECTOR, out_dim=10, knn_k=0),
}


@pytest.mark.parametrize("method", ISSUE_34_METHODS)
def test_the_trunks_of_barlow_twins_vicreg_swav_and_dino_export_to_timm_and_dinos_teacher_on_request(method, tmp_path):
    model = ISSUE_34_METHODS[method](BackboneSpec("timm:test_resnet"))
    randomised(model.backbone)
    checkpoint = saved(model, tmp_path / "last.ckpt")
    encoders = {"online": model.backbone} | ({"momentum": model.target_backbone} if method == "dino" else {})
    for encoder, trunk in encoders.items():
        if method == "dino":
            randomised(model.target_backbone, seed=3)  # the teacher differs from the student
            checkpoint = saved(model, tmp_path / "last.ckpt")
        pth = export(checkpoint, "timm", tmp_path / encoder / "trunk", encoder=encoder)[0]
        exported = timm.create_model("test_resnet", num_classes=0)
        exported.load_state_dict(torch.load(pth, weights_only=True), strict=True)
        with torch.no_grad():
            assert torch.equal(exported.eval()(IMAGES), trunk.eval()(IMAGES))
    evaluated = "momentum" if method == "dino" else "online"  # DINO's papers evaluate the teacher: eval_linear.py --checkpoint_key teacher
    pth, _, record = export(checkpoint, "timm", tmp_path / "default" / "trunk")
    assert json.loads(record.read_text())["encoder"] == evaluated
    assert torch.load(pth, weights_only=True).keys() == torch.load(tmp_path / evaluated / "trunk.pth", weights_only=True).keys()
    assert all(torch.equal(value, torch.load(tmp_path / evaluated / "trunk.pth", weights_only=True)[key]) for key, value in torch.load(pth, weights_only=True).items())


def test_a_dino_vit_exports_its_teacher_with_a_load_line_that_builds_it(tmp_path, monkeypatch):
    vit = BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=1, num_heads=6, init="dino", position_interpolation="dino"))
    model = DINO(backbone=vit, projector=TINY_PROJECTOR, out_dim=10, knn_k=0)
    randomised(model.target_backbone, seed=3)  # the teacher differs from the student
    _, safetensors, record = export(saved(model, tmp_path / "last.ckpt"), "timm", tmp_path / "trunk")
    recipe = {"torch": torch, "timm": timm, "functools": functools, "safetensors": __import__("safetensors.torch")}
    monkeypatch.chdir(safetensors.parent)
    exec(json.loads(record.read_text())["load"], recipe)  # the record's own instructions
    with torch.no_grad():
        assert torch.equal(recipe["model"].eval()(IMAGES), model.target_backbone.eval()(IMAGES))


def test_the_weights_of_a_bf16_run_are_exported_in_float32_to_every_format(tmp_path):
    model = moco(BackboneSpec("resnet18")).to(torch.bfloat16)  # as trainer.precision bf16-true keeps them
    checkpoint = saved(model, tmp_path / "last.ckpt")
    pth = export(checkpoint, "torchvision", tmp_path / "trunk")[0]
    pkl = export(checkpoint, "detectron2", tmp_path / "d2")[0]
    exported, converted = torch.load(pth, weights_only=True), pickle.loads(pkl.read_bytes())["model"]
    assert exported["conv1.weight"].dtype == torch.float32 and converted["stem.conv1.weight"].dtype == np.float32
    assert torch.equal(exported["conv1.weight"], model.backbone.conv1.weight.float())


def moco_converter(state: dict) -> dict:
    """facebookresearch/moco detection/convert-pretrain-to-detectron2.py, its renaming rules applied to a MoCo state dict."""
    converted = {}
    for key, value in state.items():
        if not key.startswith("module.encoder_q."):
            continue
        key = key.replace("module.encoder_q.", "")
        if "layer" not in key:
            key = "stem." + key
        for t in [1, 2, 3, 4]:
            key = key.replace(f"layer{t}", f"res{t + 1}")
        for t in [1, 2, 3]:
            key = key.replace(f"bn{t}", f"conv{t}.norm")
        key = key.replace("downsample.0", "shortcut").replace("downsample.1", "shortcut.norm")
        converted[key] = value.numpy()
    return {"model": converted, "__author__": "MOCO", "matching_heuristics": True}


@pytest.mark.slow
def test_detectron2_settings_of_each_resnet_family_are_those_detectron2_builds_it_with():
    imagenet = {"MODEL.PIXEL_MEAN": [123.675, 116.28, 103.53], "MODEL.PIXEL_STD": [58.395, 57.12, 57.375]}
    base = {"MODEL.RESNETS.STRIDE_IN_1X1": False, "INPUT.FORMAT": "RGB"} | imagenet
    assert detectron2_config(BackboneSpec("resnet50"), None) == base | {"MODEL.RESNETS.DEPTH": 50}
    assert detectron2_config(BackboneSpec("resnext50_32x4d"), None) == base | {
        "MODEL.RESNETS.DEPTH": 50, "MODEL.RESNETS.NUM_GROUPS": 32, "MODEL.RESNETS.WIDTH_PER_GROUP": 4}
    # basic blocks: detectron2 refuses R18/R34 unless res2 outputs 64 channels
    assert detectron2_config(BackboneSpec("resnet18"), None) == base | {"MODEL.RESNETS.DEPTH": 18, "MODEL.RESNETS.RES2_OUT_CHANNELS": 64}
    own = detectron2_config(BackboneSpec("resnet50"), {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]})
    assert (own["MODEL.PIXEL_MEAN"], own["MODEL.PIXEL_STD"]) == ([127.5] * 3, [63.75] * 3)


def test_detectron2_export_has_the_keys_and_shapes_that_moco_s_converter_writes_for_a_resnet50(tmp_path):
    trunk = torchvision.models.resnet50()
    trunk.fc = nn.Identity()  # the trunk: the converter would carry a MoCo head along as stem.fc.*, which detectron2 leaves unused
    expected = moco_converter({f"module.encoder_q.{key}": value for key, value in trunk.state_dict().items()})["model"]

    model = moco(BackboneSpec("resnet50"))
    pkl, record = export(saved(model, tmp_path / "last.ckpt"), "detectron2", tmp_path / "r50")
    exported = pickle.loads(pkl.read_bytes())
    assert set(exported) == {"model", "__author__", "matching_heuristics"} and exported["matching_heuristics"] is True
    assert {key: value.shape for key, value in exported["model"].items()} == {key: value.shape for key, value in expected.items()}
    assert all(isinstance(value, np.ndarray) for value in exported["model"].values())
    online = model.backbone.state_dict()
    assert np.array_equal(exported["model"]["res5.2.conv3.norm.running_var"], online["layer4.2.bn3.running_var"].numpy())
    assert np.array_equal(exported["model"]["stem.conv1.weight"], online["conv1.weight"].numpy())
    settings = json.loads(record.read_text())["detectron2_config"]
    assert settings["MODEL.RESNETS.DEPTH"] == 50 and settings["MODEL.RESNETS.STRIDE_IN_1X1"] is False and settings["INPUT.FORMAT"] == "RGB"
    # a checkpoint that records no data normalisation: ImageNet's RGB statistics (moco detection/configs/Base-RCNN-C4-BN.yaml),
    # not detectron2's BGR defaults, which an RGB input would take in the wrong order
    assert (settings["MODEL.PIXEL_MEAN"], settings["MODEL.PIXEL_STD"]) == ([123.675, 116.28, 103.53], [58.395, 57.12, 57.375])


def spread(classifier: nn.Linear, features: torch.Tensor) -> None:
    """Centres under which the two images fall in classes 0 and 1, with or without tau-normalisation: a random
    trunk's features share a large mean m, so centre i is image i's deviation from it made orthogonal to m
    (the other image's deviation is its opposite), and every other centre is -m, which no image is close to."""
    mean = features.mean(dim=0)
    unit_mean = mean / mean.norm()
    deviations = features - mean
    with torch.no_grad():
        classifier.weight.copy_(-unit_mean.expand_as(classifier.weight))
        classifier.weight[: len(features)] = deviations - (deviations @ unit_mean)[:, None] * unit_mean
        classifier.bias.zero_()


@pytest.mark.parametrize("model_class, tau_norm", [(CrossEntropy, 0.0), (CrossEntropy, 1.0), (PaCo, None)])
@pytest.mark.slow
def test_an_exported_long_tail_classifier_predicts_the_classes_validate_predicts(model_class, tau_norm, tmp_path):
    options = {"tau_norm": tau_norm} if model_class is CrossEntropy else {"projector": TINY_PROJECTOR, "queue_size": 64}
    model = model_class(backbone=BackboneSpec("resnet18", small_input=True), num_classes=10, **options)
    randomised(model.backbone).eval()
    with torch.no_grad():
        spread(model.classifier, model.backbone(IMAGES))
        model.classifier.bias.fill_(0.3)  # the same for every class: the argmax stays; tau-normalised, it is dropped
        expected = model.classify(IMAGES).argmax(dim=1)
    assert expected.tolist() == [0, 1]
    pth, _, record = export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "classifier")
    state = torch.load(pth, weights_only=True)
    # the weights the model classifies with: tau-normalised where it is set (the same argmax either way here)
    assert torch.equal(state["fc.weight"], tau_normalised(model.classifier.weight, tau_norm) if tau_norm else model.classifier.weight)
    assert torch.equal(state["fc.bias"], torch.zeros(10) if tau_norm else torch.full((10,), 0.3))
    exported = torchvision_model("resnet18", small_input=True, num_classes=10)
    exported.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(exported.eval()(IMAGES).argmax(dim=1), expected)
    assert json.loads(record.read_text())["classifier"] == {"num_classes": 10, "tau_norm": tau_norm or 0.0, "keys": "fc.*"}
    reimported = CrossEntropy(backbone=BackboneSpec("resnet18", small_input=True), num_classes=10, pretrained_ckpt=str(pth)).eval()
    with torch.no_grad():
        assert torch.equal(reimported.classify(IMAGES).argmax(dim=1), expected)  # and back, as a torchvision classifier
    if tau_norm:  # normalised once, in the export: tau-normalising it again at evaluation is refused
        with pytest.raises(ValueError, match=r"^model.tau_norm 0.5: model.pretrained_ckpt holds a classifier exported already tau-normalised \(tau 1, "):
            CrossEntropy(backbone=BackboneSpec("resnet18", small_input=True), num_classes=10, pretrained_ckpt=str(pth), tau_norm=0.5)


def test_paco_on_ride_exports_its_one_experts_classifier_and_refuses_several(tmp_path):
    """PaCo on RIDE predicts with the mean of its experts' classifiers: with one expert (any trunk but a RIDE one),
    that expert's layer; with several, each on its own features, no single fc (one error line, not a KeyError)."""
    model = PaCoRIDE(backbone=BackboneSpec("resnet18", small_input=True), num_classes=10, projector=TINY_PROJECTOR, queue_size=64)
    randomised(model.backbone).eval()
    with torch.no_grad():
        spread(model.classifier.experts[0], model.backbone(IMAGES))
        expected = model.classify(IMAGES)
    state = torch.load(export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "ride")[0], weights_only=True)
    exported = torchvision_model("resnet18", small_input=True, num_classes=10)
    exported.load_state_dict(state, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(IMAGES), expected)
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    for key in [key for key in checkpoint["state_dict"] if key.startswith("classifier.experts.0.")]:
        checkpoint["state_dict"][key.replace(".experts.0.", ".experts.1.")] = checkpoint["state_dict"][key].clone()
    torch.save(checkpoint, tmp_path / "two_experts.ckpt")
    with pytest.raises(ValueError, match=r"^the classifier has several RIDE experts, each on its own features"):
        export(tmp_path / "two_experts.ckpt", "torchvision", tmp_path / "two")


@pytest.mark.slow
def test_tau_normalisation_is_applied_to_paco_s_centres_when_asked(tmp_path):
    model = PaCo(backbone=BackboneSpec("resnet18", small_input=True), num_classes=10, projector=TINY_PROJECTOR, queue_size=64)
    randomised(model.backbone).eval()
    with torch.no_grad():
        features = model.backbone(IMAGES)
        spread(model.classifier, features)
        model.classifier.bias.fill_(0.3)  # dropped by the tau-normalisation
        expected = (features @ tau_normalised(model.classifier.weight, 1.0).T).argmax(dim=1)
    assert expected.tolist() == [0, 1]
    pth = export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "tau", tau_norm=1.0)[0]
    state = torch.load(pth, weights_only=True)
    assert torch.equal(state["fc.bias"], torch.zeros(10)) and torch.equal(state["fc.weight"], tau_normalised(model.classifier.weight, 1.0))
    exported = torchvision_model("resnet18", small_input=True, num_classes=10)
    exported.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(exported.eval()(IMAGES).argmax(dim=1), expected)


# ----------------------------------------------------------------- the command, on runs of the shipped configs
@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A MoCo v2 run of configs/moco_digits.yaml (timm:test_resnet), two steps, written by main_pretrain.py."""
    run_dir = tmp_path_factory.mktemp("moco_digits")
    main_pretrain.cli_main([
        "fit", "--config", str(ROOT / "configs/moco_digits.yaml"), "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        "--data.init_args.batch_size=16", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1",
        "--model.init_args.queue_size=64", f"--trainer.default_root_dir={run_dir}",
    ])  # fmt: skip
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_the_record_beside_the_export_says_where_it_came_from(digits_run, capsys):
    assert export_command([str(digits_run), "--format", "timm"]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert [path.name for path in written] == ["last_timm.pth", "last_timm.safetensors", "last_timm.json"]
    assert written[0].parent == digits_run.parent.parent / "export"
    record = json.loads(written[2].read_text())
    config = torch.load(digits_run, weights_only=True)["contrastlab"]["config"]
    assert record["checkpoint"] == str(digits_run) and "last_timm.safetensors" in record["load"]
    assert record | {"checkpoint": None, "load": None} == {
        "format": "timm",
        "files": ["last_timm.pth", "last_timm.safetensors"],
        "checkpoint": None,
        "method": "methods.moco.MoCoV2",
        "encoder": "online",
        "trunk": {"name": "timm:test_resnet", "small_input": False, "small_input_stem": "sce", "kwargs": {}, "feature_dim": 96},
        "classifier": None,
        "load": None,
        "dataset": "datamodules.DigitsDataModule",
        "image_size": 32,
        "normalisation": {"mean": [0.195, 0.2033, 0.1866], "std": [0.1783, 0.1546, 0.1607]},
        "epoch": 0,  # last.ckpt of the end of epoch 0 (engine.preemption.LastCheckpointAtEveryEpoch), as at a validated epoch's end
        "step": 2,
        "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        "contrastlab_version": VERSION,
    }


@pytest.mark.slow
def test_the_linear_stage_on_an_exported_trunk_gives_the_probe_result_of_the_original_checkpoint(digits_run, tmp_path):
    safetensors = export(digits_run, "timm", tmp_path / "trunk")[1]
    results = []
    for name, source in (("original", []), ("exported", ["--model.pretrained_format=timm", "--model.backbone.name=timm:test_resnet"])):
        checkpoint = digits_run if name == "original" else safetensors
        main_linear.cli_main([
            "fit", "--config", str(ROOT / "configs/linear_digits.yaml"), f"--model.pretrained_ckpt={checkpoint}", *source,
            "--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1",
            f"--trainer.default_root_dir={tmp_path / name}",
        ])  # fmt: skip
        metrics = json.loads((tmp_path / name / "results_val.json").read_text())["metrics"]
        results.append({key: value for key, value in metrics.items() if key not in ("train/time_s", "train/images_per_s")})  # wall clock
    assert {"val/probe_top1", "val/knn_top1", "train/loss"} <= set(results[0]) and results[0] == results[1]


def test_the_command_lists_the_formats_and_ends_bad_input_with_one_error_line(digits_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        export_command(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(f"  {format}  " in help_text for format in ("torchvision", "timm", "detectron2"))
    official = tmp_path / "moco_v2.pth.tar"
    torch.save({"state_dict": {"module.encoder_q.conv1.weight": torch.zeros(1)}}, official)
    linear = saved(LinearProbe(random_init=True, backbone=BackboneSpec("resnet18")), tmp_path / "linear.ckpt")
    for arguments, message in [
        ([str(tmp_path / "none.ckpt"), "--format", "torchvision"], "none.ckpt' is not an existing file"),
        ([str(official), "--format", "torchvision"], "is not a Lightning checkpoint and holds no contrastlab record"),
        ([str(linear), "--format", "torchvision"], "is a methods.linear.LinearProbe checkpoint: export a pretraining, fine-tuned or long-tail checkpoint"),
        ([str(digits_run), "--format", "torchvision"], "backbone 'timm:test_resnet' is not a torchvision ResNet / ResNeXt"),
        ([str(digits_run), "--format", "detectron2"], "backbone 'timm:test_resnet' is not a torchvision ResNet / ResNeXt"),
        ([str(digits_run), "--format", "timm", "--tau-norm", "1"], "--tau-norm applies to a long-tail classifier's classifier"),
        ([str(digits_run), "--format", "torchvision", "--tau-norm", "-1"], "--tau-norm must be a finite number >= 0, got -1.0"),
        ([str(digits_run), "--format", "torchvision", "--tau-norm", "nan"], "--tau-norm must be a finite number >= 0, got nan"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            export_command(arguments)
        assert str(exit_info.value).startswith("error: ") and message in str(exit_info.value) and "\n" not in str(exit_info.value)
    small = saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "small.ckpt")
    with pytest.raises(SystemExit, match="has the small-input stem .* detectron2's ResNet stem is 7x7"):
        export_command([str(small), "--format", "detectron2"])


def test_an_export_refuses_to_overwrite_files_without_force_and_drops_its_own_suffix(tmp_path, capsys):
    checkpoint = saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "last.ckpt")
    assert export_command([str(checkpoint), "--format", "torchvision", "--out", str(tmp_path / "model.pth")]) == 0
    assert sorted(path.name for path in tmp_path.glob("model*")) == ["model.json", "model.pth", "model.safetensors"]
    before = (tmp_path / "model.pth").stat().st_mtime_ns
    with pytest.raises(SystemExit, match=rf"^error: --out: {tmp_path / 'model.pth'}, .* already exists: give another --out, or --force to overwrite$"):
        export_command([str(checkpoint), "--format", "torchvision", "--out", str(tmp_path / "model")])
    assert (tmp_path / "model.pth").stat().st_mtime_ns == before
    assert export_command([str(checkpoint), "--format", "torchvision", "--out", str(tmp_path / "model"), "--force"]) == 0
    assert (tmp_path / "model.pth").stat().st_mtime_ns != before
    (tmp_path / "exports").mkdir()  # an existing folder: the files go in it, under their default name, not beside it
    assert export_command([str(checkpoint), "--format", "torchvision", "--out", f"{tmp_path / 'exports'}/"]) == 0
    assert sorted(path.name for path in (tmp_path / "exports").iterdir()) == ["last_torchvision.json", "last_torchvision.pth", "last_torchvision.safetensors"]


def test_an_out_below_a_file_and_an_export_record_of_the_wrong_shape_are_one_error_line(tmp_path):
    checkpoint = saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "last.ckpt")
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit, match=rf"^error: the export folder {tmp_path / 'taken'} cannot be a folder: {tmp_path / 'taken'} is a file$"):
        export_command([str(checkpoint), "--format", "torchvision", "--out", str(tmp_path / "taken" / "model")])
    pth = export(checkpoint, "torchvision", tmp_path / "model")[0]
    record = json.loads(pth.with_suffix(".json").read_text())
    pth.with_suffix(".json").write_text(json.dumps(record | {"trunk": 5}))
    with pytest.raises(ValueError, match=r"its export record .* is unreadable \(AttributeError"):
        exported_backbone(str(pth), "test")


def test_the_probe_of_an_export_says_of_its_pretraining_what_the_checkpoint_said(tmp_path):
    """The record names the method, trunk, dataset, image size, epoch and step of the checkpoint: a probe of the export
    says them (and warns of another dataset) as a probe of the checkpoint does, instead of '?'."""
    checkpoint = saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "last.ckpt")
    state = torch.load(checkpoint, weights_only=True)
    state["contrastlab"]["config"] = {"data": {"class_path": "datamodules.CIFAR10DataModule", "init_args": {}}}  # what the CLI records
    state["epoch"], state["global_step"] = 7, 70
    torch.save(state, checkpoint)
    pth = export(checkpoint, "torchvision", tmp_path / "trunk")[0]
    from_export, from_checkpoint = LinearProbe(pretrained_ckpt=str(pth)).pretraining, LinearProbe(pretrained_ckpt=str(checkpoint)).pretraining
    assert from_export == from_checkpoint == {"method": "methods.moco.MoCoV2", "backbone": "resnet18", "dataset": "CIFAR10DataModule",
                                              "image_size": 32, "epoch": 7, "step": 70}


def test_both_exported_files_have_the_mode_of_a_new_file(tmp_path):
    pth, safetensors, record = export(saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "last.ckpt"), "torchvision", tmp_path / "trunk")
    modes = {path.suffix: path.stat().st_mode & 0o777 for path in (pth, safetensors, record)}
    assert modes[".safetensors"] == modes[".pth"] == modes[".json"]


# ----------------------------------------------------------------- the record is true, and written last
def test_the_load_line_of_a_timm_export_builds_the_trunk_with_the_backbone_s_arguments(tmp_path, monkeypatch):
    model = moco(BackboneSpec("timm:test_resnet", kwargs={"global_pool": "max"}))
    _, safetensors, record = export(saved(model, tmp_path / "last.ckpt"), "timm", tmp_path / "trunk")
    recipe = {"torch": torch, "timm": timm, "safetensors": __import__("safetensors.torch")}
    monkeypatch.chdir(safetensors.parent)
    exec(json.loads(record.read_text())["load"], recipe)
    with torch.no_grad():
        images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))  # max and mean pooling differ here
        assert torch.equal(recipe["model"].eval()(images), model.backbone.eval()(images))


@pytest.mark.parametrize("features", [{"last_blocks": 2}, {"last_blocks": 1, "average_patch_tokens": True}])
def test_a_vit_export_with_token_features_says_how_to_compute_them_and_probes_as_timm(features, tmp_path, monkeypatch):
    vit = BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=2, num_heads=6, features=features))
    model = SimCLR(backbone=vit, projector=TINY_PROJECTOR, knn_k=0)
    _, safetensors, record = export(saved(model, tmp_path / "last.ckpt"), "timm", tmp_path / "trunk")
    recipe = {"torch": torch, "timm": timm, "functools": functools, "safetensors": __import__("safetensors.torch")}
    monkeypatch.chdir(safetensors.parent)
    exec(json.loads(record.read_text())["load"], recipe)
    with torch.no_grad():
        expected = model.backbone.eval()(IMAGES)
        assert expected.shape[1] == json.loads(record.read_text())["trunk"]["feature_dim"] == 768
        assert torch.equal(recipe["features"](IMAGES), expected)
        probe = LinearProbe(pretrained_ckpt=str(safetensors), pretrained_format="timm")  # the format it was written in
        assert torch.equal(probe.backbone(IMAGES), expected)


def test_the_record_gives_the_evaluation_view_s_normalisation_and_the_training_views_that_differ():
    cifar10_mean = [0.4914, 0.4822, 0.4465]
    digits = {"mean": list(DigitsDataModule.mean), "std": list(DigitsDataModule.std)}
    views = {"query": {"preset": "mocov2", "mean": cifar10_mean}, "key": {"preset": "mocov2"}}
    config = {"data": {"class_path": "datamodules.DigitsDataModule", "init_args": {"views": views, "eval_view": {"preset": "center", "mean": cifar10_mean}}}}
    facts = data_facts(config)
    assert facts["normalisation"] == {"mean": cifar10_mean, "std": digits["std"]} and facts["training_normalisation"] == {"key": digits}
    assert "training_normalisation" not in data_facts({"data": {"class_path": "datamodules.DigitsDataModule", "init_args": {"views": {"key": {"preset": "mocov2"}}}}})
    own = {"class_path": "mylab.data.MyDataModule", "init_args": {"mean": [0.5] * 3, "std": [0.25] * 3}}  # not importable here
    assert data_facts({"data": own}) == {"dataset": "mylab.data.MyDataModule", "image_size": None, "normalisation": {"mean": [0.5] * 3, "std": [0.25] * 3}}
    assert data_facts({"data": own | {"init_args": {}}})["normalisation"] is None


def test_a_forced_export_that_cannot_write_leaves_no_record_of_the_previous_export_beside_its_weights(tmp_path, monkeypatch):
    solo_learn = saved(moco(BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn")), tmp_path / "a.ckpt")
    other = saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "b.ckpt")
    assert export_command([str(solo_learn), "--format", "torchvision", "--out", str(tmp_path / "trunk")]) == 0

    def unwritable(state, path):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("interop.export._save_safetensors", unwritable)
    with pytest.raises(SystemExit, match=r"^error: cannot write .*trunk.safetensors: Permission denied$"):
        export_command([str(other), "--format", "torchvision", "--out", str(tmp_path / "trunk"), "--force"])
    assert not (tmp_path / "trunk.json").exists()  # the .pth holds b's weights: a's record must not describe it


def test_an_export_goes_beside_a_checkpoint_outside_a_run_and_records_its_absolute_path(tmp_path, monkeypatch):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    saved(moco(BackboneSpec("resnet18", small_input=True)), downloads / "moco.ckpt")
    monkeypatch.chdir(downloads)
    pth, _, record = export(Path("moco.ckpt"), "torchvision")
    assert pth == downloads / "export" / "moco_torchvision.pth"
    assert json.loads(record.read_text())["checkpoint"] == str(downloads / "moco.ckpt")


def test_a_record_written_before_the_stem_was_recorded_is_read_as_the_one_stem_there_was(tmp_path):
    pth, _, record = export(saved(moco(BackboneSpec("resnet18", small_input=True)), tmp_path / "last.ckpt"), "torchvision", tmp_path / "trunk")
    old = json.loads(record.read_text())
    del old["trunk"]["small_input_stem"]
    record.write_text(json.dumps(old))
    assert LinearProbe(pretrained_ckpt=str(pth)).backbone.conv1.padding == (1, 1)


def test_a_long_tail_classifier_reloaded_from_its_export_must_name_the_stem_its_record_names(tmp_path):
    model = CrossEntropy(backbone=BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn"), num_classes=10)
    randomised(model.backbone).eval()
    pth = export(saved(model, tmp_path / "last.ckpt"), "torchvision", tmp_path / "classifier")[0]
    with pytest.raises(ValueError, match=rf"model.backbone.small_input_stem 'sce', but model.pretrained_ckpt '{pth}' was exported from a trunk with 'solo_learn'"):
        CrossEntropy(backbone=BackboneSpec("resnet18", small_input=True), num_classes=10, pretrained_ckpt=str(pth))
    reloaded = CrossEntropy(backbone=BackboneSpec("resnet18", small_input=True, small_input_stem="solo_learn"), num_classes=10, pretrained_ckpt=str(pth))
    with torch.no_grad():
        assert torch.equal(reloaded.eval().classify(IMAGES), model.classify(IMAGES))
