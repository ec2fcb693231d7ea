"""scripts/sweep.py: grid expansion, statistics over seeds, the table, the Slurm array, and one real run."""

import json
import math
import os
import re
import shlex
import signal
from pathlib import Path

import pytest

from scripts import sweep
from test_cli import LINEAR_DIGITS, PRETRAIN_DIGITS, TINY_RUN


def test_grid_expands_to_the_product_of_values_times_seeds_with_distinct_directories(tmp_path):
    grid = sweep.parse_grid(["model.init_args.temperature=0.1,0.2", "model.init_args.temperature_momentum=0.05,0.07"])
    runs = sweep.expand(grid, [0, 1], tmp_path)
    assert len(runs) == 8
    assert [run.point_name for run in runs[:2]] == ["temperature=0.1,temperature_momentum=0.05"] * 2
    assert [run.seed for run in runs[:2]] == [0, 1]
    assert runs[-1].point == (("model.init_args.temperature", "0.2"), ("model.init_args.temperature_momentum", "0.07"))
    assert len({run.directory for run in runs}) == 8
    assert runs[0].directory.name == "temperature0.1_temperature_momentum0.05_seed0"


@pytest.mark.parametrize("entry", ["model.init_args.temperature", "=0.1", "model.init_args.temperature="])
def test_a_malformed_grid_entry_is_refused_with_its_text(entry):
    with pytest.raises(ValueError, match="must look like key=value1,value2"):
        sweep.parse_grid([entry])


def test_summary_is_mean_sample_std_and_student_t_interval():
    summary = sweep.summarise([0.1, 0.2, 0.3])
    assert summary["mean"] == pytest.approx(0.2)
    assert summary["std"] == pytest.approx(0.1)
    assert summary["ci95"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)  # t(0.975, 2 dof)
    single = sweep.summarise([0.5])
    assert single["mean"] == 0.5 and math.isnan(single["ci95"])


