"""Compare runs in the table a paper prints, and plot their curves (issue 10).

    uv run python scripts/compare.py runs/sweeps/moco_digits runs/sce_digits --out runs/comparison

Each argument is a run, a W&B run, or a directory holding runs:
- a run directory (a `trainer.default_root_dir`): the `config.yaml` and `results_val.json` the CLI writes there
  (without them, `lightning_logs/version_*/config.yaml` and the last logged values), the linear stage's
  `linear/results_val.json` (`scripts/sweep.py --linear`; one error line when its `config.yaml` probed another
  checkpoint than the run's `last.ckpt`, or its results record weights of an earlier step than the run's), and the
  curves of its Lightning CSV log (`lightning_logs/version_*/metrics.csv`) or else of its W&B runs (`wandb/*run-*`);
- a W&B run directory (`<root>/wandb/offline-run-*` or `run-*`): config, summary and history from its `.wandb`
  log, parsed by W&B itself (`wandb leet inspect --json`); the directories of one resumed run (same id) are one
  run, read in the order of their starts; the linear stage, as above, from `<root>/linear`; named beside its run
  directory, it counts once;
- any other directory: every run below it (a run's own subdirectories, e.g. its linear stage, belong to it).

Runs whose `model`, `data`, `trainer` and `non_finite` settings differ only in their random seed and in run control
(`RUN_CONTROL`: run directory, logging, validation frequency; not the batch limits of a smoke run) form one row:
method x dataset (and, where rows of one method and dataset differ, the settings that set them apart; runs probed
with other linear-stage settings, `linear.*`, are rows of their own), with the mean ± sample standard deviation over
seeds of the linear, kNN and online-probe top-1, the training time
and the training images per second (`engine.tracking.TrainingThroughput`). A metric that no run of a row
recorded is "n/a"; one that only some recorded says over how many runs it is taken. A run without its results file
(interrupted: its numbers are the last values it logged) is not averaged with finished ones: its row says "unfinished".
A run that recorded no config (a directory of results alone) is a row of its own.

Writes `OUT/comparison.md`, `OUT/comparison.csv` (the same rows, metrics in their logged units) and
`OUT/curves.png` (training loss and the validation top-1 of every run against the step).
"""

import collections
import csv
import io
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)
import yaml  # noqa: E402

from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.files import check_folder, read_json_object, write_atomically  # noqa: E402

COLUMNS = {  # metric key -> (column, scale)
    "linear/val/probe_top1": ("linear top-1 (%)", 100.0),
    "val/knn_top1": ("kNN top-1 (%)", 100.0),
    "val/probe_top1": ("probe top-1 (%)", 100.0),
    "train/time_s": ("training time (s)", 1.0),
    "train/images_per_s": ("images/s", 1.0),
}
LOSS_CURVE = "train/loss"
VAL_CURVES = ("val/knn_top1", "val/probe_top1", "val/top1")  # the first that a run logged is plotted
GROUPING_SECTIONS = ("model", "data", "trainer", "non_finite")
UNFINISHED = "unfinished: its last logged values"  # the label of runs without a results file
RUN_ID_FILE = "wandb_run_id"  # where a run directory keeps its W&B run's id (engine.tracking.RUN_ID_FILE)
DERIVED = ("model.num_classes",)  # linked from the data when the model is built: in the W&B config, not in config.yaml
# Run control: where a run writes, what it logs and shows, and how often it validates (the last epoch is validated
# in any case: engine.cli.results.FinalValidation). These differ between the repeats of one setting and never set rows
# apart; how much of each epoch a run trains and validates (`limit_*`, `fast_dev_run`: a smoke run) does.
RUN_CONTROL = tuple(
    f"trainer.{key}"
    for key in ("default_root_dir", "logger", "callbacks", "enable_progress_bar", "enable_model_summary", "enable_checkpointing",
                "log_every_n_steps", "num_sanity_val_steps", "check_val_every_n_epoch", "val_check_interval", "profiler")
)


