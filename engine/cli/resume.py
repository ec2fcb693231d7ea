"""Which run a `fit` continues, and the checks before it does: a new run never overwrites an earlier one in its
directory; `--ckpt_path last`, `hpc` or a Slurm requeue resume the run's newest readable checkpoint; a checkpoint
is restored only by a run of the class that wrote it, and by a model class whose own check accepts it (a linear
probe, for instance, checks that its pretraining checkpoint is still there: `MethodBase.check_resume`); a resumed
run trains with the settings it was started with (`changed_setting`). Every refusal is a `CheckpointMismatch` or
one error line, before anything is written."""

import dataclasses
import inspect
import os
from pathlib import Path

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from engine.checkpoint_record import RECORD_KEY, CheckpointMismatch
from engine.cli.errors import fail
from engine.cli.results import FIT_RESULTS
from engine.config import flattened
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


# The settings a run is trained with, which a resumed run must keep: the model (every hyper-parameter, the optimizer
# and its schedule), the data and its order (the dataset, batch size, views, sampler; the seed of the data order),
# and what fixes the schedules and the gradient: the epochs and the batches of each (and max_steps where no max_epochs
# is given: then it is the schedules' length, `engine.optim.schedule_length`), the accumulation and the precision. A
# resumed run that changed one would restore the optimizer and the schedules of the old value while the config and W&B
# record the new one (or restore a queue of another size). What a resumption may change: where and how much it runs
# (max_steps beside max_epochs, max_time, validation, logging, checkpoints) and how the data is loaded (workers).
RUN_CONTROL_DATA_KEYS = ("num_workers", "persistent_workers", "pin_memory", "root")
TRAINING_TRAINER_KEYS = (
    "max_epochs", "limit_train_batches", "accumulate_grad_batches", "precision", "gradient_clip_val", "gradient_clip_algorithm", "sync_batchnorm",
)  # fmt: skip


def training_settings(config: dict) -> dict[str, object]:
    """The settings of a resolved config (as `config.yaml` holds it) that a resumed run must keep."""
    data = dict(config.get("data") or {})
    data["init_args"] = {key: value for key, value in (data.get("init_args") or {}).items() if key not in RUN_CONTROL_DATA_KEYS}
    trainer = {key: (config.get("trainer") or {}).get(key) for key in TRAINING_TRAINER_KEYS}
    if trainer["max_epochs"] in (None, -1):
        trainer["max_steps"] = (config.get("trainer") or {}).get("max_steps")
    return flattened({"model": config.get("model"), "data": data, "seed_everything": config.get("seed_everything"), "trainer": trainer})


PRECISION = "trainer.precision"


def precision_hint(trained_with: str) -> str:
    """How to resume a run in the precision it was trained in: moved between CPUs with and without bf16 units, the
    same command meets the CPU precision rule (`engine.devices.choose_cpu_precision`), which the user did not write."""
    keep_bf16 = " --bf16_on_cpu always" if "bf16" in str(trained_with) else ""
    return (f"; --trainer.precision {trained_with}{keep_bf16} resumes it so: on a CPU without bf16 units the precision rule "
            "trains a bf16 precision as 32-true")


def changed_setting(checkpoint: dict, config: dict, world_size: int | None = None) -> str | None:
    """The first setting the configured run changes against the run that wrote the checkpoint, as
    "<key> <new> (the run was trained with <old>)"; None when none changed or the checkpoint records no config."""
    record = checkpoint.get(RECORD_KEY) or {}
    if not isinstance(record.get("config"), dict):
        return None
    before, now = training_settings(record["config"]), training_settings(config)
    for key in sorted(before.keys() & now.keys()):
        if before[key] != now[key] and not without_effect(key, before, now, record.get("world_size"), world_size):
            return f"{key} {now[key]!r} (the run was trained with {before[key]!r}{precision_hint(before[key]) if key == PRECISION else ''})"
    for key in sorted(before.keys() - now.keys()):  # left out now: a dict replaced by a shorter one or by null (whose values would revert silently)
        replaced = next((parent for parent in prefixes(key) if parent in now), None)  # by null: name the whole setting
        if replaced is not None:
            trained = {name.removeprefix(f"{replaced}."): value for name, value in before.items() if name.startswith(f"{replaced}.")}
            return f"{replaced} {now[replaced]!r} (the run was trained with {trained!r})"
        return f"{key} not given (the run was trained with {before[key]!r})"
    for key in sorted(now.keys() - before.keys()):  # a setting added since the checkpoint: the run trained with its default
        default = class_default(config, key)
        if default is not UNKNOWN and plain(default) != now[key]:
            return f"{key} {now[key]!r} (the run was trained before this setting existed, as with its default {plain(default)!r})"
    if world_size is not None and record.get("world_size") not in (None, world_size):
        return f"{world_size} processes (the run was trained with {record['world_size']}: another global batch)"
    return None