def write_results(directory: Path, metrics: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results_val.json").write_text(json.dumps({"metrics": metrics}))


def test_table_aggregates_seeds_per_point_and_marks_missing_runs(tmp_path):
    runs = sweep.expand(sweep.parse_grid(["model.init_args.temperature=0.1,0.2"]), [0, 1], tmp_path)
    write_results(runs[0].directory, {"val/knn_top1": 0.40})
    write_results(runs[0].directory / "linear", {"val/probe_top1": 0.50})
    write_results(runs[1].directory, {"val/knn_top1": 0.60})
    write_results(runs[1].directory / "linear", {"val/probe_top1": 0.70})
    table = sweep.collect(runs, ["val/knn_top1", "linear:val/probe_top1"], tmp_path)
    rows = table.splitlines()
    assert rows[2].startswith("| temperature=0.1 | 2 | 50.00 ± 14.14 (±127.06) | 60.00 ± 14.14")
    assert rows[3] == "| temperature=0.2 | 2 | missing | missing |"
    assert (tmp_path / "results.md").read_text() == table
    assert (tmp_path / "results.csv").read_text().splitlines()[1] == "temperature=0.1,0,0.4,0.5"



def test_a_point_with_fewer_finished_seeds_than_planned_says_how_many_its_numbers_average(tmp_path):
    runs = sweep.expand(sweep.parse_grid(["model.init_args.temperature=0.1,0.2"]), [0, 1, 2], tmp_path)
    for run, value in zip(runs[:3], (0.40, 0.50, 0.60)):
        write_results(run.directory, {"val/knn_top1": value})
    write_results(runs[3].directory, {"val/knn_top1": 0.70})
    rows = sweep.collect(runs, ["val/knn_top1"], tmp_path).splitlines()
    assert rows[2] == "| temperature=0.1 | 3 | 50.00 ± 10.00 (±24.84) |"
    assert rows[3] == "| temperature=0.2 | 3 | 70.00 (n=1) |"


def test_an_array_task_leaves_the_table_to_collect(tmp_path, capsys):
    runs = sweep.expand(sweep.parse_grid([]), [0, 1], tmp_path)
    write_results(runs[1].directory, {"val/knn_top1": 0.5})
    assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--seeds", "0", "1", "--only", "1"]) == 0
    assert "base seed 1: done; the table: python scripts/sweep.py --collect" in capsys.readouterr().out
    assert not (tmp_path / "results.md").exists() and not (tmp_path / "results.csv").exists()


def test_a_collect_before_any_run_finished_tables_every_default_metric_as_missing(tmp_path, capsys):
    """It printed a header of `setting | seeds` over rows of one cell more."""
    sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--seeds", "0", "1", "--grid", "model.init_args.temperature=0.1,0.2", "--collect"])
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert lines[0] == "| setting | seeds | " + " | ".join(sweep.DEFAULT_METRICS[:2]) + " |"
    assert lines[2:4] == ["| temperature=0.1 | 2 | missing | missing |", "| temperature=0.2 | 2 | missing | missing |"]


def test_results_of_other_arguments_in_the_same_out_are_stale_not_skipped_as_done_nor_tabled(tmp_path, capsys):
    """A smoke sweep (`-- --trainer.max_epochs=1`) rerun without its `--` arguments in the same --out: its finished
    runs are named stale and left out of the table instead of standing for the real ones."""
    smoke = sweep.parse_args(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--seeds", "0", "1", "--", "--trainer.max_epochs=1"])
    real = sweep.parse_args(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--seeds", "0", "1"])
    runs = sweep.expand([], [0, 1], tmp_path)
    for run, args in zip(runs, (smoke, real)):  # seed 0 made by the smoke sweep, seed 1 by the real one
        ((directory, command),) = sweep.stages(run, args)
        write_results(directory, {"val/knn_top1": 0.5})
        (directory / sweep.RECORD).write_text(json.dumps({"arguments": sweep.stage_arguments(command)}))
    assert sweep.stale(runs[0], real).startswith("base_seed0's results were made with --trainer.max_epochs=1: remove ")
    assert sweep.stale(runs[1], real) is None and sweep.stale(runs[0], smoke) is None
    ((directory, command),) = sweep.stages(runs[1], real)
    assert sweep.stage_arguments([*command, "--trainer.num_nodes=2", "--trainer.devices=4"]) == sweep.stage_arguments(command)  # a Slurm task's
    (directory / "results_val.json").unlink()  # a run that failed: its record is of no results, and it runs again
    (directory / sweep.RECORD).write_text(json.dumps({"arguments": [*sweep.stage_arguments(command), "--trainer.max_epcohs=1"]}))
    assert sweep.stale(runs[1], real) is None
    write_results(directory, {"val/knn_top1": 0.5})
    (directory / sweep.RECORD).write_text(json.dumps({"arguments": sweep.stage_arguments(command)}))
    assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--seeds", "0", "1"]) == 1  # runs nothing
    printed = capsys.readouterr().out
    assert "[base seed 0] stale: base_seed0's results were made with --trainer.max_epochs=1" in printed
    assert "| base | 2 | 50.00 (n=1) |" in printed and "main_pretrain.py fit" not in printed

def test_slurm_mode_writes_the_job_template_as_an_array_of_one_task_per_run_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(out), "--grid", "model.init_args.temperature=0.1,0.2",
                       "--seeds", "0", "1", "2", "--linear", LINEAR_DIGITS, "--slurm", "--gpus-per-node=2",
                       "--sbatch-option=--account=lab", "--", "--trainer.max_epochs=5"])
    assert code == 0
    script = (out / "sweep.sbatch").read_text()
    for line in ("--array=0-5", "--account=lab", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=2",
                 "--signal=SIGUSR1@90", "--requeue", "--open-mode=append", f"--output={out}/slurm-%a.out"):
        assert f"#SBATCH {line}\n" in script  # the lines of scripts/slurm/template.sbatch
    task = script.strip().splitlines()[-1]
    assert task.startswith("srun python scripts/sweep.py --only $SLURM_ARRAY_TASK_ID --config")
    assert task.endswith("-- --trainer.max_epochs=5 --trainer.num_nodes=1 --trainer.devices=2")
    args = sweep.parse_args(shlex.split(task.replace("$SLURM_ARRAY_TASK_ID", "4"))[3:])  # what the task parses
    assert args.only == 4 and args.seeds == [0, 1, 2] and args.grid == ["model.init_args.temperature=0.1,0.2"]
    assert args.linear_override == ["--trainer.num_nodes=1", "--trainer.devices=2"]
    assert "sbatch" in capsys.readouterr().out
    assert not any(path.is_dir() for path in out.iterdir())


@pytest.mark.slow
def test_an_array_task_outlives_the_signals_that_slurm_sends_its_training_run(tmp_path):
    previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--only", "0", "--collect"]) == 0
        # a handler: not SIG_DFL (the wrapper would die first) nor SIG_IGN (inherited: Lightning would not install its own)
        assert all(callable(signal.getsignal(signum)) for signum in previous)
        for signum in previous:  # as Slurm signals every process of the step: this one carries on
            os.kill(os.getpid(), signum)
        assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--only", "0", "--collect"]) == 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_slurm_mode_refuses_an_override_of_the_jobs_devices_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit, match="override '--trainer.devices=4': set it with --gpus-per-node"):
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "sweep"), "--slurm", "--", "--trainer.devices=4"])
    assert not (tmp_path / "sweep").exists()