@dataclass
class Run:
    path: Path
    source: str  # where its numbers come from
    config: dict
    metrics: dict[str, float]
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(step, value)]
    linear_config: dict = field(default_factory=dict)  # the linear stage's config.yaml, when its results are read
    finished: bool = True  # False: no results file, its numbers are the last values it logged (an interrupted run)

    @property
    def method(self) -> str:
        return str(self.config.get("model", {}).get("class_path", "n/a")).rsplit(".", 1)[-1]

    @property
    def dataset(self) -> str:
        return str(self.config.get("data", {}).get("class_path", "n/a")).rsplit(".", 1)[-1].removesuffix("DataModule")

    @property
    def seed(self) -> int | str:
        return self.config.get("seed_everything", "n/a")

    def setting(self) -> dict[str, str]:
        """The flattened settings of `GROUPING_SECTIONS`, without run control (`RUN_CONTROL`) and what the data sets
        (`DERIVED`). A run that recorded no config cannot be told from another: it is a setting of its own."""
        if not self.config:
            return {"run": str(self.path)}
        flat = flatten({section: self.config.get(section) for section in GROUPING_SECTIONS})
        return {key: value for key, value in flat.items() if not key.startswith(RUN_CONTROL) and key.replace(".init_args", "") not in DERIVED}

    def linear_setting(self) -> dict[str, str]:
        """The linear stage's settings as `setting()` reads them, keyed `linear.*`, without the checkpoint it probed
        (each run's own); empty for a run whose linear results are not read."""
        flat = flatten({section: self.linear_config[section] for section in GROUPING_SECTIONS if section in self.linear_config}, "linear.")
        return {key: value for key, value in flat.items() if not key.removeprefix("linear.").startswith((*RUN_CONTROL, "model.init_args.pretrained_ckpt"))
                and key.removeprefix("linear.").replace(".init_args", "") not in DERIVED}


def flatten(tree, prefix: str = "") -> dict[str, str]:
    """Dotted keys and their values as JSON; a whole float as the integer it equals, since W&B's config stores
    `0.0` as `0` and `[0.5, 1.0]` as `[0.5, 1]` (a run read from W&B and one read from its config.yaml have one setting)."""
    if isinstance(tree, dict):
        return {key: value for name, sub in tree.items() for key, value in flatten(sub, f"{prefix}{name}.").items()}
    return {prefix.rstrip("."): json.dumps(whole_as_int(tree), default=str)}


def whole_as_int(value):
    """`value` with every whole float in it (in lists too: a crop scale [0.5, 1.0]) as the integer it equals."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [whole_as_int(item) for item in value] if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------- reading runs
def is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() or (path / "lightning_logs").is_dir() or any(path.glob("results_*.json"))


def wandb_log(path: Path) -> Path | None:
    return next(iter(sorted(path.glob("run-*.wandb"))), None)


@dataclass
class WandbLog:
    name: str = ""
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)


def read_wandb(run_dirs: list[Path]) -> WandbLog:
    """Name, config, summary and history rows of one W&B run, from the `.wandb` logs of its directories (one per
    start of a resumed run, in time order), each parsed by W&B's own reader into one JSON record per line."""
    log = WandbLog()
    for run_dir in run_dirs:
        result = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
            capture_output=True,
            text=True,
            env=os.environ | {"WANDB_ERROR_REPORTING": "false"},  # a reader sends no telemetry
        )
        if result.returncode != 0:
            raise ValueError(f"{run_dir}: W&B could not read its log: {result.stderr.strip()}")
        for record in map(json.loads, result.stdout.splitlines()):
            kind = record["type"]
            if kind == "run":  # wandb.init's name and config
                log.name = record["run"].get("display_name", log.name)
                log.config.update(record["run"].get("config", {}).get("update", {}))
            elif kind == "config":  # config.update(): the CLI's resolved config, the module's hyperparameters
                log.config.update(record["config"].get("update", {}))
            elif kind == "summary":
                log.summary.update(record["summary"].get("update", {}))
            elif kind == "history":
                log.history.append(record["history"]["item"])
    log.config.pop("_wandb", None)
    return log


def curves_from_rows(rows: list[dict], step_key: str) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key in (LOSS_CURVE, *VAL_CURVES):
            if row.get(key) not in (None, "") and row.get(step_key) not in (None, ""):
                curves.setdefault(key, []).append((int(float(row[step_key])), float(row[key])))
    return curves


def csv_rows(root: Path) -> list[dict]:
    """The rows of the Lightning CSV logs of a run, in version order (a resumed run writes a new version)."""
    versions = sorted(root.glob("lightning_logs/version_*/metrics.csv"), key=lambda path: int(path.parent.name.split("_")[1]))
    return [row for path in versions for row in csv.DictReader(path.open())]


def read_results(path: Path) -> dict:
    """A results file's metrics; a damaged one is a ValueError naming it."""
    metrics = read_json_object(path, "results file").get("metrics")
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: the results file holds no 'metrics' mapping")
    return metrics


def read_yaml(path: Path) -> dict | None:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not a readable config ({' '.join(str(error).split())})") from None


