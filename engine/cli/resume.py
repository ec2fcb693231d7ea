"""Which run a `fit` continues, and the checks before it does: a new run never overwrites an earlier one in its
directory; `--ckpt_path last`, `hpc` or a Slurm requeue resume the run's newest readable checkpoint; a checkpoint
is restored only by a run of the class that wrote it, and by a model class whose own check accepts it (a linear
probe, for instance, checks that its pretraining checkpoint is still there: `MethodBase.check_resume`). Every
refusal is a `CheckpointMismatch` or one error line, before anything is written."""

import os
from pathlib import Path

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from engine.checkpoint_record import CheckpointMismatch
from engine.cli.errors import fail
from engine.files import UnreadableCheckpoint, last_checkpoint_path, read_checkpoint
from methods.checkpoints import class_at, method_class

LIGHTNING_CHECKPOINT_NAMES = ("last", "best", "hpc")  # ckpt_path values that Lightning resolves to a file


def check_resumable(checkpoint: dict, source: str, config) -> None:
    """A checkpoint that the configured run may restore: written by a compatible version, by the configured model
    class, and accepted by that class's own `check_resume`."""
    model = config["model"]
    model_class = class_at(model["class_path"])
    recorded = method_class(checkpoint, source)
    if recorded is not None and recorded[1] is not model_class:
        raise CheckpointMismatch(
            f"{source} is a {recorded[0]} checkpoint, but this run's model is {model['class_path']}: --ckpt_path "
            f"resumes or evaluates a run of the same model{model_class.wrong_checkpoint_hint}"
        )
    model_class.check_resume(checkpoint.get("hyper_parameters", {}), model["init_args"], source)


def run_checkpoints(trainer) -> list[Path]:
    """Every checkpoint of a run: `hpc_ckpt_*.ckpt` in the run directory and the checkpoint callbacks' files."""
    folders = [Path(callback.dirpath) for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    return [*Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"), *(path for folder in folders for path in folder.glob("*.ckpt"))]


def checkpoint_to_resume(trainer, ckpt_path: str | None) -> Path | None:
    """The file `fit` will restore, as Lightning resolves it: for `last` the newest `last.ckpt` of the checkpoint
    callbacks, for a Slurm job without a ckpt_path (or `hpc`) the highest `hpc_ckpt_<n>.ckpt`; None for a new run
    and for a path given as such (checked when the arguments are parsed)."""
    if ckpt_path == "last":
        found = [last_checkpoint_path(callback) for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
        return max((path for path in found if path.is_file()), key=lambda path: path.stat().st_mtime, default=None)
    if ckpt_path == "hpc" or (ckpt_path is None and SLURMEnvironment.detect()):
        numbered = {int(path.stem.removeprefix("hpc_ckpt_")): path for path in run_checkpoints(trainer) if path.stem.removeprefix("hpc_ckpt_").isdigit()}
        return numbered[max(numbered)] if numbered else None
    return None


def readable_checkpoint_to_resume(trainer, run: dict) -> tuple[Path, dict] | None:
    """The checkpoint the run (its `ckpt_path`) restores, read; None for a new run. One that cannot be read (a copy
    cut short, a full disk) is passed over, with a warning, for the newest readable checkpoint of the run (by
    modification time: an epoch-end `epoch=*-step=*.ckpt`, an hpc checkpoint), which becomes the run's `ckpt_path`;
    with none, one error line."""
    path = checkpoint_to_resume(trainer, run.get("ckpt_path"))
    if path is None:
        return None
    try:
        return path, read_checkpoint(path, str(path))
    except UnreadableCheckpoint as unreadable:
        for candidate in sorted(set(run_checkpoints(trainer)) - {path}, key=lambda other: other.stat().st_mtime, reverse=True):
            try:
                checkpoint = read_checkpoint(candidate, str(candidate))
            except UnreadableCheckpoint:
                continue
            rank_zero_warn(f"{unreadable}: resuming from {candidate} instead, the newest readable checkpoint of this run")
            run["ckpt_path"] = str(candidate)
            return candidate, checkpoint
        fail(f"{unreadable}; this run holds no other readable checkpoint: start a new run under another trainer.default_root_dir")


def refuse_to_overwrite_a_run(trainer, ckpt_path: str | None) -> str | None:
    """A new `fit` must not overwrite the checkpoints of an earlier run in the same directory: one error line. Returns
    the ckpt_path to use: `last` for a Slurm job requeued before it wrote an hpc checkpoint, else the given one."""
    if ckpt_path is not None:
        return ckpt_path
    root = Path(trainer.default_root_dir)
    if SLURMEnvironment.detect() and any(root.glob("hpc_ckpt_*.ckpt")):
        return ckpt_path  # a requeued Slurm job: Lightning resumes it from its hpc checkpoint
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and last_checkpoint_path(callback).is_file():
            if SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0:
                return "last"  # requeued after a preemption (SIGTERM) or a node failure, before any hpc checkpoint
            fail(
                f"{last_checkpoint_path(callback)} already holds a run: resume it with --ckpt_path last, or "
                "start a new one under another trainer.default_root_dir"
            )
    return ckpt_path
