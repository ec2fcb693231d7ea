"""engine/compat.py holds every use of a private Lightning or W&B attribute: each one still exists on the
installed versions, and no other file of the project uses one."""

import functools
import importlib
import re
from importlib.metadata import version
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import WandbLogger

from engine.compat import PRIVATE_ATTRIBUTES

ROOT = Path(__file__).parents[1]
PACKAGES = ("engine", "methods", "datamodules", "backbones", "analysis", "interop", "scripts", "benchmarks")
# a private attribute of a trainer, module, logger or W&B run, a private Lightning / W&B module, wandb.sdk
PRIVATE_USE = re.compile(
    r"\b(?:trainer|pl_module|module|logger|experiment)\._[a-z]\w*"
    r"|self\._(?:trainer|experiment|wandb_init|save_dir|signal_connector|accelerator_connector)\b"
    r"|\._(?:signal_connector|accelerator_connector|checkpoint_connector|logger_connector|fit_loop|wandb_init|experiment)\b"
    r"|\b(?:lightning|wandb)(?:\.\w+)*\._\w+"
    r"|\bfrom (?:lightning|wandb)[\w.]* import _\w+"
    r"|\bwandb\.sdk\b"
)


@functools.cache
def holders() -> dict:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module = L.LightningModule()
    module.trainer = trainer
    return {
        "LightningModule": (module, f"lightning {version('lightning')}"),
        "Trainer": (trainer, f"lightning {version('lightning')}"),
        "WandbLogger": (WandbLogger(project="compat-check", offline=True), f"lightning {version('lightning')}"),
        "wandb.sdk.lib": (importlib.import_module("wandb.sdk.lib"), f"wandb {version('wandb')}"),
    }


@pytest.mark.parametrize(
    "holder, path", [(holder, path) for holder, paths in PRIVATE_ATTRIBUTES.items() for path in paths], ids=str
)
def test_every_private_attribute_compat_uses_exists_on_the_installed_version(holder, path):
    value, installed = holders()[holder]
    for part in path.split("."):
        if not hasattr(value, part) and isinstance(value, type(importlib)):
            importlib.import_module(f"{value.__name__}.{part}")  # a submodule not imported by its package
        assert hasattr(value, part), f"{holder}.{path}: `{part}` is gone in {installed}; update engine/compat.py"
        value = getattr(value, part)


def private_uses(text: str) -> list[tuple[int, str]]:
    code = [line.split("#", 1)[0] for line in text.splitlines()]
    return [(number, line.strip()) for number, line in enumerate(code, 1) if PRIVATE_USE.search(line)]


def test_the_pattern_finds_the_private_uses_compat_holds():
    assert len(private_uses((ROOT / "engine" / "compat.py").read_text())) >= 8
    assert private_uses("if self._trainer is not None:\n") and private_uses("from wandb.sdk.lib import runid\n")
    assert not private_uses("self._collected = {}\nself._check_data()\n")


def test_no_file_outside_compat_uses_a_private_lightning_or_wandb_attribute():
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")] + list(ROOT.glob("main_*.py"))
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line}"
        for path in files
        if path != ROOT / "engine" / "compat.py"
        for number, line in private_uses(path.read_text())
    ]
    assert not found, "private Lightning / W&B attributes outside engine/compat.py:\n" + "\n".join(found)
