"""scripts/reproduce.py and scripts/tables.py: table files, the runs of a table, their status, the assembled table,
the Slurm chain, and one real reproduction on Digits-M that is interrupted and resumed."""

import csv
import fcntl
import itertools
import json
import os
import re
import shlex
import signal
import stat
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import Callback

from scripts import compare, reproduce, sweep
from scripts.tables import load_table

ROOT = Path(__file__).resolve().parents[1]
TABLES = sorted((ROOT / "tables").glob("*.yaml"))
BASELINES = ("BYOL", "SimSiam", "MoCoV3", "NNCLR", "BarlowTwins", "VICReg", "SwAV", "DINO")  # issues 33 and 34
README_AT_COMMIT = re.compile(r"\b[\w.-]+/[\w.-]+ (?:[\w.-]+/)*README(?:\.md)? at [0-9a-f]{7,40}\b")  # a baselines table's source
TINY = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2", "--trainer.check_val_every_n_epoch=1",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.precision=32-true",
        "--data.init_args.batch_size=16", "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]


class InterruptOnce(Callback):
    """Sends its own process SIGTERM, as a scheduler would, after the first training step of the run in `run_dir`,
    once (a marker file remembers it): the run saves last.ckpt at the end of the next step and exits with 143."""

    def __init__(self, run_dir: str, marker: str):
        self.run_dir, self.marker = Path(run_dir), Path(marker)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if Path(trainer.default_root_dir) == self.run_dir and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGTERM)


def write_table(path: Path, rows: str, head: str = 'title: "a test table"\n') -> Path:
    path.write_text(head + "rows:\n" + rows)
    return path


def a_row(row_id: str, config: str = "configs/moco_digits.yaml", evaluation: str = "[probe, knn]", paper: str = "{probe: 50.0}",
          seeds: int = 2, overrides: str = "", extra: str = "") -> str:
    pretrain = f"{{config: {config}" + (f", overrides: {{{overrides}}}}}" if overrides else "}")
    return (f"  - id: {row_id}\n    label: row {row_id}\n    pretrain: {pretrain}\n    evaluation: {evaluation}\n"
            f"    paper: {paper}\n    source: a test\n    seeds: {seeds}\n{extra}")


def write_results(directory: Path, metrics: dict, name: str = "results_val.json", best: dict | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps({"metrics": metrics} | ({"best": best} if best is not None else {})))


def csv_rows(out: Path) -> list[dict]:
    return list(csv.DictReader((out / "table.csv").open()))


# ----------------------------------------------------------------- table files
@pytest.mark.parametrize("path", TABLES, ids=[path.stem for path in TABLES])
def test_every_shipped_table_file_validates_and_cites_a_paper_or_a_readme_or_says_it_stands_in(path):
    table = load_table(path)
    assert table.rows
    if path.stem.startswith("digits_"):
        assert table.stand_in, "a Digits-M table says which paper table it stands in for"
    else:
        assert table.stand_in is None and all(any(number is not None for number in row.paper.values()) for row in table.rows)
        if table.kind == "paper":
            assert [row.id for row in table.rows if " supplementary, Table " not in row.source] == []
        else:  # a baselines' table: the repository's README at the commit read
            assert [row.id for row in table.rows if not README_AT_COMMIT.search(row.source)] == []


def test_the_paper_tables_cover_every_seed_table_with_configs():
    names = {path.stem for path in TABLES}
    assert {"sce_table2", "tcl_table1", "tcl_table2", "wang_liu_table1", "wang_liu_table2"} <= names
    assert {f"paco_table{number}" for number in range(9, 15)} <= names
    assert len(load_table(ROOT / "tables/sce_table2.yaml").rows) == 4 * 2 * 8  # datasets x tau x tau_m
    assert len(load_table(ROOT / "tables/wang_liu_table2.yaml").rows) == 4 * 12  # datasets x tau


def header(config: str) -> str:
    """The comment lines that open a config: its target, sources and what is UNVERIFIED."""
    return "\n".join(itertools.takewhile(lambda line: line.startswith("#"), (ROOT / config).read_text().splitlines()))


def test_every_baseline_config_is_a_row_of_a_baselines_table_or_named_there_as_not_covered():
    """A baseline's paper-scale config (the Digits-M stand-ins are tables/digits_baselines.yaml's) added without a
    row of a `kind: baselines` table, or a not_covered entry naming it with the reason, fails here."""
    configs = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        method = yaml.safe_load(path.read_text())["model"]["class_path"].removeprefix("methods.")
        if method in BASELINES and not path.stem.endswith("_digits"):
            configs[f"configs/{path.name}"] = method
    assert set(configs.values()) == set(BASELINES)
    tables = [table for table in map(load_table, TABLES) if table.kind == "baselines"]
    rows = {row.config for table in tables for row in table.rows}
    not_covered = " ".join(label for table in tables for label, _ in table.not_covered)
    assert [config for config in configs if config not in rows and config not in not_covered] == []


