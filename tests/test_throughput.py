"""benchmarks/throughput.py end to end on a tiny SCE CIFAR-10 setting on fake CIFAR-10 files (CPU)."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402

import throughput  # noqa: E402

TINY = ["--data.init_args.batch_size=16", "--model.init_args.queue_size=64", "--model.init_args.backbone.small_input=false",
        "--model.init_args.projector.hidden_dim=64", "--model.init_args.projector.output_dim=32"]


@pytest.fixture(autouse=True)
def official_checksums_restored(monkeypatch):
    """--fake-data replaces torchvision's CIFAR-10 checksums by its files' for the process: undo it after each test."""
    for attribute in ("train_list", "test_list", "meta"):
        monkeypatch.setattr(torchvision.datasets.CIFAR10, attribute, getattr(torchvision.datasets.CIFAR10, attribute))


@pytest.mark.slow
def test_both_pipelines_train_and_their_table_reports_throughput_flops_and_ratio(tmp_path, capsys):
    out = tmp_path / "table.md"
    argv = ["--config", str(ROOT / "configs/sce_cifar10.yaml"), "--fake-data", "--fake-images", "160", "--steps", "2",
            "--warmup", "1", "--num-workers", "0", "--out", str(out), "--", *TINY]
    assert throughput.main(argv) == 0
    table = capsys.readouterr().out
    rows = re.findall(r"^\| (cpu|gpu) \| 0 \| 16 \| ([\d,]+) \| (\d+)% \| ([\d.]+) \| n/a \| n/a \| n/a \|$", table, re.MULTILINE)
    assert [row[0] for row in rows] == ["cpu", "gpu"]
    assert all(float(row[1].replace(",", "")) > 0 and float(row[3]) > 0 for row in rows)
    assert rows[0][3] == rows[1][3]  # the same model: the same FLOPs per image, whichever pipeline feeds it
    assert re.search(r"ratio gpu / cpu: \d+\.\d\dx", table)
    assert table.endswith(out.read_text())  # after Lightning's own lines
    assert re.search(rf"^measured \d{{4}}-\d\d-\d\d on CPU, \d+ threads; torch {re.escape(torch.__version__)}, ", out.read_text())


def test_views_only_measures_each_view_and_their_sum_without_a_model(tmp_path, capsys):
    argv = ["--config", str(ROOT / "configs/sce_cifar10.yaml"), "--fake-data", "--fake-images", "160", "--views-only",
            "--view-images", "32", "--num-workers", "0", "--", *TINY]
    assert throughput.main(argv) == 0
    rows = re.findall(r"^\| (weak|strong|weak \+ strong) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|$", capsys.readouterr().out, re.MULTILINE)
    assert [row[0] for row in rows] == ["weak", "strong", "weak + strong"]
    assert all(int(value.replace(",", "")) > 0 for row in rows for value in row[1:])


@pytest.mark.slow
def test_profile_writes_the_operator_table_of_the_timed_steps(tmp_path, capsys):
    argv = ["--config", str(ROOT / "configs/sce_cifar10.yaml"), "--fake-data", "--fake-images", "160", "--steps", "5",
            "--warmup", "1", "--num-workers", "0", "--pipelines", "gpu", "--profile", str(tmp_path), "--", *TINY]
    assert throughput.main(argv) == 0
    table = (tmp_path / "profile_gpu.txt").read_text()
    assert "Self CPU" in table
    # the trunk's convolutions were profiled (which aten op names them depends on the CPU kernel chosen)
    assert re.search(r"aten::\w*conv\w*", table)
    assert not (tmp_path / "profile_cpu.txt").exists()


def test_profile_needs_enough_timed_steps():
    with pytest.raises(SystemExit, match="--profile needs --steps >= 5, got 2"):
        throughput.main(["--config", str(ROOT / "configs/sce_cifar10.yaml"), "--steps", "2", "--profile", "/tmp/unused"])


def test_a_data_root_of_other_files_than_the_dataset_s_is_one_error_line(tmp_path):
    """A folder that exists but holds no official CIFAR-10 files ended in a traceback; a run says it in one line."""
    (tmp_path / "cifar-10-batches-py").mkdir()
    for name in (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"):
        (tmp_path / "cifar-10-batches-py" / name).write_bytes(b"not CIFAR-10")
    with pytest.raises(SystemExit) as stopped:
        throughput.main(["--config", str(ROOT / "configs/sce_cifar10.yaml"), "--data-root", str(tmp_path), "--views-only", "--view-images", "8"])
    assert str(stopped.value).startswith("error: ") and "\n" not in str(stopped.value) and str(tmp_path) in str(stopped.value)
