"""engine/compat.py holds every use of a private Lightning or W&B attribute: each one still exists on the
installed versions, and no other file of the project uses one.

Private uses are found in the syntax tree of every project file: an attribute `._name` that a Lightning or W&B
object has (a trainer's, a module's, a callback's, a logger's, a W&B run's, a loop's), an attribute that reaches
into the fit loop's progress internals (`fit_loop`, `epoch_loop`, `*_progress`), and an import of a private
Lightning / W&B module or name or of W&B's internal `wandb.sdk`.
"""

import ast
import functools
import importlib
import re
from importlib.metadata import version
from pathlib import Path

import lightning as L
import pytest
import wandb
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import WandbLogger

import main_pretrain
from engine.compat import PRIVATE_ATTRIBUTES

ROOT = Path(__file__).parents[1]
PACKAGES = ("engine", "methods", "datamodules", "backbones", "analysis", "interop", "scripts", "benchmarks")
FRAMEWORKS = ("lightning", "pytorch_lightning", "wandb")
LOOP_INTERNALS = re.compile(r"^(?:fit|validate|test|predict|epoch)_loop$|_progress$")


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


@functools.cache
def framework_private_names() -> frozenset[str]:
    """The private attribute names of the Lightning and W&B objects a project file can hold."""
    objects = [value for value, _ in holders().values()] + [
        L.LightningDataModule(), L.Callback(), ModelCheckpoint(), holders()["Trainer"][0].fit_loop,
        holders()["Trainer"][0].fit_loop.epoch_loop, wandb.Run,
    ]
    trainer = holders()["Trainer"][0]
    objects += [getattr(trainer, name) for name in dir(trainer) if name.endswith("_connector")]  # its private helpers
    return frozenset(name for value in objects for name in dir(value) if name.startswith("_") and not name.startswith("__"))


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


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every private Lightning / W&B use in a file's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr in framework_private_names() or LOOP_INTERNALS.search(node.attr)):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = [] if isinstance(node, ast.Import) else [alias.name for alias in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] not in FRAMEWORKS:
                    continue
                if any(part.startswith("_") for part in parts) or module.startswith("wandb.sdk") or any(name.startswith("_") for name in names):
                    found.append((node.lineno, f"import of {module}" + (f": {', '.join(names)}" if names else "")))
    return sorted(found)


def test_the_finder_sees_every_kind_of_private_use():
    assert [what for _, what in private_uses("def f(self, trainer):\n    return self._trainer, trainer._accelerator_connector\n")] == [
        "._accelerator_connector", "._trainer"]
    assert [what for _, what in private_uses("epoch = trainer.fit_loop.epoch_loop.batch_progress.current.processed\n")] == [
        ".batch_progress", ".epoch_loop", ".fit_loop"]
    assert [what for _, what in private_uses("from wandb.sdk.lib import runid\nfrom lightning.pytorch.utilities import _pytree\n")] == [
        "import of wandb.sdk.lib: runid", "import of lightning.pytorch.utilities: _pytree"]
    assert private_uses("self._collected = {}\nself._check_data()\nx = torch._foreach_lerp_\n") == []


def test_compat_itself_holds_the_private_uses_it_declares():
    found = {what for _, what in private_uses((ROOT / "engine" / "compat.py").read_text())}
    declared = {f".{part}" for paths in PRIVATE_ATTRIBUTES.values() for path in paths for part in path.split(".") if part.startswith("_") or LOOP_INTERNALS.search(part)}
    assert declared <= found


def test_no_file_outside_compat_uses_a_private_lightning_or_wandb_attribute():
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")] + list(ROOT.glob("main_*.py"))
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        if path != ROOT / "engine" / "compat.py"
        for line, what in private_uses(path.read_text())
    ]
    assert not found, "private Lightning / W&B attributes outside engine/compat.py:\n" + "\n".join(found)


def test_the_config_dump_of_the_hyperparameters_is_lightnings_own_and_lightning_keeps_it(tmp_path, monkeypatch):
    """`dump_config_for_hyperparameters` (which skips the repeated validation) gives the config Lightning's
    `_dump_config` records with the model and the data, and Lightning uses a `config_dump` it finds instead of
    dumping again."""
    monkeypatch.setattr(LightningCLI, "_run_subcommand", lambda cli, subcommand: None)
    cli = main_pretrain.cli_main(["fit", "--config", str(ROOT / "configs" / "moco_digits.yaml"), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"])
    ours = cli.config_dump
    assert ours["model"]["init_args"]["queue_size"] == 1024 and ours["trainer"]["default_root_dir"] == str(tmp_path)
    del cli.config_dump
    cli._dump_config()
    assert cli.config_dump == ours
    kept = {"model": {}, "data": {}}
    cli.config_dump = kept
    cli._dump_config()
    assert cli.config_dump is kept
