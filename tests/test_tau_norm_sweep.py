"""scripts/tau_norm_sweep.py: Kang et al.'s choice of tau on the validation split, from one extraction of the features."""

import json
from pathlib import Path

import pytest

import main_pretrain
from scripts import tau_norm_sweep

ROOT = Path(__file__).parents[1]

CONFIG = str(ROOT / "configs/ce_digits_lt.yaml")
RUN = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--data.init_args.batch_size=32"]


@pytest.mark.slow
def test_each_tau_gives_the_numbers_validate_gives_with_it_and_the_best_top1_is_chosen(tmp_path, capsys):
    run_dir = tmp_path / "run"
    main_pretrain.cli_main(["fit", "--config", CONFIG, *RUN, "--trainer.max_steps=4", f"--trainer.default_root_dir={run_dir}"])
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    validated = {}
    for tau in (0.5, 1.5):
        main_pretrain.cli_main(["validate", "--config", CONFIG, *RUN, f"--trainer.default_root_dir={run_dir}", f"--ckpt_path={checkpoint}",
                                f"--model.init_args.tau_norm={tau}"])
        validated[tau] = json.loads((run_dir / "results_validate.json").read_text())["metrics"]
    capsys.readouterr()
    assert tau_norm_sweep.main([str(checkpoint), "--config", CONFIG, "--tau", "0.5", "0", "1.5", "--", "--data.init_args.batch_size=32"]) == 0
    record = json.loads((run_dir / "analysis" / "last-val" / "tau_norm.json").read_text())
    assert [setting["tau"] for setting in record["settings"]] == [0.5, 0.0, 1.5]
    for setting in record["settings"][::2]:
        for key in ("top1", "many_top1", "medium_top1", "few_top1"):
            assert setting[key] == pytest.approx(validated[setting["tau"]][f"val/{key}"], abs=1e-6), (setting["tau"], key)
    best = max(setting["top1"] for setting in record["settings"])
    assert record["chosen_tau"] == next(setting["tau"] for setting in record["settings"] if setting["top1"] == best)
    assert any(line.startswith(f"chosen: tau {record['chosen_tau']} (top-1 ") for line in capsys.readouterr().out.splitlines())
    # data overrides that change the training split leave the shot groups of the counts the model was trained on, as validate
    assert tau_norm_sweep.main([str(checkpoint), "--config", CONFIG, "--tau", "0.5", "--out", str(tmp_path / "other"), "--",
                                "--data.init_args.batch_size=32", "--data.init_args.imbalance_ratio=10"]) == 0
    setting = json.loads((tmp_path / "other" / "tau_norm.json").read_text())["settings"][0]
    assert {key: setting.get(key) for key in ("many_top1", "medium_top1", "few_top1")} == pytest.approx(
        {key: validated[0.5][f"val/{key}"] for key in ("many_top1", "medium_top1", "few_top1")}, abs=1e-6)


def test_a_chosen_tau_0_is_said_to_be_the_classifier_without_its_bias_with_the_best_tau_test_can_evaluate(monkeypatch, tmp_path, capsys):
    settings = [{"tau": 0.0, "top1": 0.5}, {"tau": 0.5, "top1": 0.25}, {"tau": 1.0, "top1": 0.375}]
    monkeypatch.setattr(tau_norm_sweep, "read_checkpoint", lambda path, source: {})
    monkeypatch.setattr(tau_norm_sweep, "require_method", lambda *args: None)
    monkeypatch.setattr(tau_norm_sweep, "instantiate_config", lambda config, overrides: type("Config", (), {"datamodule": None}))
    monkeypatch.setattr(tau_norm_sweep.CrossEntropy, "load_from_checkpoint", lambda path, map_location: None)
    monkeypatch.setattr(tau_norm_sweep, "tau_sweep", lambda model, datamodule, taus, split: settings)
    monkeypatch.setattr(tau_norm_sweep, "measured_on", lambda *args: {})
    assert tau_norm_sweep.main([str(tmp_path / "last.ckpt"), "--config", CONFIG, "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("chosen: tau 0.0 (top-1 50.00% on val)")
    assert lines[-1] == ("tau 0 is the classifier without its bias, which no model.init_args.tau_norm gives (0 keeps the bias): "
                         "the best tau that `test` can evaluate is 1.0 (top-1 37.50%)")


def test_a_negative_tau_a_model_override_or_a_checkpoint_of_another_method_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tau_norm_sweep.main([str(tmp_path / "absent.ckpt"), "--config", CONFIG, "--tau", "-1"])
    assert "argument --tau: invalid non_negative_float value: '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # every logit 0, and a tau_norm.json that JSON cannot read (Infinity)
        tau_norm_sweep.main([str(tmp_path / "absent.ckpt"), "--config", CONFIG, "--tau", "inf"])
    assert "argument --tau: invalid non_negative_float value: 'inf'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^error: --model.init_args.tau_norm=1: the sweep evaluates the classifier the checkpoint holds"):
        tau_norm_sweep.main([str(tmp_path / "absent.ckpt"), "--config", CONFIG, "--", "--model.init_args.tau_norm=1"])
    with pytest.raises(SystemExit, match=rf"^error: checkpoint '{tmp_path / 'absent.ckpt'}' is not an existing file"):
        tau_norm_sweep.main([str(tmp_path / "absent.ckpt"), "--config", CONFIG])
