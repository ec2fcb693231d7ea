"""scripts/compare.py on run directories written in the formats the CLI and Lightning write: the grouping of seeds,
mean ± sample std, n/a for what a run did not record, a CSV-only run, and a path that holds no run.
(Runs read from W&B logs: tests/test_tracking.py.)"""

import csv
import json
import re
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

from scripts import compare


def config(directory: Path, seed: int, temperature: float = 0.2) -> dict:
    return {
        "seed_everything": seed,
        "model": {"class_path": "methods.MoCoV2", "init_args": {"temperature": temperature}},
        "data": {"class_path": "datamodules.DigitsDataModule", "init_args": {"batch_size": 128}},
        "trainer": {"max_epochs": 5, "default_root_dir": str(directory)},
    }


def write_run(directory: Path, seed: int, metrics: dict, temperature: float = 0.2, linear: float | None = None, trainer: dict | None = None,
              linear_lr: float | None = None, data: dict | None = None) -> None:
    """What the CLI leaves in a run directory (`config.yaml`, `results_val.json`) and the linear stage in `linear/`."""
    directory.mkdir(parents=True)
    settings = config(directory, seed, temperature)
    settings["trainer"] |= trainer or {}
    settings["data"]["init_args"] |= data or {}
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    (directory / "results_val.json").write_text(json.dumps({"epoch": 5, "global_step": 10, "metrics": metrics}))
    if linear is not None:
        (directory / "linear").mkdir()
        (directory / "linear" / "results_val.json").write_text(json.dumps({"epoch": 10, "global_step": 20, "metrics": {"val/probe_top1": linear}}))
        probed = {"model": {"init_args": {"pretrained_ckpt": str(directory / "checkpoints" / "last.ckpt")}}}
        if linear_lr is not None:
            probed["model"]["init_args"]["optimizer"] = {"lr": linear_lr}
        (directory / "linear" / "config.yaml").write_text(yaml.safe_dump(probed))


