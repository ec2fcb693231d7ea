"""One Slurm job rendered from `scripts/slurm/template.sbatch`: its resources, the trainer settings that
must match them, and the hand-over to `sbatch`. Shared by `scripts/slurm/submit.py` (one job per run) and
`scripts/sweep.py --slurm` (a job array), so that both write the same #SBATCH lines."""

import argparse
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from string import Template

import yaml

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).with_name("template.sbatch")
# Lightning under Slurm refuses trainer.devices != --ntasks-per-node and trainer.num_nodes != --nodes,
# so the job sets both from its own resources and an override may not set them.
CLUSTER_KEYS = {"--trainer.num_nodes": "--nodes", "--trainer.devices": "--gpus-per-node"}
# the job's run directory is the job's own (its logs and its requeue live there): an override would move the run alone
PLACEMENT_KEYS = {"--trainer.default_root_dir": "--run-dir (submit.py) or --out (sweep.py)"}
# What the template's #SBATCH lines set (long and short forms): another value in --sbatch-option would override them
# (sbatch takes the later line) while the trainer keeps the first.
MANAGED_OPTIONS = ("--job-name", "--nodes", "--ntasks", "--ntasks-per-node", "--gpus", "--gpus-per-node", "--gpus-per-task", "--gres",
                   "--cpus-per-task", "--time", "--signal", "--requeue", "--no-requeue", "--open-mode", "--chdir", "--output", "--error",
                   "--array", "--partition")
MANAGED_SHORT = "JNnGctDoeap"  # their one-letter forms (-N4 or -N 4)
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|unlimited|infinite|-1", re.IGNORECASE)  # M, M:S, H:M:S, D-H, D-H:M, D-H:M:S


def add_resource_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Slurm resources")
    group.add_argument("--nodes", type=int, default=1, help="nodes per job (trainer.num_nodes)")
    group.add_argument("--gpus-per-node", type=int,
                       help="GPUs per node = srun tasks per node = trainer.devices (default: the config's trainer.devices, else 1)")
    group.add_argument("--cpus-per-task", type=int,
                       help="CPUs per GPU process (default: the config's data.init_args.num_workers + 1)")
    group.add_argument("--time", default="24:00:00", help="time limit of one job; a longer run is requeued and resumes")
    group.add_argument("--partition", help="the Slurm partition")
    group.add_argument("--sbatch-option", action="append", default=[],
                       help="another #SBATCH option, e.g. --sbatch-option=--account=lab (repeat for more)")


def read_config(path: str) -> dict:
    """The config a job reads: `path` relative to the project (its working directory), or absolute."""
    if not (ROOT / path).is_file():
        raise ValueError(f"--config {path!r} is not an existing file")
    try:
        config = yaml.safe_load((ROOT / path).read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"--config {path!r} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--config {path!r} is not a config (a YAML mapping of trainer, model, data, ...)")
    return config


