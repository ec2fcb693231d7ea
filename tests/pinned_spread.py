"""How far the pinned steps move when the CPU kernels round differently: runs every case of
`test_pinned_steps.py` in a subprocess on this machine's kernels and on others (environment variables that hold
oneDNN, MKL or ATen to narrower instruction sets), and prints the largest differences relative to the loss and to
the norms of the fingerprints. `TOLERANCE` in `test_pinned_steps.py` is set from what this prints.

    uv run --locked python tests/pinned_spread.py                      # oneDNN held to SSE4.1, MKL to SSE4.2
    uv run --locked python tests/pinned_spread.py ATEN_CPU_CAPABILITY=default
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(1, str(Path(__file__).parents[1]))  # run as a script from tests/: the project's modules too
from test_pinned_steps import run_cases  # noqa: E402

DEFAULT_VARIANT = ["ONEDNN_MAX_CPU_ISA=SSE41", "MKL_ENABLE_INSTRUCTIONS=SSE4_2"]


def spread(reference: dict, other: dict) -> dict[str, tuple[float, str]]:
    """The largest relative difference of the loss, a state, a buffers' change and a parameters' change (the keys of
    `TOLERANCE`), and where it was."""
    worst = {"loss": (0.0, ""), "state": (0.0, ""), "change": (0.0, ""), "parameter_change": (0.0, "")}
    for case, found in reference.items():
        compared = other[case]
        loss = abs(found["loss"] - compared["loss"]) / max(abs(found["loss"]), 1.0)
        worst["loss"] = max(worst["loss"], (loss, case))
        for module, values in found["modules"].items():
            change = "parameter_change" if module.endswith(" parameters") else "change"
            for prefix, kind in (("", "state"), ("change_", change)):
                norm = values[f"{prefix}norm"]
                pairs = [(values[f"{prefix}norm"], compared["modules"][module][f"{prefix}norm"])]
                pairs += list(zip(values[f"{prefix}projections"], compared["modules"][module][f"{prefix}projections"]))
                difference = max(abs(a - b) for a, b in pairs) / norm if norm else 0.0
                worst[kind] = max(worst[kind], (difference, f"{case} {module}"))
    return worst


def main(assignments: list[str]) -> None:
    variant = dict(assignment.split("=", 1) for assignment in (assignments or DEFAULT_VARIANT))
    with tempfile.TemporaryDirectory() as scratch:
        reference = run_cases(Path(scratch) / "reference.json", {})
        other = run_cases(Path(scratch) / "variant.json", variant)
    for kind, (difference, where) in spread(reference, other).items():
        print(f"{kind}: {difference:.3g} ({where})")


if __name__ == "__main__":
    main(sys.argv[1:])
