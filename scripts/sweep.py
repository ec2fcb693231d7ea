"""Run a grid of settings x seeds and collect their final metrics into one table.

    uv run python scripts/sweep.py --config configs/sce_digits.yaml --out runs/sweeps/sce_tau \\
        --grid model.init_args.temperature=0.1,0.2 \\
        --grid model.init_args.temperature_momentum=0.03,0.05,0.07,0.1 \\
        --seeds 0 1 2 --linear configs/linear_digits.yaml -- --trainer.max_epochs=20

Every (grid point, seed) is one `main_pretrain.py fit` run in `OUT/<point>_seed<S>/` (its log in
`log.txt`), followed, with `--linear`, by `main_linear.py fit` on its `last.ckpt` in `.../linear/`.
Arguments after `--` are passed to every pretraining run; every grid point's stages are resolved by the CLI
(`--print_config`), and its pretraining built unless `--slurm`, before anything is written. A run whose results file already exists is
skipped and an interrupted one resumes from its `last.ckpt` (`--ckpt_path last`), so re-running the
command resumes an interrupted sweep; a failed run is reported and the others go on; a run that another process
trains (a second sweep of the same `--out`) is left to it. Each stage directory
records the arguments it ran with and its config's values (`sweep.json`): results made with other ones (an earlier
sweep's `--` arguments in the same `--out`, a config edited since) are stale, reported and left out of the table, never taken for this sweep's.
The table `OUT/results.md` gives, per grid point, mean ± std and the 95% confidence interval (Student t) over
seeds; `OUT/results.csv` has one row per run.

On a cluster, `--slurm` writes `OUT/sweep.sbatch`, the job of `scripts/slurm/template.sbatch` (the
one `scripts/slurm/submit.py` writes) as an array with one task per run: each task is this command with
`--only <index>` on `--nodes` x `--gpus-per-node` (default: the config's trainer.devices), and every run
gets the matching `--trainer.num_nodes` / `--trainer.devices`. Slurm logs go to `OUT/slurm-<index>.out`
/ `.err`; a task requeued on SIGUSR1 resumes its run from the newer of its hpc checkpoint and `last.ckpt`.
The tasks write no table (they end together); `--collect` then builds it from the finished runs.
"""

import argparse
import contextlib
import csv
import fcntl
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: make `scripts` importable
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.config import load_yaml, split_overrides  # noqa: E402
from engine.files import read_json_object, write_atomically  # noqa: E402
from scripts.slurm import job  # noqa: E402

DEFAULT_METRICS = ("val/knn_top1", "val/probe_top1", "linear:val/probe_top1")


@dataclass(frozen=True)
class Run:
    point: tuple[tuple[str, str], ...]  # ((config key, value), ...)
    seed: int
    directory: Path

    @property
    def point_name(self) -> str:
        return ",".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in self.point) or "base"


def point_label(point: tuple[tuple[str, str], ...]) -> str:
    """A folder name for a grid point, e.g. `temperature0.1_temperature_momentum0.05`."""
    label = "_".join(f"{key.rsplit('.', 1)[-1]}{value}" for key, value in point) or "base"
    return re.sub(r"[^\w.=-]", "-", label)


def point_overrides(point: tuple[tuple[str, str], ...]) -> list[str]:
    return [f"--{key}={value}" for key, value in point]


def parse_grid(entries: list[str]) -> list[tuple[str, list[str]]]:
    grid = []
    for entry in entries:
        key, separator, values = entry.partition("=")
        if not separator or not key or not values:
            raise ValueError(f"--grid {entry!r} must look like key=value1,value2")
        listed = values.split(",")
        if repeated := sorted({value for value in listed if listed.count(value) > 1}):
            raise ValueError(f"--grid {entry!r} repeats {', '.join(repeated)}: each run would count as two")
        if key in (given for given, _ in grid):  # the later value would win in every run, labelled with both
            raise ValueError(f"--grid {entry!r}: {key} has a --grid already; give all its values in one, as {key}=v1,v2")
        grid.append((key, listed))
    return grid


