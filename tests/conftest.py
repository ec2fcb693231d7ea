"""Every test starts from the same seed, with deterministic algorithms, and with W&B disabled. The suite runs on
two parallel workers (pytest-xdist, `-n 2` in pyproject.toml) that share one Digits-M cache; `-n 0` runs it in
this process."""

import os
import sys

# Threads that wait for work sleep instead of spinning (read by torch's OpenMP runtime when it loads, so set before
# torch is imported; the workers and every process a test starts inherit it): a spinning thread takes the core from
# the other worker's threads (two training tests took 123 s instead of 21 s while other jobs kept the cores busy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Parallel workers share the cores: each worker (and every process it starts) runs torch with its share of them,
# one intra-op thread per core in all, instead of each running one per core. The numbers that depend on the count
# are computed with the recording machine's (`recorded_threads`). Measured on 2 cores, 2 workers, two runs each way:
# the suite used 805 and 819 s of CPU instead of 856 and 882 s, and pytest took 428 and 445 s instead of 461 to 472 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # the cores this process may use (Linux)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))

import pytest  # noqa: E402

# torch and Lightning are imported where a fixture first needs them: in a worker (or a run without workers), at
# the first test; the process that only hands the tests to parallel workers never imports them (8 s here).


@pytest.fixture(autouse=True)
def _deterministic():
    import lightning as L
    import torch

    L.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True, scope="session")
def _wandb_disabled():
    """The configs log to W&B (`engine.tracking.WandbRun`): no test starts W&B processes or writes W&B files,
    whatever the environment says; a test that needs a W&B run sets WANDB_MODE itself (monkeypatch)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        yield


@pytest.fixture(autouse=True, scope="session")
def _no_pytest_arguments_in_argv():
    """The CLIs under test read the arguments each test gives them, never pytest's own (LightningCLI warns when
    both are present)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", sys.argv[:1])
        yield


@pytest.fixture(autouse=True, scope="session")
def _cache_of_the_session(tmp_path_factory):
    """Digits-M's arrays are generated once per test session, into a directory of its own (not the user's cache),
    and read from there by every test and every subprocess a test starts. The workers of one parallel session share
    it (the base directory of their temporary directories): the cache writes each file atomically, so two workers
    that generate the same split at once both read a whole file."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        cache = tmp_path_factory.mktemp("contrastlab-cache")
    else:
        cache = tmp_path_factory.getbasetemp().parent / "contrastlab-cache"
        cache.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTRASTLAB_CACHE", str(cache))
        yield


@pytest.fixture
def recorded_threads():
    """The CPU kernels' summation order depends on the number of threads: the numbers of `pinned_steps.json` and
    `fixtures/checkpoints_6332e42/expected.json` were recorded with `RECORDED_THREADS` (this project's machine),
    so every machine and every parallel worker computes them with that many, whatever its cores or OMP_NUM_THREADS."""
    import torch
    from fingerprint import RECORDED_THREADS

    threads = torch.get_num_threads()
    torch.set_num_threads(RECORDED_THREADS)
    yield
    torch.set_num_threads(threads)


def pytest_configure(config):
    """CONTRASTLAB_REPIN=1 rewrites the pinned numbers' files from every test that it runs, CONTRASTLAB_REPIN=kind adds
    this machine kind's bits to them (tests/test_pinned_steps.py): in one process, so that no worker writes over what
    another wrote."""
    repin = os.environ.get("CONTRASTLAB_REPIN", "")
    if repin not in ("", "0", "1", "kind"):
        raise pytest.UsageError(f"CONTRASTLAB_REPIN={repin!r} (environment): 1 records the pinned numbers anew, kind adds this machine kind's bits, 0 or unset neither")
    if repin in ("1", "kind") and hasattr(config.option, "dist"):
        config.option.dist = "no"


def pytest_collection_modifyitems(config, items):
    """On parallel workers, the modules that hold tests marked slow come first, each module's tests together and in
    order (a module-scoped run is made once): the modules of short tests then fill the time that is left at the end,
    instead of one long test running alone while the other worker waits. (Each worker sorts its collection the
    same way.)"""
    if "PYTEST_XDIST_WORKER" in os.environ:
        with_slow_tests = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in with_slow_tests)
