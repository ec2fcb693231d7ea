"""The paths a long cluster run takes, each told truthfully (issue 32): a run directory holds one run at a time; a
resumed run keeps the settings it was trained with, or is refused in one line before anything is written."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, Timer
from test_cli import PRETRAIN_DIGITS, TINY_RUN, run_failing

import main_pretrain
from engine.config import load_yaml
from engine.preemption import ProcessTimeLimit
from scripts import compare

QUIET = ["--trainer.logger=false", "--trainer.precision=32-true"]


def files_in(directory) -> dict:
    return {path: path.stat().st_mtime_ns for path in directory.rglob("*") if path.is_file()}


def pretrain(run_dir, *overrides):
    return main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={run_dir}", *overrides])


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    pretrain(run_dir)
    return run_dir


@pytest.fixture
def finished_run(trained_once, tmp_path):
    """A copy of a finished two-step run, for the test to resume or alter."""
    return Path(shutil.copytree(trained_once, tmp_path / "run"))


# ----------------------------------------------------------------- one run per directory
HOLD_THE_LOCK = """
import fcntl, os, sys, time
descriptor = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(descriptor, fcntl.LOCK_EX)
os.write(descriptor, b"process %d on testhost, started now: another run" % os.getpid())
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_run_into_a_directory_in_use_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(run_dir / "run.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = files_in(run_dir)
        line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={run_dir}"], capsys)
        assert line == (f"error: trainer.default_root_dir '{run_dir}' is in use by another run (process {holder.pid} on testhost, started "
                        "now: another run): wait for it to end, or give this run another trainer.default_root_dir")
        assert files_in(run_dir) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_the_lock_of_a_run_that_ended_or_died_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").write_text("process 1 on elsewhere, started long ago: killed with -9\n")  # nobody holds it
    cli = pretrain(run_dir)
    assert cli.trainer.global_step == 2
    holder = (run_dir / "run.lock").read_text()
    assert f"process {os.getpid()} on " in holder and "elsewhere" not in holder  # this run's own description replaced the stale one
    assert pretrain(run_dir, "--ckpt_path=last", "--trainer.max_epochs=1").trainer.global_step == 2  # released at the end


# ----------------------------------------------------------------- a resumed run keeps its settings
@pytest.mark.parametrize(
    "override, changed",
    [
        ("--model.init_args.optimizer.lr=2.4", "model.init_args.optimizer.lr 2.4 (the run was trained with 0.24)"),
        ("--model.init_args.temperature=0.5", "model.init_args.temperature 0.5 (the run was trained with 0.2)"),
        ("--model.init_args.queue_size=128", "model.init_args.queue_size 128 (the run was trained with 64)"),
        ("--data.init_args.batch_size=32", "data.init_args.batch_size 32 (the run was trained with 16)"),
        ("--trainer.max_epochs=3", "trainer.max_epochs 3 (the run was trained with 1)"),
        ("--seed_everything=1", "seed_everything 1 (the run was trained with 0)"),
        ("--trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches 2 (the run was trained with 1)"),
        ("--trainer.gradient_clip_val=1.0", "trainer.gradient_clip_val 1.0 (the run was trained with None)"),
        # what a CPU without bf16 units chooses for the same command (engine.devices.choose_cpu_precision): the error says how to keep it
        ("--trainer.precision=bf16-mixed", "trainer.precision 'bf16-mixed' (the run was trained with '32-true'; --trainer.precision 32-true "
                                           "resumes it so: on a CPU without bf16 units the precision rule trains a bf16 precision as 32-true)"),
        # a view given anew with its preset only: its other settings would revert to the preset's (blur 0.5) without a word
        ("--data.init_args.views={query: {preset: mocov2}, key: {preset: mocov2}}",
         "data.init_args.views.key.blur_prob not given (the run was trained with 0.0)"),
    ],
)
@pytest.mark.slow
def test_resuming_with_a_changed_setting_is_refused_in_one_line_before_anything_is_written(finished_run, override, changed, capsys):
    before = files_in(finished_run)
    for ckpt_path in ("last", str(finished_run / "checkpoints" / "last.ckpt")):
        source = f"checkpoint {finished_run / 'checkpoints' / 'last.ckpt'}" if ckpt_path == "last" else f"ckpt_path {ckpt_path!r}"
        line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={finished_run}",
                                           f"--ckpt_path={ckpt_path}", override], capsys)
        assert line.startswith(f"error: {source} resumes a run with {changed}: a resumed run keeps the settings it was trained with")
    assert files_in(finished_run) == before


