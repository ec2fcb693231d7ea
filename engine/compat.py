"""Every use of a private attribute of Lightning or W&B, in one module.

Lightning and W&B offer no public way to do what these functions do (requeue a Slurm job at a batch the
processes agreed on, stop a fit at the end of a step, read where the fit loop is in its epoch, bind a W&B run to a
directory and id before it is created). They reach into private attributes, which a minor release may rename: pyproject.toml pins both
packages to the minor versions tested here, and tests/test_compat.py checks every attribute below by name on
the installed versions, so an upgrade that renames one fails there, naming it, and not in a user's run.
"""

import configparser
import importlib
import os
from pathlib import Path

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger

from engine.checkpoint_record import CheckpointMismatch
from engine.config import flattened, load_yaml

# (what holds it, attribute path): the private attributes used below, checked by tests/test_compat.py
PRIVATE_ATTRIBUTES = {
    "LightningModule": ["_trainer"],
    "Trainer": [
        "_accelerator_connector.cluster_environment",
        "_signal_connector._slurm_sigusr_handler_fn",
        "_signal_connector.received_sigterm",
        "fit_loop.epoch_progress.current.started",
        "fit_loop.epoch_loop.batch_idx",
        "fit_loop.epoch_loop.batch_progress.current.processed",
        "fit_loop.setup_data",
    ],
    "WandbLogger": ["_experiment", "_name", "_save_dir", "_id", "_wandb_init"],
    "wandb.sdk.lib": ["runid.generate_id", "urls.DEFAULT_BASE_URL", "wbauth.read_netrc_auth"],
}


def attached_trainer(module: LightningModule) -> Trainer | None:
    """The trainer a module is attached to, or None (`module.trainer` raises when there is none)."""
    return module._trainer


def cluster_environment(trainer: Trainer):
    return trainer._accelerator_connector.cluster_environment


def checkpoint_and_requeue(trainer: Trainer, signum: int) -> None:
    """Lightning's own Slurm handler: the hpc checkpoint, then `scontrol requeue` (rank 0)."""
    trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)


def stop_at_the_end_of_this_step(trainer: Trainer) -> None:
    """What Lightning's SIGTERM handler sets: the fit loop raises `SIGTERMException` after the current step."""
    trainer._signal_connector.received_sigterm = True


def batch_in_epoch(trainer: Trainer) -> int:
    """The index of the training batch the fit loop is at in its epoch."""
    return trainer.fit_loop.epoch_loop.batch_idx


def count_training_batches(trainer: Trainer) -> None:
    """Set up the training data, so that `trainer.num_training_batches` is counted: `estimated_stepping_batches` does it
    only for a run with `max_epochs` (it returns `max_steps` without)."""
    trainer.fit_loop.setup_data()


def epochs_trained(trainer: Trainer) -> int:
    """The whole epochs a fit has trained. Lightning counts an epoch that max_steps stops inside as completed once the
    fit ends (`current_epoch` 1 after 3 steps of a 37-batch epoch, where a checkpoint saved in it says 0)."""
    batches = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    return trainer.current_epoch - 1 if 0 < batches < trainer.num_training_batches else trainer.current_epoch


def data_position(trainer: Trainer) -> tuple[int, int]:
    """(epoch, training batches processed in it): the epoch is the one the loop started last, the one its batch
    count is about (`trainer.current_epoch` moves on before a SIGTERM checkpoint at the end of an epoch is written)."""
    loop = trainer.fit_loop
    return loop.epoch_progress.current.started - 1, loop.epoch_loop.batch_progress.current.processed


def dump_config_for_hyperparameters(cli: LightningCLI) -> None:
    """Dump the config for the hyperparameters Lightning records with the model and the data, as its
    `LightningCLI._dump_config` does, without validating it again: it was validated when parsed, and validating took
    3/4 of the dump's 0.10 s (a Digits-M config, this project's 2-core CPU). Lightning uses a `config_dump` it finds
    (tests/test_compat.py checks both)."""
    dumped = load_yaml(cli.parser.dump(cli.config, skip_link_targets=False, skip_none=False, format="yaml", skip_validation=True))
    cli.config_dump = dumped[cli.config.subcommand] if "subcommand" in cli.config else dumped


def reopen_stopped_epoch(checkpoint: dict) -> None:
    """Make a checkpoint that a stop inside an epoch wrote (Lightning's max_steps or max_time stop, which marks the
    epoch processed and completed) resume inside that epoch, as a SIGTERM checkpoint of the same batch does: the
    epoch counts as started, not processed or completed, and the batch progress stays where it stopped (the loop state
    `checkpoint["loops"]["fit_loop"]`, as Lightning 2.6 writes it; tests/test_long_runs.py checks both forms)."""
    for progress in checkpoint["loops"]["fit_loop"]["epoch_progress"].values():
        progress["processed"] = progress["completed"] = progress["started"] - 1


def close_finished_epoch(checkpoint: dict) -> None:
    """Make a checkpoint written at the end of an epoch (processed, not yet completed) resume at the start of the next
    epoch also when the run sets max_steps: Lightning then counts every resumption as a restart (`FitLoop.restarting`,
    `_iteration_based_training`) and would continue the finished epoch, one batch past its end with the next epoch's
    data and every later epoch a data order ahead. The epoch counts as completed and the batch progress of the current
    epoch as empty, the state Lightning gives the same checkpoint without max_steps (`FitLoop.on_run_start`, the batch
    progress `reset_on_run`). The loop state as Lightning 2.6 writes it; tests/test_long_runs.py checks its layout."""
    loop = checkpoint["loops"]["fit_loop"]
    for progress in loop["epoch_progress"].values():
        progress["completed"] = progress["processed"]
    batches = loop["epoch_loop.batch_progress"]
    batches["current"] = dict.fromkeys(batches["current"], 0)
    batches["is_last_batch"] = False


