"""The LightningCLI shared by `main_pretrain.py` and `main_linear.py`.

- `fit` / `validate` / `test` subcommands, `--config` YAMLs, `--print_config`;
- `data.num_classes` linked into `model.num_classes` (read from the instantiated DataModule);
- optimizers and schedules come from the model's own config (`auto_configure_optimizers=False`),
  because they need parameter groups and per-step schedules;
- the resolved config is written with overwrite enabled (a second run in the same directory or a
  Slurm requeue must not crash) and, with a `WandbLogger`, sent to the W&B run (`engine.cli.parsing`);
- a `checkpoint` group (ModelCheckpoint) is always present, with `save_last: true`, writing to
  `<default_root_dir>/checkpoints/` whatever the logger (`last.ckpt` is where the linear stage and a
  resumed run look);
- configuration mistakes end with one `error:` line naming the offending key or value, before any
  directory, config or checkpoint is written (set CONTRASTLAB_TRACEBACK=1 for the full traceback;
  `engine.cli.errors`, `engine.cli.parsing`);
- at the end of `fit` / `validate` / `test`, the final metrics are printed and written to
  `<default_root_dir>/results_<stage>.json` (`engine.cli.results`);
- reliability: `seed_everything` must be an explicit integer; a `non_finite` group (`engine.non_finite`) stops
  the run at the first non-finite loss; checkpoints hold the random states (`engine.random_state`), the position
  in the epoch's data order (the DataModule's state), the contrastlab version and the resolved config
  (`engine.checkpoint_record`); on SIGTERM the current step is saved as `last.ckpt` and the process exits with
  status 143 (`engine.preemption`); checkpoints are written next to their target and renamed over it
  (`engine.files`);
- which run a `fit` continues (`engine.cli.resume`): a directory that already holds a run's checkpoints is
  refused unless the run resumes (`--ckpt_path last`, which also starts a run that has no checkpoint yet; a
  requeued Slurm job resumes from its hpc checkpoint, or from `last.ckpt` when it has none), and so is a checkpoint
  of another run there; the checkpoint it restores is opened before anything is written; `last.ckpt` is written at
  every epoch's end, validated or not (`engine.preemption`);
- the model class answers what the CLI needs to know of it (`MethodBase.default_run_directory`,
  `check_resume`, `wrong_checkpoint_hint`): a linear probe, for one, runs beside its pretraining checkpoint.
"""

import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from analysis.monitors import CollapseMonitor, EmbeddingMap
from datamodules.base import ContrastiveDataModule
from datamodules.folders import TooManyUnreadableImages
from engine.checkpoint_record import CheckpointMismatch
from engine.cli.errors import condense_parser_error, fail, last_line, located, one_error_line, root_cause
from engine.cli.parsing import ContrastlabArgumentParser, SaveConfigToRun, batch_counts_as_written, check_run_values, integer_batch_counts
from engine.cli.quiet import quiet_run
from engine.cli.resume import (
    LIGHTNING_CHECKPOINT_NAMES,
    UNKNOWN,
    check_resumable,
    checkpoints_in_the_run_directory,
    choose_checkpoint_to_evaluate,
    class_default,
    check_unchanged,
    continues_this_run,
    plain,
    readable_checkpoint_to_resume,
    refuse_to_overwrite_a_run,
)
from engine.cli.run_lock import RunDirectoryInUse, RunDirectoryLock
from engine.cli.results import FinalValidation, end_of_fit, evaluated_position, report_results
from engine.compat import KeepsEvaluationSettings, dump_config_for_hyperparameters
from engine.config import load_yaml
from engine.devices import choose_cpu_precision, keep_freed_host_memory
from engine.files import SameDirectoryCheckpointIO, UnreadableCheckpoint, WriteFailed, read_checkpoint
from engine.non_finite import NonFiniteLossError, NonFiniteLossGuard, check_guard_processes
from engine.preemption import LastCheckpointAtEveryEpoch, LastCheckpointOnSigterm, PreemptionSignals, ProcessTimeLimit, ResumeInStoppedEpoch
from engine.random_state import RandomStateCheckpoint
from engine.tracking import TrainingThroughput, WandbUnavailable, tracked_run, wandb_mode
from methods.base import MethodBase
from methods.checkpoints import class_at, trainable_classes

def models_trained_here(model_class) -> str:
    """For --help: the model classes a config's `model.class_path` may name."""
    return f"model.class_path: one of methods.{{{', '.join(trainable_classes(model_class))}}}; see configs/ for one config per paper setting"