@pytest.mark.slow
def test_resuming_with_another_number_of_processes_is_refused(finished_run, capsys):
    checkpoint = torch.load(finished_run / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["contrastlab"]["world_size"] == 1
    checkpoint["contrastlab"]["world_size"] = 2  # as if two processes had trained it
    torch.save(checkpoint, finished_run / "checkpoints" / "last.ckpt")
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={finished_run}",
                                       "--ckpt_path=last"], capsys)
    assert "resumes a run with 1 processes (the run was trained with 2: another global batch)" in line


@pytest.mark.slow
def test_what_a_resumption_may_change_does_not_stop_it(finished_run):
    cli = pretrain(finished_run, "--ckpt_path=last", "--trainer.max_steps=3", "--trainer.limit_val_batches=1", "--data.init_args.num_workers=1",
                   "--trainer.max_epochs=1", "--trainer.callbacks+=test_long_runs.TrainingBatches")
    batches = next(callback for callback in cli.trainer.callbacks if isinstance(callback, TrainingBatches))
    # resumed at its end: the epoch it was trained for is over, nothing more to train (a new run would train 2 batches)
    assert cli.trainer.global_step == 2 and batches.count == 0


@pytest.mark.slow
def test_a_finished_run_whose_results_file_was_removed_measures_its_final_weights_again_when_resumed(finished_run):
    """`reproduce.py --collect` says to remove an unreadable results file to run its stage again: the stage then resumes
    the finished run, which trains nothing, and must still write its results, of the same final weights."""
    results = finished_run / "results_val.json"
    written = json.loads(results.read_text())
    counted = ["--trainer.callbacks+=test_long_runs.TrainingBatches", "--trainer.callbacks+=test_long_runs.Validations"]
    assert callback_of(pretrain(finished_run, "--ckpt_path=last", *counted), Validations).count == 0  # its results kept: nothing to do
    results.unlink()
    cli = pretrain(finished_run, "--ckpt_path=last", *counted)
    again = json.loads(results.read_text())
    assert callback_of(cli, TrainingBatches).count == 0 and callback_of(cli, Validations).count == 1
    assert again["global_step"] == again["val_global_step"] == written["global_step"] == 2
    measured = {name: value for name, value in written["metrics"].items() if name.startswith("val/")}
    assert measured and {name: again["metrics"][name] for name in measured} == measured