def test_every_baselines_table_row_gives_the_numbers_its_config_header_targets():
    wrong = [f"{path.name} {row.id}: {metric} {number} is not in the header of {row.config}"
             for path in TABLES if (table := load_table(path)).kind == "baselines" for row in table.rows
             for metric, number in row.paper.items()
             if not re.search(rf"(?<![\d.]){re.escape(f'{number:g}')}0*(?!\d)", header(row.config))]
    assert wrong == []


@pytest.mark.parametrize(
    "row, problem",
    [
        (a_row("b").replace("    source: a test\n", ""), "row 2 (b) has no source"),
        (a_row("b", config="configs/no_such.yaml"), "row 2 (b) its pretraining config 'configs/no_such.yaml' is not a config"),
        (a_row("b", evaluation="{linear: configs/linear_nothing.yaml}", paper="{linear: 1}"), "row 2 (b) its linear-stage config"),
        (a_row("b", evaluation="kmeans"), "row 2 (b) its evaluation 'kmeans' is none of"),
        (a_row("b", paper="{linear: 90.0}"), "row 2 (b) its paper {'linear': 90.0} is not a mapping of its metrics (probe, knn)"),
        (a_row("b", paper="{probe: null}"), "row 2 (b) gives no paper number"),
        (a_row("b", seeds=0), "row 2 (b) its seeds 0 is not a number of seeds from 1 to 100"),
        (a_row("b", seeds=100000000000), "row 2 (b) its seeds 100000000000 is not a number of seeds from 1 to 100"),
        (a_row("b", paper="{probe: .nan}"), "row 2 (b) its paper number for probe (nan) is not a finite number"),
        (a_row("b", extra="    colour: red\n"), "row 2 (b) has unknown keys ['colour']"),
        (a_row("a"), "row 2 (a) repeats the id of an earlier row"),
    ],
)
def test_a_bad_row_is_one_error_line_naming_the_file_and_the_row_before_anything_is_written(row, problem, tmp_path):
    path = write_table(tmp_path / "bad.yaml", a_row("a") + row)
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main([str(path), "--out", str(tmp_path / "out")])
    message = str(exit_info.value)
    assert message.startswith(f"error: {path}: ") and problem in message and "\n" not in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "head, problem",
    [('not_covered: [{label: 5, reason: [1, 2]}]\n', "not_covered is not a list of {label, reason} texts"),
     ("stand_in: 5\n", "stand_in 5 is not a text (the paper's table the stand-in stands in for)")],
)
def test_a_table_whose_texts_are_not_texts_is_refused(head, problem, tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a"), head='title: "a test table"\n' + head)
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(path))}: {re.escape(problem)}$"):
        reproduce.main([str(path), "--dry-run"])


def test_a_table_of_an_unknown_kind_is_refused(tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a"), head='title: "a test table"\nkind: survey\n')
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(path))}: kind 'survey' is none of paper, baselines$"):
        reproduce.main([str(path), "--dry-run"])


