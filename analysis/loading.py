"""What every `python -m analysis` command reads: a checkpoint's method and the data of its pretraining config.

A contrastlab checkpoint (written by `main_pretrain.py`) gives the method (class and hyperparameters, hence its
temperature); a published one (`--format`, `interop.official`) gives the trunk and projection head of the config's
method, which must be built as the official code builds them (overrides after `--`). The data (splits, views,
evaluation view) come from the pretraining config, with the CLI overrides given after `--`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from datamodules.base import ContrastiveDataModule
from engine.cli import instantiate_config
from engine.files import check_folder, read_checkpoint
from interop import FORMATS, load_official_encoder
from methods import PretrainMethod
from methods.checkpoints import require_method

__all__ = ["add_checkpoint_arguments", "default_out", "load_checkpoint_and_data", "load_method"]


def load_method(checkpoint_path: Path, checkpoint: dict | None = None) -> PretrainMethod:
    """The pretraining method saved in a checkpoint (read here unless given), as the class the CLI instantiated."""
    source = str(checkpoint_path)
    checkpoint = read_checkpoint(checkpoint_path, source) if checkpoint is None else checkpoint
    method_class = require_method(checkpoint, source, PretrainMethod, "analyse the checkpoint of a pretraining method (main_pretrain.py)")
    return method_class.load_from_checkpoint(checkpoint_path, map_location="cpu")


def positive_int(text: str) -> int:
    """An argparse type: a count of images or classes (argparse's one error line names the option and the value)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: a seed (argparse's one error line names the option and the value)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def positive_float(text: str) -> float:
    """An argparse type: a temperature (argparse's one error line names the option and the value)."""
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def usable_device(text: str) -> str:
    """An argparse type: a CPU or a CUDA device this machine has (torch also names devices it has no kernels for
    here, e.g. `meta`, or that another build would have, e.g. `mps`)."""
    try:
        device = torch.device(text)
    except RuntimeError:  # not a device name
        raise ValueError(text) from None
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count())):
        raise ValueError(text)
    return text


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every analysis command shares: the checkpoint, its format, the config, the split, where to write."""
    parser.add_argument("checkpoint", type=Path, help="a main_pretrain.py checkpoint, or a published one (--format)")
    parser.add_argument("--format", choices=FORMATS, help="the checkpoint's layout (default: read from its keys)")
    parser.add_argument("--config", required=True, help="the pretraining config (for the data)")
    parser.add_argument("--split", default="val", help="the DataModule split to analyse")
    parser.add_argument("--out", type=Path, help="output folder (default: <run>/analysis/<checkpoint>-<split>)")
    parser.add_argument("--device", type=usable_device, default="cuda" if torch.cuda.is_available() else "cpu")


def load_checkpoint_and_data(args: argparse.Namespace, overrides: list[str]) -> tuple[PretrainMethod, ContrastiveDataModule, str]:
    """The method of `args.checkpoint` on `args.device`, the DataModule of `args.config` with `overrides`, and the
    checkpoint's format (`contrastlab` or the official layout read). A bad input is a ValueError naming it."""
    source = f"checkpoint {str(args.checkpoint)!r}"
    checkpoint = read_checkpoint(args.checkpoint, source)  # before the config is built: a missing file is one line
    cli = instantiate_config(args.config, overrides)
    official = load_official_encoder(cli.model, checkpoint, args.format, source)  # None: a contrastlab checkpoint
    model_overrides = [argument for argument in overrides if argument.startswith("--model")]
    if not official and model_overrides:  # the method is the one the checkpoint was trained with: they would change nothing
        raise ValueError(f"{model_overrides[0]}: a contrastlab {source} analyses the method it was trained with; "
                         "model overrides build the method of a published checkpoint (--format)")
    model = (cli.model if official else load_method(args.checkpoint, checkpoint)).to(args.device)
    return model, cli.datamodule, official or "contrastlab"


def measured_on(args: argparse.Namespace, overrides: list[str], checkpoint_format: str, datamodule) -> dict:
    """What a written record measured: the checkpoint (absolute path) and its format, the config, its overrides and
    the DataModule that gave the images."""
    dataset = f"{type(datamodule).__module__}.{type(datamodule).__qualname__}"
    return {"checkpoint": str(args.checkpoint.resolve()), "format": checkpoint_format, "config": args.config, "overrides": overrides, "dataset": dataset}


def default_out(args: argparse.Namespace) -> Path:
    """`--out`, else a folder of the checkpoint and split in the `analysis` folder of the checkpoint's run
    (`<run>/checkpoints/x.ckpt`, split val -> `<run>/analysis/x-val`), or of the checkpoint's own folder for one outside a
    run (a published file), as the linear stage places its run: the analyses of other checkpoints or splits, and the
    embedding map the training drew in `<run>/analysis`, stay as they are."""
    folder = args.checkpoint.resolve().parent
    out = args.out or (folder.parent if folder.name == "checkpoints" else folder) / "analysis" / f"{args.checkpoint.stem}-{args.split}"
    check_folder(out, "the output folder")  # before the analysis runs, not when its first file is written
    return out
