"""Files on disk: the one reader of checkpoint files, and writes that never leave half a file.

- `read_checkpoint(path, source)` is the only place the project calls `torch.load`. Every entry point that takes a
  checkpoint (`--ckpt_path`, `model.init_args.pretrained_ckpt`, `backbone.weights`, the analysis, the export)
  reads it here, for the purpose its `source` names, and gets one `UnreadableCheckpoint` naming the file when it
  cannot. It loads with `weights_only=True`, which runs no code from the file. Official releases pickle more than
  tensors (SupContrast its `argparse.Namespace` of options, SCE's Lightning checkpoints their OmegaConf
  hyperparameters): every class such a file names besides torch's and Python's plain types is let in as an inert
  `ForeignObject`, which runs nothing and keeps the plain data it held as attributes (DINO's `args.arch`).
- `write_atomically(path, write)` writes a partial file of its own next to `path`, then renames it over `path`.
- `SameDirectoryCheckpointIO`: Lightning's checkpoint writes, done that way; `write_run_file`: a run's config.yaml.
"""

import builtins
import errno
import json
import os
import pickle
import re
import secrets
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint

FOREIGN_CLASSES_AT_MOST = 64  # classes a file may name before it is refused (each costs one more read)
# Python types a pickle may name as values (OmegaConf keeps `dict`, `list`, `int` as the types of its nodes)
PLAIN_BUILTINS = ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bool")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6
PICKLE_STARTS = tuple(bytes([0x80, protocol]) for protocol in (2, 3, 4, 5))  # the legacy format: a pickle (PROTO opcode)


class UnreadableCheckpoint(ValueError):
    """A file given as a checkpoint that cannot be read as one."""