@pytest.mark.slow
def test_a_finished_run_resumed_to_train_further_is_unfinished_until_its_new_end(tmp_path, capsys, monkeypatch):
    """The results of the fit before must not stand beside the new settings of config.yaml while the run trains on
    (stopped here by max_time; a SIGTERM or a crash alike): compare.py, sweeps and tables would take them as its end."""
    finished_run = tmp_path / "run"
    pretrain(finished_run, *STOPPABLE, "--trainer.max_steps=2")
    one_second_per_step(monkeypatch)
    earlier = json.loads((finished_run / "results_val.json").read_text())
    extend = [*STOPPABLE, "--ckpt_path=last", "--trainer.max_steps=5", "--trainer.max_time=00:00:00:02"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain(finished_run, *extend)  # steps 3 and 4 of 5
    assert exit_info.value.code == 143 and earlier["global_step"] == 2
    assert not (finished_run / "results_val.json").exists() and not compare.read_run(finished_run).finished
    assert json.loads((finished_run / "results_val.earlier.json").read_text()) == earlier  # kept, under another name
    assert load_yaml((finished_run / "config.yaml").read_text())["trainer"]["max_steps"] == 5
    pretrain(finished_run, *extend)  # step 5: the end
    assert json.loads((finished_run / "results_val.json").read_text())["global_step"] == 5 and compare.read_run(finished_run).finished


def callback_of(cli, kind: type) -> Callback:
    return next(callback for callback in cli.trainer.callbacks if isinstance(callback, kind))


class Validations(Callback):
    """Counts the validations a run makes (not its sanity check)."""

    def __init__(self):
        self.count = 0

    def on_validation_end(self, trainer, pl_module):
        self.count += not trainer.sanity_checking


def test_a_run_validates_its_final_weights_once(tmp_path):
    assert callback_of(pretrain(tmp_path / "run", "--trainer.callbacks+=test_long_runs.Validations"), Validations).count == 1


class TrainingBatches(Callback):
    """Counts the training batches a run trains."""

    def __init__(self):
        self.count = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.count += 1


def test_a_setting_added_since_the_checkpoint_is_kept_at_its_default_and_one_the_run_recorded_cannot_be_left_out():
    """A checkpoint written before a setting existed trained as with its default (its class's constructor says which)."""
    from engine.cli.resume import changed_setting

    recorded = {"contrastlab": {"config": {"model": {"init_args": {"lr": 0.1}}, "trainer": {"max_epochs": 5}}}}
    assert changed_setting(recorded, {"model": {"init_args": {"lr": 0.1, "new_option": "default"}}, "trainer": {"max_epochs": 5}}) is None  # no class: no default to read
    assert changed_setting(recorded, {"model": {"init_args": {"lr": 0.2}}, "trainer": {"max_epochs": 5}}) == (
        "model.init_args.lr 0.2 (the run was trained with 0.1)")
    assert changed_setting({"contrastlab": {}}, {"model": {}}) is None  # a checkpoint without a recorded config
    subset = {"contrastlab": {"config": {"data": {"init_args": {"label_subset": {"fraction": 0.1}}}}}}
    assert changed_setting(subset, {"data": {"init_args": {"label_subset": None}}}) == (  # the whole training set instead of a tenth
        "data.init_args.label_subset None (the run was trained with {'fraction': 0.1})")
    assert changed_setting(subset, {"data": {"init_args": {"label_subset": {}}}}) == (
        "data.init_args.label_subset {} (the run was trained with {'fraction': 0.1})")

    simclr = {"class_path": "methods.SimCLR", "init_args": {"temperature": 0.5, "optimizer": {"name": "lars", "lr": 1.0}}}
    old = {"contrastlab": {"config": {"model": simclr}}}
    added = lambda **options: {"model": simclr | {"init_args": simclr["init_args"] | options}}  # noqa: E731
    assert changed_setting(old, added(sum_of_directions=False)) is None
    assert changed_setting(old, added(sum_of_directions=True)) == (
        "model.init_args.sum_of_directions True (the run was trained before this setting existed, as with its default False)")
    optimizer = simclr["init_args"]["optimizer"]
    assert changed_setting(old, added(optimizer=optimizer | {"lars_lr_in_momentum": False})) is None
    assert changed_setting(old, added(optimizer=optimizer | {"lars_lr_in_momentum": True})).startswith("model.init_args.optimizer.lars_lr_in_momentum True")


def test_a_checkpoint_of_another_run_is_refused_into_a_directory_that_holds_a_run(finished_run, tmp_path, capsys):
    """An explicit ckpt_path continues into an empty directory, never over another run's checkpoints and W&B run."""
    other = pretrain(tmp_path / "other", "--seed_everything=1")
    other_checkpoint = Path(other.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    before = files_in(finished_run)
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={finished_run}",
                                       "--seed_everything=1", f"--ckpt_path={other_checkpoint}"], capsys)
    assert line == (f"error: {finished_run / 'checkpoints' / 'last.ckpt'} already holds a run, and ckpt_path {other_checkpoint} is not one of its "
                    "checkpoints: the run would go on over that run's files; give another trainer.default_root_dir (or --ckpt_path last to resume the run there)")
    assert files_in(finished_run) == before
    assert pretrain(tmp_path / "empty", "--seed_everything=1", f"--ckpt_path={other_checkpoint}").trainer.global_step == 2


@pytest.mark.parametrize("kept", ["removed", "elsewhere"])
def test_a_finished_run_whose_checkpoints_are_not_in_its_directory_still_holds_it(kept, tmp_path, capsys):
    """Its results and config were overwritten by a new run, without a word, when only checkpoints counted."""
    run_dir = tmp_path / "run"
    pretrain(run_dir, *([f"--checkpoint.dirpath={tmp_path / 'kept'}"] if kept == "elsewhere" else []))
    if kept == "removed":
        shutil.rmtree(run_dir / "checkpoints")
    before = files_in(run_dir)
    for resume in ([], ["--ckpt_path=last"]):  # `last` with no checkpoint starts a new run
        line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={run_dir}",
                                           "--seed_everything=5", *resume], capsys)
        assert line == (f"error: {run_dir / 'results_val.json'} holds the results of a finished run whose checkpoints are not in "
                        f"{run_dir / 'checkpoints'}: a new run there would overwrite them; give another trainer.default_root_dir, or remove "
                        "that file to reuse the directory")
        assert files_in(run_dir) == before