class ContrastlabCLI(KeepsEvaluationSettings):
    def __init__(self, model_class, args: Any = None, **kwargs):
        self.given_checkpoint: tuple[dict, str] | None = None  # a --ckpt_path file, read when the arguments are parsed
        self.precision_note: str | None = None  # the CPU precision rule's choice, printed at the start of the run
        self.run_lock: RunDirectoryLock | None = None
        command_line = sys.argv[1:] if args is None else args
        self.command_line = list(command_line) if isinstance(command_line, Sequence) else []  # where values came from, for errors
        self.requested_subcommand = self.command_line[0] if self.command_line else None
        keep_freed_host_memory()  # before the data and the model allocate anything
        try:
            with quiet_run(), one_error_line(NonFiniteLossError, CheckpointMismatch, UnreadableCheckpoint, TooManyUnreadableImages, WriteFailed, describe=last_line):
                super().__init__(
                    model_class,
                    ContrastiveDataModule,
                    subclass_mode_model=True,
                    subclass_mode_data=True,
                    parser_class=ContrastlabArgumentParser,
                    save_config_callback=SaveConfigToRun,
                    save_config_kwargs={"save_to_log_dir": False},  # SaveConfigToRun writes config.yaml from its one dump
                    trainer_defaults={"callbacks": [
                        RandomStateCheckpoint(), LastCheckpointOnSigterm(), LastCheckpointAtEveryEpoch(), PreemptionSignals(), ResumeInStoppedEpoch(), TrainingThroughput(), FinalValidation(),
                    ]},  # fmt: skip
                    auto_configure_optimizers=False,
                    args=args,
                    parser_kwargs={"description": models_trained_here(model_class)},
                    **kwargs,
                )
        except SIGTERMException:
            sys.stderr.write(f"stopped by SIGTERM after global step {self.trainer.global_step} (checkpoints/last.ckpt): resume with --ckpt_path last\n")
            sys.exit(128 + signal.SIGTERM)
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def subcommands(self) -> dict[str, set[str]]:
        """The subcommand the command line starts with, alone: each subcommand's parser adds every Trainer, model and
        data argument, and building the other three took 0.19 s of a 0.51 s `--print_config` here. A command line
        that starts with anything else (`--help`, a misspelt subcommand) gets all three, to list them."""
        every = {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}  # no method has a predict_step
        return {self.requested_subcommand: every[self.requested_subcommand]} if self.requested_subcommand in every else every

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # a resumed run overwrites its own last.ckpt (Lightning would write last-v1.ckpt beside a last.ckpt it
        # did not write in this process, leaving the stale one where the linear stage and a resume look)
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.enable_version_counter": False})
        parser.add_lightning_class_args(NonFiniteLossGuard, "non_finite")
        parser.add_argument(
            "--bf16_on_cpu", choices=["auto", "always"], default="auto",
            help="auto: a CPU run given a bf16 precision trains in 32-true unless the CPU has bf16 units (engine.devices.cpu_precision); always: as given",
        )  # fmt: skip
        if self.model_class.monitors_representations:  # collapse monitors every 10 epochs, the embedding map at the end (docs/evaluation.md)
            parser.add_lightning_class_args(CollapseMonitor, "collapse_monitor")
            parser.add_lightning_class_args(EmbeddingMap, "embedding_map")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        check_run_values(config, subcommand)
        accelerator = config["trainer"].get("accelerator")
        on_cpu = accelerator == "cpu" or (accelerator in ("auto", None) and not (CUDAAccelerator.is_available() or MPSAccelerator.is_available()))
        self.precision_note = choose_cpu_precision(config["trainer"], config.get("bf16_on_cpu", "auto")) if on_cpu else None  # said at the start
        for name, count in batch_counts_as_written(config["trainer"], self.command_line).items():  # `limit_val_batches=1`: one batch
            config["trainer"][name] = count
        ckpt_path = config.get("ckpt_path")
        if ckpt_path is None or ckpt_path in LIGHTNING_CHECKPOINT_NAMES or "://" in str(ckpt_path) or str(ckpt_path).startswith("registry"):
            return  # a name Lightning resolves (`last` is read in before_fit), a remote or registry path
        if not Path(ckpt_path).is_file():
            fail(f"ckpt_path {ckpt_path!r} is not an existing file (or `last`: the newest checkpoint of trainer.default_root_dir)")
        source = f"ckpt_path {ckpt_path!r}"
        with one_error_line(CheckpointMismatch, UnreadableCheckpoint):  # before Lightning reads the hyperparameters from it
            checkpoint = read_checkpoint(ckpt_path, source)
            check_resumable(checkpoint, source, config)
            if subcommand == "fit":  # an evaluation may use other data settings (batch size, workers)
                check_unchanged(checkpoint, source, self.resolved_config(settled=True))
        self.given_checkpoint = (checkpoint, source)

    def at_default(self, class_path: str, name: str, value) -> bool:  # an evaluation setting left as the class sets it
        default = class_default({"model": {"class_path": class_path}}, f"model.init_args.{name}")
        return default is not UNKNOWN and value == plain(default)

    def resolved_config(self, settled: bool = False) -> dict:
        """The resolved config of the subcommand as `config.yaml` and the checkpoints record it (plain YAML types); with
        `settled`, before `before_instantiate_classes` settles the model's arguments, as it will record them."""
        subcommand = self.config.get("subcommand")
        dumped = load_yaml(self.parser.dump(self.config, skip_none=False, skip_validation=True))  # as SaveConfigToRun dumps it
        resolved = dumped[subcommand] if subcommand else dumped
        resolved["trainer"].update(integer_batch_counts((self.config[subcommand] if subcommand else self.config)["trainer"]))
        if settled:
            class_at(resolved["model"]["class_path"]).settle_arguments(resolved["model"]["init_args"])
        return resolved

    def before_instantiate_classes(self) -> None:
        """A model class may choose its run directory when trainer.default_root_dir is not given
        (`MethodBase.default_run_directory`: a linear probe runs beside its pretraining checkpoint), after Lightning
        read a resumed checkpoint's hyperparameters into the config; it is saved with the config."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        class_at(config["model"]["class_path"]).settle_arguments(config["model"]["init_args"])  # config.yaml records the value used
        if config["trainer"].get("default_root_dir") is None:
            dataset = config["data"]["class_path"].rsplit(".", 1)[-1].removesuffix("DataModule").lower()
            model = config["model"]
            directory = class_at(model["class_path"]).default_run_directory(model["init_args"], dataset, config["seed_everything"])
            if directory is not None:
                config["trainer"]["default_root_dir"] = directory
        dump_config_for_hyperparameters(self)

    def instantiate_trainer(self, **kwargs: Any):  # the parser's instantiation makes the batch counts floats again
        return super().instantiate_trainer(**kwargs, **batch_counts_as_written(self._get(self.config_init, "trainer", default={}), self.command_line))

    def instantiate_classes(self) -> None:
        trainer = (self.config[self.subcommand] if self.subcommand else self.config)["trainer"]
        accelerator, devices = trainer.get("accelerator"), trainer.get("devices")
        if accelerator in ("gpu", "cuda") and not (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
            fail(f"trainer.accelerator {accelerator!r}, but this machine has no GPU: give --trainer.accelerator cpu (and --trainer.devices N for N CPU processes)")
        # MisconfigurationException: a trainer value Lightning refuses (max_time '48h', devices 0, max_epochs -5)
        with one_error_line(ValueError, MisconfigurationException,
                            describe=lambda error: located(condense_parser_error(str(root_cause(error))), self.resolved_config(), self.command_line)):
            super().instantiate_classes()
        self.run_lock = RunDirectoryLock(self.trainer.default_root_dir)
        max_time = trainer.get("max_time")
        if max_time is not None:  # the time of this process, not of the run since it started (engine.preemption)
            self.trainer.callbacks = [ProcessTimeLimit(max_time) if type(callback) is Timer else callback for callback in self.trainer.callbacks]
        if accelerator == "auto" and isinstance(self.trainer.accelerator, CPUAccelerator) and self.trainer.num_devices > 1:
            # Lightning would quietly start one gloo process per "device" on the CPU
            fail(
                f"trainer.devices {devices} asks for {self.trainer.num_devices} devices, but this machine has no GPU: give "
                f"--trainer.devices 1 to train here, or --trainer.accelerator cpu to start {self.trainer.num_devices} CPU processes"
            )

    def _check_data(self) -> None:
        with one_error_line(ValueError):
            check_guard_processes(self.trainer)
            self.datamodule.setup("fit")  # opens the dataset files: a corrupt one is one error line too
            self.model.check_data(self.datamodule, self.trainer.world_size)
            self.datamodule.check_sampler(self.trainer.max_epochs)
        for message in (*self.model.expected_warnings(), *self.datamodule.expected_warnings()):
            warnings.filterwarnings("ignore", message=message)  # within quiet_run: for this run only

    def before_fit(self) -> None:
        self._check_data()
        self._say_precision()
        checkpoints_in_the_run_directory(self.trainer)
        for callback in self.trainer.checkpoint_callbacks:
            if self.trainer.fast_dev_run and isinstance(callback, ModelCheckpoint):
                # Lightning suppresses checkpoints in a smoke run but still writes last.ckpt when training ends,
                # which a later `--ckpt_path last` would quietly continue from
                callback.save_last = False
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not a configured plugin
            self.trainer.strategy.checkpoint_io = SameDirectoryCheckpointIO()
        run = self.config_init[self.subcommand]
        run["ckpt_path"] = refuse_to_overwrite_a_run(self.trainer, run.get("ckpt_path"))
        resumed = readable_checkpoint_to_resume(self.trainer, run)
        with one_error_line(CheckpointMismatch):
            if resumed is not None:  # `last`, `hpc`, a requeue: Lightning takes the model's settings from the config
                path, checkpoint = resumed
                check_resumable(checkpoint, f"checkpoint {path}", self.config[self.subcommand])
                check_unchanged(checkpoint, f"checkpoint {path}", self.resolved_config(), self.trainer.world_size)
            elif self.given_checkpoint is not None:  # its settings were checked when parsed; the processes now are known
                check_unchanged(*self.given_checkpoint, self.resolved_config(), self.trainer.world_size)
        mode = self._tracking_mode()
        self._claim_run_directory()  # the checks above only read: two runs that pass them together meet here
        self._start_tracking(mode, resumed=continues_this_run(self.trainer, run.get("ckpt_path"), resumed is not None))

    def _claim_run_directory(self) -> None:
        """One run at a time in a run directory (`engine.cli.run_lock`), claimed before anything is written there."""
        if self.trainer.is_global_zero:
            with one_error_line(RunDirectoryInUse):
                self.run_lock.acquire()

    def _tracking_mode(self) -> str | None:
        """The W&B mode (`engine.tracking.wandb_mode`) and the run's name, decided before anything is written: an online
        run that cannot log, or a name key that the config lacks, is one error line."""
        if (run := tracked_run(self.trainer)) is None:
            return None
        with one_error_line(WandbUnavailable, ValueError):
            run.check_name(self.config[self.subcommand].as_dict())
            return wandb_mode()

    def _start_tracking(self, mode: str | None, resumed: bool = False) -> None:
        """Bind a W&B logger to the run directory and the resolved config before the trainer creates its run."""
        if (run := tracked_run(self.trainer)) is None:
            return
        with one_error_line(ValueError):
            run.start(self.trainer.default_root_dir, self.config[self.subcommand].as_dict(), mode, self.subcommand, resumed)

    def _say_precision(self) -> None:
        if self.precision_note is not None:
            self.trainer.print(self.precision_note)

    def _prepare_evaluation(self) -> None:
        self._check_data()
        self._say_precision()
        with one_error_line(CheckpointMismatch):
            choose_checkpoint_to_evaluate(self.trainer, self.config_init[self.subcommand], self.subcommand, self.config[self.subcommand])
        mode = self._tracking_mode()
        self._claim_run_directory()
        self._start_tracking(mode)

    before_validate = before_test = _prepare_evaluation

    def after_fit(self) -> None:
        for limit in (callback for callback in self.trainer.callbacks if isinstance(callback, ProcessTimeLimit)):
            limit.exit_if_cut_short(self.trainer, self.config[self.subcommand]["trainer"]["max_time"])  # no results: as after a SIGTERM
        end_of_fit(self.trainer, self.model, self.datamodule)

    def after_validate(self) -> None:
        # its own file: a `validate` in a run directory keeps the training's results (epoch, step, time, images/s)
        report_results(self.trainer, "val", "results_validate.json", evaluated_position(self.trainer))

    def after_test(self) -> None:
        report_results(self.trainer, "test", "results_test.json", evaluated_position(self.trainer))


def instantiate_config(config: str, overrides: Sequence[str] = ()) -> ContrastlabCLI:
    """The model, DataModule and trainer of a pretraining config and its overrides, built without running anything
    and without a logger: what `python -m analysis`, the key distribution and the throughput benchmark build."""
    return ContrastlabCLI(MethodBase, args=["--config", config, "--trainer.logger=false", *overrides], run=False)