def grid_points(grid: list[tuple[str, list[str]]]) -> list[tuple[tuple[str, str], ...]]:
    """Every combination of the grid values, in a stable order (one empty point for no grid)."""
    return [tuple((key, value) for (key, _), value in zip(grid, values)) for values in itertools.product(*(values for _, values in grid))]


def expand(grid: list[tuple[str, list[str]]], seeds: list[int], out: Path) -> list[Run]:
    """Every grid point with every seed, in a stable order."""
    return [Run(point, seed, out / f"{point_label(point)}_seed{seed}") for point in grid_points(grid) for seed in seeds]


# What a sweep or a table sets for each run itself (its seed, directory, checkpoints, W&B group and name)
EACH_RUN_SETS = ("seed_everything", "trainer.default_root_dir", "model.pretrained_ckpt", "ckpt_path", "trainer.logger.init_args.group",
                 "trainer.logger.init_args.name")


def setting_key(argument: str) -> str:
    """The config key an argument sets, in one spelling: `--model.temperature=0.3` and `--model.init_args.temperature 0.3`
    both set model.temperature."""
    return argument.split("=", 1)[0].removeprefix("--").replace(".init_args.", ".")


def set_for_every_run(arguments: list[str], own: list[str]) -> tuple[str, str] | None:
    """(argument, key): the first of `arguments` given for every run (after `--`, or an override of every linear stage)
    that sets what each run sets itself: a key of EACH_RUN_SETS or a part of one, or a key of `own` (the grid's, a row's
    overrides), a part of one or a whole that holds one. It would follow the run's own value and win, training the same
    run under every label (`--trainer.logger=false` holds the W&B group and name, and drops them with the logger)."""
    placed, owned = [setting_key(key) for key in EACH_RUN_SETS], [setting_key(key) for key in own]
    for argument in (argument for argument in arguments if argument.startswith("--")):
        given = setting_key(argument)
        for key in placed + owned:
            if given == key or given.startswith(key + ".") or (key in owned and key.startswith(given + ".")):
                return argument, key
    return None


def refuse_what_each_run_sets(arguments: list[str], where: str, own: list[str], seeds: str, origin: str) -> None:
    """One error line for an argument of `set_for_every_run`: `seeds` and `origin` say where each run's own seed and
    other values come from."""
    if (found := set_for_every_run(arguments, own)) is not None:
        argument, key = found
        if key == "seed_everything":
            raise SystemExit(f"error: {argument} {where}: each run's seed {seeds}: one for all would train the same run under every seed")
        raise SystemExit(f"error: {argument} {where}: each run sets {key} itself ({origin}); one value for all would follow it and win, "
                         "the same run under every label")


def tracked_as(config: str, group: str, name: str) -> list[str]:
    """The W&B group and run name of a stage whose config logs to W&B (`engine.tracking.WandbRun`): a group per grid
    point or table row, whose seeds it holds. By the config's own, every point or row of a config would share its group
    (W&B would average them as one), and their names where they differ in keys the config's name_keys do not show."""
    logger = (load_yaml((ROOT / config).read_text()).get("trainer") or {}).get("logger")
    if not (isinstance(logger, dict) and logger.get("class_path") == "engine.tracking.WandbRun"):
        return []
    return [f"--trainer.logger.init_args.group={group}", f"--trainer.logger.init_args.name={name}"]


def pretrain_command(run: Run, config: str, extra: list[str], tracking: list[str] = ()) -> list[str]:
    return [sys.executable, str(ROOT / "main_pretrain.py"), "fit", "--config", config, f"--seed_everything={run.seed}",
            f"--trainer.default_root_dir={run.directory}", "--ckpt_path=last", *tracking, *point_overrides(run.point), *extra]


