"""Three training steps of every Digits-M method config, pinned to the numbers recorded in `pinned_steps.json`.

Each case runs `main_pretrain.py fit` (or `main_linear.py fit`) on its shipped config as a user does, for three
optimizer steps, and records the last training loss and, per top-level module of the state dict (trunk, heads,
momentum encoder, queue, memory bank, class centres, ...), a SHA-256 of its tensors' bytes and their sum. A change
that is meant to keep every method's computation (a refactor, a move of plumbing) keeps these bit for bit. The
steps run in fp32 (`--trainer.precision 32-true`): the Digits-M configs' bf16 autocast is emulated on a CPU
without bf16 units, three times slower here, and rounds as the CPU's kernels do.

On a CPU of another kind than the one that recorded them (`torch.backends.cpu.get_cpu_capability()`) or another
torch, kernels may round differently: there the sums are compared to 1e-4 relative and the loss to 1e-4, and
the bytes are not compared.

To record them anew, when a change is meant to alter the numbers (say why in its commit):

    CONTRASTLAB_REPIN=1 uv run --locked pytest tests/test_pinned_steps.py
"""

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

import main_linear
import main_pretrain

ROOT = Path(__file__).parents[1]
PINNED = Path(__file__).with_name("pinned_steps.json")
STEPS = 3
# config, extra overrides: the Digits-M configs, and the method variants that have no Digits-M config of their own
CASES = {
    "moco_digits": ("moco_digits.yaml", []),
    "sce_digits": ("sce_digits.yaml", []),
    "ressl_digits": ("ressl_digits.yaml", []),
    "npid_digits": ("npid_digits.yaml", []),
    "npid_hard_digits": ("npid_digits.yaml", ["--model.init_args.loss=hard", "--model.init_args.num_hard=255"]),
    "simclr_digits": ("simclr_digits.yaml", []),
    "simclr_hard_digits": ("simclr_digits.yaml", ["--model.init_args.num_hard=64"]),
    "jcl_digits": ("jcl_digits.yaml", []),
    "supcon_digits": ("supcon_digits.yaml", []),
    "tcl_digits": ("tcl_digits.yaml", []),
    "tcl_ssl_digits": ("tcl_ssl_digits.yaml", []),
    "ce_digits_lt": ("ce_digits_lt.yaml", []),
    "balanced_softmax_digits_lt": ("balanced_softmax_digits_lt.yaml", []),
    "paco_digits_lt": ("paco_digits_lt.yaml", []),
    "paco_ride_digits_lt": ("paco_ride_digits_lt.yaml", []),
    "multitask_digits_lt": ("paco_digits_lt.yaml", ["--model.class_path=methods.MultiTaskContrast", "--model.init_args.classifier_loss=balanced_softmax"]),
    "linear_digits": ("linear_digits.yaml", ["--model.random_init=true", "--model.backbone.name=timm:test_resnet"]),
    "linear_tcl_digits": ("linear_tcl_digits.yaml", ["--model.random_init=true", "--model.backbone.name=timm:test_resnet"]),
}


RECORDED_THREADS = 2


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def three_steps(config: str, overrides: list[str], run_dir: Path) -> dict:
    """The loss after three steps of `config` and, per top-level module, the SHA-256 and sum of its tensors."""
    entry = main_linear if config.startswith("linear_") else main_pretrain
    cli = entry.cli_main([
        "fit", "--config", str(ROOT / "configs" / config), *overrides, f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}",
    ])  # fmt: skip
    assert cli.trainer.global_step == STEPS
    modules: dict[str, dict] = {}
    for name, tensor in sorted(cli.model.state_dict().items()):
        group = modules.setdefault(name.split(".")[0], {"hash": hashlib.sha256(), "sum": 0.0})
        data = tensor.detach().cpu().contiguous().reshape(-1)
        group["hash"].update(name.encode() + str(data.dtype).encode() + data.view(torch.uint8).numpy().tobytes())
        if data.is_floating_point():
            group["sum"] += data.double().sum().item()
    return {
        "loss": cli.trainer.callback_metrics["train/loss"].item(),
        "modules": {name: {"sha256": group["hash"].hexdigest(), "sum": group["sum"]} for name, group in modules.items()},
    }


def recorded() -> dict:
    return json.loads(PINNED.read_text()) if PINNED.is_file() else {"machine": machine(), "cases": {}}


@pytest.fixture
def recorded_threads():
    """The CPU kernels' summation order depends on the number of threads: the numbers were recorded with 2 (this
    project's machine), so every machine computes them with 2, whatever its cores or OMP_NUM_THREADS."""
    threads = torch.get_num_threads()
    torch.set_num_threads(RECORDED_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", CASES)
def test_three_training_steps_give_the_pinned_loss_and_state(case, tmp_path, recorded_threads):
    config, overrides = CASES[case]
    found = three_steps(config, overrides, tmp_path / "run")
    pinned = recorded()
    if os.environ.get("CONTRASTLAB_REPIN") == "1":
        pinned = pinned if pinned["machine"] == machine() else {"machine": machine(), "cases": {}}
        pinned["cases"][case] = found
        PINNED.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        return
    assert case in pinned["cases"], f"{case} is not pinned: record it with CONTRASTLAB_REPIN=1"
    expected = pinned["cases"][case]
    assert sorted(found["modules"]) == sorted(expected["modules"]), "the state dict's top-level modules changed"
    if pinned["machine"] == machine():
        assert found["loss"] == expected["loss"]
        for name, module in found["modules"].items():
            assert module == expected["modules"][name], f"{case}: {name} differs from the pinned state"
    else:
        assert math.isclose(found["loss"], expected["loss"], rel_tol=1e-4, abs_tol=1e-4)
        for name, module in found["modules"].items():
            assert math.isclose(module["sum"], expected["modules"][name]["sum"], rel_tol=1e-4, abs_tol=1e-4), f"{case}: {name}"