def linear_metrics(root: Path) -> tuple[dict[str, float], dict]:
    """The linear stage's results in `<root>/linear` and its config, when its config.yaml says it probed this run's
    last.ckpt (a probe of another run's trunk, or of an earlier checkpoint, is refused: its numbers are not this run's)."""
    results = root / "linear" / "results_val.json"
    if not results.is_file():
        return {}, {}
    config = (read_yaml(root / "linear" / "config.yaml") if (root / "linear" / "config.yaml").is_file() else None) or {}
    probed = (config.get("model") or {}).get("init_args", {}).get("pretrained_ckpt")
    if probed is not None and not probed_the_run(probed, (config.get("trainer") or {}).get("default_root_dir"), root):
        raise ValueError(f"{root / 'linear'} probed {probed} (its config.yaml), not this run's checkpoints/last.ckpt: its numbers are not this run's")
    # the step of the weights it probed (written since results_context), against the run's final step
    probed_step = read_json_object(results, "results file").get("pretrained_step")
    final_step = read_json_object(root / "results_val.json", "results file").get("global_step") if (root / "results_val.json").is_file() else None
    if None not in (probed_step, final_step) and probed_step != final_step:
        raise ValueError(f"{root / 'linear'} probed the run's weights of step {probed_step}, and the run has trained on to step {final_step} "
                         "since: its numbers are not of the run's final weights (probe them again)")
    return {f"linear/{key}": value for key, value in read_results(results).items()}, config


def probed_the_run(probed: str, linear_dir: str | None, root: Path) -> bool:
    """Whether the linear stage run in `linear_dir` (both paths as its config.yaml holds them, relative to where it
    ran or absolute) probed `checkpoints/last.ckpt` of the run above it: read against the run as the stage saw it,
    so that a run moved or copied since, or compared from another directory, is still recognised."""
    if linear_dir is not None and Path(linear_dir).is_absolute() == Path(probed).is_absolute():
        run_as_seen = os.path.normpath(os.path.join(linear_dir, os.pardir))
        return os.path.normpath(os.path.relpath(probed, run_as_seen)) == os.path.join("checkpoints", "last.ckpt")
    last = (root / "checkpoints" / "last.ckpt").resolve()  # else: the path itself, or a relative one that ends the run's
    return Path(probed).resolve() == last or (not Path(probed).is_absolute() and str(last).endswith(os.sep + os.path.normpath(probed)))


def read_run(root: Path) -> Run:
    """A run directory, from the files the CLI writes, its CSV log and its W&B runs."""
    config_files = [path for path in [root / "config.yaml", *sorted(root.glob("lightning_logs/version_*/config.yaml"))] if path.is_file()]
    config = read_yaml(config_files[0]) if config_files else None
    results = root / "results_val.json"
    metrics = read_results(results) if results.is_file() else {}
    rows = csv_rows(root)
    curves = curves_from_rows(rows, "step")
    linear, linear_config = linear_metrics(root)
    sources = [name for name, found in (("config.yaml", config_files), ("results_val.json", metrics), ("CSV log", rows)) if found]
    starts = by_start(own_wandb_runs(root))
    if starts and (config is None or not metrics or not curves):
        log = read_wandb(starts)
        config, metrics = config or log.config, metrics or log.summary
        curves = curves or curves_from_rows(log.history, "trainer/global_step")
        sources.append(f"W&B log ({log.name})")
    if not metrics:  # no results file (e.g. an interrupted run): the last value of every logged metric
        metrics = {key: float(value) for row in rows for key, value in row.items() if value not in ("", None) and key not in ("epoch", "step")}
    return Run(root, ", ".join(sources + ["linear/results_val.json"] * bool(linear)), config or {}, metrics | linear, curves, linear_config,
               finished=results.is_file())


def own_wandb_runs(root: Path) -> list[Path]:
    """The W&B directories of the run in `root` (`wandb/[offline-]run-<time>-<id>`): those of the id it keeps in
    RUN_ID_FILE. A `validate` or `test` in the run directory logs a W&B run of its own there, of other settings."""
    run_dirs = [log.parent for log in root.glob("wandb/*run-*/run-*.wandb")]
    run_id = (root / RUN_ID_FILE).read_text().strip() if (root / RUN_ID_FILE).is_file() else None
    return [run_dir for run_dir in run_dirs if run_id is None or run_dir.name.endswith(f"-{run_id}")]


