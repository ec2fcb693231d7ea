"""The CLI keeps freed host memory for the next tensors (`engine.devices.keep_freed_host_memory`)."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.devices import keep_freed_host_memory

ROOT = Path(__file__).parents[1]

# Fifty steps of a colour-jitter-like chain on a batch of 128 images of 32 px (a gray image, a blend, rows copied
# back: temporaries of 0.5 and 1.5 MiB), after three untimed ones; prints the page faults they took, with
# keep_freed_host_memory called first ("kept") or not ("default").
FAULTS = """
import json, resource, sys
import torch
from engine.devices import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "kept" else None
torch.manual_seed(0)
factor, rows = torch.rand(128, 1, 1, 1), torch.arange(0, 128, 4)
def step(x):
    gray = (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)
    return (factor * x + (1 - factor) * gray).clamp(0, 1).index_copy(0, rows, x[rows].flip(-1))
x = step(step(step(torch.rand(128, 3, 32, 32))))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    x = step(x)
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def chain_faults(mode: str, **environment: str) -> dict:
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **environment)
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_steps_temporaries_reuse_freed_memory_instead_of_page_faulting():
    kept = chain_faults("kept")
    if platform.libc_ver()[0] != "glibc":
        assert kept["kept"] is False
        return
    # measured on this project's machines (glibc 2.36, transparent huge pages on madvise): 14,720-15,616 page faults
    # without the call (freed blocks went back to the kernel; the default run below), 256-384 with it
    assert kept["kept"] is True and kept["faults"] < 50 * 20, (kept, chain_faults("default"))


@pytest.mark.parametrize("name, value", [("MALLOC_TRIM_THRESHOLD_", "131072"), ("MALLOC_MMAP_THRESHOLD_", "131072"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")])
def test_malloc_settings_in_the_environment_stay_in_charge(name, value, monkeypatch):
    monkeypatch.setenv(name, value)  # read before any setting is made: this process's allocator is left as it is
    assert keep_freed_host_memory() is False


@pytest.mark.slow
def test_the_cli_keeps_freed_host_memory_before_it_builds_the_run(monkeypatch):
    from engine.cli import lightning_cli

    built = []
    monkeypatch.setattr(lightning_cli, "keep_freed_host_memory", lambda: built.append("memory kept"))
    monkeypatch.setattr(lightning_cli.ContrastlabCLI, "instantiate_classes", lambda self: built.append("classes"))
    lightning_cli.instantiate_config(str(ROOT / "configs" / "moco_digits.yaml"))
    assert built == ["memory kept", "classes"]
