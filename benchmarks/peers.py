"""Training speed side by side with the peers (issue 37): the same MoCo v2 workload in contrastlab, lightly and
stable-pretraining, each in its own environment with the same torch, in interleaved rounds.

    uv run --locked python benchmarks/peers.py [--rounds 3] [--warmup 5] [--steps 30] [--out FILE]

1. Makes a venv per peer under `--venvs` (default `~/.cache/contrastlab/peer-venvs`): `uv venv` + `uv pip install`
   of lightly 1.6.0 or stable-pretraining 0.1.8 with the torch and torchvision versions of contrastlab's locked
   environment, the one this script runs in; contrastlab runs in its own locked environment.
2. Writes 5,120 random images once, in CIFAR-10's real format (`portable.write_fake_cifar10`).
3. Round after round, runs each system once as its own process (`benchmarks/peer_workloads.py`, which describes the
   workload and how each system is written): W warm-up and N timed steps, the load average read before and after.
   Per system: the median over the rounds of the training images/s of the timed steps, and of the start-up, the seconds
   from starting the process to the start of its first training step.
4. In the same rounds, the views alone: images/s of drawing the two MoCo v2 views of an image with contrastlab's
   pipelines and with lightly's `MoCoV2Transform`, in one process and through a DataLoader with the same workers
   (`--skip-training`: only these; `--skip-views`: only the training runs).

Prints the tables (and writes them to `--out`): the medians with the ratios to the faster peer (of the medians, and
the median of the rounds' own ratios), and every run.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.files import write_atomically  # noqa: E402
from peer_workloads import TRAINED, VIEWED  # noqa: E402
from benchmarks.portable import cpu_description, write_fake_cifar10  # noqa: E402

HERE = Path(__file__).resolve().parent
PEER_PACKAGES = {"lightly": "lightly==1.6.0", "stable-pretraining": "stable-pretraining==0.1.8"}
PEERS = tuple(PEER_PACKAGES)
# outside the checkout: a venv inside it would be read by every scan of the repository's files (tests/test_compat.py)
VENVS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "contrastlab" / "peer-venvs"
# what each environment reports about itself (the packages that are not installed are left out)
VERSIONS = ("torch", "torchvision", "lightning", "pytorch-lightning", "lightly", "stable-pretraining", "pillow")


def fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = ScriptArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds: every system runs once per round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--images", type=int, default=5120, help="random training images written once")
    parser.add_argument("--view-images", type=int, default=2560, help="images per views measurement")
    parser.add_argument("--systems", nargs="+", choices=TRAINED, default=list(TRAINED))
    parser.add_argument("--skip-views", action="store_true", help="train only, no views measurement")
    parser.add_argument("--skip-training", action="store_true", help="the views only, no training runs")
    parser.add_argument("--venvs", type=Path, default=VENVS, help="where the peers' venvs are made (and kept)")
    parser.add_argument("--logs", type=Path, help="keep each run's output here (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="also write the tables here (atomically)")
    options = parser.parse_args(argv)
    for name in ("rounds", "warmup", "steps", "batch", "images", "view_images"):
        if getattr(options, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
    if options.skip_views and options.skip_training:
        fail("--skip-views and --skip-training together leave nothing to measure")
    if options.workers < 0:
        fail(f"--workers must be >= 0, got {options.workers}")
    if not options.skip_training and (options.warmup + options.steps) * options.batch > options.images:
        fail(f"--warmup {options.warmup} + --steps {options.steps} batches of {options.batch} need "
             f"{(options.warmup + options.steps) * options.batch} images, more than one epoch of --images {options.images}: "
             "the timed steps must not cross an epoch's end")
    return options


def uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")  # `uv run` names itself in UV
    if found is None:
        fail("uv is not on PATH: the peers' venvs are made with `uv venv` and `uv pip install` (pip install uv)")
    return found


def python_of(system: str, venvs: Path) -> Path:
    return Path(sys.executable) if system.startswith("contrastlab") else venvs / system / "bin" / "python"


def make_venv(peer: str, venvs: Path, log: Path) -> None:
    """The peer's venv with contrastlab's torch and torchvision (an installed one is only checked by uv)."""
    python = python_of(peer, venvs)
    steps = [] if python.exists() else [[uv(), "venv", "--python", sys.executable, str(python.parents[1])]]
    steps.append([uv(), "pip", "install", "--python", str(python), "--compile-bytecode", f"torch=={version('torch')}",
                  f"torchvision=={version('torchvision')}", PEER_PACKAGES[peer]])
    for command in steps:
        with log.open("a") as output:
            if subprocess.run(command, stdout=output, stderr=subprocess.STDOUT).returncode != 0:
                fail(f"making the {peer} venv failed: {' '.join(command)} (its output: {log})")


def versions_of(python: Path) -> dict[str, str]:
    script = ("import importlib.metadata as m, json\nfound = {}\nfor name in %r:\n    try: found[name] = m.version(name)\n"
              "    except m.PackageNotFoundError: pass\nprint(json.dumps(found))") % (VERSIONS,)
    return json.loads(subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout)


def timed_rate(record: dict, warmup: int, steps: int, batch: int) -> float:
    """Training images/s over the timed steps: from the end of the last warm-up step to the end of the last step."""
    ends = record["step_ends"]
    if len(ends) < warmup + steps:
        raise ValueError(f"the run recorded {len(ends)} steps, fewer than {warmup} + {steps}")
    return steps * batch / (ends[warmup + steps - 1] - ends[warmup - 1])


def run_once(mode: str, system: str, options, data: Path, logs: Path, label: str) -> dict:
    """One process of `peer_workloads.py` in the system's environment, in a scratch working folder: its record, the
    load average before and after, and (training) its images/s and start-up."""
    log, result = logs / f"{label}.log", logs / f"{label}.json"
    command = [str(python_of(system, options.venvs)), str(HERE / "peer_workloads.py"), mode, system, "--data", str(data),
               "--json", str(result), "--warmup", str(options.warmup), "--steps", str(options.steps), "--batch",
               str(options.batch), "--workers", str(options.workers), "--images", str(options.view_images)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as workdir, log.open("w") as output:
        started = time.time()
        finished = subprocess.run(command, cwd=workdir, stdout=output, stderr=subprocess.STDOUT)
    if finished.returncode != 0:
        fail(f"{mode} {system} exited with {finished.returncode}: {log}")
    record = json.loads(result.read_text()) | {"system": system, "load_before": load_before, "load_after": os.getloadavg()[0]}
    if mode == "train":
        record["images_per_s"] = timed_rate(record, options.warmup, options.steps, options.batch)
        record["startup_s"] = record["first_step_at"] - started
    return record


def median(runs: list[dict], system: str, key: str) -> float:
    return statistics.median(run[key] for run in runs if run["system"] == system)


def paired_ratio(runs: list[dict], system: str, other: str) -> float:
    """The median over the rounds of `system`'s images/s ÷ `other`'s in the same round: the two ran minutes apart,
    so a machine that drifts over the rounds moves both sides of each ratio."""
    rates = {(run["system"], run["round"]): run["images_per_s"] for run in runs}
    return statistics.median(rates[system, round_] / rates[other, round_] for (name, round_) in rates
                             if name == system and (other, round_) in rates)


def training_tables(runs: list[dict]) -> str:
    systems = list(dict.fromkeys(run["system"] for run in runs))
    rates = {system: median(runs, system, "images_per_s") for system in systems}
    startups = {system: median(runs, system, "startup_s") for system in systems}
    peers = [system for system in systems if system in PEERS]
    faster = max(peers, key=rates.get) if peers else None
    lines = ["| system | precision | views | channels-last | images/s (median) | start-up s (median) | "
             + (f"images/s ÷ {faster}'s (the faster peer) | the same, round by round (median) | " if faster else "")
             + ("start-up − lightly's s |" if "lightly" in systems else ""),
             "|---|---|---|---|---:|---:|" + ("---:|---:|" if faster else "") + ("---:|" if "lightly" in systems else "")]
    for system in systems:
        settings = next(run["settings"] for run in runs if run["system"] == system)
        views = "PIL per image, workers" if settings["pipeline"] == "cpu" else "batched on the device"
        line = (f"| {system} | {settings['precision']} | {views} | {'yes' if settings['channels_last'] else 'no'} | "
                f"{rates[system]:.1f} | {startups[system]:.1f} |")
        line += f" {rates[system] / rates[faster]:.2f}x | {paired_ratio(runs, system, faster):.2f}x |" if faster else ""
        line += f" {startups[system] - startups['lightly']:+.1f} |" if "lightly" in systems else ""
        lines.append(line)
    lines += ["", "| round | system | images/s | start-up s | load before | load after |", "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {run['round']} | {run['system']} | {run['images_per_s']:.1f} | {run['startup_s']:.1f} | {run['load_before']:.2f} | "
              f"{run['load_after']:.2f} |" for run in runs]
    return "\n".join(lines)


def views_tables(runs: list[dict]) -> str:
    columns = ("one_process", "loader", "batched")
    threads, workers = runs[0]["threads"], runs[0]["workers"]
    lines = [f"| system | views | PIL, 1 process | PIL, DataLoader {workers} workers | batched on the CPU, {threads} threads |",
             "|---|---|---:|---:|---:|"]
    best = {}
    for system in dict.fromkeys(run["system"] for run in runs):
        own = [run for run in runs if run["system"] == system]
        values = {column: median(own, system, column) if own[0][column] is not None else None for column in columns}
        best[system] = max(value for value in values.values() if value is not None)
        lines.append(f"| {system} | {own[0]['views']} | " + " | ".join("n/a" if values[c] is None else f"{values[c]:,.0f}" for c in columns) + " |")
    if set(VIEWED) <= set(best):
        lines.append(f"\nthe fastest views of each on these {workers} cores, contrastlab / lightly: {best['contrastlab'] / best['lightly']:.2f}x")
    lines += ["", "| round | system | PIL, 1 process | PIL, DataLoader | batched | load before | load after |", "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {run['round']} | {run['system']} | " + " | ".join("n/a" if run[c] is None else f"{run[c]:,.0f}" for c in columns)
              + f" | {run['load_before']:.2f} | {run['load_after']:.2f} |" for run in runs]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    options = parse(argv)
    trained_systems = [] if options.skip_training else options.systems
    peers = [system for system in PEERS if system in trained_systems or (system == "lightly" and not options.skip_views)]
    options.venvs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        logs = options.logs or Path(scratch) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for peer in peers:
            print(f"making the {peer} venv under {options.venvs} ...", flush=True)
            make_venv(peer, options.venvs, logs / f"venv_{peer}.log")
        environments = {system: versions_of(python_of(system, options.venvs)) for system in ["contrastlab", *peers]}
        for system, found in environments.items():
            if (found["torch"], found["torchvision"]) != (version("torch"), version("torchvision")):
                fail(f"the {system} environment has torch {found['torch']} / torchvision {found['torchvision']}, not contrastlab's")
        data = Path(scratch) / "data"
        write_fake_cifar10(data, options.images)
        trained, viewed = [], []
        for round_ in range(1, options.rounds + 1):
            if not options.skip_views:
                for system in VIEWED:
                    viewed.append(run_once("views", system, options, data, logs, f"views_{system}_{round_}")
                                  | {"round": round_, "workers": options.workers})
                    print(f"round {round_} views {system}: {viewed[-1]['loader']:,.0f} images/s through the DataLoader", flush=True)
            for system in trained_systems:
                trained.append(run_once("train", system, options, data, logs, f"train_{system}_{round_}") | {"round": round_})
                print(f"round {round_} {system}: {trained[-1]['images_per_s']:.1f} images/s, first step after "
                      f"{trained[-1]['startup_s']:.1f} s", flush=True)
    measured = (f"{options.view_images} images in batches of {options.batch}" if options.skip_training
                else f"{options.warmup} warm-up + {options.steps} timed steps, batch {options.batch}")
    header = (f"measured {datetime.date.today().isoformat()} on {cpu_description()}; {options.rounds} interleaved rounds of "
              f"{measured}, {options.workers} workers; "
              + "; ".join(f"{system}: " + ", ".join(f"{name} {number}" for name, number in found.items())
                          for system, found in environments.items()))
    tables = header + ("" if options.skip_training else f"\n\n{training_tables(trained)}") + ("" if options.skip_views else f"\n\nviews:\n\n{views_tables(viewed)}")
    print(tables)
    if options.out:
        write_atomically(options.out, lambda partial: partial.write_text(tables + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
