"""A bad argument to a script (scripts/, `python -m analysis`, `python -m interop.export`, benchmarks/) is one `error:`
line that names it, with exit status 2, as the training CLI reports a bad value (`engine.arguments`), not argparse's
usage block followed by its error line."""

import re
from pathlib import Path

import pytest

from analysis import __main__ as analysis_main
from benchmarks import startup
from engine.arguments import ScriptArgumentParser
from interop import export
from scripts import compare, reproduce, sweep
from scripts.slurm import submit

ROOT = Path(__file__).resolve().parents[1]
# peer_workloads.py runs inside lightly's and stable-pretraining's venvs, which do not install contrastlab's packages
OWN_ENVIRONMENT_ONLY = {ROOT / "benchmarks" / "peer_workloads.py"}


@pytest.mark.parametrize(
    "main, arguments, message",
    [
        (sweep.main, ["--config", "configs/moco_digits.yaml"], "the following arguments are required: --out"),
        (reproduce.main, ["tables/sce_table2.yaml", "--launcher", "cluster"], "argument --launcher: invalid choice: 'cluster'"),
        (submit.main, ["--config", "configs/moco_digits.yaml", "--stage", "probe"], "argument --stage: invalid choice: 'probe'"),
        (compare.main, ["--out", "comparison"], "the following arguments are required: paths"),
        (export.main, ["run.ckpt", "--format", "onnx"], "argument --format: invalid choice: 'onnx'"),
        (analysis_main.main, ["embedding-map", "run.ckpt", "--config", "configs/moco_digits.yaml", "--max-samples", "0"],
         "argument --max-samples: invalid positive_int value: '0'"),
        (startup.main, ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ],
    ids=["sweep", "reproduce", "submit", "compare", "export", "analysis", "benchmark"],
)
def test_a_bad_argument_is_one_error_line_naming_it(main, arguments, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("error: ") and message in captured.err, captured.err
    assert not (ROOT / "comparison").exists()


def test_the_error_line_says_where_the_usage_is(capsys):
    parser = ScriptArgumentParser(prog="sweep.py")
    parser.add_argument("--seeds", type=int)
    with pytest.raises(SystemExit):
        parser.parse_args(["--seeds", "two"])
    assert capsys.readouterr().err == "error: sweep.py: argument --seeds: invalid int value: 'two' (`sweep.py --help` lists the arguments)\n"


def test_every_script_parses_its_arguments_with_the_one_line_parser():
    plain = [path.relative_to(ROOT) for path in sorted(ROOT.glob("[!.]*/**/*.py")) if not path.is_relative_to(ROOT / "tests")
             and path not in OWN_ENVIRONMENT_ONLY and re.search(r"argparse\.ArgumentParser\(", path.read_text())]
    assert plain == []
