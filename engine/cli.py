"""The LightningCLI shared by `main_pretrain.py` and `main_linear.py`.

- `fit` / `validate` / `test` subcommands, `--config` YAMLs, `--print_config`;
- `data.num_classes` linked into `model.num_classes` (read from the instantiated DataModule);
- optimizers and schedules come from the model's own config (`auto_configure_optimizers=False`),
  because they need parameter groups and per-step schedules;
- the resolved config is written with overwrite enabled (a second run in the same directory or a
  Slurm requeue must not crash) and, with a `WandbLogger`, sent to the W&B run;
- a `checkpoint` group (ModelCheckpoint) is always present, with `save_last: true`, writing to
  `<default_root_dir>/checkpoints/` whatever the logger (`last.ckpt` is where the linear stage and a
  resumed run look);
- configuration mistakes end with one `error:` line naming the offending key or value, before any
  directory, config or checkpoint is written (set CONTRASTLAB_TRACEBACK=1 for the full traceback);
- at the end of `fit` / `validate` / `test`, the final metrics are printed and written to
  `<default_root_dir>/results_val.json` (what `scripts/sweep.py` and `scripts/compare.py` collect),
  `results_validate.json` and `results_test.json`;
- reliability (`engine.reliability`): `seed_everything` must be an explicit integer; a `non_finite`
  group (NonFiniteLossGuard) stops the run at the first non-finite loss; checkpoints hold the random
  states, the position in the epoch's data order (the DataModule's state), the contrastlab version
  and the resolved config; `fit` in a directory that already holds `checkpoints/last.ckpt` is refused
  unless it resumes (`--ckpt_path last`, which also starts a run that has no checkpoint yet; a
  requeued Slurm job resumes from its hpc checkpoint, or from `last.ckpt` when it has none); on
  SIGTERM the current step is saved as `last.ckpt` and the process exits with status 143;
  checkpoints are written next to their target and renamed over it;
- the checkpoint a run restores is opened before anything is written: a `--ckpt_path` that is no file,
  or a checkpoint of another version, model class or (linear probe) pretraining checkpoint, is one error
  line; an unreadable one that `last` or a requeue resolves to is passed over, with a warning, for the
  run's newest readable checkpoint (`hpc_ckpt_*`, `epoch=*-step=*`), and without one is an error line;
- a linear probe without `trainer.default_root_dir` runs in `<pretraining run>/linear/`
  (`methods.linear.probe_run_directory`).
"""

import importlib
import json
import logging
import os
import re
import signal
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from datamodules.base import ContrastiveDataModule
from datamodules.folders import TooManyUnreadableImages
from engine.reliability import (
    RECORD_KEY,
    CheckpointMismatch,
    LastCheckpointOnSigterm,
    NonFiniteLossError,
    NonFiniteLossGuard,
    PreemptionSignals,
    RandomStateCheckpoint,
    SameDirectoryCheckpointIO,
    checkpoint_class,
    last_checkpoint_path,
    write_atomically,
)
from engine.tracking import TrainingThroughput, WandbRun
from methods.base import PretrainMethod
from methods.linear import LinearProbe, probe_run_directory

# Noise a user cannot act on: Lightning's advertisement for LitLogger at every start, and the deprecation that its own
# pytree helper triggers in torch (lightning/pytorch/utilities/_pytree.py) at every fit
for logger_name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(logger_name).addFilter(lambda record: not record.getMessage().startswith("💡 Tip: For seamless cloud logging"))
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

SUMMARY_KEYS = ("probe_top1", "probe_top5", "knn_top1", "knn_top5", "top1", "many_top1", "medium_top1", "few_top1")


def fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


@contextmanager
def one_error_line(*errors: type[BaseException], describe: Callable[[BaseException], str] = str):
    """End the run with one `error:` line for these errors (CONTRASTLAB_TRACEBACK=1 keeps the traceback)."""
    try:
        yield
    except errors as error:
        if os.environ.get("CONTRASTLAB_TRACEBACK"):
            raise
        fail(describe(error))


NOISE = ("Does not validate", "Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>", "- Problem with given class_path")


