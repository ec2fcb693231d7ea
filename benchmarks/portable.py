"""Benchmark helpers that run in any system's environment: they import only numpy, torch and torchvision.

- Random images in CIFAR-10's real on-disk format (python-pickle batches): throughput does not depend on the pixel
  values, so the benchmarks train on these. torchvision's CIFAR10 class checks the official MD5 checksums when it
  opens the folder; `accept_fake_cifar10` replaces them, in the calling process, by those of the files written here.
- Images/s of per-image views, in one process and through a DataLoader, measured the same way for contrastlab's views
  (`benchmarks/throughput.py --views-only`) and for a peer library's (`benchmarks/peers.py`, in the peer's own venv).
- The CPU a measurement ran on, for the tables' headers (`benchmarks/peers.py`, `benchmarks/startup.py`).
"""

import hashlib
import os
import pickle
import platform
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torchvision
from torch.utils.data import DataLoader, Dataset

TEST_IMAGES = 256


def write_fake_cifar10(root: Path, images: int) -> None:
    """`images` training images (in 5 batches) and 256 test images under `root/cifar-10-batches-py`, seed 0."""
    folder = root / torchvision.datasets.CIFAR10.base_folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    per_batch = -(-images // 5)
    for name in [f"data_batch_{index}" for index in range(1, 6)] + ["test_batch"]:
        count = per_batch if name != "test_batch" else TEST_IMAGES
        batch = {"data": rng.integers(0, 256, (count, 3 * 32 * 32), dtype=np.uint8), "labels": rng.integers(0, 10, count).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{index}" for index in range(10)]}))


def accept_fake_cifar10(root: Path) -> None:
    """Make torchvision's CIFAR10 accept the files under `root` (their checksums instead of the official ones)."""
    folder = root / torchvision.datasets.CIFAR10.base_folder
    dataset = torchvision.datasets.CIFAR10
    md5 = lambda name: hashlib.md5((folder / name).read_bytes()).hexdigest()  # noqa: E731
    dataset.train_list = [[name, md5(name)] for name, _ in dataset.train_list]
    dataset.test_list = [[name, md5(name)] for name, _ in dataset.test_list]
    dataset.meta = dataset.meta | {"md5": md5(dataset.meta["filename"])}


def one_process_rate(images: list, views: Callable[[Any], Any]) -> float:
    """Images/s of `views` applied to each image in this process with one torch thread, as in a DataLoader worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        for image in images:
            views(image)
        return len(images) / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def loader_rate(dataset: Dataset, batch_size: int, workers: int) -> float:
    """Images/s of a DataLoader with `workers` workers drawing every sample of `dataset`, worker start-up included."""
    start = time.perf_counter()
    for _ in DataLoader(dataset, batch_size=batch_size, num_workers=workers):
        pass
    return len(dataset) / (time.perf_counter() - start)


def cpu_description() -> str:
    """The CPU a measurement ran on: model, cores, the kernels torch dispatches to and its bf16 units (read from
    /proc/cpuinfo on Linux; elsewhere the processor's name only)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    flags = next((line for line in lines if line.startswith("flags")), "").split()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor() or platform.machine())
    bf16 = [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags] or (["none"] if lines else ["unknown"])
    return (f"{model}, {os.cpu_count()} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"bf16 units: {', '.join(bf16)}")