def linear_command(run: Run, config: str, extra: list[str], tracking: list[str] = ()) -> list[str]:
    return [sys.executable, str(ROOT / "main_linear.py"), "fit", "--config", config, f"--seed_everything={run.seed}",
            f"--model.pretrained_ckpt={run.directory / 'checkpoints' / 'last.ckpt'}",
            f"--trainer.default_root_dir={run.directory / 'linear'}", "--ckpt_path=last", *tracking, *extra]


def execute(command: list[str], log: Path) -> bool:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as stream:
        stream.write("$ " + shlex.join(command) + "\n")
        stream.flush()
        return subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT).returncode == 0


RECORD = "sweep.json"  # in each stage directory: the arguments its results are of
# where a run is, on what it runs and how W&B shows it: paths that move with --out, the processes a Slurm job adds
# (--slurm), and the W&B group and name (`tracked_as`)
RUN_PLACEMENT = ("--trainer.default_root_dir=", "--model.pretrained_ckpt=", "--ckpt_path=", "--trainer.num_nodes=", "--trainer.devices=",
                 "--trainer.logger.init_args.group=", "--trainer.logger.init_args.name=")


def stage_arguments(command: list[str]) -> list[str]:
    """What a stage's results are of: its entry point, subcommand, config (relative to the project when inside it)
    and arguments, without where the run is and on how many processes ([python, script, subcommand, --config,
    CONFIG, arguments...])."""
    config = (ROOT / command[4]).resolve()  # as the stage reads it: it runs in the project (a relative path is the project's)
    config_name = str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config)
    return [Path(command[1]).name, command[2], command[3], config_name, *(argument for argument in command[5:] if not argument.startswith(RUN_PLACEMENT))]


def config_values(config: str) -> str:
    """SHA-256 of a config file's values (not its comments or layout), recorded beside each stage's arguments: the
    arguments name the config's path only, and results made before its values were edited are not of this config."""
    return hashlib.sha256(json.dumps(load_yaml((ROOT / config).read_text()), sort_keys=True, default=str).encode()).hexdigest()


def stage_record(command: list[str]) -> dict:
    """What a stage records of how its results are made (`made_differently` compares it with a later command)."""
    return {"arguments": stage_arguments(command), "config_values": config_values(command[4])}


def made_differently(record: dict | None, command: list[str]) -> str | None:
    """How results recorded with `record` were made otherwise than `command` would make them ("with A and without
    B", "with other values in CONFIG"), or None (also for a record older than what it lacks)."""
    if record is None:
        return None
    if (how := other_arguments(record.get("arguments"), stage_arguments(command))) is not None:
        return how
    if record.get("config_values") not in (None, config_values(command[4])):
        return f"with other values in {command[4]} (edited since)"
    return None


def read_json(path: Path, what: str) -> dict:
    """A JSON object the runs wrote (`engine.files.read_json_object`); the error says how to get a good one."""
    try:
        return read_json_object(path, what)
    except ValueError as error:
        raise ValueError(f"{error}; remove it to run its stage again") from None


def read_metric_value(path: Path, key: str) -> float | None:
    """The metric `key` of a results file (None when the file or the key is absent)."""
    if not path.is_file():
        return None
    metrics = read_json(path, "results file").get("metrics")
    value = metrics.get(key) if isinstance(metrics, dict) else None
    if value is not None and not isinstance(value, (int, float)):
        raise ValueError(f"{path}: metric {key} is {value!r}, not a number; remove the file to run its stage again")
    return value


def read_best_value(path: Path, key: str) -> float | None:
    """The value of `key` at the best validation of a fit's results file (`best`, engine.cli.results: a top-1's own
    best, or the number recorded with it, as a shot group with the best overall top-1); None when it has none."""
    if not path.is_file():
        return None
    best = read_json(path, "results file").get("best")
    found = [entry["metrics"][key] for entry in (best.values() if isinstance(best, dict) else ())
             if isinstance(entry, dict) and isinstance(entry.get("metrics"), dict) and key in entry["metrics"]]
    return float(found[0]) if found and isinstance(found[0], (int, float)) else None