def test_unknown_rows_and_bad_seeds_are_refused(tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a"))
    with pytest.raises(SystemExit, match=r"error: --rows zz: .* has no such row \(its rows: a\)"):
        reproduce.main([str(path), "--rows", "zz", "--dry-run"])
    with pytest.raises(SystemExit, match="error: --seeds 0 is not a number of seeds from 1 to 100"):
        reproduce.main([str(path), "--seeds", "0", "--dry-run"])
    # one seed for every run would train each row's seeds as the same run
    with pytest.raises(SystemExit, match="error: --seed_everything=3 after --: each run's seed is its own"):
        reproduce.main([str(path), "--dry-run", "--", "--seed_everything=3"])
    with pytest.raises(SystemExit, match="error: --seed_everything=3 in --evaluation-override: each run's seed is its own"):
        reproduce.main([str(path), "--dry-run", "--evaluation-override=--seed_everything=3"])


def test_an_argument_for_every_row_that_a_row_or_the_table_sets_for_each_run_is_refused(tmp_path):
    """After `--` it would follow the row's own override (or each run's directory) and win: two rows, one run."""
    path = write_table(tmp_path / "t.yaml", a_row("a") + a_row("b", overrides="model.init_args.temperature: 0.5"))
    with pytest.raises(SystemExit, match=re.escape("error: --model.temperature=0.3 after --: each run sets model.temperature itself "
                                                   "(--out, and the overrides of a row); one value for all would follow it and win")):
        reproduce.main([str(path), "--dry-run", "--", "--model.temperature=0.3"])
    with pytest.raises(SystemExit, match="error: --trainer.default_root_dir after --: each run sets trainer.default_root_dir itself"):
        reproduce.main([str(path), "--dry-run", "--", "--trainer.default_root_dir", str(tmp_path / "one")])
    assert reproduce.main([str(path), "--rows", "a", "--dry-run", "--", "--model.temperature=0.3"]) == 0  # row a leaves it to the config


def test_dry_run_prints_each_stage_resolved_in_order_and_writes_nothing(tmp_path, capsys):
    path = write_table(tmp_path / "t.yaml", a_row("a", overrides="model.init_args.temperature: 0.5") + a_row(
        "lt", config="configs/paco_digits_lt.yaml", evaluation="{longtail: test, overrides: {model.init_args.temperature: 0.1}}",
        paper="{all: 1}", seeds=3) + a_row("lin", evaluation="[knn, {linear: configs/linear_digits.yaml}]", paper="{linear: 1}"))
    out = tmp_path / "out"
    assert reproduce.main([str(path), "--out", str(out), "--rows", "lt", "lin", "--seeds", "1", "--dry-run",
                           "--evaluation-override=--trainer.max_epochs=2", "--", "--trainer.max_epochs=1"]) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert [command[1:3] for command in commands] == [[str(ROOT / "main_pretrain.py"), "fit"], [str(ROOT / "main_pretrain.py"), "test"],
                                                    [str(ROOT / "main_pretrain.py"), "fit"], [str(ROOT / "main_linear.py"), "fit"]]
    pretrain, test, _, linear = commands
    # W&B: a group per row and stage, whose runs are its seeds (the configs' own group is the config's: every row of it)
    assert pretrain[3:] == ["--config", "configs/paco_digits_lt.yaml", "--seed_everything=0",
                            f"--trainer.default_root_dir={out / 'lt' / 'seed0'}", "--ckpt_path=last",
                            "--trainer.logger.init_args.group=out.lt", "--trainer.logger.init_args.name=out.lt-s0", "--trainer.max_epochs=1"]
    assert test[5:] == ["--seed_everything=0", "--trainer.logger.init_args.group=out.lt.test", "--trainer.logger.init_args.name=out.lt.test-s0",
                        "--trainer.max_epochs=1", "--model.init_args.temperature=0.1", "--trainer.max_epochs=2",
                        f"--ckpt_path={out / 'lt' / 'seed0' / 'checkpoints' / 'last.ckpt'}", f"--trainer.default_root_dir={out / 'lt' / 'seed0' / 'test'}"]
    assert f"--model.pretrained_ckpt={out / 'lin' / 'seed0' / 'checkpoints' / 'last.ckpt'}" in linear
    assert linear[-1] == "--trainer.max_epochs=2" and f"--trainer.default_root_dir={out / 'lin' / 'seed0' / 'linear'}" in linear
    assert {"--trainer.logger.init_args.group=out.lin.linear", "--trainer.logger.init_args.name=out.lin.linear-s0"} <= set(linear)
    assert not out.exists()


# ----------------------------------------------------------------- status and the assembled table
def record(directory: Path, **fields) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    reproduce.write_state(directory, {"launcher": "local", "host": "here", "pid": 1, "log": str(directory / "log.txt"), **fields})


def test_a_misspelt_override_in_a_table_is_one_error_line_naming_the_row_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the tables' config paths are the project's, wherever the command starts
    assert reproduce.main([str(write_table(tmp_path / "ok.yaml", a_row("good"))), "--out", str(tmp_path / "ok"), "--dry-run"]) == 0
    path = write_table(tmp_path / "t.yaml", a_row("good") + a_row("typo", overrides="model.init_args.temprature: 0.1"))
    out = tmp_path / "out"
    for launcher in ("local", "slurm"):
        with pytest.raises(SystemExit) as stopped:
            reproduce.main([str(path), "--out", str(out), "--launcher", launcher, "--dry-run"])
        message = str(stopped.value)
        assert message.startswith("error: t.yaml row typo, pretrain: ") and "temprature" in message and "\n" not in message  # the table shown from the working directory
    assert not out.exists()

def test_a_row_whose_model_or_views_do_not_build_is_one_error_line_before_a_local_run_writes_anything(tmp_path, monkeypatch):
    """--print_config resolves a view's keys and a value out of range; building the pretraining refuses them, before
    the first stage's folder is made (each stage would fail in its log, one after another)."""
    monkeypatch.chdir(tmp_path)
    bad_view = "data.init_args.views: {query: {preset: mocov2, scal: [0.2, 1.0]}, key: {preset: mocov2}}"
    for row, message in ((a_row("tau", overrides="model.init_args.temperature: 0.0"), "row tau, pretrain: model.init_args.temperature must be > 0"),
                         (a_row("view", overrides=bad_view), "row view, pretrain: view 'query': preset 'mocov2' does not accept ['scal']")):
        path, out = write_table(tmp_path / "t.yaml", row), tmp_path / "out"
        with pytest.raises(SystemExit) as stopped:
            reproduce.main([str(path), "--out", str(out), "--seeds", "1"])
        assert str(stopped.value).startswith(f"error: t.yaml {message}") and "\n" not in str(stopped.value)
        assert not out.exists()


def test_results_made_with_other_arguments_are_stale_neither_run_again_nor_counted(tmp_path, capsys):
    """A finished smoke run (`-- --trainer.max_epochs=1`) is not the row's result once the command no longer asks
    for it, nor is a run of the table's override before it was edited: both are named, and the row shows no number."""
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=3, overrides="model.init_args.temperature: 0.5"))
    runs = reproduce.plan(list(load_table(path).rows), None, tmp_path, [], [])
    smoke, edited, same = (run.stages[0] for run in runs)
    planned = [sweep.stage_arguments(stage.command) for stage in (smoke, edited, same)]
    assert "--model.init_args.temperature=0.5" in planned[1] and not any(str(tmp_path) in argument for argument in planned[2])
    made_with = [[*planned[0], "--trainer.max_epochs=1"], [argument.replace("temperature=0.5", "temperature=0.2") for argument in planned[1]], planned[2]]
    for stage, arguments in zip((smoke, edited, same), made_with):
        write_results(stage.directory, {"val/probe_top1": 0.5})
        record(stage.directory, exit_code=0, arguments=arguments)
    states = [reproduce.stage_status(stage) for stage in (smoke, edited, same)]
    assert [status.state for status in states] == ["stale", "stale", "done"]
    assert str(states[0]).startswith("stale (its results were made with --trainer.max_epochs=1: remove ")
    assert str(states[1]).startswith("stale (its results were made with --model.init_args.temperature=0.2 and without --model.init_args.temperature=0.5: ")
    reproduce.run_locally(runs)  # runs nothing: a stale stage is named, and its run's later stages wait
    printed = capsys.readouterr().out
    assert printed.count(": stale (its results were made with") == 2 and "$ " not in printed and "main_pretrain.py" not in printed


