"""PaCo and the long-tail baselines (methods/longtail/)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
import yaml

import main_pretrain
from backbones import MLPSpec
from methods import CrossEntropy, MultiTaskContrast, PaCo
from methods.losses import paco_loss
from methods.momentum import MomentumSpec
from methods.longtail.multitask import class_balanced_weights
from helpers import TINY_BACKBONE, digits
from test_longtail_data import write_cifar_batches, write_lists

PACO_VIEWS = {"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}
COUNTS = torch.tensor([400, 240, 143, 86, 51, 31, 18, 11, 6, 4])  # Digits-LT, ratio 100
TINY_BN_PROJECTOR = MLPSpec(hidden_dim=32, output_dim=16, batch_norm=True)


def tiny(method, **kwargs):
    options = dict(backbone=TINY_BACKBONE, num_classes=10)
    if method is not CrossEntropy:
        options |= dict(projector=TINY_BN_PROJECTOR, queue_size=48, momentum=MomentumSpec(base=0.99, shuffle_bn=False))
    model = method(**(options | kwargs))
    model.class_counts.copy_(COUNTS)
    return model


def batch_of(views, batch_size=16):
    datamodule = digits(views, batch_size=batch_size)
    datamodule.setup()
    return next(iter(datamodule.train_dataloader()))


def test_paco_loss_is_paco_loss_of_the_query_key_queue_and_centre_logits_with_the_training_prior():
    torch.manual_seed(0)
    model = tiny(PaCo, alpha=0.05, temperature=0.2).train()
    batch = batch_of(PACO_VIEWS)
    queue, queue_labels = model.queue.read(), model.queue.read_labels()
    loss = model.step(batch)[0]
    features = model.backbone(batch["views"]["query"])
    query = F.normalize(model.projector(features), dim=1)
    with torch.no_grad():
        key = F.normalize(model.target_projector(model.target_backbone(batch["views"]["key"])), dim=1)
    prior = COUNTS / COUNTS.sum()
    expected = paco_loss(query, key, queue, batch["label"], queue_labels, model.classifier(features), 0.05, 0.2, class_prior=prior)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    without_prior = tiny(PaCo, alpha=0.05, temperature=0.2, rebalance=False)
    without_prior.load_state_dict(model.state_dict())
    without_prior.queue.keys.copy_(queue)
    without_prior.queue.labels.copy_(queue_labels)
    without_prior.queue.pointer.zero_()
    assert abs(without_prior.step(batch)[0].item() - loss.item()) > 1e-3  # the prior matters in training


def test_paco_queue_keeps_each_key_with_its_own_label_across_the_wrap_around():
    torch.manual_seed(0)
    model = tiny(PaCo)  # queue of 48, two batches of 32: the second push fills slots 32-47, then 0-15
    first, second = batch_of(PACO_VIEWS, 32), batch_of(PACO_VIEWS, 32)
    model.step(first)[0]
    model.step(second)[0]
    with torch.no_grad():
        keys = model.target_embed(second["views"]["key"])
    slots = torch.arange(32, 64) % 48
    torch.testing.assert_close(model.queue.keys[slots], keys, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.queue.labels[slots], second["label"])
    assert model.queue.pointer.item() == 16


def test_prediction_is_the_raw_centre_logits_without_the_prior():
    model = tiny(PaCo).eval()
    images = batch_of(PACO_VIEWS)["views"]["query"]
    with torch.no_grad():
        torch.testing.assert_close(model.classify(images), model.classifier(model.backbone(images)))


def test_balanced_softmax_adds_the_log_prior_in_training_only():
    torch.manual_seed(0)
    model = tiny(CrossEntropy, loss="balanced_softmax").eval()  # eval: BatchNorm gives the same features twice
    batch = batch_of({"image": {"preset": "crop_flip"}})
    logits = model.classifier(model.backbone(batch["views"]["image"]))
    prior = torch.log(COUNTS.float() / COUNTS.sum() + 1e-9)
    torch.testing.assert_close(model.step(batch)[0], F.cross_entropy(logits + prior, batch["label"]))
    torch.testing.assert_close(model.classify(batch["views"]["image"]), logits)


def test_tau_normalisation_divides_each_class_weight_by_its_norm_to_the_power_tau_and_drops_the_bias():
    model = tiny(CrossEntropy, tau_norm=1.0).eval()
    images = batch_of({"image": {"preset": "crop_flip"}})["views"]["image"]
    with torch.no_grad():
        before = model.classify(images)
        model.classifier.weight[3] *= 7.0  # a head class with a large weight norm
        model.classifier.bias.fill_(5.0)
        torch.testing.assert_close(model.classify(images), before)  # tau = 1: only directions count
        model.tau_norm = 0.5
        weight = model.classifier.weight
        expected = model.backbone(images) @ (weight / weight.norm(dim=1, keepdim=True).sqrt()).T
        torch.testing.assert_close(model.classify(images), expected)


@pytest.mark.parametrize("method", [CrossEntropy, PaCo])
def test_the_evaluation_logits_are_fp32_at_a_bf16_training_precision(method):
    """PaCo's validate() runs without autocast: bf16 logits of this size tie, and a tie goes to the lowest class."""
    model = tiny(method).eval()
    images = batch_of(PACO_VIEWS)["views"]["query"]
    with torch.no_grad():
        expected = model.classify(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what Lightning's bf16-mixed wraps a validation step in
            _, logits = model.evaluation_outputs(images)
            assert model.classify(images).dtype == torch.bfloat16  # the training precision, had it applied
    assert logits.dtype == torch.float32 and torch.equal(logits, expected)


def test_class_balanced_weights_are_cui_et_al_s_normalised_inverse_effective_numbers():
    """richardaecn/class-balanced-loss class_balanced_loss.py CB_loss, transcribed (numpy, as there): the weights sum to
    the number of classes, and rarer classes weigh more."""
    weights = class_balanced_weights(COUNTS, 0.999)
    effective_num = 1.0 - np.power(0.999, COUNTS.numpy().astype(np.float64))
    official = (1.0 - 0.999) / np.array(effective_num)
    official = official / np.sum(official) * len(COUNTS)
    torch.testing.assert_close(weights.double(), torch.from_numpy(official), rtol=1e-6, atol=0)
    assert weights.sum().item() == pytest.approx(len(COUNTS)) and torch.all(weights[1:] > weights[:-1])
    with_an_empty_class = class_balanced_weights(torch.cat([COUNTS, torch.tensor([0])]), 0.999)
    torch.testing.assert_close(with_an_empty_class, torch.cat([weights, torch.zeros(1)]))  # the others as without it


def test_multitask_loss_is_cross_entropy_plus_the_weighted_reweighted_contrast():
    torch.manual_seed(0)
    model = tiny(MultiTaskContrast, classifier_loss="balanced_softmax", contrast_weight=0.3, temperature=0.2).train()
    batch = batch_of(PACO_VIEWS)
    queue, queue_labels = model.queue.read(), model.queue.read_labels()
    loss = model.step(batch)[0]
    features = model.backbone(batch["views"]["query"])
    with torch.no_grad():
        key = F.normalize(model.target_projector(model.target_backbone(batch["views"]["key"])), dim=1)
    labels = batch["label"]
    classification = F.cross_entropy(model.classifier(features) + torch.log(COUNTS / COUNTS.sum() + 1e-9), labels)
    weights = class_balanced_weights(COUNTS, 0.999)[labels]  # the default beta, the supplement's
    query = F.normalize(model.projector(features), dim=1)
    contrast = paco_loss(query, key, queue, labels, queue_labels, None, 1.0, 0.2, anchor_weights=weights)
    torch.testing.assert_close(loss, classification + 0.3 * contrast, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gamma=0.0), "unbounded below"),
        (dict(alpha=0.0, beta=0.0), r"model.alpha = model.beta = 0 leaves the PaCo loss no positive \(nothing would train\)"),
        (dict(alpha=-1.0), "model.alpha must be >= 0"),
        (dict(temperature=0.0), "model.temperature must be > 0"),
        (dict(trainable_convs="layer9"), "model.trainable_convs 'layer9' is not a module of the backbone"),
        (dict(trainable_convs=""), "model.trainable_convs '' is not a module of the backbone"),  # the trunk itself: it froze every convolution
    ],
)
def test_paco_rejects_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(PaCo, **kwargs)