def other_arguments(made_with: list[str] | None, planned: list[str]) -> str | None:
    """How the arguments results were made with differ from the planned ones ("with A and without B"), or None
    when they do not (or were not recorded)."""
    if made_with is None or made_with == planned:
        return None
    extra, missing = [a for a in made_with if a not in planned], [a for a in planned if a not in made_with]
    how = " and ".join([*(["with " + " ".join(extra)] if extra else []), *(["without " + " ".join(missing)] if missing else [])])
    return how or "with these arguments in another order"


def resolution_problem(entry: str, arguments: list[str], build: bool = False) -> str | None:
    """None if the CLI of `entry` (main_pretrain.py or main_linear.py) resolves `arguments` ([subcommand, ...]) with
    --print_config in this process, where the stages run, and, with `build`, builds a pretraining's model, DataModule
    and trainer from them, as its run would before writing anything: what --print_config leaves unchecked (a view's
    keys, a value out of range, a missing data folder); else the CLI's error line."""
    import main_linear  # the CLI: imported only when stages are about to run
    import main_pretrain

    checks = [lambda: (main_linear if entry == "main_linear.py" else main_pretrain).cli_main([*arguments, "--print_config"])]
    if build and entry == "main_pretrain.py":  # a probe's model reads a checkpoint its pretraining is still to write
        checks.append(lambda: main_pretrain.ContrastlabCLI(main_pretrain.MethodBase, args=[*arguments[1:], "--trainer.logger=false"], run=False))
    for check in checks:
        errors = io.StringIO()
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            logging.disable(logging.INFO)  # Lightning's notes of a build ("Seed set to 0"), whose handlers hold the real streams
            try:
                check()
            except SystemExit as exit:  # --print_config exits with 0 once it printed
                if exit.code not in (0, None):
                    reasons = [line.removeprefix("error: ") for line in errors.getvalue().splitlines() if line.startswith("error: ")]
                    return reasons[-1] if reasons else f"exit {exit.code}"
            finally:
                logging.disable(logging.NOTSET)
    return None


def unresolved(runs: list[Run], args, build: bool = False) -> str | None:
    """The first grid point whose stages the CLI does not resolve (a misspelt key, a value of the wrong type) or, with
    `build`, whose pretraining it does not build (`resolution_problem`), with the CLI's error, before any run writes
    anything. A point's seeds differ only in --seed_everything: its first stands."""
    for run in (run for run in runs if run.seed == runs[0].seed):
        # a point whose every pretraining finished trains nothing more: it is not built again
        trains = build and not all((other.directory / "results_val.json").is_file() for other in runs if other.point == run.point)
        for _, command in stages(run, args):  # [python, script, subcommand, --config, CONFIG, arguments...]
            entry = Path(command[1]).name
            if (problem := resolution_problem(entry, [argument for argument in command[2:] if not argument.startswith("--ckpt_path=")], trains)) is not None:
                return f"{run.point_name}, {entry}: {problem}"
    return None


def stages(run: Run, args) -> list[tuple[Path, list[str]]]:
    """The (directory, command) of each stage of a sweep entry: the pretraining, then the linear stage."""
    group = f"{args.out.name}.{point_label(run.point)}"  # the sweep's folder and the point's
    commands = [(run.directory, pretrain_command(run, args.config, args.extra, tracked_as(args.config, group, f"{group}-s{run.seed}")))]
    if args.linear:
        tracking = tracked_as(args.linear, f"{group}.linear", f"{group}.linear-s{run.seed}")
        commands.append((run.directory / "linear", linear_command(run, args.linear, args.linear_override, tracking)))
    return commands


def stale(run: Run, args) -> str | None:
    """Why the results of a sweep entry are not of this sweep's arguments (an earlier sweep's, in the same --out)."""
    for directory, command in stages(run, args):
        record = directory / RECORD
        if not (directory / "results_val.json").is_file():
            continue  # no results to mistake (a failed run's record is rewritten when it runs again)
        if (how := made_differently(read_json(record, "record of the stage") if record.is_file() else None, command)) is not None:
            return f"{directory.relative_to(run.directory.parent)}'s results were made {how}: remove {run.directory} to run it with these arguments, or give another --out"
    return None


