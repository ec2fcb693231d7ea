"""Cost of JCL's M' positive keys against MoCo v2 (JCL supplement section 2), on CPU.

One training step = the method's `step` (online forward of the query view, momentum forward
of the key view(s), loss, enqueue) + backward + SGD step + EMA update, on a fixed random batch. Setting:
ResNet-18 (ImageNet stem) at 64x64 px, batch 64, projector 512-512-128, queue 4,096, float32. Every case
runs in a fresh process, so that its memory high-water mark is its own. Reported per case:

- time per step: the best of `--steps` timed steps after one warm-up step (the minimum is the timing least
  disturbed by other processes on a shared machine);
- peak step memory: the increase of the process's peak resident set size (`ru_maxrss`) over the training
  steps, relative to the peak after building the model, optimizer state and batch: the memory the step
  itself needs at its high point (transient activations included), as the operating system counts it;
- kept for backward: the bytes of the tensors autograd saves for the backward pass during one step
  (`torch.autograd.graph.saved_tensors_hooks`), exact.

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_jcl.py [--keys 1 3 5 8] [--steps 5]
"""

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import torch

from backbones import BackboneSpec, MLPSpec
from engine.arguments import ScriptArgumentParser
from methods import JCL, MoCoV2
from methods.momentum import MomentumSpec, ema_update_

BATCH, SIZE, QUEUE = 64, 64, 4096


def build(method: str, num_keys: int):
    options = dict(backbone=BackboneSpec(name="resnet18"), projector=MLPSpec(hidden_dim=512, output_dim=128, batch_norm=False),
                   queue_size=QUEUE, temperature=0.2, momentum=MomentumSpec(base=0.999, shuffle_bn=False), knn_k=0)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)
    if method == "moco":
        model = MoCoV2(**options)
        views = {"query": query, "key": torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)}
    else:
        model = JCL(jcl_lambda=4.0, **options)
        views = {"query": query, "keys": torch.randn(BATCH, num_keys, 3, SIZE, SIZE, generator=generator)}
    return model.train(), {"views": views, "label": torch.zeros(BATCH, dtype=torch.long)}


def train_step(model, batch, optimizer) -> None:
    loss, _ = model.step(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    ema_update_(model.backbone, model.target_backbone, 0.999)
    ema_update_(model.projector, model.target_projector, 0.999)


def bytes_kept_for_backward(model, batch) -> int:
    saved = []
    pack = lambda tensor: saved.append(tensor.numel() * tensor.element_size()) or tensor  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.step(batch)
    return sum(saved)


def measure(method: str, num_keys: int, steps: int) -> dict:
    """One case, in this process."""
    warnings.filterwarnings("ignore")  # `self.log` outside a Trainer
    torch.manual_seed(0)
    model, batch = build(method, num_keys)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.03, momentum=0.9)
    for group in optimizer.param_groups:  # allocate the momentum buffers before the baseline
        for param in group["params"]:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)
            param.grad = torch.zeros_like(param)
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        train_step(model, batch, optimizer)
        times.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"method": method, "keys": num_keys, "step_ms": 1000 * min(times[1:]),
            "peak_step_mib": (peak_kib - baseline_kib) / 1024, "backward_mib": bytes_kept_for_backward(model, batch) / 2**20}


def main() -> None:
    parser = ScriptArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1, 3, 5, 8], help="M' values for JCL")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per case (after one warm-up)")
    parser.add_argument("--case", nargs=2, metavar=("METHOD", "KEYS"), help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(measure(args.case[0], int(args.case[1]), args.steps)))
        return
    cases = [("moco", 1)] + [("jcl", keys) for keys in args.keys]
    results = []
    for method, keys in cases:
        command = [sys.executable, __file__, "--case", method, str(keys), "--steps", str(args.steps)]
        results.append(json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
    moco = results[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s); batch {BATCH}, {SIZE}x{SIZE} px, ResNet-18, queue {QUEUE}\n")
    print("| method | M' | key images per step | time per step (ms) | x MoCo | peak step memory (MiB) | kept for backward (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for result in results:
        name = "MoCo v2" if result["method"] == "moco" else "JCL"
        keys = "-" if result["method"] == "moco" else result["keys"]
        print(f"| {name} | {keys} | {BATCH * result['keys']} | {result['step_ms']:.0f} | {result['step_ms'] / moco['step_ms']:.2f} "
              f"| {result['peak_step_mib']:.0f} | {result['backward_mib']:.1f} |")


if __name__ == "__main__":
    main()
