"""The two entry points, driven as a user drives them (in-process, `cli_main(args)`)."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torchvision
import yaml
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import Callback

import main_linear
import main_pretrain
from datamodules.imagenet import IMAGENET100_WNIDS
from engine.cli.lightning_cli import ContrastlabCLI, instantiate_config

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(ROOT.glob("configs/*.yaml"))
FINETUNE_CONFIGS = sorted(ROOT.glob("configs/finetune_*.yaml"))
SECOND_STAGES = ("linear_", "finetune_")  # the configs of main_linear.py
PRETRAIN_DIGITS = str(ROOT / "configs/moco_digits.yaml")
LINEAR_DIGITS = str(ROOT / "configs/linear_digits.yaml")
TINY_RUN = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.check_val_every_n_epoch=1",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.batch_size=16",
    "--data.init_args.train_variants=1",
    "--data.init_args.eval_variants=1",
    "--model.init_args.projector.hidden_dim=32",
    "--model.init_args.queue_size=64",
]


@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
@pytest.mark.slow
def test_every_shipped_config_parses(config, capsys):
    entry = main_linear if config.name.startswith(SECOND_STAGES) else main_pretrain
    with pytest.raises(SystemExit) as exit_info:
        entry.cli_main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path" in capsys.readouterr().out


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test"])
def test_each_subcommand_parses_a_config_with_only_its_own_parser_built(subcommand, capsys, monkeypatch):
    built, build = [], ContrastlabCLI._prepare_subcommand_parser
    monkeypatch.setattr(ContrastlabCLI, "_prepare_subcommand_parser", lambda cli, trainer_class, name, **kwargs: built.append(name) or build(cli, trainer_class, name, **kwargs))
    with pytest.raises(SystemExit) as exit_info:
        main_pretrain.cli_main([subcommand, "--config", PRETRAIN_DIGITS, "--print_config"])
    assert exit_info.value.code == 0 and built == [subcommand]
    assert "class_path" in capsys.readouterr().out


def test_a_command_line_that_does_not_start_with_a_subcommand_is_told_all_three(capsys):
    with pytest.raises(SystemExit):
        main_pretrain.cli_main(["--help"])
    listed = capsys.readouterr().out.split("Available subcommands:")[1]
    assert [line.split()[0] for line in listed.splitlines() if line.startswith("    ") and not line.startswith("     ")] == [
        "fit", "validate", "test"]
    with pytest.raises(SystemExit):
        main_pretrain.cli_main(["fitt", "--config", PRETRAIN_DIGITS])
    assert "invalid choice: 'fitt' (choose from 'fit', 'validate', 'test')" in capsys.readouterr().err


def fake_dataset_of(config: Path, tmp_path: Path, monkeypatch) -> list[str]:
    """Overrides that point a fine-tuning config at a fake copy of its dataset (and a subset list naming its images)."""
    from test_datasets import write_cifar, write_imagenet_tree  # the dataset writers of the format tests

    data = yaml.safe_load(config.read_text())["data"]
    if data["class_path"] == "datamodules.DigitsDataModule":
        return ["--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]
    if data["class_path"] == "datamodules.CIFAR10DataModule":
        return [f"--data.init_args.root={write_cifar(tmp_path, torchvision.datasets.CIFAR10, monkeypatch)}"]
    tree = write_imagenet_tree(tmp_path / "imagenet")
    listed = tmp_path / Path(data["init_args"]["label_subset"]["list_file"]).name  # SimCLR's format: one file name per line
    listed.write_text("".join(f"{image.name}\n" for image in sorted((tree / "train").rglob("*.JPEG"))))
    return [f"--data.init_args.root={tree}", f"--data.init_args.label_subset.list_file={listed}", "--data.init_args.image_size=32",
            "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.sync_batchnorm=false"]


@pytest.mark.parametrize("config", FINETUNE_CONFIGS, ids=[config.name for config in FINETUNE_CONFIGS])
@pytest.mark.slow
def test_every_fine_tuning_config_trains_one_step_on_its_label_subset(config, tmp_path, monkeypatch):
    cli = main_linear.cli_main([
        "fit", "--config", str(config), *fake_dataset_of(config, tmp_path, monkeypatch),
        "--model.init_args.random_init=true", "--model.init_args.backbone.name=timm:test_resnet",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=0", "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu",
        "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path / 'run'}",
    ])
    assert cli.trainer.global_step == 1 and isinstance(cli.datamodule.splits["train"], torch.utils.data.Subset)  # the label subset
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def run_failing(entry, args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        entry.cli_main(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ")
    return lines[-1]


@pytest.mark.parametrize(
    "override, expected",
    [
        # named by the whole key: jsonargparse says 'Parser key "model": Option 'temprature' ...' and '... --optimizer.lrr=0.1'
        ("--model.init_args.temprature=0.1", "error: Option 'model.init_args.temprature' is not accepted"),
        ("--model.init_args.optimizer.lrr=0.1", "error: unrecognized arguments: --model.init_args.optimizer.lrr=0.1"),
        ("--model.init_args.backbone.name=resnet19", "unknown backbone name 'resnet19'"),
        ("--model.init_args.temperature=-0.2", "model.init_args.temperature must be > 0, got -0.2 (given on the command line)"),
        ("--model.init_args.optimizer.lr=-1", "model.init_args.optimizer.lr must be >= 0, got -1 (given on the command line)"),
        ("--model.init_args.queue_size=8", "queue size 8 is smaller than the 16 keys enqueued per step"),
        ("--data.init_args.root=/no/such/folder", "data.init_args.root '/no/such/folder' is not an existing directory (given on the command line)"),
        ("--data.init_args.views.key.preset=mocov3", "view 'key': unknown preset 'mocov3'"),
    ],
)
def test_bad_input_ends_with_one_error_line_naming_the_value_and_writes_nothing(override, expected, tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = run_failing(
        main_pretrain,
        ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run_dir}", override],
        capsys,
    )
    assert expected in line
    assert not run_dir.exists()



@pytest.mark.parametrize("stop", [["--trainer.max_epochs=3", "--trainer.check_val_every_n_epoch=2"], ["--trainer.max_epochs=5", "--trainer.max_steps=3"]],
                         ids=["last-epoch-off-the-validation-interval", "max-steps-inside-an-epoch"])
@pytest.mark.slow
def test_the_results_of_a_fit_are_the_validation_of_the_weights_it_ends_with(stop, tmp_path):
    """Lightning would validate epoch 2 of 3 (every 2) or no step after step 2 (max_steps 3 in the second epoch) and
    results_val.json would give those earlier numbers as the run's final ones."""
    cli = main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", *stop,
                                  "--trainer.callbacks+=test_cli.LoggedAtTheFirstValidationOnly"])
    results = json.loads((tmp_path / "results_val.json").read_text())
    assert results["global_step"] == results["val_global_step"] == cli.trainer.global_step == {"3": 6, "5": 3}[stop[0][-1]]
    assert results["epoch"] == {"3": 3, "5": 1}[stop[0][-1]]  # whole epochs: max_steps stopped the second one after its first batch
    assert "val/knn_top1" in results["metrics"]
    assert "val/first_validation_only" in cli.trainer.callback_metrics and "val/first_validation_only" not in results["metrics"]  # not of these weights


