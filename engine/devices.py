"""What a device does cheaply."""

import os

import torch


def host_reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading a tensor's values on the host costs nothing: on the CPU it does not; on an accelerator it
    stalls the step until the device has caught up with the queued work (issue 11). Checks of values (labels in
    range, a prior that sums to 1) and value-dependent branches run only where this holds: the DataModules check
    labels when they build them, and the methods' own buffers hold what the methods put there."""
    return tensor.device.type == "cpu"


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
    (benchmarks/README.md), while an AMX or AVX512-BF16 CPU trains about 2x faster in bf16."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return isa in BF16_ONEDNN_ISAS and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_precision(requested: str, has_bf16_units: bool) -> str:
    """The precision a CPU run trains in: a bf16 precision only where the CPU has bf16 units, fp32 otherwise."""
    if str(requested) in BF16_PRECISIONS and not has_bf16_units:
        return "32-true"
    return str(requested)
