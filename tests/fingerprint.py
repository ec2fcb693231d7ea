"""Fingerprints of a model's state after a few training steps, for the tests that pin them (`test_pinned_steps.py`,
`test_old_checkpoints.py`).

On the machine that recorded them, the state is compared bit for bit (a SHA-256 of every tensor's bytes). On a CPU
of another kind, kernels round differently, so the bytes differ while the computation is the same. There the
fingerprint is compared instead, per part: the parameters and the buffers of each top-level module (trunk, heads,
momentum encoder, queue, ...) apart, so that the BatchNorm statistics, which a few steps move far more than the
weights, cannot hide a change of the weights' update (an EMA not applied, no weight decay):

- every tensor's name, shape and dtype, and the integer tensors (queue pointers and labels, class counts, BatchNorm
  step counts), exactly;
- the floating-point state x and its change over the training steps, d = x - x_before, each by its norm and its
  projections on `DIRECTIONS` fixed random directions with N(0, 1) entries. A projection has the size of the norm,
  so both are compared to a tolerance times the recorded norm. The change matters most: a few steps move the
  weights little, and two methods that share a trunk and its initialisation (CE and Balanced Softmax) differ in
  their change only; a parameter sum cannot even see it (cross-entropy gradients sum to zero over the classes).

The directions come from NumPy's PCG64 generator, which gives the same numbers on every CPU.

So that another kind need not rely on the tolerances, which cannot see a small change of an update, a pinned file keeps
beside its recording (`machine`, `cases`) the bits of other machine kinds (`kinds`, by `kernel_kind`): each case's loss
and the SHA-256 of each part as that kind computes them, recorded there with `CONTRASTLAB_REPIN=kind` once its
numbers agree with the recording to the tolerances. A machine of such a kind compares them bit for bit.
"""

import fcntl
import hashlib
import json
import math
import platform
import zlib
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

DIRECTIONS = 4
RECORDED_THREADS = 2  # the intra-op threads of the recording machine: the tests compute with as many (conftest.py)
# Read when torch loads: an AVX-512 CPU then computes with the AVX2 kernels of ATen and oneDNN, and gives the numbers
# an AVX2 machine recorded bit for bit (the fingerprint's tolerances cannot be tight: after three steps the kernels of
# another CPU kind move a parameter update by up to 5.6% of its norm, test_pinned_steps.TOLERANCE).
HELD_TO_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


