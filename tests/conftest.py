"""Every test starts from the same seed, with deterministic algorithms, and with W&B disabled."""

import sys

import lightning as L
import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
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
    and read from there by every test and every subprocess a test starts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTRASTLAB_CACHE", str(tmp_path_factory.mktemp("contrastlab-cache")))
        yield