@pytest.mark.parametrize("tau", [-0.5, float("nan")], ids=["negative", "nan"])
def test_a_tau_norm_below_zero_or_nan_is_refused_naming_it(tau):
    """NaN passed a `< 0` check, and every logit of the validation was then NaN."""
    with pytest.raises(ValueError, match=f"model.tau_norm must be >= 0, got {tau}"):
        tiny(CrossEntropy, tau_norm=tau)


def test_trainable_convs_freezes_every_other_convolution_but_keeps_batchnorm_trainable():
    model = tiny(CrossEntropy, trainable_convs="layer4.1")
    for name, parameter in model.backbone.named_parameters():
        is_conv = name.endswith(".weight") and parameter.ndim == 4
        assert parameter.requires_grad == (not is_conv or name.startswith("layer4.1.")), name


def test_a_classifier_validated_without_its_training_counts_reports_no_shot_groups(tmp_path):
    """From Python, without a DataModule, the class counts are unknown (zeros): no class is few-shot then."""
    import lightning as L

    model = CrossEntropy(backbone=TINY_BACKBONE, num_classes=10)
    images = torch.rand(8, 3, 32, 32)
    batches = torch.utils.data.DataLoader([{"image": images[i], "label": i, "index": i} for i in range(8)], batch_size=8)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    metrics = trainer.validate(model, dataloaders=batches, verbose=False)[0]
    assert "val/top1" in metrics and not any(name.endswith(("many_top1", "medium_top1", "few_top1")) for name in metrics)
    model.class_counts.copy_(torch.tensor([200] * 3 + [50] * 3 + [5] * 4))
    metrics = trainer.validate(model, dataloaders=batches, verbose=False)[0]
    assert {"val/many_top1", "val/medium_top1", "val/few_top1"} <= set(metrics)