def test_only_refuses_an_index_outside_the_sweep_before_making_its_folder(tmp_path):
    with pytest.raises(SystemExit, match="--only 2 is outside the 2 runs"):
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "sweep"), "--seeds", "0", "1", "--only", "2"])
    assert not (tmp_path / "sweep").exists()


def test_results_made_before_the_configs_values_were_edited_are_stale_and_a_comment_edit_is_not(tmp_path):
    """The record names the config by its path: its values' SHA-256 beside the arguments tells an edited file."""
    config = tmp_path / "pretrain.yaml"
    config.write_text(Path(PRETRAIN_DIGITS).read_text())
    args = sweep.parse_args(["--config", str(config), "--out", str(tmp_path / "out")])
    (run,) = sweep.expand([], [0], tmp_path / "out")
    ((directory, command),) = sweep.stages(run, args)
    write_results(directory, {"val/knn_top1": 0.5})
    (directory / sweep.RECORD).write_text(json.dumps(sweep.stage_record(command)))
    config.write_text("# a new comment\n" + config.read_text())
    assert sweep.stale(run, args) is None
    config.write_text(config.read_text().replace("temperature: 0.2", "temperature: 0.5", 1))
    assert sweep.stale(run, args) == (f"base_seed0's results were made with other values in {config} (edited since): remove {run.directory} "
                                      "to run it with these arguments, or give another --out")
    (directory / sweep.RECORD).write_text(json.dumps({"arguments": sweep.stage_arguments(command)}))  # recorded before the values were
    assert sweep.stale(run, args) is None


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--seeds", "0", "0"], "error: --seeds 0 0: seed 0 is repeated or negative (each seed is one run)"),
        (["--seeds", "-1"], "error: --seeds -1: seed -1 is repeated or negative"),
        (["--grid", "model.init_args.temperature=0.1,0.1"], "error: --grid 'model.init_args.temperature=0.1,0.1' repeats 0.1: each run would count as two"),
        (["--grid", "model.init_args.temperature=0.1", "--grid", "model.init_args.temperature=0.2"],  # one run at 0.2, labelled with both
         "error: --grid 'model.init_args.temperature=0.2': model.init_args.temperature has a --grid already; give all its values in one"),
        # it follows each run's own --seed_everything and wins: seeds 0 and 1 would be one run twice, with a std of 0
        (["--seeds", "0", "1", "--", "--seed_everything=7"], "error: --seed_everything=7 after --: each run's seed comes from --seeds"),
        (["--seeds", "0", "1", "--linear", LINEAR_DIGITS, "--linear-override=--seed_everything", "--linear-override=7"],
         "error: --seed_everything in --linear-override: each run's seed comes from --seeds"),
        # after --, a value the grid or the sweep sets per run follows it and wins: every point would train the same run
        (["--grid", "model.init_args.temperature=0.1,0.2", "--", "--model.temperature=0.3"],
         "error: --model.temperature=0.3 after --: each run sets model.temperature itself (--grid and --out give it per run)"),
        (["--grid", "model.init_args.momentum.base=0.9,0.99", "--", "--model.init_args.momentum={base: 0.5}"],
         "error: --model.init_args.momentum={base: 0.5} after --: each run sets model.momentum.base itself"),
        (["--", "--trainer.default_root_dir", "/tmp/one"], "error: --trainer.default_root_dir after --: each run sets trainer.default_root_dir itself"),
        (["--linear", LINEAR_DIGITS, "--linear-override=--model.init_args.pretrained_ckpt=x.ckpt"],
         "error: --model.init_args.pretrained_ckpt=x.ckpt in --linear-override: each run sets model.pretrained_ckpt itself (--out gives it per run)"),
    ],
)
def test_a_seed_or_grid_value_given_twice_is_refused_before_anything_is_written(arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit, match=re.escape(message)):
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "sweep"), *arguments])
    assert not (tmp_path / "sweep").exists()