RUN_LOCK = "run.lock"  # engine.cli.run_lock.LOCK_FILE, which a training run holds while it lives (not imported: it loads Lightning)


def held_elsewhere(directory: Path) -> str | None:
    """Who holds a run directory's lock, while another living process (a sweep run at the same time) trains there."""
    path = directory / RUN_LOCK
    if not path.is_file():
        return None
    with path.open() as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return lock.read().strip() or "a process that has not yet said which"
        except OSError:  # a filesystem without locks (engine.cli.run_lock warns of it when the run starts)
            return None
        fcntl.flock(lock, fcntl.LOCK_UN)
    return None


def perform(run: Run, args) -> bool:
    """Run the stages of one sweep entry that have no results yet; False when one fails or has stale results. A
    stage that another process trains (another sweep of the same --out) is left to it: nothing is written. In a
    Slurm array task srun starts this once per rank, each starting its rank's training process: a rank above 0 goes
    on where the lock's holder is its own job's rank 0 (`engine.cli.run_lock` names the job), writes no record, and
    logs apart."""
    rank = int(os.environ.get("SLURM_PROCID", 0)) if args.only is not None else 0
    if (why := stale(run, args)) is not None:
        print(f"[{run.point_name} seed {run.seed}] stale: {why}", flush=True)
        return False
    log = run.directory / ("log.txt" if rank == 0 else f"log.rank{rank}.txt")
    for directory, command in stages(run, args):
        if (directory / "results_val.json").is_file():
            continue
        own_job = f"(slurm job {os.environ.get('SLURM_JOB_ID')})"
        if (holder := held_elsewhere(directory)) is not None and not (rank > 0 and own_job in holder):
            print(f"[{run.point_name} seed {run.seed}] running in another process ({holder}): left to it", flush=True)
            return True
        print(f"[{run.point_name} seed {run.seed}] {shlex.join(command[1:])}", flush=True)
        if rank == 0:
            write_atomically(directory / RECORD, lambda partial: partial.write_text(json.dumps(stage_record(command))))
        if not execute(command, log):
            print(f"  failed: see {log}", flush=True)
            return False
    return True


def read_finished_metric(run: Run, metric: str) -> float | None:
    stage, _, key = metric.rpartition(":")
    return read_metric_value(run.directory / stage / "results_val.json" if stage else run.directory / "results_val.json", key)


def unreported_metric(runs: list[Run], metrics: list[str]) -> str | None:
    """The first asked metric that the finished results of its stage all lack (a misspelt key would fill its column
    with "missing"), with the keys they have; None while no result of its stage exists to tell."""
    for metric in metrics:
        stage, _, key = metric.rpartition(":")
        files = [path for run in runs if (path := run.directory / stage / "results_val.json").is_file()]
        if files and all(read_metric_value(path, key) is None for path in files):
            reported = sorted(read_json(files[0], "results file").get("metrics") or {})
            return f"{metric}: no finished run reports {key} ({files[0]} has {', '.join(reported) or 'no metric'})"
    return None


