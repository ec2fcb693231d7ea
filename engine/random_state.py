"""The random states of a run, saved with every checkpoint and restored on resume."""

import random

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback


class RandomStateCheckpoint(Callback):
    """Saves the torch (CPU and current CUDA device), NumPy and Python random states with every checkpoint and
    restores them when the resumed run starts training: after its sanity check and the creation of its
    training iterator, which draw random numbers that an uninterrupted run does not draw at that point (the
    training DataLoader draws its worker seeds from a generator of its own, `datamodules.base`). Under DDP
    the states of rank 0 are restored on every rank, which is exact: `seed_everything` gives every rank the
    same states and every rank draws the same numbers (shuffle-BN's permutation included; the batched views draw the
    numbers of every rank's samples and keep their own, `datamodules.batched.process_rows`, and per-image views
    without workers draw from their own seeds, `datamodules.base.ViewsDataset`)."""

    def __init__(self):
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        name, keys, position, has_gauss, gauss = np.random.get_state()
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),  # plain types: weights_only loads
            "python": random.getstate(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict

    def on_train_start(self, trainer, pl_module) -> None:
        if self.loaded is None:
            return
        torch.set_rng_state(self.loaded["torch"])
        if self.loaded["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.loaded["cuda"])
        name, keys, position, has_gauss, gauss = self.loaded["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        random.setstate(self.loaded["python"])
        self.loaded = None