def test_seeds_of_one_setting_make_one_row_of_mean_and_sample_std_and_missing_metrics_are_na(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "tau0.2_seed0", 0, {"val/knn_top1": 0.2, "val/probe_top1": 0.3, "train/time_s": 100.0, "train/images_per_s": 50.0}, linear=0.4)
    write_run(runs / "tau0.2_seed1", 1, {"val/knn_top1": 0.3, "val/probe_top1": 0.5, "train/time_s": 120.0}, linear=0.5)
    write_run(runs / "tau0.1_seed0", 0, {"val/knn_top1": 0.1, "val/probe_top1": 0.2}, temperature=0.1)
    markdown = compare.main([str(runs), "--out", str(tmp_path / "out")])
    lines = markdown.splitlines()
    assert "| MoCoV2 | Digits | model.temperature=0.2 | 0, 1 | 45.00 ± 7.07 | 25.00 ± 7.07 | 40.00 ± 14.14 | 110.00 ± 14.14 | 50.00 (1 of 2 runs) |" in lines
    assert "| MoCoV2 | Digits | model.temperature=0.1 | 0 | n/a | 10.00 | 20.00 | n/a | n/a |" in lines
    with (tmp_path / "out" / "comparison.csv").open() as stream:
        rows = {row["setting"]: row for row in csv.DictReader(stream)}
    assert set(rows) == {"model.temperature=0.2", "model.temperature=0.1"}  # a run's linear/ stage is not a run of its own
    assert float(rows["model.temperature=0.2"]["val/knn_top1 mean"]) == pytest.approx(0.25)
    assert float(rows["model.temperature=0.2"]["val/knn_top1 std"]) == pytest.approx(0.0707107, rel=1e-5)
    assert rows["model.temperature=0.2"]["train/images_per_s n"] == "1"
    assert rows["model.temperature=0.1"]["linear/val/probe_top1 mean"] == "n/a"
    assert (tmp_path / "out" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("other", [dict(data={"batch_size": 256}), dict(trainer={"max_epochs": 10})], ids=["data", "trainer"])
def test_seeds_of_other_data_or_run_length_are_not_one_setting(other, tmp_path):
    write_run(tmp_path / "runs" / "a", 0, {"val/knn_top1": 0.2})
    write_run(tmp_path / "runs" / "b", 1, {"val/knn_top1": 0.4}, **other)
    compare.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    with (tmp_path / "out" / "comparison.csv").open() as stream:
        rows = list(csv.DictReader(stream))
    changed = next(iter(other.values()))
    assert len(rows) == 2 and any(f"{key}={value}" in row["setting"] for row in rows for key, value in changed.items()), rows


def test_runs_probed_with_other_linear_settings_are_rows_of_their_own_and_runs_not_probed_yet_join_the_one_protocol(tmp_path):
    """A sweep's `--linear-override` changes only the linear stage: its seeds must not be averaged as one setting."""
    one, two = tmp_path / "one_protocol", tmp_path / "two_protocols"
    write_run(one / "seed0", 0, {"val/knn_top1": 0.2}, linear=0.4, linear_lr=0.5)
    write_run(one / "seed1", 1, {"val/knn_top1": 0.4})  # its linear stage has not run yet
    assert "| MoCoV2 | Digits | – | 0, 1 | 40.00 (1 of 2 runs) | 30.00 ± 14.14 | n/a | n/a | n/a |" in compare.main([str(one), "--out", str(tmp_path / "a")]).splitlines()
    write_run(two / "seed0", 0, {"val/knn_top1": 0.2}, linear=0.4, linear_lr=0.5)
    write_run(two / "seed1", 1, {"val/knn_top1": 0.4}, linear=0.1, linear_lr=0.0)
    lines = compare.main([str(two), "--out", str(tmp_path / "b")]).splitlines()
    assert "| MoCoV2 | Digits | linear.model.optimizer.lr=0.5 | 0 | 40.00 | 20.00 | n/a | n/a | n/a |" in lines
    assert "| MoCoV2 | Digits | linear.model.optimizer.lr=0 | 1 | 10.00 | 40.00 | n/a | n/a | n/a |" in lines


def test_run_control_settings_set_no_rows_apart_and_runs_of_one_label_get_distinct_legend_entries(tmp_path):
    runs = tmp_path / "runs"
    quiet = {"logger": False, "enable_progress_bar": False, "check_val_every_n_epoch": 5}
    write_run(runs / "full", 0, {"val/knn_top1": 0.2})
    write_run(runs / "quiet", 0, {"val/knn_top1": 0.4}, trainer=quiet)
    write_run(runs / "tau0.1", 0, {"val/knn_top1": 0.1}, temperature=0.1, trainer=quiet)
    found = [run for run in compare.find_runs(runs)]
    rows = compare.group(found)
    assert [(setting, [run.path.name for run in members]) for setting, members in rows] == [
        ("model.temperature=0.2", ["full", "quiet"]), ("model.temperature=0.1", ["tau0.1"])]
    assert [label for label, _ in compare.curve_labels(rows)] == [
        f"MoCoV2 Digits model.temperature=0.2 s0 [{runs / 'full'}]", f"MoCoV2 Digits model.temperature=0.2 s0 [{runs / 'quiet'}]",
        "MoCoV2 Digits model.temperature=0.1 s0"]


def test_a_smoke_run_is_a_row_of_its_own_and_a_run_named_twice_counts_once(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "seed0", 0, {"val/knn_top1": 0.30})
    write_run(runs / "seed1", 1, {"val/knn_top1": 0.32})
    write_run(runs / "smoke", 2, {"val/knn_top1": 0.05}, trainer={"limit_train_batches": 2, "limit_val_batches": 1})
    markdown = compare.main([str(runs), str(runs / "seed0"), str(runs / "seed0"), "--out", str(tmp_path / "out")])
    rows = {line.split(" | ")[2]: line.split(" | ")[3:5] for line in markdown.splitlines() if line.startswith("| MoCoV2")}
    assert rows == {"–": ["0, 1", "n/a"], "trainer.limit_train_batches=2, trainer.limit_val_batches=1": ["2", "n/a"]}
    assert "| 31.00 ± 1.41 |" in next(line for line in markdown.splitlines() if line.startswith("| MoCoV2 | Digits | – |"))


def test_a_run_with_only_a_csv_log_gives_its_last_logged_values_and_curves(tmp_path):
    run = tmp_path / "csv_run"
    logger = CSVLogger(run)  # what a run with a CSVLogger writes: lightning_logs/version_0/{metrics.csv, config.yaml}
    for step in range(4):
        logger.log_metrics({"train/loss": 4.0 - step}, step=step)
    logger.log_metrics({"val/knn_top1": 0.35, "epoch": 0}, step=3)
    logger.save()
    (Path(logger.log_dir) / "config.yaml").write_text(yaml.safe_dump(config(run, 0)))
    (found,) = compare.find_runs(run)
    assert found.source == "config.yaml, CSV log"
    assert found.curves == {"train/loss": [(0, 4.0), (1, 3.0), (2, 2.0), (3, 1.0)], "val/knn_top1": [(3, 0.35)]}
    markdown = compare.main([str(run), "--out", str(tmp_path / "out")])
    assert "| MoCoV2 | Digits | unfinished: its last logged values | 0 | n/a | 35.00 | n/a | n/a | n/a |" in markdown.splitlines()


def test_an_interrupted_run_is_not_averaged_with_the_finished_seeds_of_its_setting(tmp_path):
    write_run(tmp_path / "seed0", 0, {"val/knn_top1": 0.2})
    write_run(tmp_path / "seed1", 1, {"val/knn_top1": 0.4})
    (tmp_path / "seed1" / "results_val.json").unlink()  # stopped before its end: the CSV log's last values
    logger = CSVLogger(tmp_path / "seed1")
    logger.log_metrics({"val/knn_top1": 0.1}, step=2)
    logger.save()
    lines = compare.main([str(tmp_path / "seed0"), str(tmp_path / "seed1"), "--out", str(tmp_path / "out")]).splitlines()
    assert "| MoCoV2 | Digits | – | 0 | n/a | 20.00 | n/a | n/a | n/a |" in lines
    assert "| MoCoV2 | Digits | unfinished: its last logged values | 1 | n/a | 10.00 | n/a | n/a | n/a |" in lines


@pytest.mark.parametrize("name, reason", [("missing", "does not exist"), ("empty", "is not a run (no config.yaml, results_*.json, lightning_logs/ or W&B run) and holds none")])
def test_a_path_that_is_not_a_run_is_one_error_naming_it_and_nothing_is_written(name, reason, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        compare.main([str(tmp_path / name), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / name} {reason}"
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_one_error_line_before_anything_is_read(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        compare.main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and capsys.readouterr().err == f"error: --out {tmp_path / 'out'} cannot be a folder: {tmp_path / 'out'} is a file\n"


def test_a_linear_stage_that_probed_another_checkpoint_is_one_error_naming_it(tmp_path, capsys):
    write_run(tmp_path / "a", 0, {"val/knn_top1": 0.2}, linear=0.4)
    write_run(tmp_path / "b", 1, {"val/knn_top1": 0.3}, linear=0.5)
    assert "linear/results_val.json" in compare.main([str(tmp_path / "a"), "--out", str(tmp_path / "out")])  # named among the sources
    other = tmp_path / "b" / "checkpoints" / "last.ckpt"
    (tmp_path / "a" / "linear" / "config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"pretrained_ckpt": str(other)}}}))
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "a"), "--out", str(tmp_path / "out2")])
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'a' / 'linear'} probed {other} (its config.yaml), not this run's "
                                                "checkpoints/last.ckpt: its numbers are not this run's")
    assert not (tmp_path / "out2").exists()


