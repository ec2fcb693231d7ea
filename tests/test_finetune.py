"""The fine-tuning stage (methods/finetune.py, `main_linear.py` with a `finetune_*.yaml` config): the whole trunk
and a linear head trained on a label fraction (`data.label_subset`), from a pretraining checkpoint or an exported
trunk, and its checkpoint exported like a pretraining one."""

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from backbones import BackboneSpec, MLPSpec
from helpers import TINY_BACKBONE, TINY_PROJECTOR, cpu_trainer, digits
from test_cli import run_failing
from test_datasets import save_image

import main_linear
from datamodules import ImageFolderDataModule
from datamodules.base import dataset_labels
from datamodules.subsets import LabelSubset
from engine.cli import ContrastlabCLI
from interop.export import export
from methods import FineTune, LinearProbe, MoCoV2
from methods.momentum import MomentumSpec

ROOT = Path(__file__).parents[1]
FINETUNE_DIGITS = str(ROOT / "configs/finetune_digits_10pct.yaml")
IMAGE_VIEW = {"image": {"preset": "crop_pad_flip"}}
SMALL_RUN = ["--trainer.enable_progress_bar=false", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1",
             "--data.init_args.batch_size=16", "--trainer.logger=false"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-step MoCo v2 pretraining checkpoint written by Lightning, and its trunk's weights."""
    directory = tmp_path_factory.mktemp("pretrain")
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MomentumSpec(shuffle_bn=False), knn_k=0)
    trainer = cpu_trainer(directory, max_steps=1, limit_val_batches=0)
    trainer.fit(model, digits({"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}, batch_size=16))
    path = directory / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(path)
    return path, {key: value.clone() for key, value in model.backbone.state_dict().items()}


def training_images() -> int:
    """The training images of the tests' Digits-M (one variant per source digit) without a label subset."""
    datamodule = digits(IMAGE_VIEW)
    datamodule.setup()
    return len(datamodule.splits["train"])


def trunk_equals(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    state = module.state_dict()
    return state.keys() == weights.keys() and all(torch.equal(state[key], weights[key]) for key in weights)


# ---------------------------------------------------------------- the label fraction
def test_a_label_fraction_keeps_a_tenth_of_every_class_and_the_same_images_for_a_seed():
    def kept(seed: int) -> np.ndarray:
        datamodule = digits(IMAGE_VIEW, label_subset={"fraction": 0.1, "seed": seed})
        datamodule.setup()
        return np.asarray(datamodule.splits["train"].indices)

    full = digits(IMAGE_VIEW)
    full.setup()
    labels = dataset_labels(full.splits["train"])
    chosen = kept(0)
    assert np.bincount(labels[chosen]).tolist() == [round(0.1 * count) for count in np.bincount(labels)]
    assert np.array_equal(chosen, kept(0)) and not np.array_equal(chosen, kept(1))


def test_the_knn_bank_of_a_label_fraction_is_that_fraction():
    datamodule = digits(IMAGE_VIEW, label_subset={"fraction": 0.1})
    bank = datamodule.val_dataloader()[1].dataset
    assert len(bank) == len(datamodule.splits["train"]) < training_images()


def test_a_simclr_subset_list_selects_the_listed_training_images_of_a_folder(tmp_path):
    for split in ("train", "val"):
        for wnid in ("n01440764", "n01443537"):
            for number in range(3):
                save_image(tmp_path / split / wnid / f"{wnid}_{number}.JPEG")
    listed = tmp_path / "1percent.txt"
    listed.write_text("n01443537_2.JPEG\nn01440764_0.JPEG\n")
    datamodule = ImageFolderDataModule(root=str(tmp_path), num_workers=0, views=IMAGE_VIEW, label_subset={"list_file": str(listed)})
    datamodule.setup()
    train = datamodule.splits["train"]
    assert [Path(train.dataset.paths[index]).name for index in train.indices] == ["n01443537_2.JPEG", "n01440764_0.JPEG"]
    assert dataset_labels(train).tolist() == [1, 0]


def test_a_subset_list_replaced_by_a_fraction_on_the_command_line_trains_on_the_fraction(tmp_path):
    """`list_file=null` reaches the DataModule as the text 'None' (jsonargparse, within a subclass's init_args)."""
    config = tmp_path / "listed.yaml"
    config.write_text(Path(FINETUNE_DIGITS).read_text().replace("{fraction: 0.1, seed: 0}", "{list_file: /no/such/1percent.txt}"))
    cli = ContrastlabCLI(LinearProbe, args=["--config", str(config), "--data.init_args.label_subset.list_file=null", "--data.init_args.label_subset.fraction=0.5",
                                            "--model.init_args.random_init=true", "--model.init_args.backbone.name=resnet18", "--trainer.logger=false"], run=False)
    assert cli.datamodule.label_subset == LabelSubset(fraction=0.5)


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--data.init_args.label_subset.fraction=0"], "error: data.init_args.label_subset.fraction must lie in (0, 1], got 0.0 (given on the command line)"),
        (["--data.init_args.label_subset.fraction=1.5"], "error: data.init_args.label_subset.fraction must lie in (0, 1], got 1.5 (given on the command line)"),
        ([], "error: data.init_args.label_subset.list_file '/no/such/1percent.txt' is not an existing file"),
        (["--data.init_args.label_subset.list_file=/no/such/1percent.txt"], "error: data.label_subset needs exactly one of fraction"),
        (["--data.init_args.label_subset.seed=-1"], "error: data.init_args.label_subset.seed must be in [0, 2**32), got -1 (given on the command line)"),
    ],
    ids=["fraction-0", "fraction-above-1", "missing-list-file", "fraction-and-list-file", "negative-seed"],
)
def test_a_bad_label_subset_is_one_error_line_naming_the_key_and_nothing_is_written(override, expected, tmp_path, capsys):
    run_dir, config = tmp_path / "run", tmp_path / "listed.yaml"
    if not override:  # a config that names a subset list instead of the fraction
        config.write_text(Path(FINETUNE_DIGITS).read_text().replace("{fraction: 0.1, seed: 0}", "{list_file: /no/such/1percent.txt}"))
    line = run_failing(main_linear, ["fit", "--config", str(config if not override else FINETUNE_DIGITS), "--model.init_args.random_init=true",
                                     "--model.init_args.backbone.name=resnet18", f"--trainer.default_root_dir={run_dir}", *override], capsys)
    assert line.startswith(expected)
    assert not run_dir.exists()


def test_a_subset_list_for_a_dataset_without_image_files_is_refused_naming_it(tmp_path):
    listed = tmp_path / "1percent.txt"
    listed.write_text("n01440764_0.JPEG\n")
    with pytest.raises(ValueError, match="^data.label_subset.list_file names image files, but the training split of DigitsDataModule is not"):
        digits(IMAGE_VIEW, label_subset={"list_file": str(listed)}).setup()


# ---------------------------------------------------------------- the model
def test_fine_tuning_starts_from_the_checkpoint_trunk_with_a_zero_head_and_trains_the_trunk(pretrained):
    path, weights = pretrained
    model = FineTune(pretrained_ckpt=str(path))
    assert trunk_equals(model.backbone, weights)
    assert not model.probe.weight.any() and not model.probe.bias.any()  # google-research/simclr --zero_init_logits_layer
    assert all(parameter.requires_grad for parameter in model.backbone.parameters())
    assert model.train().backbone.training  # BatchNorm in training mode, unlike the linear probe's frozen trunk
    assert not LinearProbe(pretrained_ckpt=str(path)).train().backbone.training


def test_a_fine_tuning_says_it_fine_tunes_and_a_probe_that_it_probes(pretrained, caplog):
    for model, verb in ((FineTune(pretrained_ckpt=str(pretrained[0])), "fine-tuning"), (LinearProbe(pretrained_ckpt=str(pretrained[0])), "probing")):
        with caplog.at_level(logging.INFO):
            model.check_data(digits({"image": {"preset": "crop_flip"}}), world_size=1)
        assert f"{verb} model.pretrained_ckpt '{pretrained[0]}': methods.moco.MoCoV2" in caplog.text
        caplog.clear()


def test_fine_tuning_a_mocov3_vit_trains_the_patch_projection_and_positions_its_pretraining_held_fixed(tmp_path):
    """moco-v3 fine-tunes through DeiT, whose patch projection and position table are parameters."""
    from lightning.pytorch import Trainer

    from methods import MoCoV3

    vit = BackboneSpec("vit_small", kwargs=dict(img_size=16, patch_size=8, depth=1, num_heads=12, init="mocov3",
                                                position_embedding="sincos_2d", stop_grad_conv1=True))
    pretraining = MoCoV3(backbone=vit, projector=TINY_PROJECTOR, predictor=MLPSpec(hidden_dim=32, output_dim=TINY_PROJECTOR.output_dim), knn_k=0)
    assert not pretraining.backbone.patch_embed.proj.weight.requires_grad and not pretraining.backbone.pos_embed.requires_grad
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.strategy.connect(pretraining)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    model = FineTune(pretrained_ckpt=str(tmp_path / "last.ckpt"), num_classes=10)
    assert all(parameter.requires_grad for parameter in model.backbone.parameters())
    assert not any(parameter.requires_grad for parameter in LinearProbe(pretrained_ckpt=str(tmp_path / "last.ckpt"), num_classes=10).backbone.parameters())


@pytest.mark.slow
def test_fine_tuning_loads_the_same_trunk_from_a_pretraining_checkpoint_and_from_its_export(pretrained, tmp_path):
    path, weights = pretrained
    exported = export(path, "torchvision", tmp_path / "trunk")[0]
    from_export = FineTune(pretrained_ckpt=str(exported), pretrained_format="torchvision", backbone=TINY_BACKBONE)
    assert trunk_equals(from_export.backbone, weights)
    assert trunk_equals(FineTune(pretrained_ckpt=str(path)).backbone, weights)


@pytest.mark.slow
def test_a_fine_tuning_run_trains_the_whole_trunk_and_its_checkpoint_exports_the_fine_tuned_trunk(pretrained, tmp_path, capsys):
    path, weights = pretrained
    run_dir = tmp_path / "finetune"
    # two steps: the head starts at zero, so the first step's gradient reaches the head only
    cli = main_linear.cli_main(["fit", "--config", FINETUNE_DIGITS, f"--model.pretrained_ckpt={path}", *SMALL_RUN, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                                "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={run_dir}"])
    assert isinstance(cli.model, FineTune) and len(cli.datamodule.splits["train"]) < training_images()
    tuned = {key: value.detach().clone() for key, value in cli.model.backbone.state_dict().items()}
    assert not torch.equal(tuned["conv1.weight"], weights["conv1.weight"]) and not torch.equal(tuned["layer4.1.conv2.weight"], weights["layer4.1.conv2.weight"])
    results = capsys.readouterr().out.strip().splitlines()[-1]
    assert results.startswith("val results: ") and " top1 " in results and "probe_top1" not in results  # its own prediction, not a probe's
    exported = torch.load(export(run_dir / "checkpoints" / "last.ckpt", "torchvision", tmp_path / "tuned")[0], weights_only=True)
    assert exported.keys() == tuned.keys() and all(torch.equal(exported[key], tuned[key]) for key in tuned)


def test_fine_tuning_runs_beside_its_pretraining_checkpoint_under_finetune():
    assert FineTune.default_run_directory({"pretrained_ckpt": "runs/moco/checkpoints/last.ckpt"}, "digits", 0) == "runs/moco/finetune"
    assert FineTune.default_run_directory({"pretrained_ckpt": None}, "digits", 2) == "runs/finetune_random_digits_s2"