@pytest.mark.parametrize("model, sampler, warned", [
    (dict(loss="balanced_softmax"), "class_balanced", True), (dict(loss="balanced_softmax"), "instance", False),
    (dict(loss="ce"), "square_root", False), (dict(rebalance=True), "progressive", True), (dict(rebalance=False), "progressive", False),
])
def test_the_log_prior_with_a_rebalancing_sampler_is_a_warning_of_rebalancing_twice(model, sampler, warned, recwarn):
    """The prior of Balanced Softmax (Ren et al. 2020) is the label distribution of the batches: a sampler that draws
    the classes otherwise than the dataset's counts changes it."""
    method = tiny(CrossEntropy, **model) if "loss" in model else tiny(PaCo, **model)
    views = {"image": {"preset": "crop_flip"}} if "loss" in model else {"query": {"preset": "crop_flip"}, "key": {"preset": "crop_flip"}}
    method.check_data(digits(views, sampler=sampler), world_size=1)
    messages = [str(warning.message) for warning in recwarn if "rebalanced twice" in str(warning.message)]
    assert len(messages) == warned and all(f"data.init_args.sampler {sampler!r}" in message for message in messages)


def test_the_data_must_have_every_configured_class_in_its_training_split():
    model = CrossEntropy(backbone=TINY_BACKBONE, num_classes=12)
    with pytest.raises(ValueError, match="model.num_classes is 12 but the training split of DigitsDataModule has 10 classes"):
        model.check_data(digits({"image": {"preset": "crop_flip"}}), world_size=1)


# ---------------------------------------------------------------- every long-tail config runs a step on fake data
ROOT = Path(__file__).resolve().parents[1]
LONG_TAIL_CONFIGS = sorted(path for path in (ROOT / "configs").glob("*.yaml") if path.stem.endswith(("_lt", "_inat2018")))
SPLIT_FILE_NAMES = {
    "ImageNetLTDataModule": {split: f"ImageNet_LT_{split}.txt" for split in ("train", "val", "test")},
    "INaturalist2018DataModule": {"train": "iNaturalist18_train.txt", "val": "iNaturalist18_val.txt"},
    "PlacesLTDataModule": {split: f"Places_LT_{split}.txt" for split in ("train", "val", "test")},
}


def fake_long_tail_root(datamodule_name: str, tmp_path: Path, monkeypatch) -> list[str]:
    """Write a tiny dataset in the real on-disk format; return the data overrides that point at it."""
    if datamodule_name in ("CIFAR10LTDataModule", "CIFAR100LTDataModule"):
        dataset_class = torchvision.datasets.CIFAR10 if datamodule_name.startswith("CIFAR10L") else torchvision.datasets.CIFAR100
        classes = 10 if dataset_class is torchvision.datasets.CIFAR10 else 100
        write_cifar_batches(tmp_path, dataset_class, np.repeat(np.arange(classes), 4), monkeypatch)
        return [f"--data.init_args.root={tmp_path}", "--data.init_args.max_count=4", "--data.init_args.imbalance_ratio=2"]
    if datamodule_name in SPLIT_FILE_NAMES:
        names = SPLIT_FILE_NAMES[datamodule_name]
        write_lists(tmp_path, names, {split: [0, 0, 0, 1, 1, 2, 2, 2] for split in names})
        return [f"--data.init_args.root={tmp_path}", "--data.init_args.num_classes=3", "--data.init_args.image_size=32"]
    return []  # Digits-LT is generated in memory


