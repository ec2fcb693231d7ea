"""What the collapse monitor (`analysis.CollapseMonitor`) costs against a training epoch (issue 36: under 2% at its
default interval), and what the end-of-training embedding map (`analysis.EmbeddingMap`) costs once.

The model and DataModule come from a pretraining config through the project's CLI. Lightning trains `--epochs`
epochs without validation (each epoch timed from its start to its end: data, steps, optimizer, momentum updates);
then the monitor's measurement (`analysis.monitors.collapse_metrics`: the fixed validation subset under two training
views through trunk and projector, RankMe, std, uniformity, alignment) runs `--repeats` times, after one untimed
call, and the map once. Reported: the median epoch (the first one left out when there are several: it decodes and
warms up), the median monitor call, the monitor's share of an epoch per call and amortised over its default
interval (it runs once every `every_n_epochs` epochs), and the map's time. The load average of the machine is
printed beside them: on shared cores the numbers vary. Overrides after `--` set the config's model and data; of its
trainer only `--trainer.precision` is read (another trainer setting is refused).

    uv run python benchmarks/monitor_cost.py --config configs/moco_digits.yaml -- --trainer.precision 32-true
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis import CollapseMonitor, EmbeddingMap  # noqa: E402
from analysis.embedding_map import write_embedding_map  # noqa: E402
from analysis.monitors import collapse_metrics  # noqa: E402
from benchmarks.throughput import environment  # noqa: E402
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.cli import instantiate_config  # noqa: E402
from engine.config import split_overrides  # noqa: E402
from engine.files import write_atomically  # noqa: E402


class EpochTimer(Callback):
    def __init__(self):
        self.seconds, self.start = [], 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self.start)


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def load() -> str:
    return " / ".join(f"{value:.1f}" for value in os.getloadavg())


def measure(config: str, epochs: int, repeats: int, overrides: list[str]) -> str:
    cli = instantiate_config(config, overrides)
    model, datamodule = cli.model, cli.datamodule
    monitor, embedding_map = CollapseMonitor(), EmbeddingMap()  # their defaults
    load_before = load()
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as scratch:
        trainer = L.Trainer(accelerator="auto", devices=1, precision=cli.trainer.precision, max_epochs=epochs, logger=False,
                            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=scratch, callbacks=[timer])
        trainer.fit(model, datamodule=datamodule)
        epoch_s = statistics.median(timer.seconds[1:] if epochs > 1 else timer.seconds)
        measure_monitor = lambda: collapse_metrics(model, datamodule, monitor.split, monitor.views, monitor.max_samples, monitor.seed)  # noqa: E731
        measure_monitor()  # untimed: first use of the evaluation path
        monitor_s = statistics.median(timed(measure_monitor) for _ in range(repeats))
        map_s = timed(lambda: write_embedding_map(model, datamodule, Path(scratch) / "map.png", embedding_map.split, embedding_map.space,
                                                  embedding_map.max_samples, embedding_map.max_classes, embedding_map.seed))
    images = min(monitor.max_samples, len(datamodule.splits[monitor.split]))
    rows = [
        "| measured | value |",
        "|---|---:|",
        f"| training epoch (median of {len(timer.seconds[1:]) or 1}; {trainer.num_training_batches} steps of {datamodule.batch_size}, precision {cli.trainer.precision}) | {epoch_s:.2f} s |",
        f"| collapse monitor, one call (median of {repeats}; {images} {monitor.split} images x 2 views) | {monitor_s:.2f} s |",
        f"| monitor / epoch, per call | {monitor_s / epoch_s:.2%} |",
        f"| monitor / epoch at its default interval (every {monitor.every_n_epochs} epochs) | {monitor_s / epoch_s / monitor.every_n_epochs:.2%} |",
        f"| embedding map at the end of training (once; up to {embedding_map.max_samples} images, t-SNE) | {map_s:.2f} s |",
    ]
    return f"{environment()}; {Path(config).name} {' '.join(overrides)}\nload average (1 / 5 / 15 min) before: {load_before}, after: {load()}\n\n" + "\n".join(rows)


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/moco_digits.yaml", help="a pretraining config")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs timed (the first is left out when there are several)")
    parser.add_argument("--repeats", type=int, default=5, help="timed monitor calls")
    parser.add_argument("--out", type=Path, help="also write the table here (atomically)")
    args = parser.parse_args(own)
    if args.epochs < 1 or args.repeats < 1:
        raise SystemExit(f"error: --epochs and --repeats must be >= 1, got {args.epochs} and {args.repeats}")
    # its own Lightning trainer times whole epochs: of the config's trainer it takes the precision only
    if unused := [argument for argument in overrides if argument.startswith("--trainer.") and argument.partition("=")[0] != "--trainer.precision"]:
        raise SystemExit(f"error: {unused[0]}: this benchmark reads only --trainer.precision of the trainer's settings (it times "
                         "whole epochs of its own trainer: give --epochs)")
    table = measure(args.config, args.epochs, args.repeats, overrides)
    print(table)
    if args.out:
        write_atomically(args.out, lambda partial: partial.write_text(table + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
