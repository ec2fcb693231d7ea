"""Every test starts from the same seed, with deterministic algorithms."""

import lightning as L
import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    L.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