def test_a_run_whose_last_ckpt_is_gone_still_holds_its_directory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    pretrain(run_dir)
    (run_dir / "checkpoints" / "last.ckpt").unlink()  # removed, or a run of a version that let checkpoint.save_last be false
    (checkpoint,) = (run_dir / "checkpoints").glob("*.ckpt")
    before = files_in(run_dir)
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={run_dir}",
                                       "--seed_everything=5"], capsys)
    assert line == f"error: {checkpoint} already holds a run: resume it with --ckpt_path last, or start a new one under another trainer.default_root_dir"
    assert files_in(run_dir) == before
    resumed = pretrain(run_dir, "--ckpt_path=last")  # its newest checkpoint: finished, nothing to train
    assert resumed.trainer.ckpt_path == str(checkpoint) and resumed.trainer.global_step == 2


def test_a_run_without_last_ckpt_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys):
    """A SIGTERM or max_time stop writes last.ckpt only where the run keeps one: with save_last false it lost its steps."""
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={tmp_path / 'run'}",
                                       "--checkpoint.save_last=false"], capsys)
    assert line.startswith("error: checkpoint.save_last False: every run keeps checkpoints/last.ckpt, which a stop (SIGTERM, max_time) writes")
    assert not (tmp_path / "run").exists()


def test_config_yaml_records_a_batch_count_as_the_integer_the_run_used(tmp_path):
    pretrain(tmp_path / "run", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1")
    trainer = load_yaml((tmp_path / "run" / "config.yaml").read_text())["trainer"]
    recorded = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["contrastlab"]["config"]["trainer"]
    assert [type(section[key]) for section in (trainer, recorded) for key in ("limit_train_batches", "limit_val_batches")] == [int] * 4


@pytest.mark.parametrize(
    "first, resumed, changed",
    [(["--trainer.max_epochs=-1", "--trainer.max_steps=2"], ["--trainer.max_steps=4"], "trainer.max_steps 4 (the run was trained with 2)"),
     ([], ["--trainer.limit_train_batches=1"], "trainer.limit_train_batches 1 (the run was trained with 2)")],
)
@pytest.mark.slow
def test_what_fixes_the_schedule_cannot_change_on_resume(first, resumed, changed, tmp_path, capsys):
    """Without max_epochs, max_steps is the schedules' length; the batches of an epoch fix it in any case."""
    run_dir = tmp_path / "run"
    pretrain(run_dir, *first)
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={run_dir}", *first,
                                       *resumed, "--ckpt_path=last"], capsys)
    assert line.startswith(f"error: checkpoint {run_dir / 'checkpoints' / 'last.ckpt'} resumes a run with {changed}")


@pytest.mark.parametrize(
    "argument, message",
    [("--ckpt_path=best", "error: ckpt_path 'best' names the best checkpoint of a fit in this process, which a new process has not written: give last or a checkpoint file"),
     ("--trainer.logger.init_args.name_keys={lr: model.init_args.optimizer.lrr}",
      "error: trainer.logger.init_args.name_keys.lr: the resolved config has no key 'model.init_args.optimizer.lrr'")],
)
def test_a_bad_ckpt_path_name_or_run_name_key_is_one_line_before_the_directory_is_made(argument, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}", argument], capsys)
    assert line.startswith(message) and not run_dir.exists()


# ----------------------------------------------------------------- stops inside an epoch resume exactly
STOPPABLE = ["--trainer.max_epochs=2", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
             "--embedding_map.enabled=false"]


def state_after(cli) -> dict:
    return {name: tensor.clone() for name, tensor in cli.model.state_dict().items()}


def assert_same_state(straight: dict, resumed: dict) -> None:
    assert straight.keys() == resumed.keys()
    assert [name for name in straight if not torch.equal(straight[name], resumed[name])] == []