@pytest.mark.slow
def test_a_knn_bank_cut_short_by_limit_val_batches_is_said_and_a_whole_one_is_not(tmp_path):
    run = ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.logger=false", "--embedding_map.enabled=false"]
    with pytest.warns(UserWarning, match=r"the kNN bank holds 32 of the 1197 training images \(trainer.limit_val_batches limits its loader too\)"):
        main_pretrain.cli_main([*run, f"--trainer.default_root_dir={tmp_path / 'limited'}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main_pretrain.cli_main([*run, "--trainer.limit_val_batches=1.0", "--data.init_args.batch_size=64", f"--trainer.default_root_dir={tmp_path / 'whole'}"])
    assert "val/knn_top1" in cli.trainer.callback_metrics and not [w for w in caught if "kNN bank" in str(w.message)]


class LoggedAtTheFirstValidationOnly(Callback):
    """A metric measured at some validations only, as the collapse monitor's every n epochs."""

    def __init__(self):
        self.validations = 0

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validations += 1
            if self.validations == 1:
                pl_module.log("val/first_validation_only", 1.0)


class AccuracySequence(Callback):
    """`val/top1` 0.25, 0.75, 0.5 at the first three validations, as a long-tail classifier's accuracy moves over a run,
    and its many-shot group's 0.875, 0.125, 0.25."""

    def __init__(self):
        self.validations = 0

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            pl_module.log("val/top1", (0.25, 0.75, 0.5)[self.validations])
            pl_module.log("val/many_top1", (0.875, 0.125, 0.25)[self.validations])
            self.validations += 1


@pytest.mark.slow
def test_the_results_record_the_best_accuracy_of_the_validations_with_its_step_beside_the_last(tmp_path):
    """Official codes that print the best epoch's accuracy (PaCo's best_acc1) are compared with `best`: each top-1's best
    validation, with the numbers of that validation (the shot groups of the best top-1's, as PaCo reports them, not each
    group's own best); `metrics` stays the last validation's. The checkpoints keep it, so that a resumed run goes on
    from it."""
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_epochs=3", "--trainer.logger=false",
                            f"--trainer.default_root_dir={tmp_path}", "--trainer.callbacks+=test_cli.AccuracySequence"])
    results = json.loads((tmp_path / "results_val.json").read_text())
    assert results["metrics"]["val/top1"] == 0.5
    assert results["best"]["val/top1"] == {"global_step": 4, "epoch": 1, "metrics": {"val/top1": 0.75, "val/many_top1": 0.125}}
    assert set(results["best"]) == {"val/top1", "val/probe_top1", "val/knn_top1"}
    assert set(results["best"]["val/knn_top1"]["metrics"]) == {"val/knn_top1", "val/knn_top5"}
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]
    assert [state["best"]["val/top1"]["metrics"] for name, state in saved.items() if name.startswith("FinalValidation")] == [{"val/top1": 0.75, "val/many_top1": 0.125}]