def test_results_made_before_the_rows_config_was_edited_are_stale(tmp_path):
    """The stage's record holds its config's values (their SHA-256): the same path with other values is another run."""
    config = tmp_path / "pretrain.yaml"
    config.write_text((ROOT / "configs/moco_digits.yaml").read_text())
    path = write_table(tmp_path / "t.yaml", a_row("a", config=str(config), seeds=1))
    ((stage, *_),) = (run.stages for run in reproduce.plan(list(load_table(path).rows), None, tmp_path / "out", [], []))
    write_results(stage.directory, {"val/probe_top1": 0.5})
    record(stage.directory, exit_code=0, **sweep.stage_record(stage.command))
    assert reproduce.stage_status(stage).state == "done"
    config.write_text(config.read_text().replace("temperature: 0.2", "temperature: 0.5", 1))
    assert str(reproduce.stage_status(stage)).startswith(f"stale (its results were made with other values in {config} (edited since): remove ")


@pytest.mark.parametrize("content", ['{"metrics": {"val/pro', '["a list"]'])
def test_a_results_file_cut_short_is_one_error_line_naming_it_when_the_table_is_collected(content, tmp_path, capsys):
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1))
    out = tmp_path / "out"
    ((stage, *_),) = (run.stages for run in reproduce.plan(list(load_table(path).rows), None, out, [], []))
    write_results(stage.directory, {})
    (stage.directory / "results_val.json").write_text(content)
    with pytest.raises(SystemExit, match=re.escape(f"error: {stage.directory / 'results_val.json'}: the results file is ")):
        reproduce.main([str(path), "--out", str(out), "--collect"])


def test_an_out_that_is_a_file_is_one_error_line(tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1))
    (tmp_path / "out").write_text("")
    with pytest.raises(SystemExit, match="error: --out .*out is a file, not a folder"):
        reproduce.main([str(path), "--out", str(tmp_path / "out"), "--collect"])


def test_the_collect_command_printed_after_a_submission_names_the_arguments_the_results_are_of(tmp_path):
    table = load_table(write_table(tmp_path / "t.yaml", a_row("a")))
    args = reproduce.parse_args([str(table.path), "--rows", "a", "--evaluation-override=--trainer.max_epochs=2", "--", "--trainer.max_epochs=1"])
    command = shlex.split(reproduce.collect_command(args, table, tmp_path / "out"))
    assert command[-4:] == ["--evaluation-override=--trainer.max_epochs=2", "--collect", "--", "--trainer.max_epochs=1"]
    assert reproduce.parse_args(command[4:]).extra == args.extra

def test_the_table_names_the_arguments_given_to_every_run_and_an_evaluation_override_without_an_evaluation_is_refused(tmp_path):
    """A smoke table (`-- --trainer.max_steps=3`) reads as the rows' runs unless it says so; an evaluation override of a
    table without linear or test stages would apply to nothing, and its runs would start at full length."""
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1))
    out = tmp_path / "out"
    ((stage, *_),) = (run.stages for run in reproduce.plan(list(load_table(path).rows), None, out, ["--trainer.max_steps=3"], []))
    write_results(stage.directory, {"val/probe_top1": 0.5})
    reproduce.main([str(path), "--out", str(out), "--collect", "--", "--trainer.max_steps=3"])
    assert "Given to every run: `--trainer.max_steps=3`." in (out / "table.md").read_text().splitlines()
    with pytest.raises(SystemExit, match=rf"^error: --evaluation-override --trainer.max_stepz=3: {re.escape(str(path))} have no evaluation stage"):
        reproduce.main([str(path), "--out", str(out), "--dry-run", "--evaluation-override=--trainer.max_stepz=3"])


