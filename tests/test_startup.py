"""benchmarks/startup.py: its callback's stamps, its table, and its one line when a measured process fails."""

import json
import sys
import time

import pytest
from test_cli import PRETRAIN_DIGITS, TINY_RUN

import main_pretrain
from benchmarks import startup


@pytest.mark.slow  # a training step through the CLI
def test_the_stamps_count_from_the_given_start_to_setup_and_to_the_first_training_batch(tmp_path, monkeypatch):
    stamps = tmp_path / "stamps.json"
    started = time.time() - 100.0  # as if the process had started 100 s ago
    monkeypatch.setenv(startup.STARTED, repr(started))
    monkeypatch.setenv(startup.STAMPS, str(stamps))
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                            "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path / 'run'}",
                            "--trainer.callbacks+=benchmarks.startup.StartupStamps"])  # fmt: skip
    found = json.loads(stamps.read_text())
    assert list(found) == ["setup", "first batch"]
    assert 100.0 < found["setup"] <= found["first batch"] < time.time() - started


def test_the_table_gives_the_median_and_every_round_of_each_measurement():
    rounds = [{"import torch": 3.0, "one step: first batch": 9.5}, {"import torch": 5.0, "one step: first batch": 9.0},
              {"import torch": 4.0, "one step: first batch": 12.25}]
    assert startup.table(rounds).splitlines()[2:] == [
        "| import torch | 4.00 | 3.00, 5.00, 4.00 |",
        "| one step: first batch | 9.50 | 9.50, 9.00, 12.25 |",
    ]


def test_a_failing_process_is_reported_by_its_last_line_of_errors():
    with pytest.raises(startup.MeasurementFailed, match=r"failed: ModuleNotFoundError: No module named 'no_such_module_here'$"):
        startup.run([sys.executable, "-c", "import no_such_module_here"])


def test_a_config_that_does_not_exist_is_one_error_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        startup.main(["--config", "configs/no_such_config.yaml"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and ": --config 'configs/no_such_config.yaml' does not exist (" in line
