"""Training throughput of one pretraining config with its two data pipelines (issue 11).

For each `data.pipeline` (`cpu`: PIL views drawn per image in the DataLoader workers; `gpu`: raw
uint8 batches, views drawn per sample on the training device by `datamodules.batched.BatchedAugment`) the
model and DataModule are built by the project's CLI from the config, then Lightning trains W warm-up and
N timed steps. A callback splits every timed step at two points (on CUDA it synchronises there only, never
inside the step):

- data: from the end of one step to the start of the next: waiting for the loader's batch, the transfer,
  and with `gpu` the augmentation on the device;
- compute: forward, backward, optimizer and momentum update of the step.

Reported: training images/s after warm-up, the data share of the step time, peak GPU memory, model
FLOPs utilisation (the FLOPs of the first warm-up step, forward + backward, counted once by
`torch.utils.flop_counter`, against the GPU's dense bf16 peak), and on CUDA the host synchronisations per
step (`torch.cuda.set_sync_debug_mode`, between the two timing points), plus the ratio gpu / cpu. The
trainer has the per-step callbacks of a real run (the non-finite loss guard: one host read per step by
design; the throughput log). `--profile DIR` writes, per pipeline, the operator table of
`torch.profiler` over 5 timed steps (what bounds a pipeline that misses its target).
`--views-only` instead measures the CPU-side ceiling: images/s of each configured PIL view alone, in one
process and through a DataLoader with K workers, and of the batched views on this process's device.

    uv run python benchmarks/throughput.py --config configs/sce_cifar10.yaml --fake-data \
        [--pipelines cpu gpu] [--steps 20] [--warmup 5] [--num-workers 16] [--out FILE] [--profile DIR] [-- overrides]
    uv run python benchmarks/throughput.py --config configs/sce_cifar10.yaml --fake-data --views-only
"""

import datetime
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torchvision
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Subset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datamodules.pipeline import PIPELINES  # noqa: E402
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.cli import ContrastlabCLI, instantiate_config  # noqa: E402
from engine.config import split_overrides  # noqa: E402
from engine.files import write_atomically  # noqa: E402
from engine.non_finite import NonFiniteLossGuard  # noqa: E402
from engine.tracking import TrainingThroughput  # noqa: E402
from benchmarks.portable import accept_fake_cifar10, loader_rate, one_process_rate, write_fake_cifar10  # noqa: E402

# Dense bf16 tensor-core peaks (vendor data sheets), matched in order against torch.cuda.get_device_name().
BF16_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


PROFILED_STEPS = 5


class StepTimer(Callback):
    """Data and compute time of every step after `warmup`; the FLOPs of the first step; on CUDA the host
    synchronisations inside the timed steps; optionally a profile of the first timed steps."""

    def __init__(self, warmup: int, profile: bool = False):
        self.warmup, self.data_s, self.compute_s = warmup, [], []
        self.flops = self.batch_images = 0
        self.counter: FlopCounterMode | None = None
        self.step_end = self.step_start = 0.0
        self.syncs: list[warnings.WarningMessage] = []
        self.profiler = torch.profiler.profile(record_shapes=False) if profile else None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        synchronize()
        self.step_start = time.perf_counter()
        timed = trainer.global_step >= self.warmup
        if timed:
            self.data_s.append(self.step_start - self.step_end)
        if trainer.global_step == 0:
            self.counter = FlopCounterMode(display=False)
            self.counter.__enter__()
        if self.profiler is not None and trainer.global_step == self.warmup:
            self.profiler.__enter__()
        if timed and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")  # from here to the step's end: what the step itself waits for

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.flops, self.batch_images, self.counter = self.counter.get_total_flops(), len(batch["index"]), None
        synchronize()
        self.step_end = time.perf_counter()
        if trainer.global_step > self.warmup:  # global_step counts this step already
            self.compute_s.append(self.step_end - self.step_start)
        if self.profiler is not None and trainer.global_step == self.warmup + PROFILED_STEPS:
            self.profiler.__exit__(None, None, None)

    def profile_table(self) -> str:
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        return self.profiler.key_averages().table(sort_by=sort_by, row_limit=25)


def build(config: str, pipeline: str, overrides: list[str]) -> ContrastlabCLI:
    return instantiate_config(config, [f"--data.init_args.pipeline={pipeline}", *overrides])


def measure_training(config: str, pipeline: str, steps: int, warmup: int, overrides: list[str], profile_dir: Path | None = None) -> dict:
    cli = build(config, pipeline, overrides)
    timer = StepTimer(warmup, profile=profile_dir is not None)
    per_step = [callback for callback in cli.trainer.callbacks if isinstance(callback, (NonFiniteLossGuard, TrainingThroughput))]
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(
            accelerator="auto", devices=1, precision=cli.trainer.precision, max_steps=warmup + steps, logger=False,
            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=scratch, callbacks=[timer, *per_step],
        )
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(cli.model, datamodule=cli.datamodule)
    step_s = sum(timer.data_s) + sum(timer.compute_s)
    images_per_s = steps * cli.datamodule.batch_size / step_s
    row = {"pipeline": pipeline, "workers": cli.datamodule.num_workers, "batch": cli.datamodule.batch_size,
           "images_per_s": images_per_s, "data_share": sum(timer.data_s) / step_s,
           "gflops_per_image": timer.flops / timer.batch_images / 1e9, "peak_memory": "n/a", "mfu": "n/a", "syncs": "n/a"}
    if torch.cuda.is_available():
        row["peak_memory"] = f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        name = torch.cuda.get_device_name()
        peak = next((flops for model, flops in BF16_PEAK_FLOPS if model in name), None)
        row["mfu"] = f"{images_per_s * timer.flops / timer.batch_images / peak:.1%}" if peak else f"n/a (no bf16 peak known for {name})"
        row["syncs"] = f"{sum('synchronizing' in str(w.message) for w in caught) / steps:.1f}"
    if profile_dir is not None:
        write_atomically(profile_dir / f"profile_{pipeline}.txt", lambda partial: partial.write_text(timer.profile_table() + "\n"))
    return row