def summarise(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation and the half-width of the 95% Student-t confidence interval."""
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": math.nan, "ci95": math.nan}
    std = math.sqrt(sum((value - mean) ** 2 for value in values) / (n - 1))
    return {"n": n, "mean": mean, "std": std, "ci95": stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)}


def format_summary(summary: dict[str, float], metric: str, planned: int) -> str:
    """Mean ± std (± 95% CI half-width) in % for accuracies; `(n=k)` when only k of the `planned` seeds finished."""
    scale = 100.0 if "top" in metric else 1.0  # accuracies in %
    text = f"{scale * summary['mean']:.2f}"
    if summary["n"] > 1:
        text += f" ± {scale * summary['std']:.2f} (±{scale * summary['ci95']:.2f})"
    return text + (f" (n={summary['n']})" if summary["n"] < planned else "")


def collect(runs: list[Run], metrics: list[str], out: Path, stale_runs: frozenset[Path] = frozenset()) -> str:
    """Write results.csv (one row per run) and results.md (per grid point: mean ± std (95% CI
    half-width) over the seeds that finished), each atomically; return the markdown table. The runs whose
    directories are in `stale_runs` (results of other arguments, `stale`) count as not finished."""
    def read_metric(run: Run, metric: str) -> float | None:
        return None if run.directory in stale_runs else read_finished_metric(run, metric)

    def write_csv(partial: Path) -> None:
        with partial.open("w", newline="") as stream:
            writer = csv.writer(stream)
            writer.writerow(["point", "seed", *metrics])
            for run in runs:
                writer.writerow([run.point_name, run.seed, *(read_metric(run, metric) for metric in metrics)])

    write_atomically(out / "results.csv", write_csv)
    points = list(dict.fromkeys(run.point for run in runs))
    header = ["setting", "seeds", *metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for point in points:
        members = [run for run in runs if run.point == point]
        cells = []
        for metric in metrics:
            values = [value for value in (read_metric(run, metric) for run in members) if value is not None]
            cells.append(format_summary(summarise(values), metric, len(members)) if values else "missing")
        lines.append("| " + " | ".join([members[0].point_name, str(len(members)), *cells]) + " |")
    table = "\n".join(lines) + "\n\nAccuracies in %; mean ± std over seeds, (± half-width of the 95% CI); (n=k): only k of the seeds finished.\n"
    write_atomically(out / "results.md", lambda partial: partial.write_text(table))
    return table


def sweep_argv(args) -> list[str]:
    """The arguments that define this sweep (what every Slurm array task repeats)."""
    argv = ["--config", args.config, "--out", str(args.out), "--seeds", *map(str, args.seeds)]
    for grid in args.grid:
        argv += ["--grid", grid]
    if args.linear:
        # `--linear-override=VALUE` in one token: the value starts with `--`
        argv += ["--linear", args.linear, *(f"--linear-override={override}" for override in args.linear_override)]
    if args.metrics:
        argv += ["--metrics", *args.metrics]
    return argv + (["--", *args.extra] if args.extra else [])


def write_slurm_array(runs: list[Run], args) -> Path:
    """OUT/sweep.sbatch: the Slurm job template as an array of one task per run, every run (pretraining
    and linear stage) set to the job's nodes x GPUs."""
    resources = job.Resources.from_args(args, job.read_config(args.config), args.extra)
    # the job runs in the project root
    paths = {key: job.from_root(Path(path)) for key in ("config", "out", "linear") if (path := getattr(args, key))}
    extra, linear_override = resources.trainer_arguments(args.extra), resources.trainer_arguments(args.linear_override)
    argv = sweep_argv(argparse.Namespace(**{**vars(args), **paths, "extra": extra, "linear_override": linear_override}))
    command = f"python scripts/sweep.py --only $SLURM_ARRAY_TASK_ID {shlex.join(argv)}"  # the task index is left to bash
    log_stem = job.log_path(job.from_root(args.out)) + "/slurm-%a"  # per array task, without the job id: appended to across requeues
    text = resources.render(args.out.name, log_stem, command, extra_options=(f"--array=0-{len(runs) - 1}",))
    args.out.mkdir(parents=True, exist_ok=True)
    script = args.out / "sweep.sbatch"
    script.write_text(text)
    return script


def parse_args(argv: list[str]):
    own, extra = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the pretraining config")
    parser.add_argument("--out", required=True, type=Path, help="folder of the sweep")
    parser.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (repeat for a product grid)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--linear", help="a linear-stage config run on each pretraining checkpoint")
    parser.add_argument("--linear-override", action="append", default=[], help="an argument for every linear run")
    parser.add_argument("--metrics", nargs="+", default=[], help="more keys of results_val.json ('linear:KEY' for the second stage)")
    parser.add_argument("--only", type=int, help="run only the run with this index (a Slurm array task)")
    parser.add_argument("--collect", action="store_true", help="only rebuild the table from finished runs")
    parser.add_argument("--slurm", action="store_true", help="write OUT/sweep.sbatch (a job array) instead of running")
    job.add_resource_arguments(parser)
    args = parser.parse_args(own)
    args.extra = extra
    # the runs start in the project: a path given from another working directory is the file meant there
    args.config, args.linear = (job.from_root(Path(path)) if path is not None else None for path in (args.config, args.linear))
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    for path, flag in ((args.config, "--config"), (args.linear, "--linear")):
        if path is not None and not (ROOT / path).is_file():
            raise SystemExit(f"error: {flag} {path!r} is not an existing file")
    try:
        grid = parse_grid(args.grid)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    refuse_what_each_run_sets(args.extra, "after --", [key for key, _ in grid], "comes from --seeds", "--grid and --out give it per run")
    refuse_what_each_run_sets(args.linear_override, "in --linear-override", [], "comes from --seeds", "--out gives it per run")
    if repeated := sorted({seed for seed in args.seeds if args.seeds.count(seed) > 1 or seed < 0}):
        raise SystemExit(f"error: --seeds {' '.join(map(str, args.seeds))}: seed {repeated[0]} is repeated or negative (each seed is one run)")
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"error: --out {args.out} is a file, not a folder")
    runs = expand(grid, args.seeds, args.out.resolve())
    if args.only is not None and not 0 <= args.only < len(runs):
        raise SystemExit(f"error: --only {args.only} is outside the {len(runs)} runs of this sweep (0..{len(runs) - 1})")
    # an array task resolves its own run only: the submitting command resolved every point (--slurm). Runs here are
    # built first too; a job's data may be on its nodes only, where its run checks it
    local = not args.slurm and args.only is None
    if not args.collect and (problem := unresolved([runs[args.only]] if args.only is not None else runs, args, build=local)) is not None:
        raise SystemExit(f"error: {problem}")
    if args.slurm:
        try:
            script = write_slurm_array(runs, args)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
        print(f"sbatch {script}   # then: python scripts/sweep.py --collect {shlex.join(sweep_argv(args))}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only is not None:
        # An array task: Slurm signals every process of the step (SIGUSR1 before the time limit, SIGTERM
        # when it ends the job). The training run handles them (hpc checkpoint and requeue; last.ckpt);
        # this wrapper waits for it instead of dying first, which would end the step and kill the run in
        # the middle of its checkpoint. A handler, unlike SIG_IGN, is reset in the run, so Lightning installs its own.
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: None)
    selected = [runs[args.only]] if args.only is not None else runs
    try:
        if unreported := unreported_metric(runs, args.metrics):
            raise SystemExit(f"error: --metrics {unreported}")
        failed = [] if args.collect else [run for run in selected if not perform(run, args)]
        defaults = DEFAULT_METRICS[: 2 if not args.linear else 3]
        # A default metric that no run reports (e.g. no kNN monitor on a classifier) is left out of the table; before
        # any run finished, every default is a column of `missing` cells
        reported = [m for m in defaults if any(read_finished_metric(run, m) is not None for run in runs)]
        metrics = [*(reported if reported or args.metrics else defaults), *args.metrics]
        if args.only is not None and not args.collect:  # the array's tasks end together: one writer of the table, `--collect`
            print(f"{selected[0].point_name} seed {selected[0].seed}: {'failed' if failed else 'done'}; the table: "
                  f"python scripts/sweep.py --collect {shlex.join(sweep_argv(args))}")
        else:
            print(collect(runs, metrics, args.out, frozenset(run.directory for run in runs if stale(run, args) is not None)))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    for run in failed:
        print(f"{'stale' if stale(run, args) else 'failed'}: {run.point_name} seed {run.seed} (log: {run.directory / 'log.txt'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
