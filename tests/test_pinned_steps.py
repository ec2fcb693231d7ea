"""Three training steps of every Digits-M method config, pinned to the numbers recorded in `pinned_steps.json`.

Each case runs `main_pretrain.py fit` (or `main_linear.py fit`) on its shipped config as a user does, for three
optimizer steps, and records the last training loss and, per top-level module of the state dict (trunk, heads,
momentum encoder, queue, memory bank, class centres, ...), the fingerprint of `tests/fingerprint.py`: a SHA-256
of its tensors' bytes, and the norms and random projections of its state and of its change over the steps. A
change that is meant to keep every method's computation (a refactor, a move of plumbing) keeps these bit for
bit. The steps run in fp32 (`--trainer.precision 32-true`): the Digits-M configs' bf16 autocast is emulated on a
CPU without bf16 units, and rounds as the CPU's kernels do.

On the machine kind that recorded them (`torch.backends.cpu.get_cpu_capability()` and the torch version) the
loss and the bytes must be equal. Elsewhere kernels round differently: the loss and the fingerprints are
compared to `TOLERANCE` (its comment says how it was measured), the integer tensors exactly. An AVX-512 machine
checks the AVX2 recordings bit for bit with ATen and oneDNN held to AVX2 (`ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` before the command: the capability then reads AVX2, and the kernels are the AVX2 ones).

To record them anew, when a change is meant to alter the numbers (say why in its commit):

    CONTRASTLAB_REPIN=1 uv run --locked pytest tests/test_pinned_steps.py
"""

import json
import os
from pathlib import Path

import pytest
import torch
from fingerprint import differences, initial_state, loss_differs, module_fingerprints

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
    "barlow_twins_digits": ("barlow_twins_digits.yaml", []),
    "vicreg_digits": ("vicreg_digits.yaml", []),
    "swav_digits": ("swav_digits.yaml", []),
    "dino_digits": ("dino_digits.yaml", []),
    "linear_digits": ("linear_digits.yaml", ["--model.random_init=true", "--model.backbone.name=timm:test_resnet"]),
    "linear_tcl_digits": ("linear_tcl_digits.yaml", ["--model.random_init=true", "--model.backbone.name=timm:test_resnet"]),
    "byol_digits": ("byol_digits.yaml", []),
    "simsiam_digits": ("simsiam_digits.yaml", []),
    "mocov3_digits": ("mocov3_digits.yaml", []),
    # a quarter of the config's batch: the same computation, and a quarter of its 17 s in fp32 on one thread
    "mocov3_vit_digits": ("mocov3_vit_digits.yaml", ["--data.init_args.batch_size=32"]),
    "nnclr_digits": ("nnclr_digits.yaml", []),
}


# How far the numbers of another CPU kind may be from the recorded ones, relative to the recorded loss and to the
# recorded norms (`fingerprint.differences`). Measured on the recording machine (AVX2) by `tests/pinned_spread.py`:
# with oneDNN held to SSE4.1 and MKL to SSE4.2 (other blockings and summation orders in every convolution and
# matrix product) the largest differences over all cases were 2.5e-5 of the loss, 2.1e-4 of a state's norm and
# 1.5e-3 of a change's norm (supcon_digits' trunk). The tolerances are 20 times those. An AVX512 machine with bf16
# units ran these cases within 1e-4 of the recorded losses (the checks before this fingerprint, at commit
# 3cc059b). Two methods differ by far more: the change of CE's and Balanced Softmax's classifiers by 1.5 times
# its norm, of linear_digits' and linear_tcl_digits' probes by 1.2 (test_swapped_cases_fail_on_any_machine).
TOLERANCE = {"loss": 5e-4, "state": 4e-3, "change": 3e-2}


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def three_steps(config: str, overrides: list[str], run_dir: Path) -> dict:
    """The loss after three steps of `config` and the fingerprint of every top-level module."""
    entry = main_linear if config.startswith("linear_") else main_pretrain
    cli = entry.cli_main([
        "fit", "--config", str(ROOT / "configs" / config), *overrides, f"--trainer.max_steps={STEPS}",
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}",
        "--trainer.callbacks+=fingerprint.InitialState", "--checkpoint.save_last=false", "--checkpoint.save_top_k=0",  # no file: only the numbers count here
    ])  # fmt: skip
    assert cli.trainer.global_step == STEPS
    return {
        "loss": cli.trainer.callback_metrics["train/loss"].item(),
        "modules": module_fingerprints(cli.model.state_dict(), initial_state(cli.trainer)),
    }


def recorded() -> dict:
    return json.loads(PINNED.read_text()) if PINNED.is_file() else {"machine": machine(), "cases": {}}


def mismatches(found: dict, expected: dict, same_machine: bool) -> list[str]:
    """How a case's numbers differ from the pinned ones: bit for bit on the recording machine, else to TOLERANCE."""
    if same_machine:
        problems = [] if found["loss"] == expected["loss"] else [f"loss {found['loss']!r} instead of {expected['loss']!r}"]
        if sorted(found["modules"]) != sorted(expected["modules"]):
            return problems + [f"modules {sorted(found['modules'])} instead of {sorted(expected['modules'])}"]
        return problems + [f"{name}: differs from the pinned state" for name, module in found["modules"].items() if module != expected["modules"][name]]
    problems = [f"loss {found['loss']!r} instead of {expected['loss']!r}"] if loss_differs(found["loss"], expected["loss"], TOLERANCE["loss"]) else []
    return problems + differences(found["modules"], expected["modules"], TOLERANCE["state"], TOLERANCE["change"])


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
    assert mismatches(found, pinned["cases"][case], pinned["machine"] == machine()) == []


@pytest.mark.parametrize("case, other", [("ce_digits_lt", "balanced_softmax_digits_lt"), ("linear_digits", "linear_tcl_digits"), ("sce_digits", "ressl_digits")])
def test_swapped_cases_fail_on_any_machine(case, other):
    """Two methods' pinned numbers, swapped, fail the comparison on the recording machine and, to the tolerance, on
    any other (CE and Balanced Softmax share trunk and initialisation: their trunks differ only in the change)."""
    pinned = recorded()["cases"]
    for same_machine in (True, False):
        assert mismatches(pinned[other], pinned[case], same_machine)
        assert mismatches(pinned[case], pinned[other], same_machine)
