"""Submit runs to Slurm, each as one multi-node job of Lightning DDP.

    uv run python scripts/slurm/submit.py --config configs/sce_imagenet100.yaml --nodes 2 --gpus-per-node 4 \\
        [--time 48:00:00] [--partition gpu] [--sbatch-option=--account=lab ...] [--run-dir DIR] \\
        [--grid model.init_args.temperature=0.1,0.2 ...] [--stage pretrain|linear|test] [--after JOB_ID] \\
        [--job-name NAME] [--dry-run] [-- --model.init_args.coeff=0.4 ...]

It fills `scripts/slurm/template.sbatch` from the config and the command line, writes it as
`RUN_DIR/job.sbatch` and calls `sbatch` on it (with `--dry-run` it only writes). The job runs
`srun python main_pretrain.py fit --config CONFIG [grid values] [overrides] --trainer.num_nodes=N
--trainer.devices=G --trainer.default_root_dir=RUN_DIR`: one task per GPU, and trainer.devices equal to
--ntasks-per-node because both come from --gpus-per-node (Lightning refuses a mismatch). Arguments after
`--` are overrides of every run, applied left to right as in main_pretrain.py. `--stage linear` runs
`main_linear.py fit` instead (CONFIG a linear-stage config, the checkpoint an override), `--stage test`
runs `main_pretrain.py test`. `--after JOB_ID` starts the job only once that job has ended successfully
(`--dependency=afterok`; if it fails, Slurm cancels this one: `--kill-on-invalid-dep=yes`). Each submitted
job is printed as `submitted job <id>: <job file>`. Before any job file is written, every grid point's command is
resolved by the CLI (`--print_config`): a misspelt key or a value of the wrong type is one error line.

RUN_DIR (`--run-dir`, else the config's trainer.default_root_dir) holds the job file, the Slurm logs
`slurm.out` / `slurm.err` (appended to across requeues) and the run itself. It contains no job id, so
the job that Lightning requeues on SIGUSR1 (90 s before the time limit) finds its
`hpc_ckpt_<n>.ckpt` there and resumes from the newest of it and `checkpoints/last.ckpt`.

`--grid key=v1,v2` (repeatable, a product grid as in scripts/sweep.py) submits one job per grid point,
each in `RUN_DIR/<point>/` (e.g. `runs/sce_imagenet100/temperature0.1/`): separate jobs rather than
an array, so that each point is requeued, resumed and cancelled on its own. For seeds and the table over
them, use `scripts/sweep.py --slurm`, which renders the same template as a job array; for a paper's table,
`scripts/reproduce.py --launcher slurm`, which submits each run's evaluation after its pretraining.
"""

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `scripts` importable
from engine.arguments import ScriptArgumentParser  # noqa: E402
from engine.config import split_overrides  # noqa: E402
from scripts import sweep  # noqa: E402
from scripts.slurm import job  # noqa: E402

STAGES = {"pretrain": ("main_pretrain.py", "fit"), "linear": ("main_linear.py", "fit"), "test": ("main_pretrain.py", "test")}


def render_jobs(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """One (run directory, job file) per grid point; every input is checked before anything is written."""
    config = job.read_config(args.config)
    resources = job.Resources.from_args(args, config, args.overrides)
    if args.run_dir is not None:
        run_dir = args.run_dir.resolve()
    elif (config.get("trainer") or {}).get("default_root_dir"):
        run_dir = job.ROOT / config["trainer"]["default_root_dir"]  # where main_pretrain.py, run from the root, puts it
    else:
        raise ValueError(f"{args.config} sets no trainer.default_root_dir: give --run-dir")
    grid = sweep.parse_grid(args.grid)
    overrides = resources.trainer_arguments(args.overrides)
    dependency = ("--dependency=afterok:" + args.after, "--kill-on-invalid-dep=yes") if args.after else ()
    jobs = []
    for point in sweep.grid_points(grid):
        directory = run_dir / sweep.point_label(point) if grid else run_dir
        command = ["python", *STAGES[args.stage], "--config", job.from_root(Path(args.config)),
                   *sweep.point_overrides(point), *overrides, f"--trainer.default_root_dir={job.from_root(directory)}"]
        name = args.job_name or (f"{run_dir.name}_{directory.name}" if grid else run_dir.name)
        jobs.append((directory, resources.render(name, job.log_path(job.from_root(directory / "slurm")), shlex.join(command), dependency)))
    return jobs


def unresolved(args: argparse.Namespace) -> str | None:
    """The first grid point whose command the CLI does not resolve (a misspelt key, a value of the wrong type), with
    the CLI's error line, before a job file is written: as sweep.py and reproduce.py check theirs. A `--ckpt_path`
    (a checkpoint an earlier job is still to write) is left out of the check."""
    entry, subcommand = STAGES[args.stage]
    overrides, skip = [], False
    for argument in args.overrides:
        if not skip and not argument.startswith("--ckpt_path"):
            overrides.append(argument)
        skip = argument == "--ckpt_path"
    for point in sweep.grid_points(sweep.parse_grid(args.grid)):
        arguments = [subcommand, "--config", str(Path(args.config).resolve()), *sweep.point_overrides(point), *overrides]
        if (problem := sweep.resolution_problem(entry, arguments)) is not None:
            return f"{sweep.point_label(point)}, {entry}: {problem}"
    return None


def write_and_submit(jobs: list[tuple[Path, str]], dry_run: bool) -> list[tuple[Path, str | None]]:
    """Write each job file into its run directory and, unless `dry_run`, submit it: (job file, job id or None)."""
    executable = None if dry_run else job.sbatch_executable()
    submitted = []
    for directory, text in jobs:
        directory.mkdir(parents=True, exist_ok=True)  # Slurm opens the log files in it before the run starts
        script = directory / "job.sbatch"
        script.write_text(text)
        job_id = None if executable is None else job.submit(executable, script)
        print(f"wrote {script}" if job_id is None else f"submitted job {job_id}: {script}", flush=True)
        submitted.append((script, job_id))
    return submitted


def parse_args(argv: list[str]) -> argparse.Namespace:
    own, overrides = split_overrides(argv)
    parser = ScriptArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the pretraining config")
    parser.add_argument("--run-dir", type=Path, help="the run directory (default: the config's trainer.default_root_dir)")
    parser.add_argument("--grid", action="append", default=[], help="key=v1,v2,... one job per point (repeat for a product grid)")
    parser.add_argument("--stage", choices=STAGES, default="pretrain",
                        help="pretrain: main_pretrain.py fit; linear: main_linear.py fit; test: main_pretrain.py test")
    parser.add_argument("--after", help="a job id: start only after that job ended successfully (afterok)")
    parser.add_argument("--job-name", help="the Slurm job name (default: the run directory's name)")
    parser.add_argument("--dry-run", action="store_true", help="only write the job files")
    job.add_resource_arguments(parser)
    args = parser.parse_args(own)
    args.overrides = overrides
    args.config = job.from_root(Path(args.config))  # the job starts in the project: the file meant from here
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        if args.after is not None and not args.after.isdigit():
            raise ValueError(f"--after {args.after!r} is not a Slurm job id")
        jobs = render_jobs(args)
        if (problem := unresolved(args)) is not None:
            raise ValueError(problem)
        write_and_submit(jobs, args.dry_run)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
