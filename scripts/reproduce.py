"""Reproduce a paper's table in one command: run its rows, then set the measured numbers beside the paper's.

    uv run python scripts/reproduce.py tables/sce_table2.yaml [--rows ID ...] [--seeds N] [--launcher local|slurm] \\
        [--out DIR] [--dry-run] [--collect] [--evaluation-override=ARG ...] [Slurm resources] [-- OVERRIDES]

TABLE is a table file (`scripts/tables.py`: its rows, their configs and evaluations, the paper's numbers and their
sources). Each selected row (`--rows`, default all) runs with seeds 0 .. n-1 (`--seeds N`, default the row's),
each seed in its run directory OUT/<row id>/seed<S>/ (`--out`, default runs/tables/<table file name>): the
pretraining there (`scripts/sweep.py`'s command: `main_pretrain.py fit ... --ckpt_path last`), then each
evaluation that needs a run of its own: the linear stage in .../linear/ (`scripts/sweep.py`'s command), a
long-tail test on the run's last.ckpt in .../test/. Arguments after `--` go to every pretraining run (and its
test), `--evaluation-override=ARG` (repeatable) to every linear stage and test.

A stage whose results file exists is done and skipped; any other is started again with `--ckpt_path last`, which
resumes an interrupted run from its last.ckpt (and starts one that has none). Each stage directory keeps
`log.txt` (the command and its output), `reproduce.json` (launcher, command, pid or Slurm job id, exit code, log)
and `reproduce.lock`, which the launcher and the training process hold locked (flock) while either lives. The
status of a stage is the first that applies: done (results file; stale when its record says they are of other
arguments: other overrides or `--` arguments, another config, other values in the config file; it is then neither
run nor counted); running (the lock is held; on Slurm: squeue lists the job as running; queued while it waits;
submitted when squeue is not there to ask); failed (it ended with an error, or the Slurm job left the queue without results: exit code and log);
interrupted (ended by SIGTERM, with the exit status 143 of the saved last.ckpt, by Ctrl-C or another signal, or its
launcher vanished; also a checkpoint without a record); not started.

`--launcher local` (default) runs the stages here one after another: a failed stage is reported and the others
go on; an interrupted one stops the command (rerun it to resume). `--launcher slurm` submits each stage not done,
queued or running through scripts/slurm/submit.py (its resource options: --nodes, --gpus-per-node, --time, ...),
each evaluation job `afterok` on its run's pretraining job, and prints the job ids and the `--collect` command.
Before anything runs, every row's stages are resolved as the CLI would (`--print_config`), and a local launch builds
each pretraining's model and DataModule too: a misspelt override, a value out of range or a missing data folder ends
the command with one error line naming the row. `--dry-run` prints every command and runs nothing (with
Slurm it writes the job files, the evaluation's dependency on a placeholder id). `--collect` only assembles the
table.

The table, printed and written as OUT/table.md and OUT/table.csv: per row and metric the paper's number, the
measured mean ± sample standard deviation over the row's seeds (n), the mean at each run's best validation (official
codes that print the best epoch's number report that), the difference (of the measured), the status and the runs
(W&B URLs of online runs, else the row's directory). A row shows a number only once every seed is done. When W&B
is in use (WANDB_MODE is not `disabled` and a run logged to W&B) the table is also logged as a `wandb.Table` in a
summary run in OUT/wandb (the runs' W&B project, group = the table file's name).
"""

import argparse
import csv
import fcntl
import io
import json
import math
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: make `scripts` importable
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.config import split_overrides  # noqa: E402
from engine.files import write_atomically  # noqa: E402
from engine.tracking import stored_run_id, wandb_mode  # noqa: E402
from scripts import sweep  # noqa: E402
from scripts.slurm import job, submit  # noqa: E402
from scripts.tables import MAX_SEEDS, Metric, Row, Table, load_table  # noqa: E402

STATE, LOCK, LOG = "reproduce.json", "reproduce.lock", "log.txt"
INTERRUPTED_EXITS = (143, 130)  # the CLI's exit after saving last.ckpt on SIGTERM; a shell's for Ctrl-C
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESIZING", "SUSPENDED")
IN_PROGRESS = ("running", "queued", "submitted")
DEPENDENCY_PLACEHOLDER = "<pretraining job id>"  # a dry run submits nothing, so has no job id to wait for
COLUMNS = ["row", "metric", "paper", "measured", "best", "difference", "status", "runs"]
CSV_COLUMNS = ["row_id", "label", "metric", "paper", "mean", "std", "n", "best", "difference", "status", "source", "runs"]


