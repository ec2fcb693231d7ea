"""What keeps a long run from being wasted (issue 12): checkpoints that say what wrote them,
resumption that continues exactly, a stop at the first non-finite loss.

- `CheckpointRecord` (a LightningModule mixin): every checkpoint records the contrastlab version and the
  module's class under `checkpoint["contrastlab"]` (the CLI adds the resolved config); loading one
  written by an incompatible version, or a file that is no Lightning checkpoint, is a `CheckpointMismatch`;
  a Lightning checkpoint without the record (written before it existed) loads with a warning.
- `RandomStateCheckpoint`: the random states go into every checkpoint and come back when the resumed
  run starts training (Lightning checkpoints none), so augmentations and shuffle-BN permutations
  continue as in an uninterrupted run.
- `PreemptionSignals`: SIGTERM and Slurm's requeue signal acted on by Lightning at the end of a step, on
  every process at the same step, not inside the signal handler.
- `LastCheckpointOnSigterm`: on SIGTERM (what a scheduler sends before preempting) Lightning stops at
  the end of the current batch; this callback then writes `last.ckpt` of that step.
- `SameDirectoryCheckpointIO`: checkpoints written next to their target and renamed over it, so an
  interrupted write never leaves a truncated `last.ckpt`, whatever filesystem /tmp is on.
- `NonFiniteLossGuard`: stops at the first non-finite loss, or skips such batches.
- `write_atomically`: write-then-rename for the files the project writes itself.
"""

import importlib
import os
import random
import re
import signal
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from engine.compat import checkpoint_and_requeue, cluster_environment, stop_at_the_end_of_this_step

