"""scripts/slurm: the rendered sbatch job, its submission, and a Trainer built from its srun line under a fake Slurm."""

import os
import re
import shlex
import stat
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from datamodules.imagenet import IMAGENET100_WNIDS
from engine.cli import ContrastlabCLI
from methods import MethodBase
from scripts.slurm import job, submit

ROOT = Path(__file__).parents[1]
SCE_IMAGENET100 = "configs/sce_imagenet100.yaml"


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch):
    """Submitted from the project root, where the job runs too (its config path is relative to it)."""
    monkeypatch.chdir(ROOT)


def render(*argv: str) -> list[tuple[Path, str]]:
    return submit.render_jobs(submit.parse_args(["--config", SCE_IMAGENET100, *argv]))


def sbatch_lines(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def srun_arguments(text: str) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith("srun ")]
    return shlex.split(line)[1:]


def test_a_two_node_job_has_every_sbatch_line_and_the_matching_trainer_settings(tmp_path):
    ((directory, text),) = render("--nodes=2", "--gpus-per-node=4", "--time=48:00:00", f"--run-dir={tmp_path / 'run'}",
                                  "--partition=gpu", "--sbatch-option=--account=lab", "--sbatch-option=--qos=high")
    run_dir = str(tmp_path / "run")
    assert directory == tmp_path / "run"
    assert sbatch_lines(text) == [
        "--job-name=run", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=9",  # 8 loader workers + 1
        "--time=48:00:00", "--signal=SIGUSR1@90", "--requeue", "--open-mode=append", f"--chdir={ROOT}",
        f"--output={run_dir}/slurm.out", f"--error={run_dir}/slurm.err", "--partition=gpu", "--account=lab", "--qos=high",
    ]
    assert srun_arguments(text) == ["python", "main_pretrain.py", "fit", "--config", SCE_IMAGENET100, "--trainer.num_nodes=2",
                                    "--trainer.devices=4", f"--trainer.default_root_dir={run_dir}"]
    assert text.startswith("#!/bin/bash\n")


def test_the_run_directory_and_gpus_default_to_the_configs_and_contain_no_job_id():
    ((directory, text),) = render()
    assert directory == ROOT / "runs/sce_imagenet100"
    lines = sbatch_lines(text)
    assert "--output=runs/sce_imagenet100/slurm.out" in lines and "--ntasks-per-node=8" in lines and "--nodes=1" in lines
    assert "--trainer.default_root_dir=runs/sce_imagenet100" in srun_arguments(text)
    assert "%j" not in text and "%A" not in text


def test_overrides_are_shell_quoted_and_reach_the_trainer_unchanged(tmp_path):
    overrides = ["--model.init_args.temperature=0.2", "--trainer.logger={class_path: CSVLogger, init_args: {name: it's $HOME; rm}}"]
    ((_, text),) = render(f"--run-dir={tmp_path}", "--", *overrides)
    arguments = srun_arguments(text)
    assert arguments[5:7] == overrides  # after `python main_pretrain.py fit --config X`, before the job's own settings
    assert "$HOME; rm}}'" in text  # single-quoted: bash neither expands nor splits it


def test_a_grid_gives_one_job_per_point_each_in_its_own_run_directory(tmp_path):
    jobs = render(f"--run-dir={tmp_path}", "--grid=model.init_args.temperature=0.1,0.2", "--grid=model.init_args.coeff=0.4,0.5")
    assert [directory.name for directory, _ in jobs] == ["temperature0.1_coeff0.4", "temperature0.1_coeff0.5",
                                                         "temperature0.2_coeff0.4", "temperature0.2_coeff0.5"]
    directory, text = jobs[1]
    arguments = srun_arguments(text)
    assert "--model.init_args.temperature=0.1" in arguments and "--model.init_args.coeff=0.5" in arguments
    assert arguments[-1] == f"--trainer.default_root_dir={directory}"
    assert f"--output={directory}/slurm.out" in sbatch_lines(text)
    assert len({sbatch_lines(text)[0] for _, text in jobs}) == 4  # distinct job names


def fake_sbatch(folder: Path) -> Path:
    """An `sbatch --parsable` that records the files it is given and numbers their jobs from 42."""
    folder.mkdir()
    executable = folder / "sbatch"
    record = folder / "submitted"
    executable.write_text(f'#!/bin/sh\nfor last; do :; done\necho "$last" >> {record}\necho "$((41 + $(wc -l < {record})));cluster"\n')
    executable.chmod(executable.stat().st_mode | stat.S_IEXEC)
    return record


