"""scripts/compare.py on run directories written in the formats the CLI and Lightning write: the grouping of seeds,
mean ± sample std, n/a for what a run did not record, a CSV-only run, and a path that holds no run.
(Runs read from W&B logs: tests/test_tracking.py.)"""

import csv
import json
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


def write_run(directory: Path, seed: int, metrics: dict, temperature: float = 0.2, linear: float | None = None, trainer: dict | None = None) -> None:
    """What the CLI leaves in a run directory (`config.yaml`, `results_val.json`) and the linear stage in `linear/`."""
    directory.mkdir(parents=True)
    settings = config(directory, seed, temperature)
    settings["trainer"] |= trainer or {}
    (directory / "config.yaml").write_text(yaml.safe_dump(settings))
    (directory / "results_val.json").write_text(json.dumps({"epoch": 5, "global_step": 10, "metrics": metrics}))
    if linear is not None:
        (directory / "linear").mkdir()
        (directory / "linear" / "results_val.json").write_text(json.dumps({"epoch": 10, "global_step": 20, "metrics": {"val/probe_top1": linear}}))


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
    assert "| MoCoV2 | Digits | – | 0 | n/a | 35.00 | n/a | n/a | n/a |" in markdown.splitlines()


@pytest.mark.parametrize("name, reason", [("missing", "does not exist"), ("empty", "is not a run (no config.yaml, results_*.json, lightning_logs/ or W&B run) and holds none")])
def test_a_path_that_is_not_a_run_is_one_error_naming_it_and_nothing_is_written(name, reason, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        compare.main([str(tmp_path / name), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / name} {reason}"
    assert not (tmp_path / "out").exists()
