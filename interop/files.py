"""Reading checkpoint files written by other code.

Official releases are pickles that hold more than tensors: SupContrast saves its `argparse.Namespace` of
options beside the weights, SCE's Lightning checkpoints their OmegaConf hyperparameters. `read_checkpoint`
loads them with `torch.load(weights_only=True)`, which runs no code from the file, and lets every class
the file names other than torch's and Python's plain types be an inert `ForeignObject`: what it held is
dropped, the tensors are kept.
"""

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

FOREIGN_CLASSES_AT_MOST = 64  # classes a file may name before it is refused (each costs one more read)


class ForeignObject:
    """Stands in for an object of a class named by a checkpoint file; keeps nothing, runs nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state) -> None:
        pass


def read_checkpoint(path: str | os.PathLike, source: str) -> Any:
    """The object saved in `path` (a `torch.save` file, legacy or zip, or `.safetensors`), tensors on the CPU.
    `source` names the file in errors (e.g. "model.pretrained_ckpt 'x.pth'")."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{source} is not an existing file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except SafetensorError as error:
            raise ValueError(f"{source} could not be read as a safetensors file: {error}") from None
    stand_ins: list[tuple[type, str]] = []
    mmap = zipfile.is_zipfile(path)  # tensors read when used (torch's legacy format cannot be mapped)
    while len(stand_ins) <= FOREIGN_CLASSES_AT_MOST:
        try:
            with torch.serialization.safe_globals(stand_ins):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            # torch names one class it refused per attempt: "GLOBAL argparse.Namespace was not an allowed global"
            refused = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
            if refused is None:
                raise ValueError(f"{source} could not be read safely (weights only): {_first_line(error)}") from None
            stand_ins.append((type(refused[1], (ForeignObject,), {}), refused[1]))
        except Exception as error:  # a truncated or foreign file: say which file, not a pickle traceback
            raise ValueError(f"{source} could not be read as a checkpoint: {_first_line(error)}") from None
    raise ValueError(f"{source} names more than {FOREIGN_CLASSES_AT_MOST} classes besides tensors: not read")


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "Weights only load failed" not in line]
    return lines[0] if lines else type(error).__name__


def is_state_dict(value: Any) -> bool:
    """A plain state dict: a non-empty mapping of names to tensors."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())
