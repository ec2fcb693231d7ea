"""engine.tracking: the W&B run of every config (its name, offline without credentials, the same id after a
restart, the resolved config sent to it), the training throughput, and two real offline runs compared."""

import json
import shutil
import socket
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_cli import PRETRAIN_DIGITS, TINY_RUN

import main_pretrain
from engine import tracking
from engine.tracking import RUN_ID_FILE, TrainingThroughput, WandbRun, WandbUnavailable, run_name, wandb_mode
from scripts import compare

CONFIG = {
    "seed_everything": 3,
    "model": {"class_path": "methods.SCE", "init_args": {"temperature": 0.1, "temperature_momentum": 0.05, "optimizer": {"lr": 5.0e-4}}},
    "data": {"class_path": "datamodules.ImageNet100DataModule"},
}


def test_run_name_is_method_dataset_key_hyperparameters_and_seed():
    keys = {"tau": "model.init_args.temperature", "taum": "model.init_args.temperature_momentum", "lr": "model.init_args.optimizer.lr"}
    assert run_name(CONFIG, keys) == "sce-imagenet100-tau=0.1-taum=0.05-lr=0.0005-s3"
    assert run_name(CONFIG, {}) == "sce-imagenet100-s3"


def test_a_name_key_missing_from_the_config_is_one_error_naming_it():
    with pytest.raises(ValueError, match=r"name_keys.tau: the resolved config has no key 'model.init_args.tau'"):
        run_name(CONFIG, {"tau": "model.init_args.tau"})


@pytest.fixture
def netrc(monkeypatch, tmp_path):
    """No W&B variable and a .netrc file of the test's own (not yet written)."""
    for variable in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    return tmp_path / "netrc"


def test_offline_exactly_when_there_are_no_credentials_and_no_wandb_mode(netrc, monkeypatch):
    monkeypatch.setattr(tracking, "wandb_server_reachable", lambda server: None)
    assert wandb_mode() == "offline"
    netrc.write_text(f"machine example.com login user password {'y' * 40}\n")  # another host's entry
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() is None  # online
    monkeypatch.delenv("WANDB_API_KEY")
    netrc.write_text(f"machine api.wandb.ai login user password {'y' * 40}\n")
    assert wandb_mode() is None
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode() == "online"