def test_the_status_of_a_stage_comes_from_its_results_lock_and_record(tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=7))
    runs = reproduce.plan(list(load_table(path).rows), None, tmp_path, [], [])
    done, running, failed, terminated, killed, vanished, orphan_checkpoint = (run.stages[0] for run in runs)
    write_results(done.directory, {"val/probe_top1": 0.5})
    record(running.directory, exit_code=None)
    record(failed.directory, exit_code=2)
    record(terminated.directory, exit_code=143)
    record(killed.directory, exit_code=-9)
    record(vanished.directory, exit_code=None)
    (orphan_checkpoint.directory / "checkpoints").mkdir(parents=True)
    (orphan_checkpoint.directory / "checkpoints" / "last.ckpt").write_bytes(b"")
    with (running.directory / reproduce.LOCK).open("a") as lock:  # as the training process holds it
        fcntl.flock(lock, fcntl.LOCK_EX)
        states = [reproduce.stage_status(stage) for stage in (done, running, failed, terminated, killed, vanished, orphan_checkpoint)]
        not_started = reproduce.stage_status(reproduce.Stage("pretrain", tmp_path / "none", tmp_path / "none" / "r.json", "c", []))
    assert [status.state for status in states] == ["done", "running", "failed", "interrupted", "interrupted", "interrupted", "interrupted"]
    assert not_started.state == "not started"
    assert str(states[2]) == f"failed (exit 2, log {failed.directory / 'log.txt'})"
    assert "exit 143" in states[3].detail and "its launcher ended" in states[5].detail
    assert reproduce.stage_status(running).state == "interrupted"  # the lock released, no exit code: its launcher vanished


def test_the_table_shows_a_number_only_for_finished_rows_with_the_results_mean_std_and_n(tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a", evaluation="[knn, {linear: configs/linear_digits.yaml}]", paper="{linear: 60.0}")
                       + a_row("b", seeds=3) + a_row("c", evaluation="[{longtail: val}, representation]", paper="{all: 40.0, few: 20.0}", seeds=1))
    table = load_table(path)
    out = tmp_path / "out"
    runs = reproduce.plan(list(table.rows), None, out, [], [])
    a_values, b_values = {0: (0.10, 0.625), 1: (0.20, 0.5)}, [0.5, 0.25]
    for seed, (knn, linear) in a_values.items():
        write_results(out / "a" / f"seed{seed}", {"val/knn_top1": knn, "val/probe_top1": 0.0})
        best = {"val/probe_top1": {"global_step": 90, "epoch": 8, "metrics": {"val/probe_top1": linear + 0.0625}}}
        write_results(out / "a" / f"seed{seed}" / "linear", {"val/probe_top1": linear}, best=best)
    for seed, value in enumerate(b_values):
        write_results(out / "b" / f"seed{seed}", {"val/probe_top1": value, "val/knn_top1": value})
    record(out / "b" / "seed2", exit_code=1)  # the third seed of b failed
    best = {"val/top1": {"global_step": 7, "epoch": 3, "metrics": {"val/top1": 0.5, "val/many_top1": 0.75, "val/medium_top1": 0.375, "val/few_top1": 0.0}}}
    write_results(out / "c" / "seed0", {"val/top1": 0.375, "val/many_top1": 0.5, "val/medium_top1": 0.25, "val/few_top1": 0.125,
                                        "val/uniformity": 2.5, "val/tolerance": 0.0625}, best=best)
    (out / "a" / "seed1" / "log.txt").write_text("wandb: \x1b[33m🚀 View run\x1b[0m at: \x1b[34mhttps://wandb.ai/lab/contrastlab/runs/abc123\x1b[0m\n")

    markdown = reproduce.assemble(table, runs, out)
    rows = csv_rows(out)
    assert [(row["row_id"], row["metric"]) for row in rows] == [("a", "knn"), ("a", "linear"), ("b", "probe"), ("b", "knn"),
                                                               ("c", "many"), ("c", "medium"), ("c", "few"), ("c", "all"),
                                                               ("c", "uniformity"), ("c", "tolerance")]
    linear = [100 * value for _, value in a_values.values()]
    assert float(rows[1]["mean"]) == statistics.mean(linear) and float(rows[1]["std"]) == statistics.stdev(linear)
    assert rows[1]["n"] == "2" and float(rows[1]["difference"]) == statistics.mean(linear) - 60.0
    assert float(rows[0]["mean"]) == pytest.approx(15.0) and rows[0]["paper"] == "" and rows[0]["difference"] == ""
    assert rows[2]["mean"] == rows[2]["std"] == rows[2]["n"] == ""  # b did not finish: no number, whatever its seeds 0 and 1 say
    assert rows[2]["status"] == f"seed 0: done; seed 1: done; seed 2: pretrain failed (exit 1, log {out / 'b' / 'seed2' / 'log.txt'})"
    assert [rows[index]["mean"] for index in range(4, 8)] == ["50.0", "25.0", "12.5", "37.5"] and rows[4]["std"] == ""
    assert float(rows[7]["difference"]) == pytest.approx(-2.5)
    assert [rows[8]["mean"], rows[9]["mean"]] == ["2.5", "0.0625"]  # not accuracies: as logged
    assert [row["best"] for row in rows] == ["", str(statistics.mean(linear) + 6.25), "", "", "75.0", "37.5", "0.0", "50.0", "", ""]
    assert markdown.splitlines()[13] == "|  | tolerance | — | 0.062 (n=1) | — | — |  |  |"  # no best of a representation metric
    assert "https://wandb.ai/lab/contrastlab/runs/abc123" in rows[0]["runs"] and str(out / "a" / "seed0") in rows[0]["runs"]
    lines = markdown.splitlines()
    assert lines[2] == "| row | metric | paper | measured | best | difference | status | runs |"
    assert lines[4].startswith("| row a | knn | — | 15.00 ± 7.07 (n=2) | — | — | done | ") and "[s1](https://wandb.ai/lab/contrastlab/runs/abc123)" in lines[4]
    assert lines[5] == "|  | linear | 60.00 | 56.25 ± 8.84 (n=2) | 62.50 | -3.75 |  |  |"  # the difference is the measured's
    assert lines[6].startswith("| row b | probe | 50.00 |  |  | — | seed 0: done; seed 1: done; seed 2: pretrain failed (exit 1, log ")
    assert (out / "table.md").read_text() == markdown and "Sources: a test." in markdown