@dataclass(frozen=True)
class Stage:
    name: str  # pretrain, linear or test: scripts/slurm/submit.py's --stage
    directory: Path
    results: Path  # written at its end: the stage is done
    config: str
    command: list[str]


@dataclass(frozen=True)
class Run:
    row: Row
    seed: int
    directory: Path
    stages: tuple[Stage, ...]  # the pretraining, then the evaluations with a run of their own


@dataclass(frozen=True)
class Status:
    state: str  # done, stale, running, queued, submitted, failed, interrupted, not started
    detail: str = ""
    job_id: str | None = None  # the Slurm job of a stage in progress

    def __str__(self) -> str:
        return f"{self.state} ({self.detail})" if self.detail else self.state


# ----------------------------------------------------------------- the runs of a table
def longtail_test_command(run: sweep.Run, config: str, overrides: list[str], tracking: list[str] = ()) -> list[str]:
    """`main_pretrain.py test` of a pretraining run's last.ckpt, in its `test/` directory."""
    return [sys.executable, str(ROOT / "main_pretrain.py"), "test", "--config", config, f"--seed_everything={run.seed}", *tracking, *overrides,
            f"--ckpt_path={run.directory / 'checkpoints' / 'last.ckpt'}", f"--trainer.default_root_dir={run.directory / 'test'}"]


def plan(rows: list[Row], seeds: int | None, out: Path, extra: list[str], evaluation_extra: list[str]) -> list[Run]:
    """Every selected row with each of its seeds, in the table's order, with the commands of its stages."""
    runs = []
    for row in rows:
        for seed in range(seeds or row.seeds):
            run = sweep.Run(point=(), seed=seed, directory=out / row.id / f"seed{seed}")
            pretraining = [*row.overrides, *extra]
            group = f"{out.name}.{row.id}"  # W&B: a group per row (`sweep.tracked_as`), each stage's seeds in it
            stages = [Stage("pretrain", run.directory, run.directory / "results_val.json", row.config,
                            sweep.pretrain_command(run, row.config, pretraining, sweep.tracked_as(row.config, group, f"{group}-s{seed}")))]
            for evaluation in row.evaluations:
                overrides = [*evaluation.overrides, *evaluation_extra]
                stage_group = f"{group}.{evaluation.stage}"
                tracking = sweep.tracked_as(evaluation.config or row.config, stage_group, f"{stage_group}-s{seed}") if evaluation.stage else []
                if evaluation.stage == "linear":
                    stages.append(Stage("linear", run.directory / "linear", run.directory / "linear" / "results_val.json",
                                        evaluation.config, sweep.linear_command(run, evaluation.config, overrides, tracking)))
                elif evaluation.stage == "test":
                    stages.append(Stage("test", run.directory / "test", run.directory / "test" / "results_test.json",
                                        row.config, longtail_test_command(run, row.config, [*pretraining, *overrides], tracking)))
            runs.append(Run(row, seed, run.directory, tuple(stages)))
    return runs


def read_value(run: Run, metric: Metric) -> float | None:
    return sweep.read_metric_value(run.directory / metric.stage / metric.results, metric.key)


def best_mean(row_runs: list[Run], metric: Metric) -> float | None:
    """The mean over the row's runs of the metric at each run's best validation; None unless every run recorded it."""
    values = [sweep.read_best_value(run.directory / metric.stage / metric.results, metric.key) for run in row_runs]
    return None if any(value is None for value in values) else sum(values) / len(values)


# ----------------------------------------------------------------- status
def read_state(directory: Path) -> dict | None:
    path = directory / STATE
    return sweep.read_json(path, "record of the stage") if path.is_file() else None


def write_state(directory: Path, record: dict) -> None:
    write_atomically(directory / STATE, lambda partial: partial.write_text(json.dumps(record, indent=1)))