class TiedAfterResume(Callback):
    """`val/top1` 0.75 at the first validation after a resume: the best of AccuracySequence's first two validations again."""

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            pl_module.log("val/top1", 0.75)
            pl_module.log("val/many_top1", 0.5)


@pytest.mark.slow
def test_a_resumed_run_goes_on_from_the_best_its_checkpoint_holds_and_a_tie_keeps_the_first(tmp_path):
    """Stopped after two validations (0.25, 0.75), resumed to a third that ties (0.75): the best stays the
    validation before the stop (PaCo's `acc1 > best_acc1` keeps the first of equal ones)."""
    run = ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_epochs=3", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    main_pretrain.cli_main([*run, "--trainer.max_steps=4", "--trainer.callbacks+=test_cli.AccuracySequence"])
    main_pretrain.cli_main([*run, "--ckpt_path=last", "--trainer.callbacks+=test_cli.TiedAfterResume"])
    results = json.loads((tmp_path / "results_val.json").read_text())
    assert results["global_step"] == 6 and results["metrics"]["val/many_top1"] == 0.5
    assert results["best"]["val/top1"] == {"global_step": 4, "epoch": 1, "metrics": {"val/top1": 0.75, "val/many_top1": 0.125}}


def test_a_bad_value_from_a_config_file_is_named_by_its_key_and_its_file(tmp_path, capsys):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model:\n  init_args:\n    optimizer: {lr: -0.5}\n")
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--config", str(overlay), *TINY_RUN, f"--trainer.default_root_dir={tmp_path / 'run'}"], capsys)
    assert line == f"error: model.init_args.optimizer.lr must be >= 0, got -0.5 (from {overlay})"
    assert not (tmp_path / "run").exists()
    run = [*TINY_RUN, f"--trainer.default_root_dir={tmp_path / 'run'}"]
    line = run_failing(main_pretrain, ["fit", "-c", PRETRAIN_DIGITS, "--model.init_args.optimizer.lr=0.1", "-c", str(overlay), *run], capsys)
    assert line.endswith(f"got -0.5 (from {overlay})")  # the later source wins
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--model.init_args.optimizer={name: sgd, lr: -1}", *run], capsys)
    assert line == "error: model.init_args.optimizer.lr must be >= 0, got -1 (given on the command line)"  # in a dict above it
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--model.init_args.knn_temperature=0", *run], capsys)
    assert line == "error: knn_k must be >= 0 and knn_temperature > 0, got 200, 0.0"  # two values: kept as the class says it