def by_start(run_dirs: list[Path]) -> list[Path]:
    """The W&B directories of a run in the order it started them: `run-<time>-<id>` or `offline-run-<time>-<id>` (a run
    started online and requeued offline has both: their names alone would put every offline start first)."""
    return sorted(run_dirs, key=lambda run_dir: run_dir.name.removeprefix("offline-"))


def read_wandb_run(run_dirs: list[Path]) -> Run:
    log = read_wandb(run_dirs)
    root = run_dirs[0].parent.parent  # <root>/wandb/<run>
    linear, linear_config = linear_metrics(root)
    return Run(run_dirs[-1], f"W&B log ({log.name})", log.config, log.summary | linear, curves_from_rows(log.history, "trainer/global_step"), linear_config,
               finished=(root / "results_val.json").is_file() or not is_run(root))  # a W&B run without its run directory: taken as finished


def find_runs(path: Path) -> list[Run]:
    """The runs at or below `path`; the W&B directories of one run id in one folder make one run."""
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if is_run(path):
        return [read_run(path)]
    found, wandb_dirs = [], {}
    for directory, subdirectories, _ in os.walk(path):
        directory = Path(directory)
        if (log := wandb_log(directory)) is not None:
            wandb_dirs.setdefault((directory.parent, log.stem), []).append(directory)
            subdirectories.clear()
        elif is_run(directory):
            found.append(read_run(directory))
            subdirectories.clear()
        subdirectories.sort()
    # a W&B run with no model in its config trained nothing: reproduce.py's table summary run (`log_to_wandb`)
    found += [run for run in map(read_wandb_run, map(by_start, wandb_dirs.values())) if "model" in run.config]
    if not found:
        raise ValueError(f"{path} is not a run (no config.yaml, results_*.json, lightning_logs/ or W&B run) and holds none")
    return found


# ----------------------------------------------------------------- the table
def group(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """Rows of runs that differ only in their random seed, each labelled with the settings that set it apart from the
    other rows of the same method and dataset. Runs of one setting probed with other linear settings are rows of their
    own (a sweep's `--linear-override`); its runs without linear results yet join the row of its one linear setting."""
    by_linear: dict[tuple, dict[tuple, list[Run]]] = {}
    for run in runs:
        pretraining = (run.method, run.dataset, tuple(sorted(run.setting().items())))
        by_linear.setdefault(pretraining, {}).setdefault(tuple(sorted(run.linear_setting().items())), []).append(run)
    rows: dict[tuple, list[Run]] = {}
    for (method, dataset, setting), members in by_linear.items():
        probed = [linear for linear in members if linear]
        if len(probed) == 1 and () in members:
            members[probed[0]] += members.pop(())
        rows |= {(method, dataset, setting + linear): runs_of for linear, runs_of in members.items()}
    labelled = []
    for (method, dataset, setting), members in rows.items():
        others = [dict(key[2]) for key in rows if key[:2] == (method, dataset)]
        # a linear setting sets a row apart from rows probed otherwise, not from those without linear results
        differing = [key for key, value in setting if any(other.get(key, value if key.startswith("linear.") else None) != value for other in others)]
        label = ", ".join(f"{key.replace('.init_args', '')}={dict(setting)[key]}" for key in differing)
        # an interrupted run's last logged values are not averaged with finished runs' results: a row of its own
        finished, unfinished = [run for run in members if run.finished], [run for run in members if not run.finished]
        labelled += [(label, finished)] * bool(finished) + [(", ".join(filter(None, [label, UNFINISHED])), unfinished)] * bool(unfinished)
    return labelled


def over_seeds(runs: list[Run], metric: str) -> tuple[float, float, int] | None:
    """Mean, sample standard deviation (nan for one run) and count over the runs that recorded `metric`."""
    values = [float(run.metrics[metric]) for run in runs if metric in run.metrics]
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else float("nan"), len(values)


def cell(runs: list[Run], metric: str, scale: float) -> str:
    found = over_seeds(runs, metric)
    if found is None:
        return "n/a"
    mean, std, count = found
    text = f"{scale * mean:.2f}" if count == 1 else f"{scale * mean:.2f} ± {scale * std:.2f}"
    return text if count == len(runs) else f"{text} ({count} of {len(runs)} runs)"


def write_table(rows: list[tuple[str, list[Run]]], columns: dict[str, tuple[str, float]], out: Path) -> str:
    header = ["method", "dataset", "setting", "seeds", *(name for name, _ in columns.values())]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 4 + "---:|" * len(columns)]
    run_lines = ["| row | seed | run | source |", "|---|---|---|---|"]
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["method", "dataset", "setting", "seeds", *(f"{metric} {part}" for metric in columns for part in ("mean", "std", "n"))])
    for number, (setting, runs) in enumerate(rows, 1):
        first, seeds = runs[0], ", ".join(str(run.seed) for run in runs)
        lines.append(f"| {first.method} | {first.dataset} | {setting or '–'} | {seeds} | " + " | ".join(cell(runs, metric, scale) for metric, (_, scale) in columns.items()) + " |")
        numbers = [over_seeds(runs, metric) or ("n/a",) * 3 for metric in columns]
        writer.writerow([first.method, first.dataset, setting, seeds, *(value for found in numbers for value in found)])
        run_lines += [f"| {number} | {run.seed} | `{run.path}` | {run.source} |" for run in runs]
    markdown = "\n".join(
        [*lines, "", "Mean ± sample standard deviation over the seeds of each row; accuracies in %, on the validation split;",
         "training time: wall time of fit, validation included; images/s: training images per second of training,",
         "validation excluded (`engine.tracking.TrainingThroughput`). Runs:", "", *run_lines, ""]
    )
    write_atomically(out / "comparison.md", lambda partial: partial.write_text(markdown))
    write_atomically(out / "comparison.csv", lambda partial: partial.write_text(table.getvalue()))
    return markdown


