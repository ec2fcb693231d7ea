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
"""

import hashlib
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


def cpu_vendor() -> str:
    """The CPU's maker as x86 Linux names it (`vendor_id` of /proc/cpuinfo: AuthenticAMD, GenuineIntel), else
    `platform.processor()`. Part of the machine kind: held to the same AVX2 kernels, an Intel Xeon (AMX,
    2026-11-28) did not give the AMD EPYC recordings' bits in any pinned case, with MKL_ENABLE_INSTRUCTIONS=AVX2 or
    MKL_CBWR=AVX2 added neither; an AMD AVX-512 CPU gives them all."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), platform.processor() or "unknown")


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_vendor": cpu_vendor()}


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
