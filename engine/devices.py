"""What a device does cheaply."""

import ctypes
import os

import torch


def host_reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading a tensor's values on the host costs nothing: on the CPU it does not; on an accelerator it
    stalls the step until the device has caught up with the queued work (issue 11). Checks of values (labels in
    range, a prior that sums to 1) and value-dependent branches run only where this holds: the DataModules check
    labels when they build them, and the methods' own buffers hold what the methods put there."""
    return tensor.device.type == "cpu"


# glibc's mallopt parameters (malloc.h) and the values keep_freed_host_memory sets: blocks up to 32 MiB (glibc's
# largest mmap threshold on 64-bit) come from the heap, and up to 64 MiB freed at its top stay there
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD, TRIM_THRESHOLD = 32 << 20, 64 << 20


def keep_freed_host_memory() -> bool:
    """Let freed host memory serve the next tensors instead of going back to the kernel (glibc only; whether it was
    set). By default glibc maps a new block of over 128 KiB (later: the largest block freed so far) from the kernel
    and returns it when freed, so the temporaries of every step (1.5 MiB for a batch of 128 32-px images) page-fault
    on each of their 4 KiB pages again. `benchmarks/throughput.py --config configs/moco_cifar10.yaml --fake-data
    --views-only` took 707,077, 682,645 and 596,394 page faults without this call and 463,542, 470,492 and 464,978
    with it (/usr/bin/time, the whole process; interleaved runs), its batched views 3,218-4,146 against
    4,354-6,123 images/s. Where memory comes from changes no value. The settings hold for the whole process and
    the workers it forks; each malloc arena (one per thread that allocates, up to 8 per core) may keep up to 64 MiB.
    MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or malloc settings in GLIBC_TUNABLES in the environment are left
    in charge."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        os.confstr("CS_GNU_LIBC_VERSION")  # glibc only: macOS and musl raise ValueError, Windows has no os.confstr
    except (AttributeError, ValueError, OSError):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


# oneDNN ISA levels (ONEDNN_MAX_CPU_ISA) at or above which oneDNN uses a CPU's bf16 instructions (oneDNN's
# dnnl_cpu_isa_t: avx512_core_bf16 and every level after it); "ALL" is oneDNN's default, no ceiling
BF16_ONEDNN_ISAS = frozenset({
    "ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
})  # fmt: skip
BF16_PRECISIONS = frozenset({"bf16-mixed", "bf16-true", "bf16", "16-mixed", "16"})  # Lightning runs 16-mixed as bf16 on the CPU


def cpu_has_bf16_units() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX) and oneDNN may use it. Without such units
    torch falls back to generic kernels for bf16 convolutions: about 10x slower than fp32 on an AVX2 CPU
    (benchmarks/README.md), while a CPU with them trains faster in bf16 than in fp32: the peers' ResNet-18 workload
    69.3 against 33.4 images/s on an AMD AVX512-BF16 CPU (issue 37), the quickstart's small trunk 1.12x on an Intel
    AMX CPU (docs/speed.md)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return isa in BF16_ONEDNN_ISAS and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_precision(requested: str, has_bf16_units: bool) -> str:
    """The precision a CPU run trains in: a bf16 precision only where the CPU has bf16 units, fp32 otherwise."""
    if str(requested) in BF16_PRECISIONS and not has_bf16_units:
        return "32-true"
    return str(requested)


def choose_cpu_precision(trainer: dict, bf16_on_cpu: str) -> str | None:
    """For a run on the CPU: a bf16 precision becomes 32-true on a CPU without bf16 units (`trainer["precision"]` is
    set, so config.yaml and the checkpoints record it) unless `bf16_on_cpu` is `always`; the line that says so at the
    start of the run, or None."""
    requested = trainer.get("precision")
    chosen = cpu_precision(requested, cpu_has_bf16_units()) if bf16_on_cpu == "auto" else str(requested)
    if chosen == str(requested):
        return None
    trainer["precision"] = chosen
    return (f"trainer.precision {requested} -> {chosen}: this CPU has no bf16 units (AVX512-BF16 or AMX), where bf16 "
            "trains about 10x slower than fp32; --bf16_on_cpu always keeps it")


def process_group() -> dict[str, int]:
    """`num_replicas` and `rank` of this process in the process group, 1 and 0 without one: what the samplers shard by."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return {"num_replicas": torch.distributed.get_world_size() if distributed else 1, "rank": torch.distributed.get_rank() if distributed else 0}