# ----------------------------------------------------------------- Slurm
def fake_slurm(folder: Path, queue: str = "") -> Path:
    """An `sbatch` that numbers the jobs it is given from 100 (recording the job files) and an `squeue` that lists
    the jobs in `folder/queue` (lines `<id> <STATE>`)."""
    folder.mkdir(exist_ok=True)
    (folder / "queue").write_text(queue)
    scripts = {
        "sbatch": f'for last; do :; done\necho "$last" >> {folder}/submitted\necho "$((99 + $(wc -l < {folder}/submitted)));cluster"\n',
        "squeue": f'for argument; do case "$argument" in --jobs=*) id="${{argument#--jobs=}}";; esac; done\n'
                  f'grep "^$id " {folder}/queue | cut -d" " -f2\n',
    }
    for name, body in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    return folder / "submitted"


def sbatch_lines(path: Path) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in path.read_text().splitlines() if line.startswith("#SBATCH ")]


def test_a_slurm_dry_run_writes_one_job_per_stage_the_evaluation_after_the_pretraining(tmp_path, capsys):
    path = write_table(tmp_path / "t.yaml", a_row("lin", evaluation="[knn, {linear: configs/linear_digits.yaml}]", paper="{linear: 1}")
                       + a_row("lt", config="configs/paco_digits_lt.yaml", evaluation="{longtail: test}", paper="{all: 1}", seeds=1))
    out = tmp_path / "out"
    assert reproduce.main([str(path), "--out", str(out), "--launcher", "slurm", "--dry-run", "--time=02:00:00", "--", "--trainer.max_epochs=3"]) == 0
    runs = reproduce.plan(list(load_table(path).rows), None, out, ["--trainer.max_epochs=3"], [])
    jobs = sorted(out.rglob("job.sbatch"))
    assert jobs == sorted(stage.directory / "job.sbatch" for run in runs for stage in run.stages) and len(jobs) == 2 * 2 + 2
    for run in runs:
        pretraining, evaluation = run.stages
        assert not any(line.startswith("--dependency") for line in sbatch_lines(pretraining.directory / "job.sbatch"))
        lines = sbatch_lines(evaluation.directory / "job.sbatch")
        assert "--dependency=afterok:<pretraining job id>" in lines and "--kill-on-invalid-dep=yes" in lines and "--time=02:00:00" in lines
        srun = shlex.split((evaluation.directory / "job.sbatch").read_text().splitlines()[-1])
        local = evaluation.command  # the job runs the local command's arguments, on the job's resources
        assert srun[1:4] == ["python", Path(local[1]).name, local[2]] and srun[4:6] == ["--config", local[4]]
        assert [argument for argument in local[5:] if "default_root_dir" not in argument] == srun[6:-3]
        assert srun[-1] == f"--trainer.default_root_dir={evaluation.directory}"
    printed = capsys.readouterr().out
    assert f"wrote {out / 'lin' / 'seed1' / 'linear' / 'job.sbatch'}" in printed
    assert "then, at any time: uv run python scripts/reproduce.py" in printed and printed.rstrip().endswith("--collect -- --trainer.max_epochs=3")  # the arguments its results are of
    assert not list(out.rglob(reproduce.STATE))  # nothing submitted