@pytest.mark.slow
@pytest.mark.parametrize("stop", [3, 4], ids=["inside-an-epoch", "at-an-epochs-end"])  # epoch 0 has 4 batches
def test_a_run_stopped_by_max_steps_and_extended_trains_as_one_straight_run(tmp_path, stop):
    # at an epoch's end Lightning itself would continue epoch 0 past its end, with epoch 1's first batch, and then
    # train epoch 1 on epoch 2's data order (`engine.compat.close_finished_epoch`)
    straight = pretrain(tmp_path / "straight", *STOPPABLE, "--trainer.max_steps=6")
    stopped = pretrain(tmp_path / "extended", *STOPPABLE, f"--trainer.max_steps={stop}")
    assert stopped.trainer.global_step == stop
    extended = pretrain(tmp_path / "extended", *STOPPABLE, "--trainer.max_steps=6", "--ckpt_path=last")
    assert extended.trainer.global_step == straight.trainer.global_step == 6
    assert extended.trainer.callback_metrics["train/loss"].item() == straight.trainer.callback_metrics["train/loss"].item()
    assert_same_state(state_after(straight), state_after(extended))


@pytest.mark.slow
def test_a_run_stopped_by_max_time_says_so_writes_no_results_and_resumes_exactly_with_the_same_limit(tmp_path, capsys, monkeypatch):
    # each training step takes one second of this process's time, plus what Lightning's Timer carries over from a
    # checkpoint (`_offset`): a limit of 2 s stops the first process after step 2
    monkeypatch.setattr(ProcessTimeLimit, "time_elapsed", lambda self, stage="train": float(getattr(self, "steps", 0)) + self._offset)
    monkeypatch.setattr(ProcessTimeLimit, "on_train_batch_end", lambda self, trainer, *args: (
        setattr(self, "steps", getattr(self, "steps", 0) + 1), Timer.on_train_batch_end(self, trainer, *args)))
    straight = pretrain(tmp_path / "straight", *STOPPABLE, "--trainer.max_steps=3")
    run_dir = tmp_path / "timed"
    timed = [*STOPPABLE, "--trainer.max_steps=3", "--trainer.max_time=00:00:00:02", "--ckpt_path=last"]
    with pytest.raises(SystemExit) as exit_info:
        pretrain(run_dir, *timed)
    assert exit_info.value.code == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "stopped at trainer.max_time 00:00:00:02 (this process's time) after global step 2 (checkpoints/last.ckpt): resume with --ckpt_path last")
    assert not (run_dir / "results_val.json").exists()
    # the same command: its own 2 s, not the 2 s of the first process, so it ends the run at max_steps 3
    resumed = pretrain(run_dir, *timed)
    assert resumed.trainer.global_step == 3 and json.loads((run_dir / "results_val.json").read_text())["global_step"] == 3
    assert_same_state(state_after(straight), torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"])


def one_second_per_step(monkeypatch) -> None:
    """Each training step takes one second of this process's time, plus what Lightning's Timer carries over from a
    checkpoint (`_offset`)."""
    monkeypatch.setattr(ProcessTimeLimit, "time_elapsed", lambda self, stage="train": float(getattr(self, "steps", 0)) + self._offset)
    monkeypatch.setattr(ProcessTimeLimit, "on_train_batch_end", lambda self, trainer, *args: (
        setattr(self, "steps", getattr(self, "steps", 0) + 1), Timer.on_train_batch_end(self, trainer, *args)))


VALIDATED_EVERY_2 = [*STOPPABLE, "--trainer.limit_val_batches=1", "--trainer.check_val_every_n_epoch=2"]


@pytest.mark.slow
def test_a_max_time_stop_in_an_epoch_that_validates_nothing_saves_its_step_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    one_second_per_step(monkeypatch)
    straight = pretrain(tmp_path / "straight", *VALIDATED_EVERY_2)
    run_dir = tmp_path / "timed"
    timed = [*VALIDATED_EVERY_2, "--trainer.max_time=00:00:00:02", "--ckpt_path=last"]
    with pytest.raises(SystemExit):
        pretrain(run_dir, *timed)  # step 2 of epoch 0, which is not validated: Lightning's ModelCheckpoint saves nothing there
    assert "after global step 2 (checkpoints/last.ckpt)" in capsys.readouterr().err
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    for _ in range(3):  # 2 steps each
        try:
            pretrain(run_dir, *timed)
        except SystemExit:
            pass
    assert json.loads((run_dir / "results_val.json").read_text())["global_step"] == 8
    assert_same_state(state_after(straight), torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"])


@pytest.mark.slow
def test_a_run_whose_time_runs_out_at_its_last_step_has_ended_and_reports_its_results(tmp_path, monkeypatch):
    one_second_per_step(monkeypatch)
    cli = pretrain(tmp_path / "run", *STOPPABLE, "--trainer.max_steps=3", "--trainer.max_time=00:00:00:03")  # no SystemExit
    assert cli.trainer.global_step == 3 and json.loads((tmp_path / "run" / "results_val.json").read_text())["global_step"] == 3


class LastCheckpointSteps(Callback):
    """The step `last.ckpt` holds when each epoch starts, and a copy of the one epoch 1 starts from."""

    def __init__(self):
        self.steps = []

    def on_train_epoch_start(self, trainer, pl_module):
        last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        if trainer.current_epoch > 0:
            self.steps.append(torch.load(last, weights_only=True)["global_step"])
        if trainer.current_epoch == 1:
            shutil.copyfile(last, last.with_name("epoch_0_end.ckpt.copy"))


@pytest.mark.slow
def test_last_ckpt_holds_the_end_of_every_epoch_when_validation_runs_every_n_epochs(tmp_path):
    """A kill or a Ctrl-C loses at most the epoch it interrupts: last.ckpt is written at the end of each epoch, not
    only at the validated ones, and a run resumed from an unvalidated epoch's end trains as the straight run."""
    straight = pretrain(tmp_path / "run", *STOPPABLE, "--trainer.max_epochs=3", "--trainer.limit_val_batches=1", "--trainer.check_val_every_n_epoch=10",
                        "--trainer.callbacks+=test_long_runs.LastCheckpointSteps")
    assert next(callback for callback in straight.trainer.callbacks if isinstance(callback, LastCheckpointSteps)).steps == [4, 8]
    copy = tmp_path / "run" / "checkpoints" / "epoch_0_end.ckpt.copy"
    resumed = pretrain(tmp_path / "resumed", *STOPPABLE, "--trainer.max_epochs=3", "--trainer.limit_val_batches=1",
                       "--trainer.check_val_every_n_epoch=10", f"--ckpt_path={copy}")
    assert resumed.trainer.global_step == 12
    assert_same_state(state_after(straight), state_after(resumed))


@pytest.mark.parametrize("completed", [0, 1])  # the epoch's last.ckpt written at its end (0) or when training ended (1)
def test_a_checkpoint_of_a_stop_inside_an_epoch_reopens_that_epoch(completed):
    """The layout of Lightning's loop state that engine.compat.reopen_stopped_epoch changes: a max_steps stop at batch 3
    of epoch 0 counts the epoch as processed; reopened, it is started only, as in a SIGTERM checkpoint of that batch."""
    from engine.compat import processed_epochs, reopen_stopped_epoch

    counts = {"ready": 1, "started": 1, "processed": 1, "completed": completed}
    checkpoint = {"loops": {"fit_loop": {"epoch_progress": {"total": dict(counts), "current": dict(counts)}}}}
    assert processed_epochs(checkpoint) == 1
    reopen_stopped_epoch(checkpoint)
    assert checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"] == {"ready": 1, "started": 1, "processed": 0, "completed": 0}
    assert processed_epochs(checkpoint) == 0


def test_a_checkpoint_of_a_stop_at_an_epochs_end_starts_the_next_epoch():
    """The layout of Lightning's loop state that engine.compat.close_finished_epoch changes: a max_steps stop at the last
    batch of epoch 0 writes the epoch processed but not completed, with its 4 batches as the current epoch's."""
    from engine.compat import close_finished_epoch, processed_epochs

    epochs = {"ready": 1, "started": 1, "processed": 1, "completed": 0}
    batches = {"ready": 4, "started": 4, "processed": 4, "completed": 4}
    checkpoint = {"loops": {"fit_loop": {"epoch_progress": {"total": dict(epochs), "current": dict(epochs)},
                                         "epoch_loop.batch_progress": {"total": dict(batches), "current": dict(batches), "is_last_batch": True}}}}
    close_finished_epoch(checkpoint)
    loop = checkpoint["loops"]["fit_loop"]
    assert loop["epoch_progress"]["current"] == loop["epoch_progress"]["total"] == {"ready": 1, "started": 1, "processed": 1, "completed": 1}
    assert loop["epoch_loop.batch_progress"] == {"total": batches, "current": dict.fromkeys(batches, 0), "is_last_batch": False}
    assert processed_epochs(checkpoint) == 1


# ----------------------------------------------------------------- a full disk, a read-only directory
def fill_the_disk_at_the_second_save(monkeypatch):
    """torch.save writes some bytes and fails as it does on a full disk (a RuntimeError from its zip writer), from
    the second save of last.ckpt on; the disk then reports no free bytes."""
    saves, real_save = [], torch.save

    def save(value, path, *args, **kwargs):
        saves.append(Path(path).name)
        if sum(name.startswith("last.ckpt.") and name.endswith(".partial") for name in saves) < 2:
            return real_save(value, path, *args, **kwargs)
        Path(path).write_bytes(b"PK" + b"\0" * 4096)
        monkeypatch.setattr("engine.files.free_bytes", lambda directory: 0)
        raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 4160 vs 4098")

    monkeypatch.setattr(torch, "save", save)


def test_a_full_disk_is_one_line_naming_the_path_and_leaves_no_partial_file_and_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    fill_the_disk_at_the_second_save(monkeypatch)
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, "--trainer.max_epochs=2",
                                       f"--trainer.default_root_dir={run_dir}"], capsys)  # fmt: skip
    last = run_dir / "checkpoints" / "last.ckpt"
    assert line.startswith(f"error: no space left on device writing {run_dir / 'checkpoints'}/")
    assert "bytes needed, 0 free" in line
    assert not list(run_dir.rglob("*.partial"))
    assert torch.load(last, weights_only=True, map_location="cpu")["epoch"] == 0  # the first epoch's, intact


