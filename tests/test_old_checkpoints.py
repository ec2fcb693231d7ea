"""Checkpoints written before the run plumbing moved (commit 6332e42, `tests/fixtures/checkpoints_6332e42/`,
made by its `make.sh`) still load everywhere a user gives one: a pretraining run resumes from them with their
saved `config.yaml` (old class paths such as `methods.tracking.WandbRun` included), the linear stage probes
their trunk, a probe's checkpoint validates and the analysis rebuilds the method.

Resuming and validating give the numbers recorded in `expected.json`: the loss and the fingerprint of every module
(`tests/fingerprint.py`) after one more step, bit for bit on the CPU kind that recorded them (and on an AVX-512 CPU of the
recording's maker, where these tests run again in one pytest process held to the AVX2 kernels, `fingerprint.held_like`) and to the
tolerances of `test_pinned_steps.py` elsewhere; the accuracies of the probe. To record them anew, at a commit meant to change them:
`CONTRASTLAB_REPIN=1 uv run --locked pytest tests/test_old_checkpoints.py` (on an AVX-512 machine with the variables of
`fingerprint.HELD_TO_AVX2` set before it, so that the numbers stay the AVX2 kernels'). A machine of another kind compares
the bits it recorded with `CONTRASTLAB_REPIN=kind` (the file's `kinds`, as `tests/test_pinned_steps.py` says) bit for bit too.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fingerprint import bit_differences, forget_kind_bits, held_like, initial_state, kernel_kind, machine, module_fingerprints, record_kind_bits
from test_pinned_steps import mismatches

import main_linear
import main_pretrain

ROOT = Path(__file__).parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints_6332e42"
EXPECTED = FIXTURES / "expected.json"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.precision=32-true"]
pytestmark = pytest.mark.usefixtures("recorded_threads")  # the recorded numbers are of 2 intra-op threads


def old_run(name: str, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the old run `name`: (its config.yaml, its last.ckpt)."""
    shutil.copytree(FIXTURES / name, tmp_path / name)
    return tmp_path / name / "config.yaml", tmp_path / name / "last.ckpt"