class ForeignObject:
    """Stands in for an object of a class named by a checkpoint file; runs nothing, and keeps its attributes as
    attributes where the file gives them as a dict (read under the same weights-only rules: plain data), so that
    e.g. DINO's `args.arch` (an argparse.Namespace) can be read."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state) -> None:
        if isinstance(state, dict):
            self.__dict__.update({key: value for key, value in state.items() if isinstance(key, str) and not key.startswith("__")})


def read_checkpoint(path: str | os.PathLike, source: str) -> Any:
    """The object saved in `path` (a `torch.save` file, zip or legacy, or `.safetensors`), tensors on the CPU (a zip
    file's memory-mapped: read when used). `source` says what the file is for and names it, e.g.
    "model.init_args.pretrained_ckpt 'x.pth'"; every error is an `UnreadableCheckpoint` that starts with it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UnreadableCheckpoint(f"{source} is not an existing file")
    if path.suffix == ".safetensors":
        return _read_safetensors(path, source)
    try:
        with path.open("rb") as file:
            start = file.read(16)
    except OSError as error:
        raise UnreadableCheckpoint(f"{source} cannot be opened: {error.strerror or error}") from None
    if not start.startswith((ZIP_MAGIC, *PICKLE_STARTS)):
        raise UnreadableCheckpoint(f"{source} is not a PyTorch checkpoint (it starts with {start!r})")
    allowed: list[tuple[Any, str]] = []
    mmap = zipfile.is_zipfile(path)  # torch's legacy format cannot be mapped
    while len(allowed) <= FOREIGN_CLASSES_AT_MOST:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            # torch names one refused class per attempt ("GLOBAL argparse.Namespace was not an allowed global"),
            # a builtin without its module ("GLOBAL dict ..." for builtins.dict)
            refused = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
            if refused is None:
                raise UnreadableCheckpoint(f"{source} could not be read safely (weights only): {_first_line(error)}") from None
            allowed.append(_stand_in(refused[1]))
        except Exception as error:  # a truncated or foreign file: say which file, not a pickle traceback
            raise UnreadableCheckpoint(f"{source} could not be read as a checkpoint: {_first_line(error)}") from None
    raise UnreadableCheckpoint(f"{source} names more than {FOREIGN_CLASSES_AT_MOST} classes besides tensors: not read")


def _stand_in(name: str) -> tuple[Any, str]:
    """What a refused global becomes: a plain Python type as itself, any other class an inert `ForeignObject`."""
    if "." not in name:
        name = f"builtins.{name}"
    module, _, attribute = name.rpartition(".")
    if module == "builtins" and attribute in PLAIN_BUILTINS:
        return getattr(builtins, attribute), name
    return type(attribute, (ForeignObject,), {}), name


def _read_safetensors(path: Path, source: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise UnreadableCheckpoint(f"{source} could not be read as a safetensors file: {error}") from None


def _first_line(error: Exception) -> str:
    """The first line of torch's message that describes the file (never its advice to load with weights_only=False,
    which would run code from the file)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "weights_only" not in line.lower()]
    return lines[0] if lines else type(error).__name__


def is_state_dict(value: Any) -> bool:
    """A plain state dict: a non-empty mapping of names to tensors."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def last_checkpoint_path(callback: ModelCheckpoint) -> Path:
    """Where a checkpoint callback writes its `last.ckpt` (the file a resumed run and the linear stage look for)."""
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


class WriteFailed(OSError):
    """A file the run must write cannot be written (a full disk, a read-only directory), said in one line."""


def check_folder(folder: Path, what: str) -> None:
    """Refuse (ValueError), before any work, a folder to write into that cannot be made: an existing file is it or one
    of the folders above it."""
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{what} {folder} cannot be a folder: {existing} is a file")


def free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def flush_to_disk(path: Path, directory: bool = False) -> None:
    """fsync a file's data, or a directory's entries (where the filesystem cannot, as some network ones, it is left
    to the filesystem)."""
    descriptor = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(descriptor)
    except OSError as error:
        if not directory or error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(descriptor)


def write_atomically(path: Path, write: Callable[[Path], object], size: int | None = None) -> None:
    """`write(partial)` to `<name>.<pid>-<random>.partial` next to `path` (the name cut to 200 bytes, so that the
    partial file's stays within the usual 255), flush it to disk, then rename it over `path` (`os.replace`, atomic
    within a filesystem): a reader never sees half a file, and an interrupted run or a machine that goes down never
    leaves one (Lightning's save does not flush). The partial file is this call's own: two processes that write one
    file at once (two `reproduce.py` on halves of a table's rows, two runs filling the Digits-M cache) each publish a
    whole file, the later one last. A write that fails or is interrupted by an exception (KeyboardInterrupt,
    SystemExit) removes its partial file (the previous `path` stays; a process killed by a signal it does not handle,
    SIGKILL, leaves it); a failure raises `WriteFailed` naming the path, on a full disk with the bytes `size` (or the
    partial file's size) and the bytes free. torch's writer reports a full disk as a RuntimeError ("unexpected pos"),
    so a failed write is called a full disk by the free space left."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = path.name.encode()[:200].decode(errors="ignore")
        partial = path.with_name(f"{prefix}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    except OSError as error:
        raise WriteFailed(f"cannot write {path}: {error.strerror or error}") from None
    try:
        write(partial)
        flush_to_disk(partial)  # before the rename: a machine that goes down then has the old file or the new, whole
        os.replace(partial, path)
        flush_to_disk(path.parent, directory=True)  # the rename itself
    except BaseException as error:
        written = partial.stat().st_size if partial.exists() else 0
        partial.unlink(missing_ok=True)
        if not isinstance(error, (OSError, RuntimeError)):  # an interrupt, a mistake of `write`: raised as it came
            raise
        needed = max(size or 0, written)
        free = free_bytes(path.parent)
        if getattr(error, "errno", None) == errno.ENOSPC or (needed and free < needed) or free == 0:
            raise WriteFailed(
                f"no space left on device writing {path} ({needed or 'more'} bytes needed, {free} free); "
                f"the partial file is removed{', the previous one kept' if path.exists() else ''}"
            ) from None
        if isinstance(error, OSError):
            raise WriteFailed(f"cannot write {path}: {error.strerror or error}") from None
        raise


class SameDirectoryCheckpointIO(TorchCheckpointIO):
    """Writes a local checkpoint to a partial file in the target's directory, then renames it over the
    target (`os.replace`, atomic within a filesystem). Lightning's own save goes through an fsspec
    transaction whose temporary file lies in the system temp dir; where /tmp is another filesystem than
    the run directory (node-local /tmp, shared run storage: the usual cluster), the final move is a copy,
    and a job killed during the copy leaves a truncated checkpoint. Remote paths keep Lightning's save."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomically(Path(path), lambda partial: torch.save(checkpoint, partial), size=tensor_bytes(checkpoint))


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object a run or a script wrote at `path` (`what` it is, for the message); a file cut short, overwritten
    or of another shape is a ValueError naming it, not a traceback."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: the {what} is not readable JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: the {what} is a JSON {type(value).__name__}, not an object")
    return value


def write_run_file(path: str, text: str) -> None:
    """A text file of a run (its config.yaml): written atomically where the run directory is local, as the
    checkpoints are (`SameDirectoryCheckpointIO`); remote paths through fsspec."""
    filesystem = get_filesystem(path)
    if not isinstance(filesystem, LocalFileSystem):
        filesystem.makedirs(os.path.dirname(path), exist_ok=True)
        with filesystem.open(path, "w") as file:
            file.write(text)
        return
    write_atomically(Path(path), lambda partial: partial.write_text(text))


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a nested checkpoint: about the size of its file."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0
