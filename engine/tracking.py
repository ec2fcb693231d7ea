"""Experiment tracking (issue 10): Weights & Biases through Lightning's `WandbLogger`, and the
training throughput that every run reports.

- `WandbRun`: the `trainer.logger` of every shipped config. Project `contrastlab`, the config's group and tags,
  a run name built from the resolved config (`run_name`), no checkpoint upload (`log_model` off: checkpoints
  stay in the run directory) and no gradient watching (nothing calls `watch`). The CLI calls
  `start(root_dir, config, mode)` before the run begins: W&B's files go to `<root_dir>/wandb`, the run id is kept in
  `<root_dir>/wandb_run_id` so that a resumed or requeued job continues the same W&B run (`resume="allow"`),
  and without `WANDB_MODE` a run without credentials or without a way to the server is offline (`wandb_mode`),
  so that no run fails for lack of a network; `wandb sync <root_dir>/wandb/offline-run-*` uploads it later.
  `WANDB_MODE=online` that cannot log is one error line before anything is written.
- `TrainingThroughput`: the wall time of `fit` and the training images per second, logged as `train/time_s`
  and `train/images_per_s` (so they reach `results_val.json`, the CSV log and W&B), summed over the
  interruptions of a resumed run.
"""

import os
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

from engine.compat import bind_wandb_run, configured_run_name, new_wandb_run_id, wandb_credentials_for, wandb_run_of, wandb_server
from engine.files import write_atomically

RUN_ID_FILE = "wandb_run_id"
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # what wandb.Settings.mode accepts (wandb 0.31)


def config_value(config: dict, key: str, source: str) -> Any:
    """The value at a dotted key of a nested config (`model.init_args.temperature`)."""
    value = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{source}: the resolved config has no key {key!r}")
        value = value[part]
    return value


def run_name(config: dict, name_keys: dict[str, str]) -> str:
    """`<method>-<dataset>[-<label>=<value> ...]-s<seed>`: the model and DataModule class names (lower case,
    without `DataModule`), the value of every `name_keys` entry (label -> dotted key of the resolved config:
    the hyperparameters a config's header calls key, so that an override of one shows in the name) and the
    run's seed, e.g. `sce-imagenet100-tau=0.1-taum=0.05-lambda=0.5-s0`."""
    method = config_value(config, "model.class_path", "run name").rsplit(".", 1)[-1]
    dataset = config_value(config, "data.class_path", "run name").rsplit(".", 1)[-1].removesuffix("DataModule")
    parts = [method.lower(), dataset.lower()]
    for label, key in name_keys.items():
        value = config_value(config, key, f"trainer.logger.init_args.name_keys.{label}")
        parts.append(f"{label}=" + (f"{value:g}" if isinstance(value, float) else str(value).replace(" ", "")))
    return "-".join([*parts, f"s{config_value(config, 'seed_everything', 'run name')}"])


class WandbUnavailable(ValueError):
    """WANDB_MODE asks for an online run that cannot log: no credentials, or no way to the server."""


def wandb_server_reachable(server: str, timeout_s: float = 3.0) -> str | None:
    """None when a TCP connection to the W&B server opens within `timeout_s`, else why not. W&B itself retries
    for minutes before it gives up (issue 32: 121 s), having trained nothing."""
    address = urllib.parse.urlsplit(server)
    try:
        socket.create_connection((address.hostname, address.port or (443 if address.scheme == "https" else 80)), timeout=timeout_s).close()
    except OSError as error:
        return error.strerror or str(error) or type(error).__name__
    return None


def wandb_mode() -> str | None:
    """The mode of a new W&B run. WANDB_MODE when set; "online" only if W&B has credentials and its server can be
    reached, else one error naming WANDB_MODE=offline (the user asked for online logging: the run does not start
    without it). Without WANDB_MODE: "offline" when W&B has no credentials (no WANDB_API_KEY, no .netrc entry for
    its host, read by W&B's own reader) or its server cannot be reached (with one warning line), so that the run
    trains and `wandb sync` uploads it later; otherwise None (online)."""
    server = os.environ.get("WANDB_BASE_URL")
    has_credentials = bool(os.environ.get("WANDB_API_KEY")) or wandb_credentials_for(server) is not None
    mode = os.environ.get("WANDB_MODE")
    if mode and mode not in WANDB_MODES:
        raise WandbUnavailable(f"WANDB_MODE={mode!r} (environment) is no W&B mode: one of {', '.join(WANDB_MODES)}")
    if mode not in (None, "", "online", "run"):
        return mode  # offline, disabled, dryrun, shared: nothing to reach
    if not has_credentials:
        if mode:
            raise WandbUnavailable(
                f"WANDB_MODE={mode}, but W&B has no API key for {wandb_server(server)} (WANDB_API_KEY or `wandb login`): "
                "log in, or set WANDB_MODE=offline to log offline and `wandb sync` later"
            )
        return "offline"
    unreachable = wandb_server_reachable(wandb_server(server))
    if unreachable is not None:
        if mode:
            raise WandbUnavailable(
                f"WANDB_MODE={mode}, but the W&B server {wandb_server(server)} cannot be reached ({unreachable}): "
                "set WANDB_MODE=offline to log offline and `wandb sync` later"
            )
        rank_zero_warn(f"the W&B server {wandb_server(server)} cannot be reached ({unreachable}): this run logs offline; `wandb sync` uploads it later")
        return "offline"
    return mode or None