def test_a_linear_stage_of_weights_the_run_has_trained_on_since_is_one_error_naming_both_steps(tmp_path, capsys):
    """The pretraining resumed after its probe (same last.ckpt path, later weights): the probe's numbers are of step 10."""
    run = tmp_path / "run"
    write_run(run, 0, {"val/knn_top1": 0.2}, linear=0.4)
    probe = json.loads((run / "linear" / "results_val.json").read_text())
    (run / "linear" / "results_val.json").write_text(json.dumps(probe | {"pretrained_step": 10}))  # the run's final step
    assert "| MoCoV2 | Digits | – | 0 | 40.00 |" in compare.main([str(run), "--out", str(tmp_path / "a")])
    (run / "results_val.json").write_text(json.dumps({"epoch": 9, "global_step": 20, "metrics": {"val/knn_top1": 0.3}}))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        compare.main([str(run), "--out", str(tmp_path / "b")])
    assert capsys.readouterr().err.startswith(f"error: {run / 'linear'} probed the run's weights of step 10, and the run has trained on to step 20 since")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "probed, linear_dir",
    [("./a/checkpoints/last.ckpt", "./a/linear"),  # relative to where the stage ran, compared from elsewhere
     ("/cluster/runs/a/checkpoints/last.ckpt", "/cluster/runs/a/linear")],  # a run copied from a cluster
)
def test_a_linear_stage_of_the_run_is_recognised_from_another_directory_or_after_a_move(probed, linear_dir, tmp_path, monkeypatch):
    write_run(tmp_path / "a", 0, {"val/knn_top1": 0.2}, linear=0.4)
    stage = {"model": {"init_args": {"pretrained_ckpt": probed}}, "trainer": {"default_root_dir": linear_dir}}
    (tmp_path / "a" / "linear" / "config.yaml").write_text(yaml.safe_dump(stage))
    monkeypatch.chdir(tmp_path / "a" / "checkpoints" if (tmp_path / "a" / "checkpoints").is_dir() else tmp_path / "a")
    assert "linear/results_val.json" in compare.main([str(tmp_path / "a"), "--out", str(tmp_path / "out")])
    stage["model"]["init_args"]["pretrained_ckpt"] = probed.replace("/a/", "/b/")  # another run of the sweep
    (tmp_path / "a" / "linear" / "config.yaml").write_text(yaml.safe_dump(stage))
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "a"), "--out", str(tmp_path / "out2")])