def test_a_bad_view_setting_is_named_by_its_key_and_where_it_came_from(tmp_path, capsys):
    # it said "view 'query': scale must be ...", naming neither its key nor the file that set it
    overlay, run = tmp_path / "views.yaml", [f"--trainer.default_root_dir={tmp_path / 'run'}"]
    overlay.write_text("data:\n  init_args:\n    views:\n      query: {preset: mocov2, scale: [0.9, 0.5]}\n      key: {preset: mocov2}\n")
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--config", str(overlay), *run], capsys)
    assert line == f"error: data.init_args.views.query.scale must be (min, max) with 0 < min <= max <= 1, got [0.9, 0.5] (from {overlay})"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--data.init_args.views.key={preset: mocov2, blur_prob: 1.5}", *run], capsys)
    assert line == "error: data.init_args.views.key.blur_prob must be a probability in [0, 1], got 1.5 (given on the command line)"
    # a value the config does not hold as such (SimCLR's jitter, from its strength) keeps the view's own message
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--data.init_args.views.key={preset: simclr, strength: 3.0}", *run], capsys)
    assert line.startswith("error: view 'key': jitter must be (brightness, contrast, saturation, hue) >= 0, hue <= 0.5, got [2.4")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_pretrain_then_linear_probe_pipeline_with_reruns_and_a_validate_in_the_same_directory_keeps_each_stages_results(tmp_path, capsys):
    run_dir = tmp_path / "pretrain"
    args = ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run_dir}"]
    cli = main_pretrain.cli_main(args)  # the default logger: its files go to a version folder
    assert cli.model.probe.out_features == cli.datamodule.num_classes == 10  # linked from the data
    assert "val results: probe_top1" in capsys.readouterr().out
    checkpoint = run_dir / "checkpoints" / "last.ckpt"  # not under the logger's version folder
    assert checkpoint.is_file() and (Path(cli.trainer.log_dir) / "config.yaml").is_file()
    for _ in range(2):  # a rerun resumes the run (finished: nothing to train, its results stay); without a logger the config lands in the run folder
        main_pretrain.cli_main([*args, "--trainer.logger=false", "--ckpt_path=last"])
    assert (run_dir / "config.yaml").is_file()
    results = json.loads((run_dir / "results_val.json").read_text())
    assert results["global_step"] == 2 and 0.0 <= results["metrics"]["val/knn_top1"] <= 1.0
    assert "train/time_s" in results["metrics"] and "train/images_per_s" in results["metrics"]
    trained_config = (run_dir / "config.yaml").read_text()
    main_pretrain.cli_main(["validate", *args[1:], "--trainer.logger=false", f"--ckpt_path={checkpoint}", "--data.init_args.num_workers=1"])  # the README's validate, into the run
    assert json.loads((run_dir / "results_val.json").read_text()) == results  # the training's results stay
    assert (run_dir / "config.yaml").read_text() == trained_config  # and the config it was trained with
    assert "num_workers: 1" in (run_dir / "config_validate.yaml").read_text()
    validated = json.loads((run_dir / "results_validate.json").read_text())
    assert validated["metrics"]["val/knn_top1"] == results["metrics"]["val/knn_top1"]  # the same weights, the same images
    assert (validated["checkpoint"], validated["global_step"]) == (str(checkpoint), 2) and "epoch" not in validated  # what was evaluated
    main_pretrain.cli_main(["test", *args[1:], "--ckpt_path=last"])  # the config's W&B logger: `last` is still the run's last.ckpt
    tested = json.loads((run_dir / "results_test.json").read_text())
    assert (tested["checkpoint"], tested["global_step"]) == (str(checkpoint), 2)

    linear = main_linear.cli_main(
        [
            "fit",
            "--config", LINEAR_DIGITS,
            f"--model.pretrained_ckpt={checkpoint}",
            f"--trainer.default_root_dir={tmp_path / 'linear'}",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.train_variants=1",
            "--data.init_args.eval_variants=1",
        ]
    )
    assert linear.model.probe.out_features == 10
    assert "val results: probe_top1" in capsys.readouterr().out
    probed = json.loads((tmp_path / "linear" / "results_val.json").read_text())
    assert (probed["pretrained_ckpt"], probed["pretrained_step"]) == (str(checkpoint), 2)  # what its numbers are of (scripts/compare.py)


def test_linear_stage_refuses_a_checkpoint_that_does_not_fit_in_one_line(tmp_path, capsys):
    line = run_failing(
        main_linear,
        ["fit", "--config", LINEAR_DIGITS, f"--model.pretrained_ckpt={tmp_path / 'missing.ckpt'}",
         f"--trainer.default_root_dir={tmp_path / 'run'}"],
        capsys,
    )
    assert "missing.ckpt' is not an existing file" in line


@pytest.mark.parametrize("abbreviated", [["--trainer.max_epoch", "1"], ["--trainer.limit_train_batch=2"]], ids=["separate-value", "joined-value"])
def test_an_abbreviated_option_is_refused_like_an_unknown_key(abbreviated, tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *abbreviated, f"--trainer.default_root_dir={run_dir}", "--print_config"], capsys)
    assert line == f"error: unrecognized arguments: {' '.join(abbreviated)} (run with --help for the accepted options)"
    assert not run_dir.exists()