def curve_labels(rows: list[tuple[str, list[Run]]]) -> list[tuple[str, Run]]:
    """Each run's legend label: method, dataset, the row's setting and the run's seed; where that names two runs (repeats
    of one seed, or W&B runs of one name), each adds its run directory."""
    labelled = [(f"{run.method} {run.dataset} {setting} s{run.seed}".replace("  ", " "), run) for setting, runs in rows for run in runs]
    counts = collections.Counter(label for label, _ in labelled)
    return [(f"{label} [{run.path}]" if counts[label] > 1 else label, run) for label, run in labelled]


def plot_curves(rows: list[tuple[str, list[Run]]], out: Path) -> None:
    figure, (loss_axes, val_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, run in curve_labels(rows):
        if LOSS_CURVE in run.curves:
            loss_axes.plot(*zip(*run.curves[LOSS_CURVE]), label=label)
        val_metric = next((metric for metric in VAL_CURVES if metric in run.curves), None)
        if val_metric is not None:
            steps, values = zip(*run.curves[val_metric])
            val_axes.plot(steps, [100 * value for value in values], marker="o", label=f"{label} ({val_metric})")
    loss_axes.set(title="training loss", xlabel="step", ylabel=LOSS_CURVE)
    val_axes.set(title="validation top-1", xlabel="step", ylabel="top-1 (%)")
    for axes in (loss_axes, val_axes):
        if axes.lines:
            axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, "no run logged this curve", ha="center", transform=axes.transAxes)
    figure.tight_layout()
    write_atomically(out / "curves.png", lambda partial: figure.savefig(partial, format="png", dpi=120))
    plt.close(figure)


def run_root(run: Run) -> Path:
    """The run directory a run was read from: a W&B run's (`<root>/wandb/<run>`) when that is a run directory too."""
    path = run.path.resolve()
    return path.parent.parent if path.parent.name == "wandb" and is_run(path.parent.parent) else path


def main(argv: list[str] | None = None) -> str:
    parser = ScriptArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="runs, W&B runs or directories holding runs")
    parser.add_argument("--out", type=Path, required=True, help="directory for comparison.md, comparison.csv and curves.png")
    parser.add_argument("--metrics", nargs="*", default=[], help="more final metrics as columns, e.g. val/top1 val/few_top1")
    args = parser.parse_args(argv)
    try:
        check_folder(args.out, "--out")
        found = [run for path in args.paths for run in find_runs(path)]
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    unique: dict[Path, Run] = {}  # a run named twice, with a folder above it or beside its W&B run, counts once
    for run in found:
        if run_root(run) not in unique or run.path.resolve() == run_root(run):  # its directory's files over its W&B log
            unique[run_root(run)] = run
    runs = list(unique.values())
    unrecorded = [metric for metric in args.metrics if not any(metric in run.metrics for run in runs)]
    if unrecorded:
        recorded = sorted({metric for run in runs for metric in run.metrics})
        parser.exit(2, f"error: --metrics {unrecorded[0]}: no run records it (they record {', '.join(recorded)})\n")
    columns = COLUMNS | {metric: (metric, 100.0 if "top" in metric else 1.0) for metric in args.metrics}
    rows = group(runs)
    markdown = write_table(rows, columns, args.out)
    plot_curves(rows, args.out)
    return markdown


if __name__ == "__main__":
    print(main())