def condense_parser_error(message: str) -> str:
    """jsonargparse explains a bad subclass config over many lines (every union member it tried); keep
    the key it concerns (nested keys of a subclass joined through its `init_args`) and the most
    specific reason."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return message
    keys = [match.group(1) for line in lines if (match := re.fullmatch(r'Parser key "(.+)":', line))]
    reasons = [line.lstrip("- ") for line in lines[1:] if not line.startswith(NOISE) and not line.startswith("Parser key")]
    head = f'Parser key "{".init_args.".join(keys)}"' if keys else None if lines[0].startswith(NOISE) else lines[0].rstrip(":")
    if not reasons:
        return head or message
    return f"{head}: {reasons[-1]}" if head else reasons[-1]


def last_line(error: BaseException) -> str:
    """An error's own message, also when a DataLoader worker raised it: the worker's traceback, re-raised in the
    training process as the message, ends with `<module>.<class>: <message>`."""
    line = str(error).strip().splitlines()[-1]
    return line.removeprefix(f"{type(error).__module__}.{type(error).__qualname__}: ")


def root_cause(error: BaseException) -> BaseException:
    """The original exception under jsonargparse's wrapping (e.g. a ValueError from a constructor)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def write_results(path: Path, trainer, metrics: dict[str, float]) -> None:
    """Write the final metrics atomically (a reader never sees half a file)."""
    record = {"epoch": trainer.current_epoch, "global_step": trainer.global_step, "metrics": metrics}
    write_atomically(path, lambda partial: partial.write_text(json.dumps(record, indent=1, sort_keys=True)))


LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc")  # ckpt_path values that Lightning resolves to a file