def test_a_value_outside_a_settings_choices_is_named_with_every_choice(tmp_path, capsys):
    # jsonargparse's last reason named one of Lightning's three precision literals, without the value or bf16-mixed
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--trainer.precision=bf16-mix", f"--trainer.default_root_dir={run_dir}"], capsys)
    assert line.startswith("error: Parser key \"trainer.precision\": got 'bf16-mix', expected one of 64, 32, 16, 'transformer-engine', ")
    assert "'bf16-mixed', '32-true', '64-true', '64', '32', '16', 'bf16' (run with --help" in line
    assert not run_dir.exists()


def test_a_yaml_syntax_error_names_the_config_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: 1\n   devices: [1\n")
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, "--config", str(bad), f"--trainer.default_root_dir={tmp_path / 'run'}"], capsys)
    assert line == f"error: config file {str(bad)!r}, line 3, column 11: mapping values are not allowed here"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_an_evaluation_of_the_last_checkpoint_of_a_directory_without_one_is_one_error_line(subcommand, tmp_path, capsys):
    # it evaluated the untrained model, and a run directory's earlier results_validate.json was overwritten with its numbers
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, [subcommand, "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run_dir}", "--ckpt_path=last"], capsys)
    assert line == (f"error: ckpt_path 'last', but trainer.default_root_dir {run_dir} holds no checkpoint to {subcommand}: "
                    "give the run's directory or a checkpoint file")
    assert not run_dir.exists()


def test_a_ckpt_path_that_does_not_exist_is_one_error_line_and_nothing_is_written(tmp_path, capsys):
    run_dir, missing = tmp_path / "run", tmp_path / "missing.ckpt"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run_dir}", f"--ckpt_path={missing}"], capsys)
    assert line == f"error: ckpt_path '{missing}' is not an existing file (or `last`: the newest checkpoint of trainer.default_root_dir)"
    assert not run_dir.exists()


