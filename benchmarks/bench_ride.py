"""Inference time and size of PaCo on RIDE trunks against the plain trunks (PaCo supplementary, Tables 10
and 12 report the time for a batch of 64 images on a GeForce 2080Ti; this runs on the CPU).

Each case builds the method as its config does (1,000 classes, ImageNet-LT) and times `model.classify`
in eval mode under `torch.inference_mode`: the trunk and the class centres, averaged over the experts
for RIDE, exactly what prediction runs. Time: median and minimum wall time of `--repeats` batches of 64
random 224 px images after one warm-up batch, and the median CPU time of the process per batch (with one
thread the CPU time is the wall time the batch would take alone: it does not count the time other jobs
on a shared machine hold the core). Parameters: those used at inference (trunk + centres; the projection
heads, momentum copies and queue only serve training), and the trunk alone. FLOPs: those of `classify` on
one image (`torch.utils.flop_counter`, 2 per multiply-add), the same on any hardware.

    uv run --locked python benchmarks/bench_ride.py [--threads 1] [--repeats 3] [--out benchmarks/results/ride_inference_cpu.md]
"""

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from backbones import BackboneSpec
from engine.arguments import ScriptArgumentParser
from engine.files import write_atomically
from methods import PaCo, PaCoRIDE

BATCH, SIZE, CLASSES = 64, 224, 1000
# (trunk, experts, the 2080Ti time in ms of PaCo supplementary, Table 10 for RIDE, Table 9 for the plain trunks)
CASES = [
    ("resnet50", None, "8.3 (Table 9)"),
    ("ride_resnet50", 1, "8.2"),
    ("ride_resnet50", 2, "12.0"),
    ("ride_resnet50", 3, "15.3"),
    ("resnext50_32x4d", None, "13.1 (Table 9)"),
    ("ride_resnext50", 1, "13.0"),
    ("ride_resnext50", 2, "19.0"),
    ("ride_resnext50", 3, "26.0"),
]


def build(name: str, num_experts: int | None):
    if num_experts is None:
        return PaCo(backbone=BackboneSpec(name), num_classes=CLASSES, queue_size=BATCH)
    return PaCoRIDE(backbone=BackboneSpec(name, kwargs={"num_experts": num_experts}), num_classes=CLASSES, queue_size=BATCH)


def measure(name: str, num_experts: int | None, repeats: int) -> dict:
    torch.manual_seed(0)
    model = build(name, num_experts).eval()
    images = torch.randn(BATCH, 3, SIZE, SIZE)
    times, cpu_times = [], []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start, cpu_start = time.perf_counter(), time.process_time()
            model.classify(images)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    with torch.inference_mode(), FlopCounterMode(display=False) as flops:
        model.classify(images[:1])
    count = lambda module: sum(parameter.numel() for parameter in module.parameters())  # noqa: E731
    return {
        "ms": 1000 * statistics.median(times[1:]),
        "min_ms": 1000 * min(times[1:]),
        "cpu_ms": 1000 * statistics.median(cpu_times[1:]),
        "gflops": flops.get_total_flops() / 1e9,
        "inference_params": count(model.backbone) + count(model.classifier),
        "trunk_params": count(model.backbone),
    }


def main() -> None:
    parser = ScriptArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per case, after one warm-up batch")
    parser.add_argument("--out", help="write the Markdown table here (and print it)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    rows = []
    for name, num_experts, seed_ms in CASES:
        result = measure(name, num_experts, args.repeats)
        rows.append(
            f"| {name} | {num_experts or '- (plain)'} | {result['ms']:.0f} | {result['min_ms']:.0f} | {result['cpu_ms']:.0f} | {result['gflops']:.2f} "
            f"| {result['inference_params'] / 1e6:.2f} | {result['trunk_params'] / 1e6:.2f} | {seed_ms} |"
        )
        print(rows[-1], file=sys.stderr)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    report = "\n".join(
        [
            "# PaCo on RIDE trunks: inference time per batch of 64 and parameters (CPU)",
            "",
            f"- Command: `{shlex.join(['python', 'benchmarks/bench_ride.py', *sys.argv[1:]])}` (the arguments as given; "
            f"{args.threads} thread(s), {args.repeats} repeats).",
            f"- Date: {datetime.date.today().isoformat()}. Python {platform.python_version()}, torch {torch.__version__}, "
            f"float32, {args.threads} intra-op thread(s), {platform.machine()} CPU ({os.cpu_count()} logical cores), "
            f"load average at the end {load} (a shared machine: other jobs ran).",
            f"- Setting: `model.classify` (trunk + class centres, mean over experts) of the method built as in the "
            f"configs ({CLASSES} classes) on {BATCH} random {SIZE}x{SIZE} images, eval mode, `torch.inference_mode`; "
            f"wall time median and minimum, and median CPU time of the process, over {args.repeats} batches after one "
            "warm-up batch.",
            "- Parameters at inference: trunk + centres (`nn.Linear(D, 1000)` per expert); the projection heads, "
            "the momentum copies and the queue serve training only.",
            "",
            "| trunk | experts | wall ms per batch of 64 (median) | wall ms (min) | CPU ms (median) | GFLOPs per image "
            "| parameters at inference (M) "
            "| trunk parameters (M) "
            "| PaCo supplementary, 2080Ti (ms; Table 10) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    )
    print(report)
    if args.out:
        write_atomically(Path(args.out), lambda partial: partial.write_text(report))


if __name__ == "__main__":
    main()
