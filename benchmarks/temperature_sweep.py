"""Wang & Liu's temperature sweep: train one method at a list of temperatures with the ordinary and
the hard contrastive loss, then lay the results out as Wang & Liu supplementary, Tables 1 and 2 (rows: loss
and metric, columns: tau) beside those tables' CIFAR-10 rows, and plot accuracy, uniformity and tolerance
against tau.

    uv run python benchmarks/temperature_sweep.py --config configs/npid_digits.yaml \\
        --out runs/sweeps/npid_tau --temperatures 0.05 0.1 0.2 0.5 1.0 --num-hard 100 [--seeds 0 1] \\
        [--linear configs/linear_digits.yaml] [-- extra overrides for every pretraining run]

Each loss is one `scripts/sweep.py` run (grid `model.init_args.temperature`, the hard one with
`--model.init_args.loss=hard --model.init_args.num_hard=N`) in OUT/<loss>/; the runs log the analysis
metrics through the config's `analysis.RepresentationAnalysis` callback. Interrupted sweeps resume
(finished runs are skipped); `--collect` only rebuilds the outputs: OUT/temperature_sweep.md and
OUT/temperature_sweep.png.
"""

import argparse
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.figures import plot_against_temperature  # noqa: E402
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.config import split_overrides  # noqa: E402
from engine.files import write_atomically  # noqa: E402

LOSSES = ("ordinary", "hard")
ANALYSIS_METRICS = ("val/uniformity", "val/tolerance", "val/negative_entropy", "val/local_separation")
ROW_LABELS = {
    "linear:val/probe_top1": "linear top-1 (%)",
    "val/probe_top1": "online probe top-1 (%)",
    "val/knn_top1": "kNN top-1 (%)",
    "val/uniformity": "-L_uniformity",
    "val/tolerance": "tolerance",
    "val/negative_entropy": "entropy over negatives",
    "val/local_separation": "s(pos) - s(n1)",
}
# Linear top-1 on CIFAR-10 of Wang & Liu supplementary, Tables 1 (ordinary) and 2 (hard), by tau.
SEED_CIFAR10 = {
    "ordinary": dict(zip((0.05, 0.07, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                         (76.10, 79.75, 81.82, 83.78, 83.27, 83.22, 82.54, 82.97, 82.69, 82.67, 81.97, 82.21))),
    "hard": dict(zip((0.05, 0.07, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                     (76.22, 79.20, 80.44, 83.28, 83.63, 84.14, 84.31, 84.60, 84.19, 84.60, 84.45, 84.19))),
}


def run_sweeps(args) -> None:
    for loss in LOSSES:
        command = [sys.executable, str(ROOT / "scripts/sweep.py"), "--config", args.config, "--out", str(args.out / loss),
                   "--grid", "model.init_args.temperature=" + ",".join(map(str, args.temperatures)),
                   "--seeds", *map(str, args.seeds), "--metrics", *ANALYSIS_METRICS]
        if args.collect:
            command.append("--collect")
        if args.linear:
            command += ["--linear", args.linear]
        overrides = [f"--model.init_args.loss={loss}"] + ([f"--model.init_args.num_hard={args.num_hard}"] if loss == "hard" else [])
        subprocess.run(command + ["--", *overrides, *args.extra], cwd=ROOT, check=False)


def read_means(results_csv: Path) -> dict[float, dict[str, float]]:
    """Per temperature, the mean over seeds of every metric of scripts/sweep.py's results.csv."""
    values: dict[float, dict[str, list[float]]] = {}
    with results_csv.open() as stream:
        for row in csv.DictReader(stream):
            temperature = float(row.pop("point").split("=")[1])
            row.pop("seed")
            for metric, value in row.items():
                if value:
                    values.setdefault(temperature, {}).setdefault(metric, []).append(float(value))
    return {tau: {metric: sum(v) / len(v) for metric, v in metrics.items()} for tau, metrics in values.items()}


def as_percent(metric: str, value: float) -> float:
    return 100 * value if "top" in metric else value


def table(means: dict[str, dict[float, dict[str, float]]], temperatures: list[float], dataset: str) -> str:
    metrics = [metric for metric in ROW_LABELS if any(metric in point for curve in means.values() for point in curve.values())]
    lines = ["| loss | dataset | metric | " + " | ".join(f"τ={tau:g}" for tau in temperatures) + " |",
             "|---|---|---|" + "---:|" * len(temperatures)]
    for loss in LOSSES:
        lines.append(f"| {loss} | CIFAR-10 (Wang & Liu supplementary, Table {1 if loss == 'ordinary' else 2}) | linear top-1 (%) | "
                     + " | ".join(f"{SEED_CIFAR10[loss][tau]:.2f}" if tau in SEED_CIFAR10[loss] else "" for tau in temperatures) + " |")
        for metric in metrics:
            cells = [means[loss].get(tau, {}).get(metric) for tau in temperatures]
            decimals = 2 if "top" in metric else 3
            lines.append(f"| {loss} | {dataset} | {ROW_LABELS[metric]} | "
                         + " | ".join("missing" if c is None else f"{as_percent(metric, c):.{decimals}f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    own, extra = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a pretraining config of a method with `temperature`, `loss` and `num_hard`")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5, 1.0])
    parser.add_argument("--num-hard", type=int, required=True, help="negatives the hard loss keeps per anchor")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--linear", help="a linear-stage config run on every checkpoint")
    parser.add_argument("--dataset", default="Digits-M", help="the dataset's name in the table")
    parser.add_argument("--collect", action="store_true", help="only rebuild the table and the plot")
    args = parser.parse_args(own)
    args.extra = extra
    run_sweeps(args)

    means = {loss: read_means(args.out / loss / "results.csv") for loss in LOSSES}
    markdown = table(means, args.temperatures, args.dataset)
    write_atomically(args.out / "temperature_sweep.md", lambda partial: partial.write_text(markdown))
    accuracy = "linear:val/probe_top1" if args.linear else "val/probe_top1"
    curves = {loss: {tau: {m: as_percent(m, v) for m, v in point.items()} for tau, point in means[loss].items()} for loss in LOSSES}
    panels = {accuracy: ROW_LABELS[accuracy], "val/knn_top1": ROW_LABELS["val/knn_top1"],
              "val/uniformity": ROW_LABELS["val/uniformity"], "val/tolerance": ROW_LABELS["val/tolerance"]}
    plot_against_temperature(curves, panels, args.out / "temperature_sweep.png", title=f"{Path(args.config).stem}: ordinary vs hard loss")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