def test_submission_calls_sbatch_on_each_written_job_file_and_prints_its_job_id(tmp_path, monkeypatch, capsys):
    record = fake_sbatch(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert submit.main(["--config", SCE_IMAGENET100, f"--run-dir={tmp_path / 'run'}", "--grid=model.init_args.temperature=0.1,0.2"]) == 0
    scripts = [tmp_path / "run" / point / "job.sbatch" for point in ("temperature0.1", "temperature0.2")]
    assert record.read_text().splitlines() == [str(script) for script in scripts]
    rendered = render(f"--run-dir={tmp_path / 'run'}", "--grid=model.init_args.temperature=0.1,0.2")
    assert [script.read_text() for script in scripts] == [text for _, text in rendered]
    assert capsys.readouterr().out.splitlines() == [f"submitted job 42: {scripts[0]}", f"submitted job 43: {scripts[1]}"]


def test_a_refused_submission_is_one_error_with_sbatchs_message(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text('#!/bin/sh\necho "sbatch: error: invalid partition specified: gpu" >&2\nexit 1\n')
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(SystemExit, match=r"error: sbatch .*job.sbatch failed: sbatch: error: invalid partition specified: gpu$"):
        submit.main(["--config", SCE_IMAGENET100, f"--run-dir={tmp_path / 'run'}"])


def test_a_job_after_another_waits_for_its_success_and_a_stage_picks_the_entry_point(tmp_path):
    ((_, text),) = render(f"--run-dir={tmp_path / 'run' / 'linear'}", "--after=1234", "--stage=test", "--job-name=t-row-s0-test")
    lines = sbatch_lines(text)
    assert lines[0] == "--job-name=t-row-s0-test" and lines[-2:] == ["--dependency=afterok:1234", "--kill-on-invalid-dep=yes"]
    assert srun_arguments(text)[:5] == ["python", "main_pretrain.py", "test", "--config", SCE_IMAGENET100]
    ((_, text),) = submit.render_jobs(submit.parse_args(["--config", "configs/linear_cifar10.yaml", f"--run-dir={tmp_path}", "--stage=linear"]))
    assert srun_arguments(text)[:3] == ["python", "main_linear.py", "fit"]
    assert not any(line.startswith("--dependency") for line in sbatch_lines(text))
    with pytest.raises(SystemExit, match=r"error: --after 'abc' is not a Slurm job id"):
        submit.main(["--config", SCE_IMAGENET100, f"--run-dir={tmp_path / 'other'}", "--after=abc", "--dry-run"])
    assert not (tmp_path / "other").exists()


def test_paths_and_names_with_spaces_are_quoted_as_sbatch_reads_its_lines(tmp_path):
    run_dir = tmp_path / "my runs" / "sce #1"
    ((_, text),) = render(f"--run-dir={run_dir}", '--job-name=a "b"')
    lines = sbatch_lines(text)
    assert f'--output="{run_dir}/slurm.out"' in lines and f'--error="{run_dir}/slurm.err"' in lines
    assert '--job-name="a \\"b\\""' in lines  # sbatch reads \" inside quotes as a quote
    assert srun_arguments(text)[-1] == f"--trainer.default_root_dir={run_dir}"  # shell-quoted on the srun line
    assert job.sbatch_value("runs/plain/slurm.out") == "runs/plain/slurm.out"  # nothing to quote: unchanged


def test_without_sbatch_on_path_submission_is_one_error_naming_it_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="error: sbatch is not on PATH"):
        submit.main(["--config", SCE_IMAGENET100, f"--run-dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    assert submit.main(["--config", SCE_IMAGENET100, f"--run-dir={tmp_path / 'run'}", "--dry-run"]) == 0
    assert (tmp_path / "run" / "job.sbatch").is_file()


@pytest.mark.parametrize(
    "arguments, expected",
    [
        (["--config", "configs/no_such.yaml"], "--config 'configs/no_such.yaml' is not an existing file"),
        (["--config", SCE_IMAGENET100, "--gpus-per-node=0"], "--gpus-per-node must be at least 1, got 0"),
        (["--config", SCE_IMAGENET100, "--grid=model.init_args.temperature"], "must look like key=value1,value2"),
        (["--config", SCE_IMAGENET100, "--", "--trainer.devices=2"], "override '--trainer.devices=2': set it with --gpus-per-node"),
        (["--config", SCE_IMAGENET100, "--", "--trainer.num_nodes", "3"], "override '--trainer.num_nodes': set it with --nodes"),
        (["--config", SCE_IMAGENET100, "--", "--trainer.default_root_dir=/elsewhere"], "set it with --run-dir (submit.py) or --out (sweep.py)"),
        (["--config", SCE_IMAGENET100, "--time=banana"], "--time 'banana' is not a Slurm time"),
        (["--config", SCE_IMAGENET100, "--time=1:00:00 --mem=1"], "--time '1:00:00 --mem=1' is not a Slurm time"),
        (["--config", SCE_IMAGENET100, "--sbatch-option=--nodes=4"], "--sbatch-option '--nodes=4': the job file sets --nodes itself"),
        (["--config", SCE_IMAGENET100, "--sbatch-option=-t 10"], "--sbatch-option '-t 10': the job file sets -t itself"),
        (["--config", SCE_IMAGENET100, "--sbatch-option=-t10"], "--sbatch-option '-t10': the job file sets -t itself"),
        (["--config", SCE_IMAGENET100, "--sbatch-option=--no-requeue"], "the job file sets --no-requeue itself"),
        (["--config", SCE_IMAGENET100, "--sbatch-option=--gres=gpu:8"], "the job file sets --gres itself"),
        (["--config", SCE_IMAGENET100, "--sbatch-option="], "--sbatch-option '' is not an sbatch option"),
        (["--config", SCE_IMAGENET100, "--", "--data.init_args.num_workers=many"], "data.init_args.num_workers 'many' is not a number of workers"),
        # resolved by the CLI as sweep.py and reproduce.py do: a job was submitted, to fail once it started
        (["--config", SCE_IMAGENET100, "--", "--model.init_args.temprature=0.1"], "base, main_pretrain.py: Option 'model.init_args.temprature' is not accepted"),
        (["--config", SCE_IMAGENET100, "--grid=model.init_args.temprature=0.1"], "temprature0.1, main_pretrain.py: "),
    ],
)
def test_bad_input_is_one_error_naming_the_value_before_anything_is_written(arguments, expected, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        submit.main([*arguments[:2], f"--run-dir={tmp_path / 'run'}", "--dry-run", *arguments[2:]])
    assert str(exit_info.value).startswith("error: ") and expected in str(exit_info.value)
    assert not (tmp_path / "run").exists()


def test_a_relative_config_is_the_file_meant_from_the_working_directory_though_the_job_starts_in_the_project(tmp_path, monkeypatch):
    own = tmp_path / "configs" / "sce_imagenet100.yaml"
    own.parent.mkdir()
    own.write_text((job.ROOT / SCE_IMAGENET100).read_text())
    monkeypatch.chdir(tmp_path)
    args = submit.parse_args(["--config", "configs/sce_imagenet100.yaml"])
    assert args.config == str(own) and f"--config {own}" in submit.render_jobs(args)[0][1]


@pytest.mark.parametrize("text, expected", [("trainer: [1,\n", "is not valid YAML"), ("- 1\n", "is not a config (a YAML mapping")])
def test_a_config_that_is_no_yaml_mapping_is_one_error_naming_it(text, expected, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=rf"--config '{config}' {re.escape(expected)}"):
        submit.render_jobs(submit.parse_args(["--config", str(config)]))


def test_a_config_without_a_number_of_devices_or_a_run_directory_needs_them_on_the_command_line(tmp_path):
    config = tmp_path / "auto.yaml"
    config.write_text("trainer: {devices: auto}\n")
    with pytest.raises(ValueError, match=r"auto.yaml: trainer.devices 'auto' is not a number of GPUs: give --gpus-per-node"):
        submit.render_jobs(submit.parse_args(["--config", str(config)]))
    with pytest.raises(ValueError, match=r"auto.yaml sets no trainer.default_root_dir: give --run-dir"):
        submit.render_jobs(submit.parse_args(["--config", str(config), "--gpus-per-node=2"]))


# ------------------------------------------------------------ the job's srun line under a fake Slurm
def srun_environment(rank: int) -> dict[str, str]:
    """What srun sets for task `rank` of a 2-node x 4-task job (sbatch --nodes=2 --ntasks-per-node=4)."""
    return {
        "SLURM_JOB_ID": "1234567", "SLURM_JOB_NAME": "sce_imagenet100", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODELIST": "gpu[017-018]", "SLURM_JOB_NODELIST": "gpu[017-018]", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8",
        "SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 4), "SLURM_NODEID": str(rank // 4),
    }


@pytest.fixture
def imagenet100_folders(tmp_path) -> Path:
    """Empty class folders: enough for the DataModule to be built (nothing is loaded)."""
    for wnid in IMAGENET100_WNIDS:
        for split in ("train", "val"):
            (tmp_path / "imagenet" / split / wnid).mkdir(parents=True)
    return tmp_path / "imagenet"


@contextmanager
def slurm_task(rank: int):
    """The environment of task `rank`, restored afterwards (with the MASTER_ADDR / MASTER_PORT that Lightning writes),
    and the process's rank for Lightning's rank-zero-only output, which a DDP trainer sets to its global rank: left
    at 6, it would silence the rank-zero logging, warnings and loggers of every later test in this process."""
    rank_zero = rank_zero_only.rank
    try:
        with mock.patch.dict(os.environ, srun_environment(rank)):
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(name, None)
            yield
    finally:
        rank_zero_only.rank = rank_zero


@pytest.mark.parametrize("rank", [0, 6])
@pytest.mark.slow
def test_the_trainer_built_from_the_srun_line_takes_its_ranks_from_slurm(rank, tmp_path, imagenet100_folders):
    ((_, text),) = render("--nodes=2", "--gpus-per-node=4", f"--run-dir={tmp_path / 'run'}")
    command = srun_arguments(text)
    assert command[:3] == ["python", "main_pretrain.py", "fit"]
    on_this_machine = ["--trainer.accelerator=cpu", f"--data.init_args.root={imagenet100_folders}"]  # 4 "devices" = 4 CPU processes
    ranks = (8, rank, rank // 4, rank % 4)  # world size, global rank, node rank, local rank
    with slurm_task(rank):
        trainer = ContrastlabCLI(MethodBase, args=[*command[3:], *on_this_machine], run=False).trainer  # main_pretrain.py's, not run
        environment = trainer._accelerator_connector.cluster_environment
        assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        assert (environment.main_address, environment.main_port) == ("gpu017", 15000 + 4567)  # first node; port from the job id
        assert (environment.world_size(), environment.global_rank(), environment.node_rank(), environment.local_rank()) == ranks
        assert (trainer.world_size, trainer.global_rank, trainer.node_rank, trainer.local_rank) == ranks
        environment.validate_settings(num_devices=trainer.num_devices, num_nodes=trainer.num_nodes)  # what `fit` checks first
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.strategy.cluster_environment is environment
    assert (trainer.num_nodes, trainer.num_devices) == (2, 4)
    assert trainer.default_root_dir == str(tmp_path / "run")  # where Lightning looks for hpc_ckpt_*.ckpt after a requeue


def test_without_the_jobs_trainer_settings_lightning_refuses_the_config_under_slurm(imagenet100_folders):
    """Why the job sets trainer.devices itself: the config's 8 devices do not match 4 tasks per node."""
    arguments = ["--config", SCE_IMAGENET100, "--trainer.accelerator=cpu", "--trainer.num_nodes=2",
                 f"--data.init_args.root={imagenet100_folders}"]
    with slurm_task(rank=0):
        trainer = ContrastlabCLI(MethodBase, args=arguments, run=False).trainer
        environment = trainer._accelerator_connector.cluster_environment
        with pytest.raises(ValueError, match=r"`devices=8` .* `--ntasks-per-node=4` does not match"):
            environment.validate_settings(num_devices=trainer.num_devices, num_nodes=trainer.num_nodes)



def test_the_job_file_quotes_the_partition_escapes_percent_in_log_paths_and_counts_the_overridden_workers(tmp_path):
    ((_, text),) = render(f"--run-dir={tmp_path / '100%j data'}", "--partition=gpu a100", "--time=2-12:00:00", "--sbatch-option=--account=lab",
                          "--", "--data.num_workers=7")
    lines = sbatch_lines(text)
    assert '--partition="gpu a100"' in lines and "--time=2-12:00:00" in lines and "--cpus-per-task=8" in lines and "--account=lab" in lines
    for time in ("unlimited", "30", "-1"):
        assert f"--time={time}" in sbatch_lines(render(f"--run-dir={tmp_path / 'run'}", f"--time={time}")[0][1])
    assert f'--output="{tmp_path}/100%%j data/slurm.out"' in lines  # Slurm would read %j as the job id