def lock_is_held(directory: Path) -> bool:
    """Whether a launcher or its training process holds the stage's lock (released when both have ended)."""
    path = directory / LOCK
    if not path.is_file():
        return False
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def shown(path: Path) -> str:
    """A path as the reader of the table sees it: relative to the working directory when inside it."""
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def queue_state(job_id: str) -> str | None:
    """Slurm's state of a job (PENDING, RUNNING, ...), None once it left the queue, "" without squeue to ask."""
    executable = shutil.which("squeue")
    if executable is None:
        return ""
    result = subprocess.run([executable, "--noheader", "--format=%T", f"--jobs={job_id}"], capture_output=True, text=True)
    return (result.stdout.strip().splitlines() or [None])[0] if result.returncode == 0 else None


def stage_status(stage: Stage) -> Status:
    if stage.results.is_file():
        if (how := sweep.made_differently(read_state(stage.directory), stage.command)) is not None:
            return Status("stale", f"its results were made {how}: remove {shown(stage.directory)} to run it with this "
                                   "command's arguments, or give another --out")
        return Status("done")
    record = read_state(stage.directory)
    if record is None:
        checkpoint = stage.directory / "checkpoints" / "last.ckpt"
        return Status("interrupted", f"{shown(checkpoint)} without a record") if checkpoint.is_file() else Status("not started")
    log = shown(Path(record["log"]))
    if record["launcher"] == "slurm":
        job_id = record["job_id"]
        state = queue_state(job_id)
        if state == "":
            return Status("submitted", f"job {job_id}; no squeue here to ask", job_id)
        if state is None:
            return Status("failed", f"job {job_id} ended without results, log {log}")
        return Status("queued" if state in QUEUED else "running", f"job {job_id}", job_id)
    if lock_is_held(stage.directory):
        return Status("running", f"pid {record['pid']} on {record['host']}, log {log}")
    code = record.get("exit_code")
    if code is None or code < 0 or code in INTERRUPTED_EXITS or record.get("interrupted"):
        # its run resumes only with the arguments it started with (the CLI refuses others): say so, keep its record
        if (how := sweep.made_differently(record, stage.command)) is not None:
            return Status("stale", f"its interrupted run was made {how}: remove {shown(stage.directory)} to start it with this "
                                   "command's arguments, or give another --out")
        return Status("interrupted", f"exit {code}, log {log}" if code is not None else f"its launcher ended, log {log}")
    return Status("failed", f"exit {code}, log {log}" if code else f"exit 0 without {stage.results.name}, log {log}")


def run_status(run: Run) -> tuple[str, Status]:
    """The first stage of a run that is not done, with its status; ("", done) when all are."""
    for stage in run.stages:
        status = stage_status(stage)
        if status.state != "done":
            return stage.name, status
    return "", Status("done")


def unresolved(runs: list[Run], build: bool = False) -> str | None:
    """The first stage whose config and arguments the CLI does not resolve (a misspelt override key, a value of the
    wrong type), with the CLI's error, as "row R, STAGE: error", found with `--print_config` in this process before
    any stage runs (an error found inside a run would leave its files and, on Slurm, a queued job behind). The
    stages of one entry point and subcommand resolve together, in one `--print_config` of `--config C ARGS` after
    `--config C ARGS` (the CLI checks each argument against the classes of the config it follows); only when that
    fails is each resolved alone, to name it. With `build`, each pretraining is then built too (`sweep.resolution_problem`:
    a view's keys, a value out of range, a missing data folder). A row's seeds differ only in --seed_everything: seed 0
    stands for them."""
    resolve = sweep.resolution_problem
    groups: dict[tuple[str, str], list[tuple[Run, Stage, list[str]]]] = {}
    for run in (run for run in runs if run.seed == 0):
        for stage in run.stages:  # [python, script, subcommand, --config, CONFIG, arguments...]; the --ckpt_path file comes later
            arguments = [argument for argument in stage.command[3:] if not argument.startswith("--ckpt_path=")]
            groups.setdefault((Path(stage.command[1]).name, stage.command[2]), []).append((run, stage, arguments))
    for (entry, subcommand), members in groups.items():
        if resolve(entry, [subcommand, *(argument for _, _, arguments in members for argument in arguments)]) is None:
            continue
        for run, stage, arguments in members:
            if (problem := resolve(entry, [subcommand, *arguments])) is not None:
                return f"row {run.row.id}, {stage.name}: {problem}"
    built = set()
    for run, stage, arguments in groups.get(("main_pretrain.py", "fit"), []) if build else ():
        if not any(stage_status(other.stages[0]).state != "done" for other in runs if other.row is run.row):
            continue  # a row whose every pretraining finished trains nothing more: it is not built again
        if tuple(arguments) not in built and (problem := resolve("main_pretrain.py", ["fit", *arguments], build=True)) is not None:
            return f"row {run.row.id}, {stage.name}: {problem}"
        built.add(tuple(arguments))
    return None