def test_a_full_disk_when_the_config_is_written_is_one_line_naming_it_and_leaves_no_partial_file(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    real_write_text = Path.write_text

    def write_text(path, text, *args, **kwargs):
        if not (path.name.startswith("config.yaml.") and path.name.endswith(".partial")):
            return real_write_text(path, text, *args, **kwargs)
        real_write_text(path, text[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", write_text)
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={run_dir}"], capsys)
    assert line.startswith(f"error: no space left on device writing {run_dir / 'config.yaml'} (")
    assert not list(run_dir.rglob("*.partial")) and not (run_dir / "config.yaml").exists()


def test_a_run_directory_that_cannot_be_written_is_one_line(tmp_path, capsys):
    occupied = tmp_path / "a-file"  # a run directory under a file: no directory can be made there, whoever runs
    occupied.write_text("")
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={occupied / 'run'}"], capsys)
    assert line == f"error: trainer.default_root_dir '{occupied / 'run'}' cannot be written: Not a directory"
    assert list(tmp_path.iterdir()) == [occupied]


# ----------------------------------------------------------------- small batches, small datasets
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["--data.init_args.batch_size=8"], "error: model.init_args.momentum.split_bn 8 needs data.init_args.batch_size divisible by 8 with at least 2 images per group, got 8"),
        (["--data.init_args.batch_size=20"], "error: model.init_args.momentum.split_bn 8 needs data.init_args.batch_size divisible by 8 with at least 2 images per group, got 20"),
        (["--data.init_args.batch_size=1", "--model.init_args.momentum.split_bn=1", "--model.init_args.momentum.shuffle_bn=false"],
         "error: data.init_args.batch_size 1: BatchNorm needs at least 2 images per batch to normalise over"),
        (["--data.init_args.batch_size=2048", "--model.init_args.queue_size=4096"],
         "error: data.init_args.batch_size 2048 is larger than the 1197 training images: no full batch to train on"),
    ],
    ids=["one-image-per-split-bn-group", "batch-not-divisible-by-split-bn", "batch-of-one", "dataset-smaller-than-a-batch"],
)
def test_a_batch_the_model_or_the_data_cannot_take_is_one_line_before_anything_is_written(overrides, expected, tmp_path, capsys):
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, *QUIET, f"--trainer.default_root_dir={tmp_path / 'run'}", *overrides], capsys)
    assert line.startswith(expected)
    assert not (tmp_path / "run").exists()


def test_a_queue_larger_than_the_dataset_is_a_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"queue size 2048 is larger than the 1197 keys of one epoch of 1197 training images"):
        pretrain(tmp_path / "run", "--model.init_args.queue_size=2048", "--trainer.max_steps=1")
