"""Where the seconds before the first training step go (issue 37), on this machine.

    uv run --locked python benchmarks/startup.py [--config configs/moco_digits.yaml] [--rounds 3] [--out FILE]

Round after round, each measurement in a process of its own, started from here with nothing else to do:
- `import torch`, `import lightning`, `import main_pretrain`: the wall time of `python -c "import ..."`;
- the config's run for one step (no validation), with the config's own logger (W&B offline unless WANDB_MODE is
  set) and with `--trainer.logger=false`: the seconds from starting the process to the `setup` of its callbacks and
  to the start of its first training batch, written by `StartupStamps`;
- an empty program (`-c pass`) started through uv's `run --locked`, when uv is on PATH: what uv adds to a command.
Prints the median and every round of each measurement (and writes the table to `--out`).
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.portable import cpu_description  # noqa: E402
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.files import write_atomically  # noqa: E402

IMPORTS = ("torch", "lightning", "main_pretrain")
STARTED, STAMPS = "CONTRASTLAB_STARTED", "CONTRASTLAB_STAMPS"  # the run's start time, where its stamps go


class StartupStamps(Callback):
    """Seconds from the process's start (the time in CONTRASTLAB_STARTED) to `setup` and to the first training batch,
    written as JSON to the file CONTRASTLAB_STAMPS names."""

    def __init__(self):
        self.stamps: dict[str, float] = {}

    def _stamp(self, moment: str) -> None:
        if moment not in self.stamps:
            self.stamps[moment] = time.time() - float(os.environ[STARTED])
            Path(os.environ[STAMPS]).write_text(json.dumps(self.stamps))

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._stamp("setup")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._stamp("first batch")


class MeasurementFailed(Exception):
    pass


def run(argv: list[str], env: dict | None = None) -> float:
    """The wall seconds of a process; its last line of error output if it fails."""
    start = time.time()
    result = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"exit {result.returncode}"]
        raise MeasurementFailed(f"{' '.join(argv)} failed: {lines[-1]}")
    return time.time() - start


def one_step(config: str, logger: bool) -> dict[str, float]:
    """The stamps of one step of `config`, with its logger or without one."""
    with tempfile.TemporaryDirectory() as scratch:
        stamps = Path(scratch) / "stamps.json"
        argv = [sys.executable, str(ROOT / "main_pretrain.py"), "fit", "--config", config, "--trainer.max_steps=1",
                "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={Path(scratch) / 'run'}", "--trainer.callbacks+=benchmarks.startup.StartupStamps",
                *([] if logger else ["--trainer.logger=false"])]  # fmt: skip
        # W&B offline unless WANDB_MODE says otherwise: a benchmark makes no runs in the user's W&B projects
        run(argv, env={"WANDB_MODE": "offline", **os.environ, STARTED: repr(time.time()), STAMPS: str(stamps)})
        return json.loads(stamps.read_text())


def one_round(config: str) -> dict[str, float]:
    seconds = {f"import {module}": run([sys.executable, "-c", f"import {module}"]) for module in IMPORTS}
    for logger, label in ((True, "with the config's logger"), (False, "without a logger")):
        for moment, value in one_step(config, logger).items():
            seconds[f"one step {label}: {moment}"] = value
    if shutil.which("uv"):
        seconds["empty program started by uv (run --locked)"] = run(["uv", "run", "--locked", "-q", "python", "-c", "pass"])
    return seconds


def table(rounds: list[dict[str, float]]) -> str:
    lines = ["| seconds (a process each) | median | each round |", "|---|---:|---|"]
    for name in rounds[0]:
        values = [measured[name] for measured in rounds]
        lines.append(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{value:.2f}' for value in values)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = ScriptArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/moco_digits.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the table here (atomically)")
    args = parser.parse_args(argv)
    if not (ROOT / args.config).is_file():
        parser.error(f"--config {args.config!r} does not exist")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        rounds = [one_round(args.config) for _ in range(args.rounds)]
    except MeasurementFailed as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
    text = (f"{table(rounds)}\n\nmeasured {time.strftime('%Y-%m-%d')} on {cpu_description()}, "
            f"{args.rounds} round{'s' if args.rounds != 1 else ''} with {args.config}")
    print(text)
    if args.out:
        write_atomically(args.out, lambda partial: partial.write_text(text + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
