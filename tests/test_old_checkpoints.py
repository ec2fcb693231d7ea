"""Checkpoints written before the run plumbing moved (commit 6332e42, `tests/fixtures/checkpoints_6332e42/`,
made by its `make.sh`) still load everywhere a user gives one: a pretraining run resumes from them with their
saved `config.yaml` (old class paths such as `methods.tracking.WandbRun` included), the linear stage probes
their trunk, a probe's checkpoint validates and the analysis rebuilds the method.

Resuming and validating give the numbers recorded at that commit in `expected.json` (bit for bit on the CPU
kind that recorded them, to 1e-4 elsewhere, as in `test_pinned_steps.py`). To record them anew, at a commit
meant to change them: `CONTRASTLAB_REPIN=1 uv run --locked pytest tests/test_old_checkpoints.py`.
"""

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

import main_linear
import main_pretrain
from tests.test_pinned_steps import machine

ROOT = Path(__file__).parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints_6332e42"
EXPECTED = FIXTURES / "expected.json"
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.precision=32-true"]


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


def digest(state_dict: dict[str, torch.Tensor]) -> dict:
    """SHA-256 of every tensor's name and bytes, and the sum of the floating-point ones."""
    hashed, total = hashlib.sha256(), 0.0
    for name, tensor in sorted(state_dict.items()):
        data = tensor.detach().cpu().contiguous().reshape(-1)
        hashed.update(name.encode() + str(data.dtype).encode() + data.view(torch.uint8).numpy().tobytes())
        total += data.double().sum().item() if data.is_floating_point() else 0.0
    return {"sha256": hashed.hexdigest(), "sum": total}


def check_recorded(case: str, found: dict) -> None:
    expected = json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {"machine": machine(), "cases": {}}
    if os.environ.get("CONTRASTLAB_REPIN") == "1":
        expected = expected if expected["machine"] == machine() else {"machine": machine(), "cases": {}}
        expected["cases"][case] = found
        EXPECTED.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        return
    recorded = expected["cases"][case]
    if expected["machine"] == machine():
        assert found == recorded
    else:
        for key, value in recorded.items():
            number = value["sum"] if isinstance(value, dict) else value
            got = found[key]["sum"] if isinstance(value, dict) else found[key]
            assert math.isclose(got, number, rel_tol=1e-4, abs_tol=1e-4), f"{case}: {key}"


@pytest.mark.parametrize("name", ["moco", "paco"])
def test_an_old_pretraining_checkpoint_resumes_with_its_saved_config_to_the_recorded_state(name, tmp_path):
    config, checkpoint = old_run(name, tmp_path)
    cli = main_pretrain.cli_main([
        "fit", "--config", str(config), "--ckpt_path", str(checkpoint), "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path / 'resumed'}", "--trainer.limit_val_batches=0", *QUIET,
    ])  # fmt: skip
    assert cli.trainer.global_step == 3
    assert type(cli.trainer.logger).__name__ == "WandbRun"  # the saved config names methods.tracking.WandbRun
    check_recorded(f"resume_{name}", {"loss": cli.trainer.callback_metrics["train/loss"].item(), "state": digest(cli.model.state_dict())})


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


def test_an_old_linear_probe_checkpoint_validates_to_the_recorded_accuracy(tmp_path):
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

