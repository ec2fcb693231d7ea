"""Forward+backward time of every loss of methods/losses/ at realistic sizes, on CPU.

Sizes: B=256, D=128, K=65536 (queue / memory bank), C=1000 classes; SupCon/TCL use B=256 images x V=2 views,
JCL uses M=5 positive keys. Gradients flow into what a trainer would train (queries, online views, centre
logits), not into momentum keys or queues. Also reports the largest tensor any op builds (forward and
backward), relative to B*(K+C). Prints a Markdown table; the best of the repeats is reported because
the minimum is the timing least disturbed by other processes on a shared machine.

    uv run python benchmarks/bench_losses.py [--repeats 5]
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.arguments import ScriptArgumentParser
from engine.memory import LargestTensor
from methods.losses import (
    contrastive_loss,
    info_nce,
    jcl_loss,
    nt_xent,
    paco_loss,
    ressl_loss,
    sce_loss,
    supcon_loss,
    tcl_loss,
)

B, D, K, C, V, M = 256, 128, 65536, 1000, 2, 5


def cases(gen: torch.Generator):
    """name -> (loss of the trainable tensors, trainable tensors)."""

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=gen), dim=-1)

    q, k, queue, views = unit(B, D), unit(B, D), unit(K, D), unit(B, V, D)
    labels, queue_labels = torch.randint(0, C, (B,), generator=gen), torch.randint(0, C, (K,), generator=gen)
    centers, keys = torch.randn(B, C, generator=gen), unit(B, M, D)
    prior = torch.rand(C, generator=gen) + 0.01
    prior /= prior.sum()
    exclude = torch.randint(0, K, (B,), generator=gen)
    return {
        "info_nce": (lambda q: info_nce(q, k, queue, 0.2), (q,)),
        "nt_xent": (lambda z1, z2: nt_xent(z1, z2, 0.5), (q, k)),
        "ressl_loss": (lambda q: ressl_loss(q, k, queue, 0.1, 0.04), (q,)),
        "sce_loss": (lambda q: sce_loss(q, k, queue, 0.1, 0.05, 0.5), (q,)),
        "supcon_loss (V=2)": (lambda f: supcon_loss(f, labels % 100, 0.1, 0.07), (views,)),
        "tcl_loss (V=2)": (lambda f: tcl_loss(f, labels % 100, 0.1, 5000.0, 1.0), (views,)),
        "paco_loss": (
            lambda q, c: paco_loss(q, k, queue, labels, queue_labels, c, 0.05, 0.2, class_prior=prior),
            (q, centers),
        ),
        "jcl_loss (M=5)": (lambda q: jcl_loss(q, keys, queue, 0.2, 2.0), (q,)),
        "contrastive_loss": (lambda q: contrastive_loss(q, k, queue, 0.2, exclude=exclude), (q,)),
        "contrastive_loss (hard, n=4096)": (
            lambda q: contrastive_loss(q, k, queue, 0.2, num_hard=4096, exclude=exclude),
            (q,),
        ),
    }


def forward_backward(loss, inputs) -> None:
    for x in inputs:
        x.grad = None
    loss(*inputs).backward()


def main() -> None:
    parser = ScriptArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    print(f"B={B}, D={D}, K={K}, C={C}, V={V}, M={M}; best of {args.repeats} runs after one warm-up\n")
    print("| loss | forward+backward (ms) | largest tensor (elements) | / B·(K+C) |")
    print("|---|---:|---:|---:|")
    for name, (loss, inputs) in cases(torch.Generator().manual_seed(0)).items():
        inputs = [x.requires_grad_() for x in inputs]
        with LargestTensor() as tracker:  # also the warm-up run
            forward_backward(loss, inputs)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            forward_backward(loss, inputs)
            times.append(time.perf_counter() - start)
        ratio = tracker.numel / (B * (K + C))
        print(f"| {name} | {1e3 * min(times):.1f} | {tracker.numel:,} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