def test_slurm_submission_chains_each_evaluation_afterok_on_its_pretraining_job_and_skips_queued_jobs(tmp_path, monkeypatch, capsys):
    submitted = fake_slurm(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    path = write_table(tmp_path / "t.yaml", a_row("lin", evaluation="[knn, {linear: configs/linear_digits.yaml}]", paper="{linear: 1}"))
    out = tmp_path / "out"
    write_results(out / "lin" / "seed1", {"val/knn_top1": 0.5})  # seed 1's pretraining is done: its linear stage waits for nothing
    argv = [str(path), "--out", str(out), "--launcher", "slurm"]
    assert reproduce.main(argv) == 0
    seed0, seed1 = out / "lin" / "seed0", out / "lin" / "seed1"
    assert submitted.read_text().splitlines() == [str(seed0 / "job.sbatch"), str(seed0 / "linear" / "job.sbatch"), str(seed1 / "linear" / "job.sbatch")]
    assert "--dependency=afterok:100" in sbatch_lines(seed0 / "linear" / "job.sbatch")
    assert not any(line.startswith("--dependency") for line in sbatch_lines(seed1 / "linear" / "job.sbatch"))
    printed = capsys.readouterr().out
    for job_id, script in ((100, seed0 / "job.sbatch"), (101, seed0 / "linear" / "job.sbatch"), (102, seed1 / "linear" / "job.sbatch")):
        assert f"submitted job {job_id}: {script}" in printed
    assert f"--out {out} --collect" in printed

    (tmp_path / "bin" / "queue").write_text("100 RUNNING\n101 PENDING\n102 PENDING\n")
    assert reproduce.main(argv) == 0  # nothing is submitted twice
    assert len(submitted.read_text().splitlines()) == 3
    assert "[lin seed 0] pretrain: running (job 100), left to it" in capsys.readouterr().out
    (tmp_path / "bin" / "queue").write_text("102 RUNNING\n")  # jobs 100 and 101 left the queue without results
    reproduce.main([*argv, "--collect"])
    (row,) = {row["status"] for row in csv_rows(out)}
    assert row == f"seed 0: pretrain failed (job 100 ended without results, log {seed0 / 'slurm.err'}); seed 1: linear running (job 102)"


# ----------------------------------------------------------------- W&B
@pytest.mark.slow  # starts W&B (a few seconds)
def test_with_wandb_in_use_the_table_is_logged_as_a_wandb_table_in_a_summary_run(tmp_path, monkeypatch, capsys):
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1))
    out = tmp_path / "out"
    write_results(out / "a" / "seed0", {"val/probe_top1": 0.25, "val/knn_top1": 0.5})
    (out / "a" / "seed0" / "wandb").mkdir()  # the run logged to W&B
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    assert reproduce.main([str(path), "--out", str(out), "--collect"]) == 0
    assert f"W&B: the table is logged in {out / 'wandb'}" in capsys.readouterr().out
    (table_file,) = out.glob("wandb/offline-run-*/files/media/table/table_*.table.json")
    logged = json.loads(table_file.read_text())
    assert logged["columns"] == reproduce.CSV_COLUMNS
    assert [entry[:3] for entry in logged["data"]] == [["a", "row a", "probe"], ["a", "row a", "knn"]] and logged["data"][0][4] == 25.0
    assert (out / "wandb_run_id").is_file()  # a later --collect logs into the same summary run
    trained = {"model": {"class_path": "methods.MoCoV2"}, "data": {"class_path": "datamodules.DigitsDataModule"}, "seed_everything": 0}
    (out / "a" / "seed0" / "config.yaml").write_text(yaml.safe_dump(trained))
    rows = [line for line in compare.main([str(out), "--out", str(tmp_path / "comparison")]).splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]][:1] == ["| MoCoV2"] and not any(row.startswith("| n/a") for row in rows)  # not the summary run