def test_a_relative_config_is_the_file_meant_from_the_working_directory_though_the_runs_start_in_the_project(tmp_path, monkeypatch):
    """From another folder, `--config configs/moco_digits.yaml` is that folder's file, not the project's of that name."""
    own = tmp_path / "configs" / "moco_digits.yaml"
    own.parent.mkdir()
    own.write_text(Path(PRETRAIN_DIGITS).read_text().replace("temperature: 0.2", "temperature: 0.7"))
    monkeypatch.chdir(sweep.ROOT)
    from_project = sweep.parse_args(["--config", "configs/moco_digits.yaml", "--out", "sweep", "--linear", LINEAR_DIGITS])
    assert (from_project.config, from_project.linear) == ("configs/moco_digits.yaml", "configs/linear_digits.yaml")
    monkeypatch.chdir(tmp_path)
    elsewhere = sweep.parse_args(["--config", "configs/moco_digits.yaml", "--out", "sweep"])
    assert elsewhere.config == str(own) and elsewhere.linear is None
    assert sweep.stage_record(sweep.pretrain_command(sweep.Run((), 0, tmp_path / "run"), elsewhere.config, []))["arguments"][3] == str(own)
    with pytest.raises(SystemExit, match=re.escape(f"error: --config '{tmp_path / 'configs' / 'absent.yaml'}' is not an existing file")):
        sweep.main(["--config", "configs/absent.yaml", "--out", "sweep"])


def test_each_grid_point_is_a_w_and_b_group_of_its_seeds_and_its_names_are_no_part_of_what_the_results_are_of(tmp_path):
    """The config's own group and name_keys would put every point in one W&B group, averaged there as one setting."""
    args = sweep.parse_args(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "sw"), "--grid", "model.init_args.momentum.base=0.9,0.99",
                             "--seeds", "0", "1", "--linear", LINEAR_DIGITS])
    runs = sweep.expand(sweep.parse_grid(args.grid), args.seeds, args.out.resolve())
    pretrain, linear = (command for _, command in sweep.stages(runs[1], args))  # the first point's seed 1
    assert {"--trainer.logger.init_args.group=sw.base0.9", "--trainer.logger.init_args.name=sw.base0.9-s1"} <= set(pretrain)
    assert {"--trainer.logger.init_args.group=sw.base0.9.linear", "--trainer.logger.init_args.name=sw.base0.9.linear-s1"} <= set(linear)
    assert not any("logger" in argument for command in (pretrain, linear) for argument in sweep.stage_arguments(command))
    (tmp_path / "no_logger.yaml").write_text("trainer: {logger: false}\n")
    assert sweep.tracked_as(str(tmp_path / "no_logger.yaml"), "g", "n") == []  # no W&B logger: nothing to name


def test_an_out_that_is_a_file_is_one_error_line(tmp_path):
    (tmp_path / "sweep").write_text("")
    with pytest.raises(SystemExit, match=re.escape(f"error: --out {tmp_path / 'sweep'} is a file, not a folder")):
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "sweep"), "--collect"])


@pytest.mark.parametrize(
    "content, problem",
    [('{"metrics": {"val/knn', "is not readable JSON"), ("[]", "is a JSON list, not an object"),
     ('{"metrics": {"val/knn_top1": "abc"}}', "metric val/knn_top1 is 'abc', not a number")],
)
def test_a_results_file_cut_short_or_overwritten_is_one_error_line_naming_it(content, problem, tmp_path):
    (run,) = sweep.expand([], [0], tmp_path)
    write_results(run.directory, {})
    (run.directory / "results_val.json").write_text(content)
    with pytest.raises(SystemExit, match=re.escape(f"error: {run.directory / 'results_val.json'}: ") + ".*" + re.escape(problem)):
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--collect"])


def test_a_metric_no_finished_run_reports_is_refused_naming_what_they_report(tmp_path):
    (run,) = sweep.expand([], [0], tmp_path)
    write_results(run.directory, {"val/knn_top1": 0.5, "val/knn_top5": 0.9})
    with pytest.raises(SystemExit, match=re.escape(f"error: --metrics val/knn_top5x: no finished run reports val/knn_top5x "
                                                   f"({run.directory / 'results_val.json'} has val/knn_top1, val/knn_top5)")):
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--collect", "--metrics", "val/knn_top5x"])
    assert not (tmp_path / "results.md").exists()
    assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--collect", "--metrics", "val/knn_top5"]) == 0


