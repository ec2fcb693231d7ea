"""The CPU precision rule (issue 37): a bf16 precision trains in fp32 on a CPU without bf16 units, where bf16
convolutions fall back to generic kernels about ten times slower than fp32; the choice is what config.yaml records."""

import pytest
import torch

from engine.cli.lightning_cli import instantiate_config
from engine.devices import cpu_has_bf16_units, cpu_precision


@pytest.mark.parametrize("requested", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_a_bf16_precision_becomes_fp32_without_bf16_units_and_stays_with_them(requested):
    assert cpu_precision(requested, has_bf16_units=False) == "32-true"
    assert cpu_precision(requested, has_bf16_units=True) == requested


@pytest.mark.parametrize("requested", ["32-true", "64-true"])
def test_a_full_precision_is_kept_on_any_cpu(requested):
    assert cpu_precision(requested, has_bf16_units=False) == requested


def patch_cpu(monkeypatch, avx512_bf16: bool, amx: bool, onednn_isa: str | None = None):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if onednn_isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)


def test_bf16_units_are_read_from_the_cpu_and_the_onednn_ceiling(monkeypatch):
    patch_cpu(monkeypatch, avx512_bf16=False, amx=False)
    assert not cpu_has_bf16_units()
    patch_cpu(monkeypatch, avx512_bf16=True, amx=False)
    assert cpu_has_bf16_units()
    patch_cpu(monkeypatch, avx512_bf16=False, amx=True)
    assert cpu_has_bf16_units()
    patch_cpu(monkeypatch, avx512_bf16=True, amx=True, onednn_isa="AVX2")  # oneDNN held below its bf16 instructions
    assert not cpu_has_bf16_units()


def test_a_digits_config_trains_in_fp32_on_a_cpu_that_reports_no_bf16(monkeypatch, tmp_path):
    patch_cpu(monkeypatch, avx512_bf16=False, amx=False)
    cli = instantiate_config("configs/moco_digits.yaml", [f"--trainer.default_root_dir={tmp_path}"])
    assert cli.trainer.precision == "32-true"
    assert cli.resolved_config()["trainer"]["precision"] == "32-true"  # what config.yaml and the checkpoints record
    assert cli.precision_note.startswith("trainer.precision bf16-mixed -> 32-true")


def test_a_cpu_with_bf16_units_and_bf16_on_cpu_always_keep_the_configured_precision(monkeypatch, tmp_path):
    patch_cpu(monkeypatch, avx512_bf16=True, amx=False)
    assert instantiate_config("configs/moco_digits.yaml", [f"--trainer.default_root_dir={tmp_path}"]).trainer.precision == "bf16-mixed"
    patch_cpu(monkeypatch, avx512_bf16=False, amx=False)
    cli = instantiate_config("configs/moco_digits.yaml", [f"--trainer.default_root_dir={tmp_path}", "--bf16_on_cpu=always"])
    assert cli.trainer.precision == "bf16-mixed" and cli.precision_note is None