def test_a_fast_dev_run_leaves_no_checkpoint_or_results_that_a_later_run_would_take_up(tmp_path, capsys):
    run_dir = tmp_path / "run"
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={run_dir}"])
    assert "val results: probe_top1" in capsys.readouterr().out  # it ran a training and a validation step
    assert not list(run_dir.rglob("*.ckpt")) and not list(run_dir.rglob("results_*.json"))


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without GPUs, wherever the test runs."""
    for accelerator in (CUDAAccelerator, MPSAccelerator):
        monkeypatch.setattr(accelerator, "is_available", staticmethod(lambda: False))


@pytest.mark.parametrize(
    "override, expected",
    [
        ([], "trainer.devices 8 asks for 8 devices, but this machine has no GPU: give --trainer.devices 1 to train here, "
             "or --trainer.accelerator cpu to start 8 CPU processes"),
        (["--trainer.accelerator=gpu"], "trainer.accelerator 'gpu', but this machine has no GPU: give --trainer.accelerator cpu "
                                        "(and --trainer.devices N for N CPU processes)"),
    ],
    ids=["8-devices-auto-accelerator", "gpu-accelerator"],
)
@pytest.mark.slow
def test_a_multi_gpu_config_on_a_machine_without_gpus_is_one_error_line_naming_the_trainer_setting(override, expected, no_gpu, tmp_path, capsys):
    for wnid in IMAGENET100_WNIDS:  # empty class folders: enough to build the DataModule
        (tmp_path / "imagenet" / "train" / wnid).mkdir(parents=True)
        (tmp_path / "imagenet" / "val" / wnid).mkdir(parents=True)
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", str(ROOT / "configs/sce_imagenet100.yaml"), f"--data.init_args.root={tmp_path / 'imagenet'}",
                                       f"--trainer.default_root_dir={run_dir}", *override], capsys)
    assert line == f"error: {expected}"
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_progressive_sampler_without_a_number_of_epochs_is_one_error_line_before_anything_is_written(tmp_path, capsys):
    """The sampler is built with the training DataLoader, after the run's directory holds its config: the CLI checks
    `data.sampler` against the split and trainer.max_epochs before that."""
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", str(ROOT / "configs/ce_digits_lt.yaml"), "--data.init_args.sampler=progressive",
                                       "--trainer.max_epochs=-1", "--trainer.max_steps=1", f"--trainer.default_root_dir={run_dir}"], capsys)
    assert line == "error: data.sampler: progressive needs the number of epochs from trainer.max_epochs (>= 1), got -1"
    assert not run_dir.exists()


def test_a_command_that_builds_the_cli_from_its_own_arguments_does_not_print_its_command_line(monkeypatch):
    # `python -m analysis CKPT --config C ...` printed a warning of Lightning's quoting its sys.argv and the CLI's args
    monkeypatch.setattr(sys, "argv", ["analysis", "run/checkpoints/last.ckpt", "--config", PRETRAIN_DIGITS])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        instantiate_config(PRETRAIN_DIGITS, ["--trainer.max_epochs=1"])
    assert [str(warning.message) for warning in caught if "args parameter" in str(warning.message)] == []


@pytest.mark.parametrize(
    "entry, arguments",
    [("main_pretrain.py", ["--config", PRETRAIN_DIGITS]),
     ("main_linear.py", ["--config", LINEAR_DIGITS, "--model.random_init=true", "--model.backbone.name=timm:test_resnet"])],
    ids=["pretraining", "linear-stage"],
)
@pytest.mark.slow
def test_a_run_prints_none_of_the_log_noise_that_the_project_causes_or_knowingly_triggers(entry, arguments, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / entry), "fit", *arguments, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                             "--trainer.check_val_every_n_epoch=1", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
                             "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1", f"--trainer.default_root_dir={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "val results: probe_top1" in output
    for noise in ("litlogger", "LeafSpec", "You have overridden `on_after_batch_transfer`", "module(s) in eval mode"):
        assert noise not in output


@pytest.mark.parametrize(
    "written, in_config, expected",
    [(["--trainer.limit_val_batches=1"], None, 1), (["--trainer.limit_val_batches", "1"], None, 1), (["--trainer.limit_val_batches=1.0"], None, 1.0),
     ([], "1", 1), ([], "1.0", 1.0), (["--trainer.limit_val_batches=1.0"], "1", 1.0), (["--trainer.limit_val_batches=1"], "1.0", 1),
     (["--trainer.limit_val_batches=0.5"], None, 0.5)],
)
def test_a_batch_count_written_as_an_integer_is_a_number_of_batches_and_a_float_a_share(written, in_config, expected, tmp_path):
    """Lightning reads limit_val_batches 1 as one batch and 1.0 as all of them; the parser makes both 1.0. The last
    value written, in a --config file or on the command line, decides, for the trainer and the saved config."""
    config = tmp_path / "config.yaml"
    text = (ROOT / "configs/moco_digits.yaml").read_text()
    config.write_text(text if in_config is None else text.replace("  max_epochs: 60\n", f"  max_epochs: 60\n  limit_val_batches: {in_config}\n"))
    cli = instantiate_config(str(config), written)
    assert repr(cli.trainer.limit_val_batches) == repr(expected) and repr(cli.config["trainer"]["limit_val_batches"]) == repr(expected)


def test_batch_counts_are_read_from_every_way_of_giving_the_trainer_a_value(tmp_path):
    from engine.cli.parsing import batch_counts_written_as_integers

    (tmp_path / "top.yaml").write_text("trainer:\n  limit_val_batches: 1\n")
    (tmp_path / "nested.yaml").write_text("fit:\n  trainer:\n    limit_val_batches: 1\n")
    (tmp_path / "trainer.yaml").write_text("limit_val_batches: 1\n")
    for command_line in (["-c", str(tmp_path / "top.yaml")], [f"--config={tmp_path / 'nested.yaml'}"], ["--trainer", "{limit_val_batches: 1}"],
                         [f"--trainer={tmp_path / 'trainer.yaml'}"], ["--trainer.limit_val_batches", "1"]):
        assert batch_counts_written_as_integers(command_line) == {"limit_val_batches"}, command_line
    assert batch_counts_written_as_integers(["-c", str(tmp_path / "top.yaml"), "--trainer.limit_val_batches=1.0"]) == set()
    assert batch_counts_written_as_integers(["--config", str(tmp_path / "absent.yaml")]) == set()


@pytest.mark.parametrize("entry", [main_pretrain, main_linear])
def test_predict_is_no_subcommand_as_no_model_predicts(entry, capsys):
    """Lightning's `predict` needs a forward or predict_step, which no method has: it ended in a traceback."""
    line = run_failing(entry, ["predict", "--config", PRETRAIN_DIGITS], capsys)
    assert line.startswith("error: argument subcommand: invalid choice: 'predict' (choose from 'fit', 'validate', 'test')")