def repoint_probe(checkpoint: Path, pretrained: Path) -> None:
    """Make the old probe's checkpoint name `pretrained` as its pretraining checkpoint (Lightning reads
    model.pretrained_ckpt from the checkpoint given as --ckpt_path, over the command line)."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["pretrained_ckpt"] == "/tmp/fx/moco/checkpoints/last.ckpt"  # make.sh's run
    saved["hyper_parameters"]["pretrained_ckpt"] = str(pretrained)
    torch.save(saved, checkpoint)


def check_recorded(case: str, found: dict) -> None:
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {"machine": machine(), "cases": {}}
    repin = os.environ.get("CONTRASTLAB_REPIN")
    if repin == "1":
        expected = forget_kind_bits(expected, case) if expected["machine"] == machine() else {"machine": machine(), "cases": {}}
        expected["cases"][case] = found
        EXPECTED.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        return
    recorded, same_machine = expected["cases"][case], expected["machine"] == machine()
    if repin == "kind" and same_machine:
        pytest.fail(f"CONTRASTLAB_REPIN=kind on {machine()}, the kind that recorded {EXPECTED.name}: compared bit for bit already", pytrace=False)
    if "modules" in recorded:  # a training step: the loss and the module fingerprints
        problems = mismatches(found, recorded, same_machine)
    elif same_machine:  # evaluation metrics
        problems = [] if found == recorded else [f"{found} instead of {recorded}"]
    else:  # another CPU kind may flip a prediction near a tie: up to one image of the 64 validated (2 batches of 32)
        close = found.keys() == recorded.keys() and all(abs(found[key] - value) <= 1 / 64 for key, value in recorded.items())
        problems = [] if close else [f"{found} instead of {recorded}, beyond one image of 64"]
    if repin == "kind":
        record_kind_bits(EXPECTED, case, found, problems)
        return
    kind_bits = expected.get("kinds", {}).get(kernel_kind(), {})  # this kind's own bits, where it recorded them
    assert problems + (bit_differences(found, kind_bits[case]) if case in kind_bits else []) == [], case


RECORDED_TESTS = ["test_an_old_pretraining_checkpoint_resumes_with_its_saved_config_to_the_recorded_state",
                  "test_an_old_linear_probe_checkpoint_validates_to_the_recorded_accuracy"]


@pytest.fixture(scope="module")
def held_outcomes(tmp_path_factory) -> dict[str, str] | None:
    """On a machine that computes as the recording one only when held so (`fingerprint.held_like`), the outcome
    (PASSED, FAILED, ...) of each test that compares recorded numbers, run in one pytest process held so, where it
    compares bit for bit; None where they run here."""
    environment = held_like(json.loads(EXPECTED.read_text())["machine"])
    if environment is None or os.environ.get("CONTRASTLAB_REPIN") == "1":
        return None
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}  # a session of its own
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rpfE", "--show-capture=no", "-n", "0",
                             f"--basetemp={tmp_path_factory.mktemp('held')}", "-k", " or ".join(RECORDED_TESTS), str(Path(__file__))],
                            cwd=ROOT, env={**inherited, **environment}, capture_output=True, text=True)
    outcomes = dict(reversed(line.split(" ", 1)) for line in result.stdout.splitlines() if line.startswith(("PASSED ", "FAILED ", "ERROR ")))
    return {test.split("::", 1)[-1].split(" - ")[0]: outcome for test, outcome in outcomes.items()} | {"output": result.stdout[-6000:]}


def ran_held(request, held_outcomes: dict[str, str] | None) -> bool:
    """Whether this test ran in the held process (asserted to have passed there)."""
    if held_outcomes is None:
        return False
    assert held_outcomes.get(request.node.name) == "PASSED", held_outcomes["output"]
    return True


@pytest.mark.parametrize("name", ["moco", "paco"])
def test_an_old_pretraining_checkpoint_resumes_with_its_saved_config_to_the_recorded_state(name, tmp_path, request, held_outcomes):
    if ran_held(request, held_outcomes):
        return
    config, checkpoint = old_run(name, tmp_path)
    cli = main_pretrain.cli_main([
        "fit", "--config", str(config), "--ckpt_path", str(checkpoint), "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path / 'resumed'}", "--trainer.limit_val_batches=0", *QUIET,
        "--trainer.callbacks+=fingerprint.InitialState",
    ])  # fmt: skip
    assert cli.trainer.global_step == 3
    assert type(cli.trainer.logger).__name__ == "WandbRun"  # the saved config names methods.tracking.WandbRun
    loss = cli.trainer.callback_metrics["train/loss"].item()
    check_recorded(f"resume_{name}", {"loss": loss, "modules": module_fingerprints(cli.model, initial_state(cli.trainer))})


def test_the_linear_stage_probes_the_trunk_of_an_old_pretraining_checkpoint(tmp_path):
    _, checkpoint = old_run("moco", tmp_path)
    cli = main_linear.cli_main([
        "fit", "--config", str(ROOT / "configs" / "linear_digits.yaml"), f"--model.init_args.pretrained_ckpt={checkpoint}",
        "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path / 'probe'}", "--data.init_args.batch_size=32", *QUIET,
    ])  # fmt: skip
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    trunk = {name: tensor for name, tensor in cli.model.state_dict().items() if name.startswith("backbone.")}
    assert trunk and all(torch.equal(tensor, saved[name]) for name, tensor in trunk.items())


def test_an_old_linear_probe_checkpoint_validates_to_the_recorded_accuracy(tmp_path, request, held_outcomes):
    if ran_held(request, held_outcomes):
        return
    config, checkpoint = old_run("linear", tmp_path)
    _, pretrained = old_run("moco", tmp_path)
    # the probe was made of the MoCo fixture's run at /tmp/fx/moco (make.sh), which need not exist here
    repoint_probe(checkpoint, pretrained)
    cli = main_linear.cli_main([
        "validate", "--config", str(config), "--ckpt_path", str(checkpoint), f"--model.init_args.pretrained_ckpt={pretrained}",
        f"--trainer.default_root_dir={tmp_path / 'validated'}", "--trainer.limit_val_batches=2", *QUIET,
    ])  # fmt: skip
    metrics = {name: value.item() for name, value in cli.trainer.callback_metrics.items() if name.startswith("val")}
    assert metrics
    check_recorded("validate_linear", metrics)


def test_an_old_probe_whose_pretraining_checkpoint_is_gone_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    config, checkpoint = old_run("linear", tmp_path)
    gone = tmp_path / "moved" / "last.ckpt"  # not /tmp/fx of make.sh itself, which the machine that made it may still hold
    repoint_probe(checkpoint, gone)
    run_dir = tmp_path / "validated"
    with pytest.raises(SystemExit) as exit_info:
        main_linear.cli_main(["validate", "--config", str(config), "--ckpt_path", str(checkpoint), f"--trainer.default_root_dir={run_dir}", *QUIET])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: ckpt_path '{checkpoint}' holds a probe of model.pretrained_ckpt '{gone}', which is not an existing file here "
        f"(moved or deleted): the probe's trunk is built from it; put that pretraining checkpoint back at '{gone}'"
    )
    assert not run_dir.exists()


def test_the_analysis_rebuilds_the_method_of_an_old_checkpoint_with_its_weights(tmp_path):
    from analysis.__main__ import load_method

    _, checkpoint = old_run("moco", tmp_path)
    method = load_method(checkpoint)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert type(method).__name__ == "MoCoV2"
    assert all(torch.equal(tensor, saved[name]) for name, tensor in method.state_dict().items())