def prefixes(key: str) -> list[str]:
    """The keys that hold a flattened key, outermost first: "a.b.c" -> ["a", "a.b"]."""
    parts = key.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


UNKNOWN = object()


def class_default(config: dict, key: str) -> object:
    """The default of a flattened `model.init_args.*` or `data.init_args.*` setting: the parameter's default in the
    configured class's constructor (or a base's, reached through **kwargs), into the fields of a spec dataclass or the
    keys of a dict; UNKNOWN where there is none to read."""
    section, _, path = key.partition(".init_args.")
    class_path = (config.get(section) or {}).get("class_path") if section in ("model", "data") else None
    if not class_path or not path:
        return UNKNOWN
    name, *fields = path.split(".")
    constructors = (klass.__dict__["__init__"] for klass in class_at(class_path).__mro__ if "__init__" in klass.__dict__)
    parameters = next((parameters for init in constructors if name in (parameters := inspect.signature(init).parameters)), None)
    if parameters is None or parameters[name].default is inspect.Parameter.empty:
        return UNKNOWN
    value = parameters[name].default
    for field in fields:
        if dataclasses.is_dataclass(value) and hasattr(value, field):
            value = getattr(value, field)
        elif isinstance(value, dict) and field in value:
            value = value[field]
        else:
            return UNKNOWN
    return value