def processed_epochs(checkpoint: dict) -> int:
    """The epochs a checkpoint's fit loop counts as processed: a resumed run starts the next one."""
    return checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]


def wandb_run_of(logger: WandbLogger):
    """The logger's W&B run if it was created, else None (`logger.experiment` would create it)."""
    return logger._experiment


def configured_run_name(logger: WandbLogger) -> str | None:
    return logger._name


def bind_wandb_run(logger: WandbLogger, name: str, directory: str, run_id: str, mode: str | None) -> None:
    """Give a not yet created W&B run its name, directory (also `trainer.log_dir`, where config.yaml goes), id
    and mode: the fields WandbLogger passes to `wandb.init`. The mode is passed even when WANDB_MODE gives it,
    since W&B reads its variables once per process."""
    logger._name, logger._save_dir, logger._id = name, directory, run_id
    logger._wandb_init.update(name=name, dir=directory, id=run_id, mode=mode)
    logger._wandb_init.pop("anonymous", None)  # WandbLogger passes None, which W&B >= 0.31 warns about at every start


def new_wandb_run_id() -> str:
    from wandb.sdk.lib import runid  # wandb is imported where a W&B run is made, not by every entry point

    return runid.generate_id()


def wandb_server(host: str | None) -> str:
    """The W&B server a run talks to: `host` (WANDB_BASE_URL), else the one W&B's settings files name (`wandb login
    --host` writes it to ~/.config/wandb/settings), else W&B's default."""
    if host:
        return host
    from wandb.sdk.lib import urls

    # the settings file where wandb/sdk/wandb_setup.py `_settings_setup` finds it, read quietly (W&B's reader says so)
    config_dir = os.environ.get("WANDB_CONFIG_DIR")
    path = Path(config_dir).expanduser() / "settings" if config_dir else Path("~/.config/wandb/settings").expanduser()
    settings = configparser.ConfigParser()
    try:
        settings.read(path)  # a missing file reads as empty
    except (configparser.Error, OSError, UnicodeDecodeError):
        return urls.DEFAULT_BASE_URL
    return settings.get("default", "base_url", fallback="").rstrip("/") or urls.DEFAULT_BASE_URL


def wandb_credentials_for(host: str | None) -> object | None:
    """The netrc credentials W&B would use for `host` (its default server when None), or None."""
    from wandb.sdk.lib.wbauth import read_netrc_auth

    return read_netrc_auth(host=wandb_server(host))


def save_last_checkpoint_unless_saved(trainer: Trainer, callback) -> None:
    """The `ModelCheckpoint` callback's own `last.ckpt` of this step (its bookkeeping kept: `last_model_path`, the
    step last saved), unless it wrote one at this step or writes one at this epoch's end itself."""
    if callback._should_skip_saving_checkpoint(trainer) or callback._should_save_on_train_epoch_end(trainer):
        return
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


class KeepsEvaluationSettings(LightningCLI):
    """A LightningCLI whose `validate` and `test` keep the model arguments named by the model class's
    `evaluation_settings` (tau-norm's tau, the kNN monitor's k) that their config or command line set to another value
    than the class's default: Lightning's `_parse_ckpt_path` puts a checkpoint's hyperparameters over every model
    argument. One left at its default keeps the checkpoint's; any other model argument that the command line sets to
    another value than the checkpoint's is refused."""

    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        given = self.config[subcommand]["model"]["init_args"].clone() if subcommand in ("validate", "test") else None
        super()._parse_ckpt_path()
        if given is not None:
            model = self.config[subcommand]["model"]
            module_name, _, class_name = model["class_path"].rpartition(".")
            settings = getattr(importlib.import_module(module_name), class_name).evaluation_settings
            for name in settings:
                if name in given and not self.at_default(model["class_path"], name, given[name]):
                    model["init_args"][name] = given[name]
            self.refuse_model_arguments_the_checkpoint_overrides(flattened(given.as_dict()), flattened(model["init_args"].as_dict()), settings)

    def refuse_model_arguments_the_checkpoint_overrides(self, given: dict, restored: dict, settings: tuple[str, ...]) -> None:
        """An evaluation's model is the checkpoint's: a model argument its command line (the subclass's `command_line`)
        sets to another value would be dropped without a word (its config files may differ: a run's training config
        beside a checkpoint of overrides)."""
        flags = [token.partition("=")[0].removeprefix("--").replace(".init_args.", ".") for token in getattr(self, "command_line", [])
                 if isinstance(token, str) and token.startswith("--model")]
        for key, value in given.items():
            set_here = any(f"model.{key}" == flag or f"model.{key}".startswith(flag + ".") for flag in flags)
            if set_here and key.split(".")[0] not in settings and restored.get(key, value) != value:
                raise CheckpointMismatch(
                    f"model.init_args.{key} {value!r} given on the command line, but {self.config['subcommand']} evaluates the model of its "
                    f"checkpoint, trained with {restored[key]!r}; an evaluation may change {', '.join(settings) or 'none of its model arguments'}"
                )

    def at_default(self, class_path: str, name: str, value) -> bool:
        """Whether `value` is the default of the model argument `name` of `class_path` (the subclass knows defaults)."""
        return False