def read_checkpoint(path: str | Path, source: str) -> dict:
    """A checkpoint's contents, its tensors memory-mapped (not read); a truncated or foreign file is a
    CheckpointMismatch naming it (not a pickle traceback)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointMismatch(f"{source} could not be read as a checkpoint: {error}") from None


def class_at(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def same_file(path: str, other: str) -> bool:
    return Path(path).expanduser().absolute() == Path(other).expanduser().absolute() or (
        os.path.exists(path) and os.path.exists(other) and os.path.samefile(path, other))


def check_resumable(checkpoint: dict, source: str, config) -> None:
    """A checkpoint that the configured run may restore: written by a compatible version (`checked_record`), by the
    configured model class, and, for a linear probe, of the same pretraining checkpoint (restoring it would bring
    back the trunk it probed, whatever model.pretrained_ckpt now says), which must still exist."""
    model = config["model"]
    model_class = class_at(model["class_path"])
    recorded = checkpoint_class(checkpoint, source)
    if recorded is not None and recorded[1] is not model_class:
        hint = " (a pretraining checkpoint to probe is --model.pretrained_ckpt)" if issubclass(model_class, LinearProbe) else ""
        raise CheckpointMismatch(
            f"{source} is a {recorded[0]} checkpoint, but this run's model is {model['class_path']}: --ckpt_path "
            f"resumes or evaluates a run of the same model{hint}"
        )
    probed, given = checkpoint.get("hyper_parameters", {}).get("pretrained_ckpt"), model["init_args"].get("pretrained_ckpt")
    if probed is not None and not Path(probed).expanduser().is_file():
        # the probe's trunk is built from it (for a --ckpt_path file, Lightning reads it from the checkpoint,
        # over the command line)
        raise CheckpointMismatch(
            f"{source} holds a probe of model.pretrained_ckpt {probed!r}, which is not an existing file here (moved or "
            f"deleted): the probe's trunk is built from it; put that pretraining checkpoint back at {probed!r}"
        )
    if probed is not None and given is not None and not same_file(probed, given):
        raise CheckpointMismatch(
            f"{source} holds a probe of model.pretrained_ckpt {probed!r}, not of {given!r}: resuming it would restore the "
            f"trunk of {probed!r}; probe {given!r} under another trainer.default_root_dir"
        )


class ContrastlabArgumentParser(LightningArgumentParser):
    def __init__(self, *args, **kwargs):
        # argparse would read `--trainer.max_epoch` as `--trainer.max_epochs`: a typo must never change a run quietly
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_path(self, path, *args, **kwargs):
        """A YAML syntax error of a config file names the file, line and column (jsonargparse parses the file's text,
        so its error says "<unicode string>")."""
        if self.exit_on_error and not os.environ.get("CONTRASTLAB_TRACEBACK"):
            try:
                yaml.compose(Path(path).read_text())  # syntax only: what the text means is jsonargparse's to read
            except yaml.MarkedYAMLError as error:
                mark = error.problem_mark or error.context_mark
                where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                fail(f"config file {str(path)!r}{where}: {', '.join(part for part in (error.context, error.problem) if part)}")
            except (OSError, yaml.YAMLError):
                pass  # an unreadable path or another problem: jsonargparse reports it
        return super().parse_path(path, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if os.environ.get("CONTRASTLAB_TRACEBACK") or not self.exit_on_error:
            return super().error(message, ex)
        fail(f"{condense_parser_error(message)} (run with --help for the accepted options)")


class SaveConfigToRun(SaveConfigCallback):
    """Write the resolved config next to the run and, with W&B, into the run's config so that runs
    can be compared by hyperparameter."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if isinstance(trainer.logger, WandbLogger):
            trainer.logger.experiment.config.update(self.config.as_dict(), allow_val_change=True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Every checkpoint carries the resolved config (plain YAML types, so `weights_only` loads read it)."""
        checkpoint.setdefault(RECORD_KEY, {})["config"] = yaml.safe_load(self.parser.dump(self.config, skip_none=False))


class ContrastlabCLI(LightningCLI):
    def __init__(self, model_class, args: Any = None, **kwargs):
        try:
            with one_error_line(NonFiniteLossError, CheckpointMismatch, TooManyUnreadableImages, describe=last_line):
                super().__init__(
                    model_class,
                    ContrastiveDataModule,
                    subclass_mode_model=True,
                    subclass_mode_data=True,
                    parser_class=ContrastlabArgumentParser,
                    save_config_callback=SaveConfigToRun,
                    save_config_kwargs={"overwrite": True},
                    trainer_defaults={"callbacks": [RandomStateCheckpoint(), LastCheckpointOnSigterm(), PreemptionSignals(), TrainingThroughput()]},
                    auto_configure_optimizers=False,
                    args=args,
                    **kwargs,
                )
        except SIGTERMException:
            sys.stderr.write(f"stopped by SIGTERM after global step {self.trainer.global_step} (checkpoints/last.ckpt): resume with --ckpt_path last\n")
            sys.exit(128 + signal.SIGTERM)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # a resumed run overwrites its own last.ckpt (Lightning would write last-v1.ckpt beside a last.ckpt it
        # did not write in this process, leaving the stale one where the linear stage and a resume look)
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.enable_version_counter": False})
        parser.add_lightning_class_args(NonFiniteLossGuard, "non_finite")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        seed = config.get("seed_everything")
        if not isinstance(seed, int) or isinstance(seed, bool):  # true means seed 0 every time (Lightning >= 2.2 seeds None as 0: Lightning-AI/pytorch-lightning #18846)
            fail(f"seed_everything must be an explicit integer (a config's seed_everything or --seed_everything), got {seed!r}")
        ckpt_path = config.get("ckpt_path")
        if ckpt_path is None or ckpt_path in LIGHTNING_CHECKPOINT_NAMES or "://" in str(ckpt_path) or str(ckpt_path).startswith("registry"):
            return  # a name Lightning resolves (`last` is read in before_fit), a remote or registry path
        if not Path(ckpt_path).is_file():
            fail(f"ckpt_path {ckpt_path!r} is not an existing file (or `last`: the newest checkpoint of trainer.default_root_dir)")
        with one_error_line(CheckpointMismatch):  # before Lightning reads the hyperparameters from it
            check_resumable(read_checkpoint(ckpt_path, f"ckpt_path {ckpt_path!r}"), f"ckpt_path {ckpt_path!r}", config)

    def before_instantiate_classes(self) -> None:
        """A linear probe's run directory follows from the checkpoint it probes (`probe_run_directory`), after
        Lightning read a resumed checkpoint's hyperparameters into the config, and is saved with the config."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config["trainer"].get("default_root_dir") is None and issubclass(class_at(config["model"]["class_path"]), LinearProbe):
            dataset = config["data"]["class_path"].rsplit(".", 1)[-1].removesuffix("DataModule").lower()
            config["trainer"]["default_root_dir"] = probe_run_directory(config["model"]["init_args"].get("pretrained_ckpt"), dataset, config["seed_everything"])

    def instantiate_classes(self) -> None:
        trainer = (self.config[self.subcommand] if self.subcommand else self.config)["trainer"]
        accelerator, devices = trainer.get("accelerator"), trainer.get("devices")
        if accelerator in ("gpu", "cuda") and not (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
            fail(f"trainer.accelerator {accelerator!r}, but this machine has no GPU: give --trainer.accelerator cpu (and --trainer.devices N for N CPU processes)")
        with one_error_line(ValueError, describe=lambda error: condense_parser_error(str(root_cause(error)))):
            super().instantiate_classes()
        if accelerator == "auto" and isinstance(self.trainer.accelerator, CPUAccelerator) and self.trainer.num_devices > 1:
            # Lightning would quietly start one gloo process per "device" on the CPU
            fail(
                f"trainer.devices {devices} asks for {self.trainer.num_devices} devices, but this machine has no GPU: give "
                f"--trainer.devices 1 to train here, or --trainer.accelerator cpu to start {self.trainer.num_devices} CPU processes"
            )

    def _check_data(self) -> None:
        with one_error_line(ValueError):
            self.datamodule.setup("fit")  # opens the dataset files: a corrupt one is one error line too
            self.model.check_data(self.datamodule, self.trainer.world_size)

    def before_fit(self) -> None:
        self._check_data()
        for callback in self.trainer.checkpoint_callbacks:
            if callback.dirpath is None:  # not under the logger's version folder: one known place per run
                callback.dirpath = str(Path(self.trainer.default_root_dir) / "checkpoints")
            if self.trainer.fast_dev_run and isinstance(callback, ModelCheckpoint):
                # Lightning suppresses checkpoints in a smoke run but still writes last.ckpt when training ends,
                # which a later `--ckpt_path last` would quietly continue from
                callback.save_last = False
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not a configured plugin
            self.trainer.strategy.checkpoint_io = SameDirectoryCheckpointIO()
        self._refuse_to_overwrite_a_run()
        self._resume_from_a_readable_checkpoint()
        self._start_tracking()

    def _refuse_to_overwrite_a_run(self) -> None:
        """A new `fit` must not overwrite the checkpoints of an earlier run in the same directory."""
        root = Path(self.trainer.default_root_dir)
        if self.config[self.subcommand].get("ckpt_path") is not None:
            return
        if SLURMEnvironment.detect() and any(root.glob("hpc_ckpt_*.ckpt")):
            return  # a requeued Slurm job: Lightning resumes it from its hpc checkpoint
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and last_checkpoint_path(callback).is_file():
                if SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0:
                    # requeued after a preemption (SIGTERM) or a node failure, before any hpc checkpoint
                    self.config_init[self.subcommand]["ckpt_path"] = "last"
                    return
                fail(
                    f"{last_checkpoint_path(callback)} already holds a run: resume it with --ckpt_path last, or "
                    "start a new one under another trainer.default_root_dir"
                )

    def _checkpoint_to_resume(self) -> Path | None:
        """The file `fit` will restore, as Lightning resolves it: for `last` the newest `last.ckpt` of the checkpoint
        callbacks, for a Slurm job without a ckpt_path (or `hpc`) the highest `hpc_ckpt_<n>.ckpt`; None for a new
        run and for a path given as such (read in `parse_arguments`)."""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if ckpt_path == "last":
            found = [last_checkpoint_path(callback) for callback in self.trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
            return max((path for path in found if path.is_file()), key=lambda path: path.stat().st_mtime, default=None)
        if ckpt_path == "hpc" or (ckpt_path is None and SLURMEnvironment.detect()):
            numbered = {int(path.stem.removeprefix("hpc_ckpt_")): path for path in self._run_checkpoints() if path.stem.removeprefix("hpc_ckpt_").isdigit()}
            return numbered[max(numbered)] if numbered else None
        return None

    def _run_checkpoints(self) -> list[Path]:
        """Every checkpoint of this run: `hpc_ckpt_*.ckpt` in the run directory and the checkpoint callbacks' files."""
        folders = [Path(callback.dirpath) for callback in self.trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
        return [*Path(self.trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"), *(path for folder in folders for path in folder.glob("*.ckpt"))]

    def _resume_from_a_readable_checkpoint(self) -> None:
        """Open the checkpoint a resumed run restores before anything is written. One that cannot be read (a copy
        cut short, a full disk) is passed over, with a warning, for the newest readable checkpoint of the run (by
        modification time: an epoch-end `epoch=*-step=*.ckpt`, an hpc checkpoint); with none, one error line."""
        path = self._checkpoint_to_resume()
        if path is None:
            return
        try:
            checkpoint = read_checkpoint(path, str(path))
        except CheckpointMismatch as unreadable:
            for candidate in sorted(set(self._run_checkpoints()) - {path}, key=lambda other: other.stat().st_mtime, reverse=True):
                try:
                    checkpoint = read_checkpoint(candidate, str(candidate))
                except CheckpointMismatch:
                    continue
                rank_zero_warn(f"{unreadable}: resuming from {candidate} instead, the newest readable checkpoint of this run")
                self.config_init[self.subcommand]["ckpt_path"] = path = str(candidate)
                break
            else:
                fail(f"{unreadable}; this run holds no other readable checkpoint: start a new run under another trainer.default_root_dir")
        with one_error_line(CheckpointMismatch):
            check_resumable(checkpoint, f"checkpoint {path}", self.config[self.subcommand])

    def _start_tracking(self) -> None:
        """Bind a W&B logger to the run directory and the resolved config before the trainer creates its run."""
        if not isinstance(self.trainer.logger, WandbRun):
            return
        with one_error_line(ValueError):
            self.trainer.logger.start(self.trainer.default_root_dir, self.config[self.subcommand].as_dict())

    def _prepare_evaluation(self) -> None:
        self._check_data()
        self._start_tracking()

    before_validate = before_test = _prepare_evaluation

    def _print_summary(self, stage: str, results: str) -> None:
        """Print the final metrics of `stage` ("val" or "test") and write them to `<default_root_dir>/<results>`."""
        if not self.trainer.is_global_zero:
            return
        metrics = {name: float(value) for name, value in self.trainer.callback_metrics.items() if value.numel() == 1}
        if not metrics:  # nothing ran (e.g. a finished run resumed): keep the results it wrote
            return
        found = {key: metrics[f"{stage}/{key}"] for key in SUMMARY_KEYS if f"{stage}/{key}" in metrics}
        if found:
            print(f"\n{stage} results: " + "  ".join(f"{key} {100 * value:.2f}%" for key, value in found.items()))
        if self.trainer.fast_dev_run:
            return  # a smoke run's numbers are no run's results
        write_results(Path(self.trainer.default_root_dir) / results, self.trainer, metrics)

    def after_fit(self) -> None:
        self._print_summary("val", "results_val.json")

    def after_validate(self) -> None:
        # its own file: a `validate` in a run directory keeps the training's results (epoch, step, time, images/s)
        self._print_summary("val", "results_validate.json")

    def after_test(self) -> None:
        self._print_summary("test", "results_test.json")


def instantiate_config(config: str, overrides: Sequence[str] = ()) -> ContrastlabCLI:
    """The model, DataModule and trainer of a pretraining config and its overrides, built without running anything
    and without a logger: what `python -m analysis`, the key distribution and the throughput benchmark build."""
    return ContrastlabCLI(PretrainMethod, args=["--config", config, "--trainer.logger=false", *overrides], run=False)