def plain(value: object) -> object:
    """A default as config.yaml holds it (tuples as lists; a dataclass as its fields)."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, (tuple, list)):
        return [plain(item) for item in value]
    return {key: plain(item) for key, item in value.items()} if isinstance(value, dict) else value


SHUFFLE_BN, SPLIT_BN = "model.init_args.momentum.shuffle_bn", "model.init_args.momentum.split_bn"


def without_effect(key: str, before: dict, now: dict, trained_on: int | None, world_size: int | None) -> bool:
    """A changed setting that changes no computation of this run: shuffle-BN in one process without split-BN
    encodes the keys unshuffled either way (`MomentumMixin.target_embed`), so a run trained with the one-device
    PaCo configs' former `shuffle_bn: true` resumes under their `false` (world_size None: not yet known, checked
    again once the processes are)."""
    one_process = trained_on in (None, 1) and world_size in (None, 1)
    return key == SHUFFLE_BN and one_process and before.get(SPLIT_BN, 1) == now.get(SPLIT_BN, 1) == 1


def check_unchanged(checkpoint: dict, source: str, config: dict, world_size: int | None = None) -> None:
    changed = changed_setting(checkpoint, config, world_size)
    if changed is not None:
        raise CheckpointMismatch(
            f"{source} resumes a run with {changed}: a resumed run keeps the settings it was trained with (its optimizer, "
            "schedules, queues and data order are restored); train with other settings as a new run under another "
            "trainer.default_root_dir"
        )


def run_checkpoints(trainer) -> list[Path]:
    """Every checkpoint of a run: `hpc_ckpt_*.ckpt` in the run directory and the checkpoint callbacks' files."""
    folders = [Path(callback.dirpath) for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    return [*Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"), *(path for folder in folders for path in folder.glob("*.ckpt"))]


def checkpoint_to_resume(trainer, ckpt_path: str | None) -> Path | None:
    """The file `fit` restores for `last`, `hpc` and a Slurm job without a ckpt_path: the newest, by modification
    time, of the checkpoint callbacks' `last.ckpt` and the run's `hpc_ckpt_<n>.ckpt` (Lightning would take `last.ckpt`
    for `last`, the highest hpc number otherwise, passing over a SIGUSR1 checkpoint written after `last.ckpt`, or a
    `last.ckpt` written after the hpc one: an epoch's end, a SIGTERM). None for a new run and for a path given as
    such (checked when the arguments are parsed)."""
    if ckpt_path not in ("last", "hpc") and not (ckpt_path is None and SLURMEnvironment.detect()):
        return None
    lasts = [last_checkpoint_path(callback) for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    found = [path for path in (*lasts, *Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt")) if path.is_file()]
    if not found and ckpt_path == "last":  # a run whose last.ckpt is gone (removed; or an old run with checkpoint.save_last false): its newest checkpoint
        found = [path for path in run_checkpoints(trainer) if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def readable_checkpoint_to_resume(trainer, run: dict) -> tuple[Path, dict] | None:
    """The checkpoint the run (its `ckpt_path`) restores or evaluates, read; None for a new run. One that cannot be read (a copy
    cut short, a full disk) is passed over, with a warning, for the newest readable checkpoint of the run (by
    modification time: an epoch-end `epoch=*-step=*.ckpt`, an hpc checkpoint), which becomes the run's `ckpt_path`;
    with none, one error line."""
    path = checkpoint_to_resume(trainer, run.get("ckpt_path"))
    if path is None:
        return None
    try:
        checkpoint = read_checkpoint(path, str(path))
        run["ckpt_path"] = str(path)  # the file chosen here, not the one Lightning would resolve the name to
        return path, checkpoint
    except UnreadableCheckpoint as unreadable:
        for candidate in sorted(set(run_checkpoints(trainer)) - {path}, key=lambda other: other.stat().st_mtime, reverse=True):
            try:
                checkpoint = read_checkpoint(candidate, str(candidate))
            except UnreadableCheckpoint:
                continue
            rank_zero_warn(f"{unreadable}: taking {candidate} instead, the newest readable checkpoint of this run")
            run["ckpt_path"] = str(candidate)
            return candidate, checkpoint
        fail(f"{unreadable}; this run holds no other readable checkpoint: start a new run under another trainer.default_root_dir")


def choose_checkpoint_to_evaluate(trainer, run: dict, subcommand: str, config) -> None:
    """A `validate` or `test` with `last` or `hpc` evaluates the run directory's newest readable checkpoint, which
    becomes the run's `ckpt_path`; a directory without one is one error line (Lightning would warn and evaluate the
    untrained model)."""
    checkpoints_in_the_run_directory(trainer)
    if run.get("ckpt_path") not in ("last", "hpc"):
        return
    found = readable_checkpoint_to_resume(trainer, run)
    if found is None:
        fail(f"ckpt_path {run['ckpt_path']!r}, but trainer.default_root_dir {trainer.default_root_dir} holds no checkpoint to {subcommand}: "
             "give the run's directory or a checkpoint file")
    check_resumable(found[1], f"checkpoint {found[0]}", config)


def checkpoints_in_the_run_directory(trainer) -> None:
    """One known place for a run's checkpoints, `<default_root_dir>/checkpoints`, where `last` is found whatever the
    logger: Lightning would put them under the logger's version folder (W&B's: <project>/<run id>/checkpoints) and
    look for `last` there."""
    for callback in trainer.checkpoint_callbacks:
        if callback.dirpath is None:
            callback.dirpath = str(Path(trainer.default_root_dir) / "checkpoints")


def refuse_to_overwrite_a_run(trainer, ckpt_path: str | None) -> str | None:
    """A `fit` must not overwrite the checkpoints of an earlier run in the same directory (any of its checkpoints:
    `last.ckpt`, the epochs' files of a run without one, `hpc_ckpt_*.ckpt`): one error line, unless it resumes that
    run (`last`, `hpc`, one of the run's own files, a requeued Slurm job). A checkpoint of another run continues into
    an empty directory only. Returns the ckpt_path to use: `last` for a Slurm job requeued before it wrote an hpc
    checkpoint, else the given one."""
    existing = [path for path in run_checkpoints(trainer) if path.is_file()]
    results = Path(trainer.default_root_dir) / FIT_RESULTS
    if not existing and results.is_file():  # checkpoints removed, or kept elsewhere (checkpoint.dirpath)
        fail(f"{results} holds the results of a finished run whose checkpoints are not in {Path(trainer.default_root_dir) / 'checkpoints'}: "
             "a new run there would overwrite them; give another trainer.default_root_dir, or remove that file to reuse the directory")
    if not existing or ckpt_path in LIGHTNING_CHECKPOINT_NAMES:
        return ckpt_path
    if SLURMEnvironment.detect() and int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0:
        # requeued after a preemption or a node failure: it resumes its own run (its newest hpc checkpoint through
        # `checkpoint_to_resume`, or last.ckpt before it wrote one), whatever ckpt_path its job script repeats
        return None if any(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt")) else "last"
    # a run without last.ckpt is shown by its newest checkpoint, which `last` resumes (`checkpoint_to_resume`)
    shown = next((path for path in existing if path.name == "last.ckpt"), None) or max(existing, key=lambda path: path.stat().st_mtime)
    if ckpt_path is not None:
        if Path(ckpt_path).resolve() in {path.resolve() for path in existing}:
            return ckpt_path
        fail(
            f"{shown} already holds a run, and ckpt_path {ckpt_path} is not one of its checkpoints: the run would go on "
            "over that run's files; give another trainer.default_root_dir (or --ckpt_path last to resume the run there)"
        )
    fail(f"{shown} already holds a run: resume it with --ckpt_path last, or start a new one under another trainer.default_root_dir")


def continues_this_run(trainer, ckpt_path: str | None, resumed: bool) -> bool:
    """Whether a fit continues the run of its own directory, whose W&B run then goes on: `last`, `hpc`, a requeue
    (`resumed`) or a checkpoint file of that directory. A checkpoint of another run starts a run of its own."""
    return resumed or (ckpt_path is not None and Path(ckpt_path).resolve().is_relative_to(Path(trainer.default_root_dir).resolve()))