def test_a_linear_stage_without_its_directory_recorded_is_recognised_by_the_end_of_its_path(tmp_path, monkeypatch):
    write_run(tmp_path / "runs" / "a", 0, {"val/knn_top1": 0.2}, linear=0.4)
    stage = {"model": {"init_args": {"pretrained_ckpt": "runs/a/checkpoints/last.ckpt"}}}  # relative to where it ran
    (tmp_path / "runs" / "a" / "linear" / "config.yaml").write_text(yaml.safe_dump(stage))
    monkeypatch.chdir(tmp_path / "runs")  # compared from elsewhere
    assert "linear/results_val.json" in compare.main([str(tmp_path / "runs" / "a"), "--out", str(tmp_path / "out")])


@pytest.mark.parametrize(
    "damage, message",
    [(("results_val.json", '{"metrics": {"val/knn'), "results_val.json: the results file is not readable JSON (Unterminated string"),
     (("results_val.json", '{"epoch": 5}'), "results_val.json: the results file holds no 'metrics' mapping"),
     (("config.yaml", "model: [\n"), "config.yaml: not a readable config (")],
)
def test_a_damaged_results_or_config_file_is_one_error_naming_it(damage, message, tmp_path, capsys):
    write_run(tmp_path / "run", 0, {"val/knn_top1": 0.2})
    (tmp_path / "run" / damage[0]).write_text(damage[1])
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "run"), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: {tmp_path / 'run' / damage[0]}") and message in error and "\n" not in error


def test_a_metric_that_no_run_records_is_one_error_before_anything_is_written(tmp_path, capsys):
    write_run(tmp_path / "run", 0, {"val/knn_top1": 0.2})
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--metrics", "val/knn_tpo1"])
    assert capsys.readouterr().err.strip() == "error: --metrics val/knn_tpo1: no run records it (they record val/knn_top1)"
    assert not (tmp_path / "out").exists()


def test_a_whole_float_and_the_integer_w_and_b_stores_for_it_are_one_setting(tmp_path):
    """W&B's config writes 0.0 as 0 and holds the model's num_classes, linked from the data: no row of its own."""
    write_run(tmp_path / "a", 0, {"val/knn_top1": 0.2}, trainer={"gradient_clip_val": 0.0})
    write_run(tmp_path / "b", 1, {"val/knn_top1": 0.4}, trainer={"gradient_clip_val": 0})
    settings = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    settings["model"]["init_args"]["num_classes"] = 10
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(settings))
    rows = [line for line in compare.main([str(tmp_path), "--out", str(tmp_path / "out")]).splitlines() if line.startswith("| MoCoV2")]
    assert len(rows) == 1 and rows[0].startswith("| MoCoV2 | Digits | – | 0, 1 |")
    assert compare.flatten({"scale": [0.5, 1.0], "jitter": [[0.4, 0.0]]}) == compare.flatten({"scale": [0.5, 1], "jitter": [[0.4, 0]]})  # W&B's, in lists


def test_the_starts_of_a_run_are_read_in_time_order_whether_online_or_offline():
    starts = [Path("wandb/offline-run-20261127_155525-x"), Path("wandb/run-20261127_155500-x"), Path("wandb/offline-run-20261127_150000-x")]
    assert [start.name for start in compare.by_start(starts)] == ["offline-run-20261127_150000-x", "run-20261127_155500-x", "offline-run-20261127_155525-x"]


def test_runs_that_recorded_no_config_are_rows_of_their_own(tmp_path):
    """Nothing tells their settings apart (a logger that kept the config elsewhere): averaged as one row, a temperature
    of 0.2 and one of 0.5 read as two seeds."""
    for name, knn in (("a", 0.2), ("b", 0.4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results_val.json").write_text(json.dumps({"epoch": 1, "global_step": 2, "metrics": {"val/knn_top1": knn}}))
    lines = compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")]).splitlines()
    assert [line.split(" | ")[5] for line in lines if line.startswith("| n/a | n/a")] == ["20.00", "40.00"]
