"""benchmarks/peers.py: its argument checks, the rates and medians of its tables, and contrastlab's run of the workload
(the peers' runs need their own venvs, made from the package index: the benchmark itself runs those)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pytest  # noqa: E402
import torchvision  # noqa: E402

import peer_workloads  # noqa: E402
import peers  # noqa: E402
from portable import write_fake_cifar10  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "error: --rounds must be >= 1, got 0"),
    (["--view-images", "0"], "error: --view-images must be >= 1, got 0"),
    (["--workers", "-1"], "error: --workers must be >= 0, got -1"),
    (["--skip-views", "--skip-training"], "error: --skip-views and --skip-training together leave nothing to measure"),
    (["--warmup", "5", "--steps", "36"], "error: --warmup 5 + --steps 36 batches of 128 need 5248 images, more than one epoch of --images 5120"),
])
def test_a_bad_argument_is_one_error_line_naming_it(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        peers.parse(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(message) and error.count("\n") == 1


def test_the_defaults_are_the_issues_protocol():
    options = peers.parse([])
    assert (options.rounds, options.warmup, options.steps, options.batch, options.workers, options.images) == (3, 5, 30, 128, 2, 5120)
    assert options.systems == ["contrastlab", "contrastlab-fp32-pil", "lightly", "stable-pretraining"]
    assert not options.venvs.resolve().is_relative_to(ROOT)  # the peers' site-packages stay out of the scans of the checkout


def test_the_rate_counts_only_the_timed_steps():
    record = {"step_ends": [10.0, 11.0, 13.0, 14.0, 15.0, 99.0]}  # 2 warm-up steps, then 3 timed ones in 4 s; a 6th ignored
    assert peers.timed_rate(record, warmup=2, steps=3, batch=8) == 3 * 8 / (15.0 - 11.0)
    with pytest.raises(ValueError, match="recorded 6 steps, fewer than 5 \\+ 2"):
        peers.timed_rate(record, warmup=5, steps=2, batch=8)


def run(system: str, round_: int, images_per_s: float, startup_s: float, precision: str = "32-true", pipeline: str = "cpu") -> dict:
    return {"system": system, "round": round_, "images_per_s": images_per_s, "startup_s": startup_s, "load_before": 0.5,
            "load_after": 1.5, "settings": {"precision": precision, "pipeline": pipeline, "channels_last": pipeline == "gpu"}}


def test_the_table_holds_the_medians_over_rounds_and_the_ratios_to_the_faster_peer_of_the_medians_and_round_by_round():
    runs = [run("contrastlab", 1, 60.0, 7.0, "bf16-mixed", "gpu"), run("lightly", 1, 30.0, 4.0), run("stable-pretraining", 1, 20.0, 9.0),
            run("contrastlab", 2, 66.0, 6.0, "bf16-mixed", "gpu"), run("lightly", 2, 33.0, 3.0), run("stable-pretraining", 2, 40.0, 8.0),
            run("contrastlab", 3, 90.0, 5.0, "bf16-mixed", "gpu"), run("lightly", 3, 36.0, 5.0), run("stable-pretraining", 3, 25.0, 10.0)]
    table = peers.training_tables(runs)
    # medians: contrastlab 66 images/s, 6 s; lightly 33, 4 s; stable-pretraining 25, 9 s: lightly is the faster peer.
    # Round by round against lightly: contrastlab 2.0, 2.0, 2.5 (median 2.00); stable-pretraining 0.67, 1.21, 0.69
    # (median 0.69, where the ratio of the medians is 0.76)
    assert "| contrastlab | bf16-mixed | batched on the device | yes | 66.0 | 6.0 | 2.00x | 2.00x | +2.0 |" in table
    assert "| lightly | 32-true | PIL per image, workers | no | 33.0 | 4.0 | 1.00x | 1.00x | +0.0 |" in table
    assert "| stable-pretraining | 32-true | PIL per image, workers | no | 25.0 | 9.0 | 0.76x | 0.69x | +5.0 |" in table
    assert "images/s ÷ lightly's (the faster peer)" in table
    assert table.count("| 0.50 | 1.50 |") == 9  # every run with its load average before and after


def test_the_views_table_compares_the_fastest_views_of_each():
    runs = [{"system": "contrastlab", "round": r, "views": "query + key", "one_process": 100.0 * r, "loader": 150.0, "batched": 800.0,
             "threads": 2, "workers": 2, "load_before": 1.0, "load_after": 1.0} for r in (1, 2, 3)]
    runs += [{"system": "lightly", "round": r, "views": "MoCoV2Transform (two views)", "one_process": 90.0, "loader": 100.0 * r,
              "batched": None, "threads": 2, "workers": 2, "load_before": 1.0, "load_after": 1.0} for r in (1, 2, 3)]
    table = peers.views_tables(runs)
    assert "| contrastlab | query + key | 200 | 150 | 800 |" in table
    assert "| lightly | MoCoV2Transform (two views) | 90 | 200 | n/a |" in table
    assert "contrastlab / lightly: 4.00x" in table


@pytest.fixture
def official_checksums_restored(monkeypatch):
    """The run replaces torchvision's CIFAR-10 checksums by the fake files' for the process: undo it after the test."""
    for attribute in ("train_list", "test_list", "meta"):
        monkeypatch.setattr(torchvision.datasets.CIFAR10, attribute, getattr(torchvision.datasets.CIFAR10, attribute))


@pytest.mark.slow
def test_contrastlab_trains_the_workload_with_the_peers_settings_and_stamps_every_step(tmp_path, official_checksums_restored):
    write_fake_cifar10(tmp_path / "data", 160)
    out = tmp_path / "run.json"
    assert peer_workloads.main(["train", "contrastlab-fp32-pil", "--data", str(tmp_path / "data"), "--json", str(out),
                                "--warmup", "1", "--steps", "2", "--batch", "16", "--workers", "0"]) == 0
    record = json.loads(out.read_text())
    assert record["settings"] == {"precision": "32-true", "pipeline": "cpu", "channels_last": False}
    assert len(record["step_ends"]) == 3 and record["first_step_at"] < record["step_ends"][0]
    assert peers.timed_rate(record, warmup=1, steps=2, batch=16) > 0