def test_a_misspelt_wandb_mode_is_one_error_naming_it_and_the_modes(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(WandbUnavailable, match=r"^WANDB_MODE='ofline' \(environment\) is no W&B mode: one of online, offline, disabled, "):
        wandb_mode()
    for mode in tracking.WANDB_MODES[1:4]:
        monkeypatch.setenv("WANDB_MODE", mode)
        assert wandb_mode() == mode


def test_an_online_run_that_cannot_log_is_one_error_naming_offline_mode(netrc, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(WandbUnavailable, match=r"^WANDB_MODE=online, but W&B has no API key for https?://\S+ .*set WANDB_MODE=offline"):
        wandb_mode()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(tracking, "wandb_server_reachable", lambda server: "Network is unreachable")
    with pytest.raises(WandbUnavailable, match=r"server https?://\S+ cannot be reached \(Network is unreachable\): set WANDB_MODE=offline"):
        wandb_mode()


def test_without_wandb_mode_an_unreachable_server_means_offline_with_one_warning(netrc, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setattr(tracking, "wandb_server_reachable", lambda server: "Network is unreachable")
    with pytest.warns(UserWarning, match="cannot be reached .* this run logs offline"):
        assert wandb_mode() == "offline"


def test_the_reachability_check_gives_up_quickly_on_a_closed_port(monkeypatch):
    with socket.socket() as listener:  # a port that was free a moment ago: nothing listens there now
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    assert tracking.wandb_server_reachable(f"http://127.0.0.1:{port}") is not None
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        assert tracking.wandb_server_reachable(f"http://127.0.0.1:{listener.getsockname()[1]}") is None
    timeouts = []  # a server that never answers: the check waits its 3 s at most, not W&B's minutes of retries

    def never_answers(address, timeout):
        timeouts.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr(tracking.socket, "create_connection", never_answers)
    assert tracking.wandb_server_reachable("https://wandb.example") == "timed out" and timeouts == [3.0]


def test_the_run_is_bound_to_its_directory_before_its_wandb_run_exists_and_not_after(tmp_path):
    logger = WandbRun(name_keys={"tau": "model.init_args.temperature"})
    with pytest.raises(RuntimeError, match="must be called before the run begins"):
        logger.experiment
    logger.start(tmp_path, CONFIG, "disabled")
    assert (tmp_path / RUN_ID_FILE).read_text() == logger.version
    assert logger.save_dir == str(tmp_path)  # trainer.log_dir: config.yaml lands in the run directory
    logger.experiment  # WANDB_MODE=disabled (conftest): no process, no files
    with pytest.raises(RuntimeError, match="after its W&B run was created"):
        logger.start(tmp_path, CONFIG, "disabled")
    logger.finalize("success")



def test_only_a_fit_that_resumes_a_checkpoint_continues_the_wandb_run_its_directory_stores(tmp_path):
    """A new fit where an earlier start wrote no checkpoint is another run; `validate` and `test` are W&B runs of
    their own, which neither change the training run's config and history nor replace the stored id."""
    def started(stage: str, resumed: bool) -> str:
        logger = WandbRun()
        logger.start(tmp_path, CONFIG, "disabled", stage, resumed)
        return logger.version

    first = started("fit", resumed=False)
    assert started("fit", resumed=True) == first == (tmp_path / RUN_ID_FILE).read_text()
    evaluations = {started("validate", resumed=False), started("test", resumed=False)}
    assert first not in evaluations and len(evaluations) == 2 and (tmp_path / RUN_ID_FILE).read_text() == first
    restarted = started("fit", resumed=False)
    assert restarted != first and (tmp_path / RUN_ID_FILE).read_text() == restarted

def test_a_new_fit_from_the_command_line_in_a_directory_whose_earlier_start_wrote_no_checkpoint_starts_its_own_wandb_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_ID_FILE).write_text("abc12345")  # a start that was stopped before its first checkpoint
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run}"])
    assert (run / RUN_ID_FILE).read_text() not in ("abc12345", "")


@pytest.fixture(scope="module")
def offline_runs(tmp_path_factory):
    """Seeds 0 and 1 of the quickstart config, two training steps each: seed 0 with neither credentials nor
    WANDB_MODE (offline by default), seed 1 with WANDB_MODE=offline; then seed 0 restarted (`--ckpt_path
    last`: finished, it trains nothing, but its W&B run starts again)."""
    root = tmp_path_factory.mktemp("runs")

    def fit(seed: int, *extra: str):
        directory = root / f"seed{seed}"
        args = ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.log_every_n_steps=1", f"--seed_everything={seed}"]
        return main_pretrain.cli_main([*args, f"--trainer.default_root_dir={directory}", *extra])

    with pytest.MonkeyPatch.context() as patch:
        for variable in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
            patch.delenv(variable, raising=False)
        patch.setenv("NETRC", str(root / "no_netrc"))
        first = fit(0)
        patch.setenv("WANDB_MODE", "offline")
        fit(1)
        restarted = fit(0, "--ckpt_path=last")
    return root, first, restarted


@pytest.mark.slow
def test_an_offline_run_keeps_its_id_when_restarted_and_holds_the_resolved_config(offline_runs):
    root, _, _ = offline_runs
    run_id = (root / "seed0" / RUN_ID_FILE).read_text()
    starts = sorted((root / "seed0" / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(start.name.endswith(f"-{run_id}") for start in starts)
    assert (root / "seed1" / RUN_ID_FILE).read_text() != run_id
    log = compare.read_wandb(starts)
    assert log.name == "mocov2-digits-tau=0.2-s0"
    assert log.config["model"]["init_args"]["temperature"] == 0.2
    assert log.config["data"]["init_args"]["batch_size"] == 16  # the override, not the config file's 128
    assert log.config["trainer"]["default_root_dir"] == str(root / "seed0") and log.config["seed_everything"] == 0
    assert (root / "seed0" / "config.yaml").is_file()
    assert [step for step, _ in compare.curves_from_rows(log.history, "trainer/global_step")["train/loss"]] == [0, 1]


def test_training_throughput_counts_the_images_and_carries_over_a_restart(offline_runs):
    root, first, restarted = offline_runs
    (throughput,) = [callback for callback in first.trainer.callbacks if isinstance(callback, TrainingThroughput)]
    assert throughput.totals()["images"] == 2 * 16  # two steps of 16 images
    metrics = json.loads((root / "seed0" / "results_val.json").read_text())["metrics"]
    assert metrics["train/time_s"] > 0 and metrics["train/images_per_s"] > 2 * 16 / metrics["train/time_s"]  # validation excluded
    (resumed,) = [callback for callback in restarted.trainer.callbacks if isinstance(callback, TrainingThroughput)]
    assert resumed.earlier["images"] == 2 * 16 and resumed.earlier["time_s"] >= metrics["train/time_s"]
    assert resumed.earlier["validation_s"] > 0 and resumed.totals()["validation_s"] >= resumed.earlier["validation_s"]  # carried over too


def test_the_throughput_counts_the_images_of_every_process():
    counter = TrainingThroughput()
    counter.on_train_batch_end(SimpleNamespace(world_size=2), None, None, {"index": torch.arange(4)}, 0)
    assert counter.totals()["images"] == 8


def test_compare_reads_the_wandb_runs_of_the_run_directorys_own_id_only(offline_runs, tmp_path):
    """A `validate` in a run directory logs a W&B run of its own there, of other settings: not the run's curves or numbers."""
    root, _, _ = offline_runs
    run = Path(shutil.copytree(root / "seed0", tmp_path / "seed0"))
    own = compare.own_wandb_runs(run)
    assert len(own) == 2 and compare.RUN_ID_FILE == RUN_ID_FILE
    shutil.copytree(own[0], own[0].with_name(own[0].name.replace((run / RUN_ID_FILE).read_text(), "validate1")))
    assert len(list(run.glob("wandb/*run-*"))) == 3 and sorted(compare.own_wandb_runs(run)) == sorted(own)


@pytest.mark.slow
def test_compare_tables_the_two_seeds_of_the_offline_runs_and_plots_their_curves(offline_runs, tmp_path):
    root, _, _ = offline_runs
    markdown = compare.main([str(root), "--out", str(tmp_path)])
    knn, probe = (
        [json.loads((root / f"seed{seed}" / "results_val.json").read_text())["metrics"][metric] for seed in (0, 1)]
        for metric in ("val/knn_top1", "val/probe_top1")
    )
    (row,) = [line for line in markdown.splitlines() if line.startswith("| MoCoV2 | Digits |")]
    expected = [f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}" for values in (knn, probe)]
    assert row.startswith(f"| MoCoV2 | Digits | – | 0, 1 | n/a | {expected[0]} | {expected[1]} |")
    assert "W&B log (mocov2-digits-tau=0.2-s0)" in markdown  # the curves come from the W&B logs
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "comparison.csv").read_text().splitlines()[1].startswith("MoCoV2,Digits,,\"0, 1\",n/a,n/a,n/a,")


def test_a_fit_continues_its_directory_s_w_and_b_run_only_when_it_resumes_that_directory_s_run(tmp_path):
    """A checkpoint of another run, continued where a start without a checkpoint left a W&B id, is a run of its own:
    reusing the id merged the two runs into one W&B run."""

    from engine.cli.resume import continues_this_run

    trainer = SimpleNamespace(default_root_dir=str(tmp_path / "run"))
    assert continues_this_run(trainer, "last", resumed=True)  # last, hpc, a requeue: resolved to this run's own file
    assert continues_this_run(trainer, str(tmp_path / "run" / "checkpoints" / "epoch=3-step=40.ckpt"), resumed=False)
    assert not continues_this_run(trainer, str(tmp_path / "other" / "checkpoints" / "last.ckpt"), resumed=False)
    assert not continues_this_run(trainer, None, resumed=False)


def test_the_credentials_that_count_are_those_of_the_server_wandb_login_host_chose(netrc, monkeypatch, tmp_path):
    """`wandb login --host` writes the server to W&B's settings file: a run of a user logged in to their own server
    logged offline without a word (and WANDB_MODE=online was refused naming W&B's default server)."""
    monkeypatch.setattr(tracking, "wandb_server_reachable", lambda server: None)
    (tmp_path / "wandb_config").mkdir()
    (tmp_path / "wandb_config" / "settings").write_text("[default]\nbase_url = https://wandb.mylab.example\n")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    netrc.write_text(f"machine wandb.mylab.example login user password {'y' * 40}\n")
    assert wandb_mode() is None  # online, with the credentials of the server it logs in to
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")  # the variable comes first, as for W&B
    assert wandb_mode() == "offline"


@pytest.mark.slow  # starts W&B, offline
def test_the_config_is_saved_in_the_run_directory_whatever_the_loggers_and_w_and_b_starts_from_any_place_in_a_list(tmp_path, monkeypatch):
    """Lightning's log_dir is the first logger's (a CSVLogger's own folder; the working directory of a plain
    WandbLogger, where each run overwrote the last one's config), and a WandbRun after another logger was never started."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    run, csv = tmp_path / "run", tmp_path / "csv"
    loggers = f"[{{class_path: lightning.pytorch.loggers.CSVLogger, init_args: {{save_dir: {csv}}}}}, {{class_path: engine.tracking.WandbRun}}]"
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run}", f"--trainer.logger={loggers}"])
    assert (run / "config.yaml").is_file() and not list(csv.rglob("config.yaml")) and not (tmp_path / "config.yaml").exists()
    assert list(csv.rglob("metrics.csv")) and list((run / "wandb").glob("offline-run-*"))