@pytest.mark.parametrize("config", LONG_TAIL_CONFIGS, ids=[path.name for path in LONG_TAIL_CONFIGS])
@pytest.mark.slow
def test_every_long_tail_config_trains_a_step_and_reports_the_shot_groups(config, tmp_path, monkeypatch):
    settings = yaml.safe_load(config.read_text())
    model_args = settings["model"]["init_args"]
    small_model = ["--model.init_args.queue_size=16"] if "queue_size" in model_args else []
    small_model += ["--model.init_args.projector.hidden_dim=32"] if "projector" in model_args else []
    if model_args["backbone"]["name"] != "cifar_resnet32":  # already tiny
        small_model += ["--model.init_args.backbone={name: 'timm:test_resnet', weights: null}", "--model.init_args.trainable_convs=null"]
    cli = main_pretrain.cli_main(
        [
            "fit", "--config", str(config),
            *fake_long_tail_root(settings["data"]["class_path"].split(".")[-1], tmp_path / "data", monkeypatch),
            "--data.init_args.batch_size=8",
            "--data.init_args.num_workers=0",
            *small_model,
            "--model.init_args.channels_last=false",
            "--trainer.fast_dev_run=1",
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            "--trainer.precision=32-true",
            f"--trainer.default_root_dir={tmp_path / 'run'}",
        ]
    )  # fmt: skip
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 1 and torch.isfinite(metrics["train/loss"])
    assert cli.model.class_counts.sum() == len(cli.datamodule.splits["train"])
    # the shot groups of the classes among the one validation batch's images (a group without any is not logged)
    assert "val/top1" in metrics and {"val/many_top1", "val/medium_top1", "val/few_top1"} & metrics.keys()



@pytest.mark.slow
def test_a_validate_of_a_checkpoint_takes_tau_and_the_shot_bounds_from_its_command_line(tmp_path):
    """Lightning's CLI puts a checkpoint's hyperparameters over the model arguments: tau-norm's tau, chosen on the trained
    model (Kang et al.), was silently the checkpoint's 0, and the table's tau-norm rows the plain cross-entropy's."""
    common = ["--config", "configs/ce_digits_lt.yaml", "--trainer.logger=false", "--trainer.precision=32-true", "--trainer.enable_progress_bar=false",
              "--data.init_args.batch_size=16", "--data.init_args.num_workers=0", "--model.init_args.channels_last=false"]
    main_pretrain.cli_main(["fit", *common, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0",
                            f"--trainer.default_root_dir={tmp_path}"])
    checkpoint = str(tmp_path / "checkpoints" / "last.ckpt")
    evaluation = ["validate", *common, f"--ckpt_path={checkpoint}", "--trainer.limit_val_batches=2", f"--trainer.default_root_dir={tmp_path}"]
    plain = main_pretrain.cli_main(evaluation)
    normed = main_pretrain.cli_main([*evaluation, "--model.init_args.tau_norm=1.0", "--model.init_args.many_shot_above=50"])
    assert (plain.model.tau_norm, normed.model.tau_norm, normed.model.hparams.many_shot_above) == (0.0, 1.0, 50)
    assert json.loads((tmp_path / "results_validate.json").read_text())["tau_norm"] == 1.0  # what its numbers are of
    # one left at its default keeps the checkpoint's: a classifier trained with other shot bounds reports its own
    main_pretrain.cli_main(["fit", *common, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0",
                            "--model.init_args.many_shot_above=50", f"--trainer.default_root_dir={tmp_path / 'bounds'}"])
    again = main_pretrain.cli_main(["validate", *common, f"--ckpt_path={tmp_path / 'bounds' / 'checkpoints' / 'last.ckpt'}",
                                    "--trainer.limit_val_batches=2", f"--trainer.default_root_dir={tmp_path / 'bounds'}"])
    assert again.model.hparams.many_shot_above == 50
    images, weight = torch.rand(4, 3, 32, 32), plain.model.classifier.weight
    with torch.no_grad():  # w_k / |w_k| without the bias
        expected = F.linear(plain.model.eval().backbone(images), weight / weight.norm(dim=1, keepdim=True))
        assert torch.allclose(normed.model.eval().classify(images), expected, atol=1e-6)