def training_table(rows: list[dict]) -> str:
    lines = ["| pipeline | workers | batch | images/s | data share | GFLOPs/image | peak GPU memory | MFU (bf16) | host syncs/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['pipeline']} | {r['workers']} | {r['batch']} | {r['images_per_s']:,.0f} | {r['data_share']:.0%} | "
              f"{r['gflops_per_image']:.2f} | {r['peak_memory']} | {r['mfu']} | {r['syncs']} |" for r in rows]
    by_pipeline = {row["pipeline"]: row["images_per_s"] for row in rows}
    if {"cpu", "gpu"} <= set(by_pipeline):
        lines.append(f"\nratio gpu / cpu: {by_pipeline['gpu'] / by_pipeline['cpu']:.2f}x")
    return "\n".join(lines)


def environment() -> str:
    """The date, device and versions a table was measured with (what benchmarks/README.md records beside it)."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    return (f"measured {datetime.date.today().isoformat()} on {device}; torch {torch.__version__}, "
            f"torchvision {torchvision.__version__}, Lightning {L.__version__}")


def view_rates(config: str, images: int, overrides: list[str]) -> list[dict]:
    """Images/s of every configured view alone and of all of them (what one training image costs): per PIL image in
    one process, through the DataModule's DataLoader, and batched (`gpu` pipeline) on this process's device."""
    workers_data = build(config, "cpu", overrides).datamodule
    device_data = build(config, "gpu", overrides).datamodule
    workers_data.setup()
    train = workers_data.splits["train"]
    images = min(images, len(train))
    pil_images = [train[index][0] for index in range(images)]
    raw = torch.stack([torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1) for image in pil_images])
    selections = {name: [name] for name in workers_data.views} | {" + ".join(workers_data.views): list(workers_data.views)}
    rows = []
    for label, names in selections.items():
        views = [workers_data.views[name] for name in names]
        one_process = one_process_rate(pil_images, lambda image: [view(image) for view in views])
        served, _ = workers_data.served(Subset(train, range(images)), {name: workers_data.views[name] for name in names})
        loaded = loader_rate(served, workers_data.batch_size, workers_data.num_workers)
        start = time.perf_counter()
        for first in range(0, images, device_data.batch_size):
            for name in names:
                device_data.views[name](raw[first:first + device_data.batch_size])
        batched = images / (time.perf_counter() - start)
        rows.append({"views": label, "one_process": one_process, "loader": loaded, "batched": batched,
                     "workers": workers_data.num_workers, "threads": torch.get_num_threads()})
    return rows


def views_table(rows: list[dict]) -> str:
    lines = [f"| views | PIL, 1 process | PIL, DataLoader {rows[0]['workers']} workers | batched (gpu pipeline) on CPU, {rows[0]['threads']} threads |",
             "|---|---:|---:|---:|"]
    lines += [f"| {r['views']} | {r['one_process']:,.0f} | {r['loader']:,.0f} | {r['batched']:,.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per pipeline")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first one counts the FLOPs)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--data-root", help="data.init_args.root")
    data.add_argument("--fake-data", action="store_true", help="random CIFAR-10 in its real format, in a temporary folder")
    parser.add_argument("--fake-images", type=int, default=10240, help="training images of --fake-data (enough for one epoch of all steps)")
    parser.add_argument("--num-workers", type=int, help="data.init_args.num_workers (default: the config's)")
    parser.add_argument("--views-only", action="store_true", help="the CPU-side ceiling of the views, no model")
    parser.add_argument("--view-images", type=int, default=2560, help="images per --views-only measurement")
    parser.add_argument("--out", type=Path, help="also write the table here (atomically)")
    parser.add_argument("--profile", type=Path, metavar="DIR", help=f"write profile_<pipeline>.txt here: torch.profiler's operator table of {PROFILED_STEPS} timed steps")
    args = parser.parse_args(own)
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit(f"error: --steps and --warmup must be >= 1, got {args.steps} and {args.warmup}")
    if args.profile is not None and args.steps < PROFILED_STEPS:
        raise SystemExit(f"error: --profile needs --steps >= {PROFILED_STEPS}, got {args.steps}")
    with tempfile.TemporaryDirectory() as fake_root:
        if args.fake_data:
            write_fake_cifar10(Path(fake_root), args.fake_images)
            accept_fake_cifar10(Path(fake_root))
            overrides = [f"--data.init_args.root={fake_root}", *overrides]
        elif args.data_root:
            overrides = [f"--data.init_args.root={args.data_root}", *overrides]
        if args.num_workers is not None:
            overrides = [f"--data.init_args.num_workers={args.num_workers}", *overrides]
        try:  # the data's files are opened here (`setup`): files that are not the dataset's are one error line, as in a run
            if args.views_only:
                table = views_table(view_rates(args.config, args.view_images, overrides))
            else:
                table = training_table([measure_training(args.config, pipeline, args.steps, args.warmup, overrides, args.profile) for pipeline in args.pipelines])
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
    table = f"{environment()}\n\n{table}"
    print(table)
    if args.out:
        write_atomically(args.out, lambda partial: partial.write_text(table + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