# The instruction sets, as /proc/cpuinfo names them, that ATen's and oneDNN's CPU kernels choose among
KERNEL_FLAGS = ("fma", "f16c", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def cpuinfo(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo (x86 Linux), None where there is none."""
    path = Path("/proc/cpuinfo")
    lines = path.read_text().splitlines() if path.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == key), None)


def cpu_vendor() -> str:
    """The CPU's maker as x86 Linux names it (`vendor_id` of /proc/cpuinfo: AuthenticAMD, GenuineIntel), else
    `platform.processor()`. Part of the machine kind: held to the same AVX2 kernels, an Intel Xeon (AMX,
    2026-11-28) did not give the AMD EPYC recordings' bits in any pinned case, with MKL_ENABLE_INSTRUCTIONS=AVX2 or
    MKL_CBWR=AVX2 added neither; an AMD AVX-512 CPU gives them all."""
    return cpuinfo("vendor_id") or platform.processor() or "unknown"


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_vendor": cpu_vendor()}


def kernel_kind() -> str:
    """The machine kind of a bit-for-bit recording in `kinds`: the `machine`, the instruction sets of KERNEL_FLAGS the
    CPU has and its cache sizes, by which oneDNN sizes the blocks of its loops, and so the order of its sums. A CPU
    that differs in any of them is another kind, compared to the tolerances until its own bits are recorded."""
    flags = set((cpuinfo("flags") or "").split())
    caches = []
    for index in sorted(CACHES.glob("index*")) if CACHES.is_dir() else []:
        level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        caches.append(f"L{level}{dict(Data='d', Instruction='i').get(kind, '')} {size}")
    described = machine()
    return ", ".join([f"torch {described['torch']}", described["cpu_vendor"], described["cpu_capability"],
                      " ".join(flag for flag in KERNEL_FLAGS if flag in flags) or "no listed flags", " ".join(caches) or "caches unknown"])


def kernel_bits(found: dict) -> dict:
    """What a kind's recording keeps of a case: the loss and each part's SHA-256 (a training step's `module_fingerprints`),
    or the numbers themselves (evaluation metrics)."""
    if "modules" not in found:
        return found
    return {"loss": found["loss"], "sha256": {part: numbers["sha256"] for part, numbers in found["modules"].items()}}


def bit_differences(found: dict, recorded: dict) -> list[str]:
    """How a case's `kernel_bits` differ from those its machine kind recorded (empty when they are equal)."""
    found, problems = kernel_bits(found), []
    for key in sorted(set(found) | set(recorded)):
        if key == "sha256" and "sha256" in found and "sha256" in recorded:
            parts = sorted(part for part in set(found["sha256"]) | set(recorded["sha256"]) if found["sha256"].get(part) != recorded["sha256"].get(part))
            problems += [f"{part}: not the bits this machine kind recorded" for part in parts]
        elif found.get(key) != recorded.get(key):
            problems.append(f"{key} {found.get(key)!r} instead of {recorded.get(key)!r}, as this machine kind recorded")
    return problems


def record_kind_bits(path: Path, case: str, found: dict, reference_problems: list[str]) -> None:
    """Add this machine kind's bits of `case` to the pinned file `path`, read and written under a lock (parallel
    workers each add their cases); refused when its numbers differ from the recording's beyond the tolerances
    (`reference_problems`): bits are pinned only of a computation the recording vouches for."""
    if reference_problems:
        raise ValueError(f"{case}: this machine kind's bits not recorded, its numbers differ from {path.name}'s beyond the tolerances: "
                         + "; ".join(reference_problems))
    with path.open("r+") as stream:
        fcntl.flock(stream, fcntl.LOCK_EX)
        pinned = json.loads(stream.read())
        pinned.setdefault("kinds", {}).setdefault(kernel_kind(), {})[case] = kernel_bits(found)
        stream.seek(0)
        stream.truncate()
        stream.write(json.dumps(pinned, indent=1, sort_keys=True) + "\n")


def forget_kind_bits(pinned: dict, case: str) -> dict:
    """`pinned` without any kind's bits of `case`, whose recording changes (a kind left empty goes too)."""
    kinds = {kind: {name: bits for name, bits in cases.items() if name != case} for kind, cases in pinned.get("kinds", {}).items()}
    return {**pinned, "kinds": {kind: cases for kind, cases in kinds.items() if cases}}


def held_like(recorded: dict) -> dict[str, str] | None:
    """The environment under which this machine computes as the machine that recorded numbers did, when it is
    another kind that can: an AVX-512 CPU of the same maker for an AVX2 recording of the same torch. None on the
    recording kind itself (compared bit for bit as it is) and where no holding reproduces it (compared to the
    tolerances)."""
    here = machine()
    same_software_and_maker = (here["torch"], here["cpu_vendor"]) == (recorded["torch"], recorded["cpu_vendor"])
    if same_software_and_maker and (recorded["cpu_capability"], here["cpu_capability"]) == ("AVX2", "AVX512"):
        return HELD_TO_AVX2
    return None


class InitialState(Callback):
    """Keeps a copy of the model's state when training starts: after a checkpoint given as --ckpt_path is restored,
    so that the change is the one this run made."""

    def __init__(self):
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.state = {name: tensor.detach().clone() for name, tensor in pl_module.state_dict().items()}


def initial_state(trainer) -> dict[str, torch.Tensor]:
    (callback,) = [callback for callback in trainer.callbacks if isinstance(callback, InitialState)]
    return callback.state


def _float_vector(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    parts = [tensor.detach().cpu().double().reshape(-1) for _, tensor in tensors if tensor.is_floating_point()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _projections(module: str, *vectors: torch.Tensor) -> list[list[float]]:
    """Each vector's projections on the module's directions, drawn once for all of them (the draw is most of the
    time of a large module's fingerprint)."""
    generator = np.random.Generator(np.random.PCG64(zlib.crc32(module.encode())))
    directions = torch.from_numpy(generator.standard_normal((DIRECTIONS, vectors[0].numel())))
    return [(directions @ vector).tolist() for vector in vectors]


def module_fingerprints(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per part, `<module> parameters` and `<module> buffers` of each top-level module of `model`'s state dict:
    `sha256` (every tensor's name and bytes), `layout` (SHA-256 of the names, shapes and dtypes), `integers` (SHA-256
    of the integer tensors), and the norm and projections of the float state (`norm`, `projections`) and of its
    change (`change_norm`, `change_projections`)."""
    after = model.state_dict()
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    parts: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name in sorted(after):
        parts.setdefault(f"{name.split('.')[0]} {'parameters' if name in parameters else 'buffers'}", []).append((name, after[name]))
    found = {}
    for part, tensors in parts.items():
        everything, layout, integers = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
        for name, tensor in tensors:
            data = tensor.detach().cpu().contiguous().reshape(-1)
            described = name.encode() + str(tuple(tensor.shape)).encode() + str(data.dtype).encode()
            entry = described + data.view(torch.uint8).numpy().tobytes()
            everything.update(entry)
            layout.update(described)
            if not data.is_floating_point():
                integers.update(entry)
        state = _float_vector(tensors)
        change = state - _float_vector([(name, before[name]) for name, _ in tensors])
        projections, change_projections = _projections(part, state, change)
        found[part] = {
            "sha256": everything.hexdigest(),
            "layout": layout.hexdigest(),
            "integers": integers.hexdigest(),
            "norm": state.norm().item(),
            "projections": projections,
            "change_norm": change.norm().item(),
            "change_projections": change_projections,
        }
    return found


def differences(found: dict[str, dict], expected: dict[str, dict], tolerance: dict[str, float]) -> list[str]:
    """What differs beyond rounding between two `module_fingerprints` (empty when they agree): the parts, their
    tensors' names, shapes and dtypes and their integer tensors exactly, the float state and its change each to its
    tolerance times the recorded norm (`state`; `change`, `parameter_change` for a module's parameters)."""
    if sorted(found) != sorted(expected):
        return [f"modules {sorted(found)} instead of {sorted(expected)}"]
    problems = []
    for module, recorded in expected.items():
        got = found[module]
        if got["layout"] != recorded["layout"]:
            problems.append(f"{module}: tensor names, shapes or dtypes differ")
        if got["integers"] != recorded["integers"]:
            problems.append(f"{module}: integer tensors differ")
        change_tolerance = tolerance["parameter_change" if module.endswith(" parameters") else "change"]
        for prefix, allowed in (("", tolerance["state"]), ("change_", change_tolerance)):
            scale = allowed * recorded[f"{prefix}norm"]
            pairs = [(got[f"{prefix}norm"], recorded[f"{prefix}norm"])] + list(zip(got[f"{prefix}projections"], recorded[f"{prefix}projections"]))
            worst = max(abs(value - reference) for value, reference in pairs)
            if worst > scale:
                what = "change over the steps" if prefix else "state"
                problems.append(f"{module}: {what} differs by {worst:.3g}, more than {allowed:g} x its norm {recorded[f'{prefix}norm']:.6g}")
    return problems


def loss_differs(found: float, expected: float, tolerance: float) -> bool:
    return not math.isclose(found, expected, rel_tol=tolerance, abs_tol=tolerance)