VERSION = version("contrastlab")
RECORD_KEY = "contrastlab"


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(partial)` to `<name>.partial` next to `path`, then rename it over `path` (`os.replace`, atomic
    within a filesystem): a reader never sees half a file, and an interrupted run never leaves one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    write(partial)
    os.replace(partial, path)


def last_checkpoint_path(callback: ModelCheckpoint) -> Path:
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


# ----------------------------------------------------------------- checkpoint compatibility
class CheckpointMismatch(ValueError):
    """A checkpoint that this code must not load."""


def compatible(saved: str, current: str = VERSION) -> bool:
    """Semantic versioning: the same major version; before 1.0 the same minor version too (0.y may break at every y)."""
    saved_major, saved_minor = map(int, re.match(r"(\d+)\.(\d+)", saved).groups())
    major, minor = map(int, re.match(r"(\d+)\.(\d+)", current).groups())
    return saved_major == major and (major > 0 or saved_minor == minor)


def checked_record(checkpoint: dict, source: str) -> dict | None:
    """The contrastlab record of a loaded checkpoint, after checking that this version can load it; None,
    with a warning, for a Lightning checkpoint without one (written before contrastlab 0.1.0 recorded
    versions: the runs measured in docs/results.md), which loads unchecked."""
    record = checkpoint.get(RECORD_KEY)
    if not isinstance(record, dict) or "version" not in record:
        if "pytorch-lightning_version" not in checkpoint:
            raise CheckpointMismatch(f"{source} is not a Lightning checkpoint and holds no contrastlab record (version, module class)")
        rank_zero_warn(f"{source} holds no contrastlab record (written before checkpoints recorded the version): loaded without a version check")
        return None
    if not compatible(record["version"]):
        raise CheckpointMismatch(
            f"{source} was written by contrastlab {record['version']} ({record.get('module')}), which this contrastlab "
            f"{VERSION} cannot load: checkpoints load within one major version (one minor version before 1.0)"
        )
    return record


# Model classes that moved since checkpoints recorded them (issue 23 moved the long-tail family into methods/longtail/)
MOVED_CLASSES = {
    "methods.paco.PaCo": "methods.longtail.paco.PaCo",
    "methods.paco_ride.PaCoRIDE": "methods.longtail.paco_ride.PaCoRIDE",
    "methods.multitask.MultiTaskContrast": "methods.longtail.multitask.MultiTaskContrast",
    "methods.longtail.CrossEntropy": "methods.longtail.cross_entropy.CrossEntropy",
}


def checkpoint_class(checkpoint: dict, source: str) -> tuple[str, type] | None:
    """The class path a loaded checkpoint names for its model (its contrastlab record's, else the `_class_path` that
    LightningCLI saved with the hyperparameters) and that class, where it lives now (`MOVED_CLASSES`); None when the
    checkpoint names none. Checks the record's version (`checked_record`)."""
    record = checked_record(checkpoint, source) or {}
    class_path = record.get("module") or checkpoint.get("hyper_parameters", {}).get("_class_path")
    if class_path is None:
        return None
    module_name, _, class_name = MOVED_CLASSES.get(class_path, class_path).rpartition(".")
    try:
        return class_path, getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        raise CheckpointMismatch(f"{source} names the class {class_path}, which this contrastlab does not have") from None


class CheckpointRecord:
    """LightningModule mixin: record the version and the module class in every checkpoint, check them on every load
    (`--ckpt_path`, `load_from_checkpoint`)."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint.setdefault(RECORD_KEY, {}).update(version=VERSION, module=f"{type(self).__module__}.{type(self).__qualname__}")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        checked_record(checkpoint, "the checkpoint being loaded")
        super().on_load_checkpoint(checkpoint)


# ----------------------------------------------------------------- resumption
class RandomStateCheckpoint(Callback):
    """Saves the torch (CPU and current CUDA device), NumPy and Python random states with every checkpoint and
    restores them when the resumed run starts training: after its sanity check and the creation of its
    training iterator, which draw random numbers that an uninterrupted run does not draw at that point (the
    training DataLoader draws its worker seeds from a generator of its own, `datamodules.base`). Under DDP
    the states of rank 0 are restored on every rank, which is exact: `seed_everything` gives every rank the
    same states and every rank draws the same numbers (shuffle-BN's permutation included)."""

    def __init__(self):
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        name, keys, position, has_gauss, gauss = np.random.get_state()
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),  # plain types: weights_only loads
            "python": random.getstate(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict

    def on_train_start(self, trainer, pl_module) -> None:
        if self.loaded is None:
            return
        torch.set_rng_state(self.loaded["torch"])
        if self.loaded["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.loaded["cuda"])
        name, keys, position, has_gauss, gauss = self.loaded["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        random.setstate(self.loaded["python"])
        self.loaded = None


class LastCheckpointOnSigterm(Callback):
    """On SIGTERM, Lightning finishes the current batch and raises `SIGTERMException`; this writes `last.ckpt`
    of that step (through the strategy's checkpoint IO, as every checkpoint), so a preempted run resumed
    with `--ckpt_path last` loses no step. Other exceptions write nothing: Ctrl-C (KeyboardInterrupt) can
    arrive in the middle of a step, and an error's state (a non-finite loss's) is not one to resume
    from, which is why this is not `ModelCheckpoint(save_on_exception=True)`: that saves on any exception."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.fast_dev_run:
            return  # a smoke run (`fast_dev_run`) leaves no checkpoint to resume from
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
                trainer.save_checkpoint(last_checkpoint_path(callback))


class PreemptionSignals(Callback):
    """Acts on a scheduler's signals between two batches, on every process at the same batch.

    Lightning's own handlers act inside the signal handler: on the requeue signal under Slurm (SIGUSR1,
    `sbatch --signal=SIGUSR1@90`) it writes `hpc_ckpt_<n>.ckpt` and runs `scontrol requeue` at once, which
    can be inside a step (after the step enqueued its keys, before its optimizer step: the requeued run
    would enqueue them twice); on SIGTERM it broadcasts from inside the handler, a collective that can pair
    with another collective of a process that is elsewhere, and the processes then wait on each other.
    Here a signal only marks the request; after each training step, and after each validation batch
    of a fit (a kNN monitor over a large bank can outlast Slurm's 90 s of notice), the processes agree in
    one all-reduce, then all of them act at the same batch: Lightning's own checkpoint-and-requeue for the
    requeue signal; for SIGTERM, Lightning's own stop at the end of a training step (it raises
    `SIGTERMException`), and the same exception at once during validation, which Lightning's loops do
    not check. `LastCheckpointOnSigterm` then writes `last.ckpt`. A run resumed from a checkpoint written
    during validation goes on with the next training step: Lightning skips the rest of that validation (its
    metrics are missing from the logs); the training is the uninterrupted run's, since validation draws no
    random number from the generator the training draws from (`datamodules.base`)."""

    def __init__(self):
        self.requested = {signal.SIGTERM: False, signal.SIGUSR1: False}
        self.requeue_signal: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning registered its handlers for this fit and restores the original ones at teardown
        signal.signal(signal.SIGTERM, self._request)
        environment = cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.requeue_signal = environment.requeue_signal
            signal.signal(self.requeue_signal, self._request)
        self.trainer = trainer

    def _request(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and not self.requested[signal.SIGTERM] and self.trainer.strategy.launcher is not None:
            self.trainer.strategy.launcher.kill(signum)  # processes Lightning started itself get it too
        self.requested[signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR1] = True

    def _agreed_stop(self, trainer, pl_module) -> bool:
        """Runs the requeue if any process received its signal; whether any process received SIGTERM."""
        stop, requeue = self.requested[signal.SIGTERM], self.requested[signal.SIGUSR1]
        if trainer.world_size > 1:  # one all-reduce (Lightning's DDP loop synchronises every step anyway)
            flags = torch.tensor([stop, requeue], dtype=torch.float32, device=pl_module.device)
            stop, requeue = (bool(flag) for flag in trainer.strategy.reduce(flags, reduce_op="max"))
        if requeue:
            self.requested[signal.SIGUSR1] = False
            checkpoint_and_requeue(trainer, self.requeue_signal)
        return stop

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._agreed_stop(trainer, pl_module):
            stop_at_the_end_of_this_step(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return  # a validate run has nothing to save; the sanity check comes before the handlers
        if self._agreed_stop(trainer, pl_module):
            stop_at_the_end_of_this_step(trainer)
            raise SIGTERMException()


class SameDirectoryCheckpointIO(TorchCheckpointIO):
    """Writes a local checkpoint to `<name>.partial` in the target's directory, then renames it over the
    target (`os.replace`, atomic within a filesystem). Lightning's own save goes through an fsspec
    transaction whose temporary file lies in the system temp dir; where /tmp is another filesystem than
    the run directory (node-local /tmp, shared run storage: the usual cluster), the final move is a copy,
    and a job killed during the copy leaves a truncated checkpoint. Remote paths keep Lightning's save."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomically(Path(path), lambda partial: torch.save(checkpoint, partial))


# ----------------------------------------------------------------- non-finite losses
class NonFiniteLossError(FloatingPointError):
    """Training produced a non-finite loss."""


class NonFiniteLossGuard(Callback):
    """Stops training at the first non-finite loss, before its backward pass and optimizer step, so the
    parameters, the optimizer and every checkpoint keep the last finite step; `NonFiniteLossError` names
    the global step, the loss and the training values logged with it. (`Trainer(detect_anomaly=True)`
    finds the operation but slows every step down; `EarlyStopping(check_finite=True)` sees one metric
    at the end of an epoch.) Under DDP the processes agree (one all-reduce per step) and stop together.

    With `skip_batch`, a non-finite batch is dropped instead: its gradients are discarded before the
    optimizer step, which then changes no parameter and no optimizer state. The step still counts
    (learning rate and momentum schedules advance, the momentum encoder moves towards the unchanged
    online one) and what the forward pass wrote stays written (queue keys, memory-bank entries,
    BatchNorm statistics): after `max_consecutive_skips` skipped batches in a row, the next non-finite
    one stops the run all the same, since a queue or bank holding non-finite entries does not heal.
    Skipping is for a single process only: under DDP the backward pass averages the gradients of all
    processes, so one process's non-finite loss spoils every process's gradient while their own losses
    look finite; Lightning's own skip, `training_step` returning None, is "not supported for multi-GPU"
    for the same reason (a process that skips its backward leaves the others waiting in the all-reduce).
    """

    def __init__(self, skip_batch: bool = False, max_consecutive_skips: int = 10):
        """
        Args:
            skip_batch: drop non-finite batches instead of stopping (single process only).
            max_consecutive_skips: with `skip_batch`, stop at a non-finite batch after this many skipped in a row.
        """
        if max_consecutive_skips < 1:
            raise ValueError(f"non_finite.max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.skip_batch, self.max_consecutive_skips = skip_batch, max_consecutive_skips
        self.consecutive_skips = 0
        self.drop_gradients = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.skip_batch and trainer.world_size > 1:
            raise ValueError(
                f"non_finite.skip_batch works in a single process only, this run has {trainer.world_size}: "
                "set it to false (the run then stops at a non-finite loss)"
            )

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        finite = bool(torch.isfinite(loss.detach()).all())
        if trainer.strategy.reduce_boolean_decision(finite, all=True):
            self.consecutive_skips = 0
            return
        terms = ", ".join(f"{name} {float(value):.4g}" for name, value in trainer.callback_metrics.items() if name.startswith("train/"))
        where = f"global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {trainer.fit_loop.epoch_loop.batch_idx})"
        message = f"non-finite training loss at {where}: loss {float(loss):.4g}; latest logged values: {terms}"
        self.consecutive_skips += 1
        if not self.skip_batch or self.consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteLossError(f"{message}. Stopped before this step's update; the checkpoints hold earlier steps only")
        rank_zero_warn(f"{message}; batch skipped ({self.consecutive_skips} in a row)")
        self.drop_gradients = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.drop_gradients:
            optimizer.zero_grad(set_to_none=True)  # an optimizer skips parameters without a gradient
            self.drop_gradients = False
