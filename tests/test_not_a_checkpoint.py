"""A file that is not a checkpoint, given to any entry point that takes one (issue 32, item 6): one line naming the
entry point's key and the file, "not a PyTorch checkpoint" with the bytes it starts with, never torch's advice to
load with weights_only=False (which would run code from the file)."""

from pathlib import Path

import pytest
from test_cli import LINEAR_DIGITS, PRETRAIN_DIGITS, TINY_RUN, run_failing

import main_linear
import main_pretrain
from analysis.__main__ import main as analyse_checkpoint
from interop.export import main as export_command

QUIET = ["--trainer.logger=false", "--trainer.precision=32-true"]
CONTENTS = {"text.pth": b"101\n", "page.pth": b"<!DOCTYPE html><html><body>Not Found</body></html>\n"}


@pytest.fixture(params=sorted(CONTENTS))
def not_a_checkpoint(request, tmp_path) -> Path:
    path = tmp_path / request.param
    path.write_bytes(CONTENTS[request.param])
    return path


def assert_one_line_about(line: str, path: Path, key: str) -> None:
    assert line.startswith("error: ") and key in line and str(path) in line
    assert "not a PyTorch checkpoint (it starts with b" in line
    assert "weights_only=False" not in line


def test_backbone_weights(not_a_checkpoint, tmp_path, capsys):
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={tmp_path / 'run'}",
                                       f"--model.init_args.backbone.weights={not_a_checkpoint}"], capsys)  # fmt: skip
    assert_one_line_about(line, not_a_checkpoint, "backbone.weights")
    assert not (tmp_path / "run").exists()


def test_ckpt_path(not_a_checkpoint, tmp_path, capsys):
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={tmp_path / 'run'}",
                                       f"--ckpt_path={not_a_checkpoint}"], capsys)  # fmt: skip
    assert_one_line_about(line, not_a_checkpoint, "ckpt_path")
    assert not (tmp_path / "run").exists()


def test_pretrained_ckpt_of_the_linear_stage(not_a_checkpoint, tmp_path, capsys):
    line = run_failing(main_linear, ["fit", "--config", LINEAR_DIGITS, *QUIET, f"--trainer.default_root_dir={tmp_path / 'run'}",
                                     f"--model.pretrained_ckpt={not_a_checkpoint}"], capsys)  # fmt: skip
    assert_one_line_about(line, not_a_checkpoint, "pretrained_ckpt")
    assert not (tmp_path / "run").exists()


def test_the_export(not_a_checkpoint, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        export_command([str(not_a_checkpoint), "--format", "torchvision", "--out", str(tmp_path / "out")])
    assert_one_line_about(str(exit_info.value.code), not_a_checkpoint, "checkpoint")
    assert not list(tmp_path.glob("out*"))


def test_the_analysis(not_a_checkpoint, tmp_path, capfd):
    with pytest.raises(SystemExit) as exit_info:
        analyse_checkpoint([str(not_a_checkpoint), "--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "out")])
    assert_one_line_about(str(exit_info.value.code), not_a_checkpoint, "checkpoint ")  # the line `python -m analysis` prints: its argument is the checkpoint
    assert capfd.readouterr().err == ""  # and nothing else
    assert not (tmp_path / "out").exists()
