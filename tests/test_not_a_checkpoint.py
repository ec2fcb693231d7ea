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


def test_a_checkpoint_of_a_method_whose_module_cannot_be_imported_here_says_so_not_that_the_class_is_missing():
    """A method kept outside the repository, its folder not on PYTHONPATH: the linear stage and the export said the
    checkpoint named a class 'this contrastlab does not have', and sent its user looking for a version mismatch."""
    from engine.checkpoint_record import RECORD_KEY, VERSION
    from methods.checkpoints import CheckpointMismatch, method_class

    outside = {"state_dict": {}, RECORD_KEY: {"version": VERSION, "module": "my_methods_not_on_the_path.SymMoCo"}}
    with pytest.raises(CheckpointMismatch, match=r"^run.ckpt names the class my_methods_not_on_the_path.SymMoCo, whose module cannot be "
                       r"imported here \(No module named 'my_methods_not_on_the_path'\): a method outside methods/ needs its folder on PYTHONPATH$"):
        method_class(outside, "run.ckpt")
    for gone in ("methods.NoSuchMethod", "methods.removed_module.Method"):  # the project's own: no PYTHONPATH hint
        missing = {"state_dict": {}, RECORD_KEY: {"version": VERSION, "module": gone}}
        with pytest.raises(CheckpointMismatch, match=rf"^run.ckpt names the class {gone}, which this contrastlab does not have$"):
            method_class(missing, "run.ckpt")


def test_a_checkpoint_of_a_method_class_that_breaks_the_contract_is_one_error_line(tmp_path, monkeypatch):
    """A trial method written before the contract checks: importing its module raises TypeError when its class is made."""
    from engine.checkpoint_record import RECORD_KEY, VERSION
    from methods.checkpoints import CheckpointMismatch, method_class

    (tmp_path / "old_trial.py").write_text("from methods.pretrain import PretrainMethod\n\n\nclass Trial(PretrainMethod):\n"
                                          "    def on_train_batch_start(self, batch, batch_idx):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    checkpoint = {"state_dict": {}, RECORD_KEY: {"version": VERSION, "module": "old_trial.Trial"}}
    with pytest.raises(CheckpointMismatch, match=r"^run.ckpt names the class old_trial.Trial, which cannot be created here: class Trial: "
                       r"Trial.on_train_batch_start overrides the base's or a mixin's"):
        method_class(checkpoint, "run.ckpt")


def test_a_checkpoint_written_before_the_method_gained_a_buffer_is_one_error_naming_it():
    """A method's code that adds a buffer, resumed from a run of its earlier code: a 13-frame "Missing key(s)" traceback."""
    import torch
    from helpers import TINY_BACKBONE, TINY_PROJECTOR

    from engine.checkpoint_record import CheckpointMismatch
    from methods import MoCoV2

    class CountingMoCo(MoCoV2):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))

    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, knn_k=0)
    earlier = MoCoV2(**options).state_dict()
    model = CountingMoCo(**options)
    with pytest.raises(CheckpointMismatch, match=r"^the checkpoint being loaded does not fit this CountingMoCo: it lacks 1 of its tensors \['steps_seen'\] "
                       r"and holds 0 it has not \[\] \(written by the method's code before a buffer or parameter was added or removed"):
        model.load_state_dict(earlier)
    model.load_state_dict(earlier, strict=False)  # a non-strict load is the caller's choice
    with pytest.raises(CheckpointMismatch, match=r"^the checkpoint being loaded does not fit this MoCoV2: 1 of its tensors have other shapes "
                       r"\(queue.keys \(64, 32\) for \(128, 32\)\): written with another configuration$"):
        MoCoV2(**(options | {"queue_size": 128})).load_state_dict(earlier)