@pytest.mark.slow
def test_a_real_run_is_collected_and_a_rerun_skips_it(tmp_path):
    args = ["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--seeds", "3", "--",
            *TINY_RUN, "--trainer.logger=false", "--trainer.precision=32-true"]
    assert sweep.main(args) == 0
    (run_dir,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert run_dir.name == "base_seed3"
    record = json.loads((run_dir / "results_val.json").read_text())
    assert 0.0 <= record["metrics"]["val/probe_top1"] <= 1.0
    assert "| base | 1 |" in (tmp_path / "results.md").read_text()
    assert sweep.main(args) == 0  # finished runs are not repeated
    assert (run_dir / "log.txt").read_text().count("$ ") == 1


def test_a_run_another_sweep_trains_is_left_to_it_without_a_failure_or_a_line_in_its_log(tmp_path, capsys):
    """A second sweep into the same --out meets the first one's run: the training run's own lock says so."""
    from engine.cli.run_lock import LOCK_FILE, RunDirectoryLock

    assert sweep.RUN_LOCK == LOCK_FILE
    (run,) = sweep.expand([], [0], tmp_path)
    lock = RunDirectoryLock(run.directory)
    lock.acquire()  # as the first sweep's training process holds it
    try:
        assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path)]) == 0
    finally:
        lock.release()
    printed = capsys.readouterr().out
    assert f"[base seed 0] running in another process (process {os.getpid()} on " in printed and ": left to it" in printed
    assert "failed" not in printed and not (run.directory / "log.txt").exists() and not (run.directory / sweep.RECORD).exists()



def test_the_other_ranks_of_a_slurm_array_task_start_their_training_beside_rank_zero_s(tmp_path, capsys, monkeypatch):
    """srun starts `sweep.py --only i` once per rank: rank 0's training holds the run's lock, and a rank above 0 that
    left the run to it kept that DDP run waiting for the rank until the time limit."""
    from engine.cli.run_lock import RunDirectoryLock

    (run,) = sweep.expand([], [0], tmp_path)
    started = []
    monkeypatch.setattr(sweep, "execute", lambda command, log: started.append((command[1], log)) or True)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = RunDirectoryLock(run.directory)
    lock.acquire()  # as rank 0's training process of job 4242 holds it
    try:
        for job_id, expected in (("4242", [("main_pretrain.py", run.directory / "log.rank1.txt")]), ("4243", [])):  # its own job's; another's
            monkeypatch.setenv("SLURM_PROCID", "1")
            monkeypatch.setenv("SLURM_JOB_ID", job_id)
            started.clear()
            assert sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path), "--only", "0"]) == 0
            assert [(Path(script).name, log) for script, log in started] == expected
            assert ("left to it" in capsys.readouterr().out) == (not expected)  # as its rank 0 leaves a run another sweep trains
    finally:
        lock.release()
    assert not (run.directory / sweep.RECORD).exists()  # rank 0 writes it

@pytest.mark.parametrize(
    "arguments, message",
    [(["--grid", "model.init_args.temprature=0.1"], "error: temprature=0.1, main_pretrain.py: "),
     (["--grid", "model.init_args.temperature=0.1,warm"], "error: temperature=warm, main_pretrain.py: "),
     (["--linear", LINEAR_DIGITS, "--linear-override=--model.init_args.probe_lrr=1"], "error: base, main_linear.py: "),
     # resolved by --print_config, refused when the model or the DataModule is built: the sweep builds each point first
     (["--grid", "model.init_args.temperature=0.0"], "error: temperature=0.0, main_pretrain.py: model.init_args.temperature must be > 0"),
     (["--", "--data.init_args.views={query: {preset: mocov2, scal: [0.2, 1.0]}, key: {preset: mocov2}}"],
      "error: base, main_pretrain.py: view 'query': preset 'mocov2' does not accept ['scal']")],
)
def test_a_grid_point_or_override_the_cli_does_not_resolve_or_build_is_one_error_line_before_anything_is_written(arguments, message, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--config", PRETRAIN_DIGITS, "--out", str(tmp_path / "sweep"), *arguments])
    assert str(exit_info.value).startswith(message) and "\n" not in str(exit_info.value)
    assert not (tmp_path / "sweep").exists()


def test_a_stages_record_is_the_same_from_any_working_directory_and_a_filesystem_without_locks_runs_it(tmp_path, monkeypatch):
    """The stages run in the project: a table's relative config path is the project's, wherever the command starts."""
    import fcntl

    command = sweep.pretrain_command(sweep.Run((), 0, tmp_path / "run"), "configs/moco_digits.yaml", [])
    here = sweep.stage_record(command)
    monkeypatch.chdir(tmp_path)
    assert sweep.stage_record(command) == here and here["arguments"][3] == "configs/moco_digits.yaml"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / sweep.RUN_LOCK).write_text("")

    def no_locks(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert sweep.held_elsewhere(tmp_path / "run") is None