def stored_run_id(root: Path, new: bool = False) -> str:
    """The W&B run id of the run directory `root`: the one a previous start wrote, or with `new` (or none written)
    a new one, written (by the main process, atomically) for every later start of the same run."""
    path = root / RUN_ID_FILE
    if path.is_file() and not new:
        return path.read_text().strip()
    run_id = new_wandb_run_id()
    if rank_zero_only.rank == 0:
        write_atomically(path, lambda partial: partial.write_text(run_id))
    return run_id


class WandbRun(WandbLogger):
    """Lightning's `WandbLogger`, configured from a config's `trainer.logger` block and started by the CLI with
    the run directory and the resolved config (`start`)."""

    def __init__(
        self,
        project: str = "contrastlab",
        name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        name_keys: dict[str, str] | None = None,
        entity: str | None = None,
    ):
        """
        Args:
            project: the W&B project.
            name: the run's display name; by default `run_name` of the resolved config.
            group: the W&B group (the shipped configs: the config's file name).
            tags: the W&B tags (the shipped configs: method and dataset).
            name_keys: label -> dotted key of the resolved config, the hyperparameters shown in the default name.
            entity: the W&B user or team; by default the credentials' own.
        """
        super().__init__(name=name, project=project, group=group, tags=tags, entity=entity, log_model=False)
        self.name_keys = name_keys or {}
        self.run_dir: Path | None = None

    def check_name(self, config: dict) -> None:
        """The run's name can be made from the resolved config: a `name_keys` entry the config lacks is a ValueError."""
        if configured_run_name(self) is None:
            run_name(config, self.name_keys)

    def start(self, root_dir: str | Path, config: dict, mode: str | None, stage: str = "fit", resumed: bool = False) -> None:
        """Bind the run to its directory and resolved config before its W&B run is created (which happens when
        the trainer sets up): name, `<root_dir>/wandb`, the id and the mode (`wandb_mode()`). A `fit` that resumes
        a checkpoint continues the W&B run whose id the directory stores; a new `fit` starts and stores a new one
        (an earlier start there that wrote no checkpoint was another run); `validate` and `test` are W&B runs of
        their own, which change neither the training run's config nor its history."""
        if wandb_run_of(self) is not None:
            raise RuntimeError("WandbRun.start() came after its W&B run was created: its name, directory and id would be ignored")
        name = configured_run_name(self) or run_name(config, self.name_keys)  # a bad name key fails before anything is written
        self.run_dir = Path(root_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_id = stored_run_id(self.run_dir, new=not resumed) if stage == "fit" else new_wandb_run_id()
        bind_wandb_run(self, name, str(self.run_dir), run_id, mode)

    @property
    def experiment(self):
        if self.run_dir is None:  # WandbLogger would write to the working directory under an unrelated id
            raise RuntimeError("WandbRun.start(root_dir, config) must be called before the run begins (the CLI does so before fit, validate and test)")
        return super().experiment

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """End the W&B run with the training run: one CLI stage per W&B run, so that the next run started in
        the same process gets its own. On Slurm's requeue signal ("finished": the job is about to stop and be
        requeued) the run is marked preempting instead; the requeued job resumes it."""
        super().finalize(status)
        run = wandb_run_of(self)
        if run is None:
            return
        if status == "finished":
            run.mark_preempting()
        else:
            run.finish(exit_code=0 if status == "success" else 1)


def tracked_run(trainer) -> WandbRun | None:
    """The trainer's `WandbRun`, wherever it stands in a list of loggers, or None."""
    return next((logger for logger in trainer.loggers if isinstance(logger, WandbRun)), None)


class TrainingThroughput(Callback):
    """Logs at the end of every training epoch `train/time_s`, the wall time since `fit` started (validation
    included), and `train/images_per_s`, the training images (dataset samples, all processes; not views) per
    second of training, validation and sanity check excluded. Both carry over a resumption through the
    checkpoint, so a resumed run reports its whole training, without the time it spent stopped."""

    def __init__(self):
        self.earlier = {"time_s": 0.0, "validation_s": 0.0, "images": 0}  # before this process resumed the run
        self.started = self.validation_started = 0.0
        self.validation_s = 0.0
        self.images = 0

    def totals(self) -> dict[str, float]:
        return {
            "time_s": self.earlier["time_s"] + time.perf_counter() - self.started,
            "validation_s": self.earlier["validation_s"] + self.validation_s,
            "images": self.earlier["images"] + self.images,
        }

    def on_fit_start(self, trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_validation_start(self, trainer, pl_module) -> None:
        self.validation_started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self.validation_s += time.perf_counter() - self.validation_started

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.images += len(batch["index"]) * trainer.world_size  # every batch carries its dataset indices

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        totals = self.totals()
        pl_module.log("train/time_s", totals["time_s"], on_step=False, on_epoch=True)
        pl_module.log("train/images_per_s", totals["images"] / (totals["time_s"] - totals["validation_s"]), on_step=False, on_epoch=True)

    def state_dict(self) -> dict:
        return self.totals()

    def load_state_dict(self, state_dict: dict) -> None:
        self.earlier = dict(state_dict)