# ----------------------------------------------------------------- end to end
@pytest.mark.slow  # five short training processes on Digits-M (one stopped at its second step)
def test_a_digits_table_runs_is_interrupted_resumes_and_collects_the_results_files_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the runs import InterruptOnce from this file
    path = write_table(tmp_path / "digits.yaml", a_row("a") + a_row("b", overrides="model.init_args.temperature: 0.5", seeds=1)
                       + a_row("f", overrides="model.init_args.optimizer.lr: 1.0e+30", seeds=1),  # a failing row: a non-finite loss at its second step
                       head='title: "a Digits-M test table"\nstand_in: nothing.\n')
    out = tmp_path / "out"
    interrupt = f"--trainer.callbacks+={{class_path: test_reproduce.InterruptOnce, init_args: {{run_dir: {out / 'a' / 'seed1'}, marker: {tmp_path / 'interrupted'}}}}}"
    argv = [str(path), "--out", str(out), "--", *TINY, interrupt]

    assert reproduce.main(argv) == 1  # a/seed1 is interrupted after its first step: the command stops there
    first = capsys.readouterr().out
    assert "interrupted: run the same command again to resume" in first
    assert (out / "a" / "seed0" / "results_val.json").is_file() and not (out / "a" / "seed1" / "results_val.json").is_file()
    assert (out / "a" / "seed1" / "checkpoints" / "last.ckpt").is_file() and not (out / "b").exists()
    assert reproduce.read_state(out / "a" / "seed1")["exit_code"] == 143
    assert {row["row_id"]: row["mean"] for row in csv_rows(out)} == {"a": "", "b": "", "f": ""}

    assert reproduce.main(argv) == 1  # the same command: skips a/seed0, resumes a/seed1, runs b; f fails
    logs = {run: (out / run / "log.txt").read_text() for run in ("a/seed0", "a/seed1", "b/seed0", "f/seed0")}
    assert {run: log.count("\n$ ") + log.startswith("$ ") for run, log in logs.items()} == {"a/seed0": 1, "a/seed1": 2, "b/seed0": 1, "f/seed0": 1}
    assert "Restored all states from the checkpoint" in logs["a/seed1"]
    results = {run: json.loads((out / run / "results_val.json").read_text()) for run in ("a/seed0", "a/seed1", "b/seed0")}
    assert {record["global_step"] for record in results.values()} == {3}  # the resumed run ends where an uninterrupted one does
    expected = defaultdict(list)
    for run, result in results.items():
        for metric, key in (("probe", "val/probe_top1"), ("knn", "val/knn_top1")):
            expected[run.split("/")[0], metric].append(100 * result["metrics"][key])
    rows = csv_rows(out)
    measured = {(row["row_id"], row["metric"]): (float(row["mean"]), row["std"] and float(row["std"]), int(row["n"])) for row in rows if row["row_id"] != "f"}
    assert measured == {key: (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else "", len(values)) for key, values in expected.items()}
    assert {key: len(values) for key, values in expected.items()} == {("a", "probe"): 2, ("a", "knn"): 2, ("b", "probe"): 1, ("b", "knn"): 1}
    failed = [row for row in rows if row["row_id"] == "f"]
    assert [(row["mean"], row["status"]) for row in failed] == [("", f"seed 0: pretrain failed (exit 2, log {out / 'f' / 'seed0' / 'log.txt'})")] * 2
    assert "error: " in logs["f/seed0"]


@pytest.mark.slow  # every table's rows resolved with --print_config
def test_the_dry_run_of_every_table_resolves_each_row_and_prints_its_commands(tmp_path, capsys, monkeypatch):
    """Every row's stages resolve with --print_config before a dry run prints them (`reproduce.unresolved`; each
    config on its own resolves in tests/test_cli.py), and the printed commands are the CLI's."""
    monkeypatch.chdir(ROOT)
    configs = set()
    for path in TABLES:
        assert reproduce.main([str(path), "--dry-run", "--out", str(tmp_path / path.stem)]) == 0
        for line in capsys.readouterr().out.splitlines():
            command = shlex.split(line)
            assert command[0] == sys.executable and Path(command[1]).name in ("main_pretrain.py", "main_linear.py") and command[3] == "--config", line
            configs.add(command[4])
    assert len(configs) > 50
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_collecting_runs_that_logged_nothing_to_wandb_asks_nothing_of_wandb(tmp_path, monkeypatch, capsys):
    """WANDB_MODE=online without credentials is refused where a W&B run would start: here none does."""
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1))
    write_results(tmp_path / "out" / "a" / "seed0", {"val/probe_top1": 0.5, "val/knn_top1": 0.4})
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    assert reproduce.main([str(path), "--out", str(tmp_path / "out"), "--collect"]) == 0
    assert "| 50.00 |" in capsys.readouterr().out


def test_a_label_with_a_vertical_bar_keeps_the_markdown_tables_columns(tmp_path):
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1).replace("label: row a", "label: 'ResNet-18 | 200 ep'"))
    out = tmp_path / "out"
    write_results(out / "a" / "seed0", {"val/probe_top1": 0.5, "val/knn_top1": 0.4})
    assert reproduce.main([str(path), "--out", str(out), "--collect"]) == 0
    (line,) = [line for line in (out / "table.md").read_text().splitlines() if "ResNet-18" in line]
    assert line.startswith("| ResNet-18 \\| 200 ep | ") and line.replace("\\|", "").count("|") == len(reproduce.COLUMNS) + 1


def test_an_interrupted_run_of_other_arguments_is_stale_and_keeps_its_record(tmp_path):
    """Rerun after the table's override was edited, an interrupted run would be resumed with other settings, which the
    CLI refuses: the stage says why instead of failing, and its record of the interruption stays."""
    path = write_table(tmp_path / "t.yaml", a_row("a", seeds=1, overrides="model.init_args.temperature: 0.5"))
    ((stage, *_),) = (run.stages for run in reproduce.plan(list(load_table(path).rows), None, tmp_path / "out", [], []))
    made_with = [argument.replace("temperature=0.5", "temperature=0.2") for argument in sweep.stage_arguments(stage.command)]
    record(stage.directory, exit_code=143, arguments=made_with)
    status = reproduce.stage_status(stage)
    assert str(status).startswith("stale (its interrupted run was made with --model.init_args.temperature=0.2 and without "
                                  "--model.init_args.temperature=0.5: remove ")
    record(stage.directory, exit_code=143, arguments=sweep.stage_arguments(stage.command))
    assert reproduce.stage_status(stage).state == "interrupted"