def sbatch_value(text: str) -> str:
    """`text` as one argument of an #SBATCH line: sbatch splits those lines at whitespace and ends them at an
    unquoted `#`, groups a double-quoted span and reads a backslash as an escape (SchedMD/slurm
    src/sbatch/opt.c, _get_argument), so a value holding any of these is double-quoted, `\\` and `"` escaped."""
    if not re.search(r"[\s\"'\\#]", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def override_value(overrides: list[str], keys: tuple[str, ...], default):
    """The value the last of `overrides` gives one of `keys` (its spellings; `KEY=VALUE` or `KEY VALUE`), else `default`."""
    value = default
    for index, override in enumerate(overrides):
        name, separator, given = override.partition("=")
        if name in keys:
            value = given if separator else (overrides[index + 1] if index + 1 < len(overrides) else default)
    return value


def log_path(path: str) -> str:
    """A path in an #SBATCH --output / --error line, its `%` written `%%` (Slurm reads `%j`, `%a`, ... there)."""
    return path.replace("%", "%%")


def from_root(path: Path) -> str:
    """`path` as the job sees it: relative to the project root (its working directory) when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass(frozen=True)
class Resources:
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    time: str
    options: tuple[str, ...]  # further #SBATCH options

    @classmethod
    def from_args(cls, args: argparse.Namespace, config: dict, overrides: list[str] = ()) -> "Resources":
        """The command line's resources, the open ones read from the config (`args.config`) and its `overrides`."""
        devices = args.gpus_per_node if args.gpus_per_node is not None else (config.get("trainer") or {}).get("devices", 1)
        if isinstance(devices, bool) or not isinstance(devices, int):
            raise ValueError(f"{args.config}: trainer.devices {devices!r} is not a number of GPUs: give --gpus-per-node")
        workers = ((config.get("data") or {}).get("init_args") or {}).get("num_workers", 0)
        workers = override_value(overrides, ("--data.init_args.num_workers", "--data.num_workers"), workers)
        if args.cpus_per_task is None and not (isinstance(workers, int) or str(workers).isdigit()):
            raise ValueError(f"data.init_args.num_workers {workers!r} is not a number of workers: give --cpus-per-task")
        cpus = args.cpus_per_task if args.cpus_per_task is not None else int(workers) + 1  # the loader workers + the trainer
        for option, value in (("--nodes", args.nodes), ("--gpus-per-node", devices), ("--cpus-per-task", cpus)):
            if value < 1:
                raise ValueError(f"{option} must be at least 1, got {value}")
        if not SLURM_TIME.fullmatch(args.time):
            raise ValueError(f"--time {args.time!r} is not a Slurm time (minutes, HH:MM:SS or D-HH:MM:SS)")
        for option in args.sbatch_option:
            name = option.split("=")[0].split()[0] if option.strip() else ""
            if not name.startswith("-"):
                raise ValueError(f"--sbatch-option {option!r} is not an sbatch option (e.g. --sbatch-option=--account=lab)")
            if name in MANAGED_OPTIONS or (not name.startswith("--") and name[1:2] in MANAGED_SHORT):
                raise ValueError(f"--sbatch-option {option!r}: the job file sets {name[:2] if not name.startswith('--') else name} itself "
                                 "(from --nodes, --gpus-per-node, --cpus-per-task, --time, --partition or the run directory)")
        options = ([f"--partition={sbatch_value(args.partition)}"] if args.partition else []) + args.sbatch_option
        return cls(args.nodes, devices, cpus, args.time, tuple(options))

    def trainer_arguments(self, overrides: list[str]) -> list[str]:
        """The overrides, then the trainer settings that Lightning checks against the job's resources."""
        for override in overrides:
            key = override.partition("=")[0]
            if key in CLUSTER_KEYS:
                raise ValueError(f"override {override!r}: set it with {CLUSTER_KEYS[key]} (it must match the #SBATCH lines)")
            if key in PLACEMENT_KEYS:
                raise ValueError(f"override {override!r}: set it with {PLACEMENT_KEYS[key]} (the job's logs and requeue live there)")
        return [*overrides, f"--trainer.num_nodes={self.nodes}", f"--trainer.devices={self.gpus_per_node}"]

    def render(self, job_name: str, log_stem: str, command: str, extra_options: tuple[str, ...] = ()) -> str:
        """The template filled in; `command` (already shell-quoted) is run by `srun` on every task."""
        options = "".join(f"\n#SBATCH {option}" for option in (*extra_options, *self.options))
        return Template(TEMPLATE.read_text()).substitute(
            job_name=sbatch_value(job_name), nodes=self.nodes, gpus_per_node=self.gpus_per_node,
            cpus_per_task=self.cpus_per_task, time=self.time, workdir=sbatch_value(str(ROOT)),
            output=sbatch_value(f"{log_stem}.out"), error=sbatch_value(f"{log_stem}.err"), extra_options=options, command=command,
        )


def sbatch_executable() -> str:
    executable = shutil.which("sbatch")
    if executable is None:
        raise ValueError("sbatch is not on PATH: run this on a Slurm login node, or use --dry-run to only write the job files")
    return executable


def submit(executable: str, script: Path) -> str:
    """Submit `script`; its job id (`sbatch --parsable` prints `<id>[;<cluster>]`)."""
    result = subprocess.run([executable, "--parsable", str(script)], cwd=ROOT, capture_output=True, text=True)
    job_id = re.search(r"\d+", result.stdout)
    if result.returncode != 0 or job_id is None:
        raise ValueError(f"sbatch {script} failed: {(result.stderr or result.stdout).strip()}")
    return job_id.group()