# ----------------------------------------------------------------- the local launcher
def execute(stage: Stage) -> str:
    """Run one stage here, recording it; done, failed, interrupted (Ctrl-C re-raised after the record), running."""
    stage.directory.mkdir(parents=True, exist_ok=True)
    with (stage.directory / LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "running"  # another launcher took it since its status was read
        log, made = stage.directory / LOG, sweep.stage_record(stage.command)  # before the process: nothing may fail after it starts
        with log.open("a") as stream:
            stream.write("$ " + shlex.join(stage.command) + "\n")
            stream.flush()
            # the training process inherits the locked descriptor: the stage counts as running while it lives
            process = subprocess.Popen(stage.command, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT, pass_fds=(lock.fileno(),))
        record = {"launcher": "local", "host": socket.gethostname(), "pid": process.pid, "command": stage.command,
                  **made, "log": str(log), "started": time.time(), "exit_code": None}
        write_state(stage.directory, record)
        try:
            code, interrupted = process.wait(), False
        except KeyboardInterrupt:  # Ctrl-C reached the training process too: let it end, then stop
            code, interrupted = process.wait(), True
        write_state(stage.directory, record | {"exit_code": code, "interrupted": interrupted, "ended": time.time()})
    if interrupted:
        raise KeyboardInterrupt
    state = stage_status(stage).state
    return "interrupted" if state == "interrupted" else state


def run_locally(runs: list[Run]) -> None:
    """Each stage not done, one after another; stop at an interruption."""
    for run in runs:
        for stage in run.stages:
            status = stage_status(stage)
            if status.state == "done":
                continue
            name = f"[{run.row.id} seed {run.seed}] {stage.name}"
            if status.state in (*IN_PROGRESS, "stale"):
                print(f"{name}: {status}" + (", left to it" if status.state != "stale" else ""), flush=True)
                break
            print(f"{name}: {shlex.join(stage.command)}", flush=True)
            outcome = execute(stage)
            if outcome != "done":
                print(f"{name}: {stage_status(stage)}", flush=True)
            if outcome == "interrupted":
                print("interrupted: run the same command again to resume", flush=True)
                return
            if outcome != "done":
                break  # its evaluation needs this stage


# ----------------------------------------------------------------- the Slurm launcher
def render_job(stage: Stage, run: Run, table: Table, args, after: str | None) -> list[tuple[Path, str]]:
    """The stage's job file through scripts/slurm/submit.py: the local command's arguments in a job of the
    requested resources, its run directory the stage's."""
    assert stage.command[3] == "--config"  # [python, script, subcommand, --config, CONFIG, arguments...]
    overrides = [argument for argument in stage.command[5:] if not argument.startswith("--trainer.default_root_dir=")]
    resources = {key: getattr(args, key) for key in ("nodes", "gpus_per_node", "cpus_per_task", "time", "partition", "sbatch_option")}
    return submit.render_jobs(argparse.Namespace(
        config=stage.config, run_dir=stage.directory, grid=[], stage=stage.name, after=after, overrides=overrides,
        job_name=f"{table.path.stem}-{run.row.id}-s{run.seed}-{stage.name}", **resources))


def submit_runs(runs: list[Run], table: Table, args) -> None:
    """Submit every stage not done and not in the queue; an evaluation waits for its run's pretraining job."""
    for run in runs:  # every job file renders (resources, overrides) before any is written
        for stage in run.stages:
            render_job(stage, run, table, args, DEPENDENCY_PLACEHOLDER if stage.name != "pretrain" else None)
    for run in runs:
        pretraining_job = None
        for stage in run.stages:
            status = stage_status(stage)
            if stage.name == "pretrain" and status.state != "done":
                pretraining_job = status.job_id or DEPENDENCY_PLACEHOLDER
            if status.state in ("done", "stale", *IN_PROGRESS):
                if status.state != "done":
                    print(f"[{run.row.id} seed {run.seed}] {stage.name}: {status}" + (", left to it" if status.state != "stale" else ""), flush=True)
                continue
            after = pretraining_job if stage.name != "pretrain" else None
            if not args.dry_run and after is not None and not after.isdigit():
                print(f"[{run.row.id} seed {run.seed}] {stage.name}: waits for its pretraining, which is not a Slurm job "
                      f"({stage_status(run.stages[0])}): submit it once that ended", flush=True)
                continue
            ((script, job_id),) = submit.write_and_submit(render_job(stage, run, table, args, after), args.dry_run)
            if job_id is not None:
                write_state(stage.directory, {"launcher": "slurm", "job_id": job_id, "job_file": str(script), "after": after,
                                              **sweep.stage_record(stage.command), "log": str(stage.directory / "slurm.err"),
                                              "submitted": time.time()})
                if stage.name == "pretrain":
                    pretraining_job = job_id


# ----------------------------------------------------------------- the table
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
RUN_URL = re.compile(r"https?://\S+?/runs/[\w-]+")


def wandb_url(run: Run) -> str | None:
    """The W&B page of an online run: the last `.../runs/<id>` address W&B printed into the pretraining's log."""
    for log in (run.directory / LOG, run.directory / "slurm.err"):
        if log.is_file() and (found := RUN_URL.findall(ANSI_ESCAPE.sub("", log.read_text(errors="replace")))):
            return found[-1]
    return None


def measured(row_runs: list[Run], metric: Metric) -> dict | None:
    """sweep.summarise of the metric over the row's runs; None unless every run is done and recorded it."""
    values = [read_value(run, metric) for run in row_runs]
    return None if any(value is None for value in values) else sweep.summarise(values)


def table_rows(table: Table, runs: list[Run]) -> list[dict]:
    """One entry per row and metric, with the numbers, the status and the runs."""
    entries = []
    for row in dict.fromkeys(run.row for run in runs):
        row_runs = [run for run in runs if run.row is row]
        statuses = [run_status(run) for run in row_runs]
        done = all(status.state == "done" for _, status in statuses)
        status = "done" if done else "; ".join(f"seed {run.seed}: " + (f"{stage} {status}" if stage else str(status))
                                               for run, (stage, status) in zip(row_runs, statuses))
        urls = [(run.seed, wandb_url(run)) for run in row_runs]
        common = {"row": row, "row_id": row.id, "label": row.label, "status": status, "source": row.source, "urls": urls,
                  "directory": row_runs[0].directory.parent,
                  "runs": " ".join(url or str(run.directory) for run, (_, url) in zip(row_runs, urls))}
        for metric in row.metrics:
            paper = row.paper.get(metric.name)
            summary = measured(row_runs, metric) if done else None
            scale = 100.0 if metric.percent else 1.0
            mean = None if summary is None else scale * summary["mean"]
            std = None if summary is None or summary["n"] == 1 else scale * summary["std"]
            difference = None if mean is None or paper is None or table.stand_in else mean - paper
            best = best_mean(row_runs, metric) if done else None
            entries.append(common | {"metric": metric.name, "paper": paper, "mean": mean, "std": std, "percent": metric.percent,
                                     "n": summary["n"] if summary else None, "best": None if best is None else scale * best,
                                     "difference": difference})
    return entries


def markdown(table: Table, entries: list[dict], given: list[str] = ()) -> str:
    lines = [f"**{table.title}** (`{shown(table.path)}`)", "", "| " + " | ".join(COLUMNS) + " |", "|---|---|---:|---:|---:|---:|---|---|"]
    previous = None
    for entry in entries:
        first = entry["row_id"] != previous  # a row's status and runs on its first metric's line
        previous = entry["row_id"]
        digits = 2 if entry["percent"] else 3
        if entry["mean"] is None:
            value = "—" if entry["status"] == "done" else ""  # done, but a metric its runs did not record
        else:
            value = f"{entry['mean']:.{digits}f}" + (f" ± {entry['std']:.{digits}f}" if entry["std"] is not None else "") + f" (n={entry['n']})"
        links = " ".join([f"`{shown(entry['directory'])}/`", *(f"[s{seed}]({url})" for seed, url in entry["urls"] if url)])
        lines.append("| " + " | ".join([
            entry["label"].replace("|", "\\|") if first else "", entry["metric"], "—" if entry["paper"] is None else f"{entry['paper']:.{digits}f}", value,
            "" if entry["status"] != "done" else "—" if entry["best"] is None else f"{entry['best']:.{digits}f}", "—" if entry["difference"] is None else f"{entry['difference']:+.2f}", entry["status"] if first else "", links if first else "",
        ]) + " |")
    notes = ["", "Measured: mean ± sample standard deviation over the row's seeds (n), accuracies in %, shown once every seed "
             "is done; difference: measured − paper. Best: the mean over the seeds of each run's number at its best validation "
             "(`best` of results_val.json: the validation of the highest top-1, as official codes that print the best "
             "epoch report it; — for a test stage)."]
    if table.stand_in:
        orientation = (" Its paper numbers are the stood-in table's, for orientation only (different data, trunk and scale): "
                       "no difference is computed.") if any(entry["paper"] is not None for entry in entries) else ""
        notes.append(f"Stand-in: {table.stand_in}{orientation}")
    notes.append("Sources: " + "; ".join(dict.fromkeys(entry["source"] for entry in entries)) + ".")
    notes += given  # the arguments of every run: a smoke table (--trainer.max_steps=3) is not the rows' runs
    notes += [f"Note on {row.label}: {row.note}." for row in dict.fromkeys(entry["row"] for entry in entries) if row.note]
    notes += [f"Not covered: {label}: {reason}." for label, reason in table.not_covered]
    return "\n".join(lines + notes) + "\n"


def csv_text(entries: list[dict]) -> str:
    stream = io.StringIO()
    writer = csv.writer(stream)
    writer.writerow(CSV_COLUMNS)
    writer.writerows([["" if entry[column] is None else entry[column] for column in CSV_COLUMNS] for entry in entries])
    return stream.getvalue()


def log_to_wandb(table: Table, runs: list[Run], entries: list[dict], out: Path) -> str | None:
    """The table as a `wandb.Table` in the table's summary run; where, or None when W&B is not in use."""
    if not any((stage.directory / "wandb").is_dir() for run in runs for stage in run.stages):
        return None  # no run logged to W&B: its mode is of no concern here
    if (mode := wandb_mode()) == "disabled":
        return None
    import wandb  # only when W&B is in use

    configs = [run.directory / "config.yaml" for run in runs if (run.directory / "config.yaml").is_file()]
    logger = (yaml.safe_load(configs[0].read_text())["trainer"].get("logger") or {}) if configs else {}
    project = (logger.get("init_args") or {}).get("project", "contrastlab") if isinstance(logger, dict) else "contrastlab"
    summary = wandb.init(project=project, group=table.path.stem, name=f"reproduce-{table.path.stem}", job_type="reproduce",
                         dir=str(out), id=stored_run_id(out), resume="allow", mode=mode,
                         config={"table": str(table.path), "title": table.title}, settings=wandb.Settings(silent=True))
    data = [[None if isinstance(entry[column], float) and math.isnan(entry[column]) else entry[column] for column in CSV_COLUMNS]
            for entry in entries]
    summary.log({"table": wandb.Table(columns=CSV_COLUMNS, data=data)})
    where = str(Path(summary.dir).parent) if mode == "offline" else summary.url  # an offline run has no address
    summary.finish()
    return where


def given_to_every_run(args) -> list[str]:
    """The table's notes on the arguments the command line gave every run and every evaluation stage."""
    return ([f"Given to every run: `{shlex.join(args.extra)}`."] * bool(args.extra)
            + [f"Given to every evaluation stage: `{shlex.join(args.evaluation_override)}`."] * bool(args.evaluation_override))


def assemble(table: Table, runs: list[Run], out: Path, given: list[str] = ()) -> str:
    """Write OUT/table.md and OUT/table.csv (and the W&B table); return the markdown."""
    entries = table_rows(table, runs)
    text = markdown(table, entries, given)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "table.md", lambda partial: partial.write_text(text))
    write_atomically(out / "table.csv", lambda partial: partial.write_text(csv_text(entries)))
    if (where := log_to_wandb(table, runs, entries, out)) is not None:
        text += f"\nW&B: the table is logged in {where}\n"
    return text


