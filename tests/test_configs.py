"""Every shipped config states, in its header, the precision and the weight-decay grouping of the
official run it follows, and trains that way.

The header lines have a fixed form, so that they can be checked here:

    # Precision: 32-true -- <the official file that says so, or why this value>
    # Weight decay: every parameter -- <source>
    # Weight decay: not on biases and normalisation parameters -- <source>
    # Weight decay: none -- <source>
"""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import methods

pytestmark = pytest.mark.slow  # every shipped config: left out of the inner loop (`pytest -m "not slow"`)

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(ROOT.glob("configs/*.yaml"))
PRECISION_LINE = re.compile(r"^# Precision: (\S+) -- \S", re.MULTILINE)
WEIGHT_DECAY_LINE = re.compile(r"^# Weight decay: (every parameter|not on biases and normalisation parameters|none) -- \S", re.MULTILINE)


def header(config: Path) -> str:
    lines = config.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def stated(pattern: re.Pattern, config: Path) -> str:
    found = pattern.findall(header(config))
    assert len(found) == 1, f"{config.name}: the header must have exactly one line of the form {pattern.pattern!r}"
    return found[0]


def build_model(config: Path):
    """The config's model as the CLI builds it (nested specs given as dicts), with its own trunk, randomly
    initialised; a linear or fine-tuning stage gets a random ResNet-18 (its trunk comes from a checkpoint)."""
    model = yaml.safe_load(config.read_text())["model"]
    init_args = dict(model.get("init_args", {}))
    model_class = getattr(methods, model["class_path"].rsplit(".", 1)[-1])
    if issubclass(model_class, methods.LinearProbe):  # the linear stage and fine-tuning
        init_args |= {"random_init": True, "backbone": {"name": "resnet18"}}
    if "weights" in init_args.get("backbone", {}):  # the grouping does not depend on the values (no download here)
        init_args["backbone"] = init_args["backbone"] | {"weights": None}
    return model_class(**init_args)


def trained_parameter_groups(model) -> list[dict]:
    """The optimizer's parameter groups, from the model's own `configure_optimizers`, without the online
    probe of a pretraining method (a monitor outside the paper's run, never decayed)."""
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(batch_size=256), world_size=1, accumulate_grad_batches=1, gradient_clip_val=None, max_epochs=10, max_steps=-1,
        estimated_stepping_batches=100, num_training_batches=10, print=lambda *args: None,
    )
    model.trainer = trainer  # configure_optimization reads only these numbers
    optimizer = model.configure_optimizers()["optimizer"]
    online_probe = {id(param) for param in getattr(model, "probe", []).parameters()} if isinstance(model, methods.PretrainMethod) else set()
    return [
        {"weight_decay": group["weight_decay"], "params": [param for param in group["params"] if id(param) not in online_probe]}
        for group in optimizer.param_groups
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_precision_is_the_one_the_header_states(config):
    precision = yaml.safe_load(config.read_text())["trainer"].get("precision", "32-true")
    assert str(precision) == stated(PRECISION_LINE, config)


@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_weight_decay_reaches_the_parameters_the_header_states(config):
    grouping = stated(WEIGHT_DECAY_LINE, config)
    with torch.device("meta"):  # shapes and groups only: no memory, no initialisation
        groups = trained_parameter_groups(build_model(config))
    decayed = [param for group in groups if group["weight_decay"] > 0 for param in group["params"]]
    undecayed = [param for group in groups if group["weight_decay"] == 0 for param in group["params"]]
    assert decayed or undecayed
    if grouping == "none":
        assert not decayed
    elif grouping == "every parameter":
        assert not undecayed
    else:
        assert all(param.ndim > 1 for param in decayed) and all(param.ndim <= 1 for param in undecayed) and decayed and undecayed


@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_a_config_for_accelerators_fixes_its_number_of_processes(config):
    """`data.batch_size` is per process: with Lightning's `devices: auto` a config would train at the global batch of
    however many GPUs the machine has (a one-GPU recipe at 8x its batch on an 8-GPU node). The Digits-M configs run on
    the CPU, where `auto` is one process."""
    trainer = yaml.safe_load(config.read_text())["trainer"]
    if trainer.get("accelerator") != "cpu":
        assert isinstance(trainer.get("devices"), int) and trainer["devices"] >= 1, f"{config.name}: trainer.devices must be a number of processes"


# The configs that follow a solo-learn pretraining recipe (vturrisi/solo-learn scripts/pretrain/, or its code for TCL's
# self-supervised setting); the Digits-M stand-ins cite solo-learn for single settings only.
SOLO_LEARN_RECIPES = [config for config in CONFIGS if "_digits" not in config.stem
                      and re.search(r"solo-learn scripts/pretrain/|vturrisi/solo-learn at 9187ea3; TCL", header(config))]


@pytest.mark.parametrize("config", SOLO_LEARN_RECIPES, ids=[config.name for config in SOLO_LEARN_RECIPES])
def test_a_solo_learn_recipe_warms_up_from_3e_5_and_builds_solo_learns_cifar_stem(config):
    """solo/methods/base.py at 9187ea3: warmup_cosine from warmup_start_lr 3e-5 to the peak at the last warm-up step
    (solo/utils/lr_scheduler.py) for every recipe, and for cifar10 / cifar100 conv1 with padding 2."""
    resolved = yaml.safe_load(config.read_text())
    init_args, dataset = resolved["model"]["init_args"], resolved["data"]["class_path"]
    assert (init_args["schedule"]["warmup_shape"], init_args["schedule"]["warmup_start_lr"]) == ("s/(W-1)", 3e-5)
    assert init_args["backbone"].get("small_input_stem", "sce") == ("solo_learn" if "CIFAR" in dataset else "sce")
    assert "CIFAR" in dataset or "ImageNet100" in dataset


def test_the_solo_learn_recipes_are_found_for_both_kinds_of_dataset():
    assert {config.stem.rsplit("_", 1)[-1] for config in SOLO_LEARN_RECIPES} == {"cifar10", "cifar100", "imagenet100"}