# ----------------------------------------------------------------- the command line
def parse_args(argv: list[str]) -> argparse.Namespace:
    own, extra = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", type=Path, help="a table file, e.g. tables/sce_table2.yaml")
    parser.add_argument("--rows", nargs="+", help="the ids of the rows to run (default: all)")
    parser.add_argument("--seeds", type=int, help="seeds 0 .. N-1 for every row (default: each row's own)")
    parser.add_argument("--launcher", choices=("local", "slurm"), default="local")
    parser.add_argument("--out", type=Path, help="the folder of the runs and the table (default: runs/tables/<table name>)")
    parser.add_argument("--dry-run", action="store_true", help="print every command (Slurm: write the job files), run nothing")
    parser.add_argument("--collect", action="store_true", help="only assemble the table from what exists")
    parser.add_argument("--evaluation-override", action="append", default=[], help="an argument for every linear stage and test")
    job.add_resource_arguments(parser)
    args = parser.parse_args(own)
    args.extra = extra
    return args


def collect_command(args, table: Table, out: Path) -> str:
    rows = ["--rows", *args.rows] if args.rows else []
    seeds = [f"--seeds={args.seeds}"] if args.seeds else []
    overrides = [f"--evaluation-override={override}" for override in args.evaluation_override]  # the results are of them
    extra = ["--", *args.extra] if args.extra else []
    return shlex.join(["uv", "run", "python", "scripts/reproduce.py", shown(table.path), "--out", shown(out), *rows, *seeds, *overrides, "--collect", *extra])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        table = load_table(args.table)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    ids = [row.id for row in table.rows]
    if unknown := [name for name in args.rows or [] if name not in ids]:
        raise SystemExit(f"error: --rows {' '.join(unknown)}: {shown(table.path)} has no such row (its rows: {', '.join(ids)})")
    if args.seeds is not None and not 1 <= args.seeds <= MAX_SEEDS:
        raise SystemExit(f"error: --seeds {args.seeds} is not a number of seeds from 1 to {MAX_SEEDS}")
    out = (args.out or Path("runs/tables") / table.path.stem).resolve()
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {shown(out)} is a file, not a folder")
    rows = [row for row in table.rows if args.rows is None or row.id in args.rows]
    seeds = "is its own (--seeds, or the row's seeds)"
    sweep.refuse_what_each_run_sets(args.extra, "after --", [override for row in rows for override in row.overrides], seeds,
                                    "--out, and the overrides of a row")
    sweep.refuse_what_each_run_sets(args.evaluation_override, "in --evaluation-override",
                                    [override for row in rows for evaluation in row.evaluations for override in evaluation.overrides], seeds,
                                    "--out, and the overrides of a row's evaluation")
    if args.evaluation_override and not any(evaluation.stage for row in rows for evaluation in row.evaluations):
        raise SystemExit(f"error: --evaluation-override {args.evaluation_override[0]}: {'the selected rows' if args.rows else shown(table.path)} "
                         "have no evaluation stage (linear or test) for it to apply to")
    runs = plan(rows, args.seeds, out, args.extra, args.evaluation_override)
    try:
        return launch(args, table, runs, out)
    except ValueError as error:  # a record or results file the runs left unreadable
        raise SystemExit(f"error: {error}") from None


def launch(args, table: Table, runs: list[Run], out: Path) -> int:
    """Run, submit, print or collect the planned runs, as the command line asks."""
    if args.collect:
        print(assemble(table, runs, out, given_to_every_run(args)))
        return 0
    # the pretrainings run here are built first too; a Slurm job's data may be on its nodes only, where its run checks it
    if problem := unresolved(runs, build=args.launcher == "local" and not args.dry_run):
        raise SystemExit(f"error: {shown(table.path)} {problem}")
    if args.launcher == "slurm":
        try:
            if not args.dry_run:
                job.sbatch_executable()
            submit_runs(runs, table, args)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
        print(f"then, at any time: {collect_command(args, table, out)}")
        return 0
    if args.dry_run:
        for run in runs:
            for stage in run.stages:
                print(shlex.join(stage.command))
        return 0
    try:
        run_locally(runs)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", flush=True)
    print(assemble(table, runs, out, given_to_every_run(args)))
    return 0 if all(run_status(run)[1].state == "done" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
