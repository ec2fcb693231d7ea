"""Every shell command in README.md and docs/*.md runs as printed (issue 22 item 6, issue 23), checked without training;
so does every command in the header comment of a config or a table (`header_commands`).

Which text is a command:
- the lines of fenced blocks tagged ```bash, ```sh, ```shell or ```console (in ```console only the lines after a
  `$ ` prompt); a line ending in `\\` continues on the next one. Blocks tagged otherwise (```text, ```python,
  ```yaml, untagged output) are not commands; a command meant for another project's checkout (detectron2's
  train_net.py) is shown as ```text;
- outside the blocks, an inline code span that starts with `uv run ` is a command too (a synopsis such as
  `benchmarks/throughput.py --config ... [--profile DIR]` is not);
- a command holding a placeholder `<...>` outside its `#` comment (e.g. `configs/<method>_digits.yaml`,
  `<run>/last.ckpt`) is not run: it is a pattern, not a command (the test reports how many it skipped);
- the blocks of one file are read by bash as one script, in order, as a reader would type them: variables, loops
  and quoting are bash's own. Bash runs with an empty PATH, so that no program starts: each program call is
  recorded (with its argument list and line) instead, in a scratch directory.

What is checked for each recorded call:
- `uv run [--locked] python main_pretrain.py|main_linear.py ARGS`: `cli_main([*ARGS, "--print_config"])` in this
  process exits with 0, i.e. the config and every override parse and resolve (nothing is trained);
- `uv run [--locked] python SCRIPT ARGS` and `uv run [--locked] python -m MODULE ARGS`: run in this process with
  `--help` (put before a `--` separator) it exits with 0, and run with ARGS its argparse parser accepts them (the
  run stops right after parsing); when the parsed arguments name a `--config`, that config with every point of
  its `--grid` and the overrides after `--` resolves through `main_pretrain.py --print_config`, and a
  `--linear` config with its `--linear-override`s through `main_linear.py --print_config`;
- `uv run [--locked] pytest ARGS`: the test files it names exist and its `-m` markers are registered;
- `srun [OPTIONS] python ...` (a Slurm job file's task): as `uv run python ...`;
- every call, `uv run` or not (`pip`, `sbatch`, `srun`, `wandb`, ...): every argument naming a path inside the
  repository (its first component is a top-level entry of the checkout, `runs/` excepted) exists.
A failure names the file, the line and the command.
"""

import argparse
import contextlib
import io
import itertools
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
PLACEHOLDER = re.compile(r"<[^<>\n]+>")
UNCHECKED_TOP_LEVEL = {"runs"}  # where runs write their output: not part of a checkout


@dataclass(frozen=True)
class Command:
    file: Path
    line: int  # 1-based, of its first line
    last_line: int
    text: str  # continuations joined
    inline: bool = False  # a code span in the prose

    def where(self) -> str:
        return f"{shown(self.file)}:{self.line}: {self.text}"


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def shell_commands(path: Path) -> tuple[list[Command], list[Command]]:
    """The commands of a markdown file's shell blocks and, separately, those with placeholders."""
    commands, placeholders = [], []
    fence, pending = None, None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence not in SHELL_FENCES:
            continue
        if pending is None:
            if fence == "console":
                if not stripped.startswith("$ "):
                    continue
                line = stripped[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pending = (number, [line])
        else:
            pending[1].append(line)
        if not line.rstrip().endswith("\\"):
            start, parts = pending
            text = " ".join(part.rstrip().removesuffix("\\").strip() for part in parts)
            command = Command(path, start, number, text)
            (placeholders if has_placeholder(text) else commands).append(command)
            pending = None
    prose = re.sub(r"```.*?```", lambda block: re.sub(r"[^\n]", " ", block.group()), path.read_text(), flags=re.S)
    for span in re.finditer(r"`(uv run [^`]+)`", prose):
        line = prose.count("\n", 0, span.start()) + 1
        command = Command(path, line, line, " ".join(span.group(1).split()), inline=True)
        (placeholders if has_placeholder(command.text) else commands).append(command)
    return commands, placeholders


def has_placeholder(text: str) -> bool:
    try:
        words = shlex.split(text, comments=True)  # a `#` comment may say `<name>`
    except ValueError:
        words = [text]
    return any(PLACEHOLDER.search(word) for word in words)


def bash_script(path: Path, commands: list[Command]) -> str:
    """The file's commands at their own line numbers (all other lines empty), after a line 1 that records every
    program call instead of starting it (line 1 of a markdown file is never inside a block)."""
    source = path.read_text().splitlines()
    lines = [""] * len(source)
    for command in commands:
        if command.inline:
            assert not lines[command.line - 1], f"{shown(path)}:{command.line}: one command per line"
            lines[command.line - 1] = command.text
            continue
        for number in range(command.line, command.last_line + 1):
            lines[number - 1] = source[number - 1]
        lines[command.line - 1] = re.sub(r"^\s*\$ ", "", lines[command.line - 1])  # a console prompt
    lines[0] = 'command_not_found_handle() { printf "%s\\0" "${BASH_LINENO[0]}" "$#" "$@" >> "$RECORD"; return 0; }'
    return "\n".join(lines) + "\n"


def recorded_calls(path: Path, commands: list[Command], scratch: Path) -> list[tuple[Command, list[str]]]:
    """Every program call the commands make, as bash would make it, with the command it belongs to."""
    script, record = scratch / "commands.sh", scratch / "calls"
    script.write_text(bash_script(path, commands))
    record.write_bytes(b"")
    result = subprocess.run(["/bin/bash", "--noprofile", "--norc", str(script)], cwd=scratch, capture_output=True,
                            text=True, env={"PATH": str(scratch / "no-programs"), "RECORD": str(record), "HOME": str(scratch)})
    assert result.returncode == 0 and not result.stderr, f"{shown(path)}: bash cannot read its commands: {result.stderr}"
    fields = record.read_bytes().decode().split("\0")[:-1]
    by_line = {command.line: command for command in commands}
    calls = []
    while fields:
        line, count = int(fields[0]), int(fields[1])
        argv, fields = fields[2 : 2 + count], fields[2 + count :]
        calls.append((by_line[line], argv))
    return calls


class _Parsed(Exception):
    """Raised instead of returning from argparse: the script stops right after parsing its arguments."""

    def __init__(self, namespace):
        self.namespace = namespace


def _run_quietly(function) -> tuple[object, str]:
    """(exit code or the _Parsed exception or 'returned', the output) of function()."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            function()
            outcome = "returned"
        except SystemExit as exit_:
            outcome = 0 if exit_.code is None else exit_.code
        except _Parsed as parsed:
            outcome = parsed
    return outcome, output.getvalue()


_RESOLVED: dict[tuple[str, ...], str | None] = {}  # 91 resolutions of the documents, 70 of them different


def print_config(main_module, args: list[str]) -> str | None:
    """None if the CLI resolves args with --print_config, else what it said (once per module and arguments)."""
    key = (main_module.__name__, *args)
    if key not in _RESOLVED:
        outcome, output = _run_quietly(lambda: main_module.cli_main([*args, "--print_config"]))
        _RESOLVED[key] = None if outcome == 0 else f"exit {outcome}: {output.strip()[-600:]}"
    return _RESOLVED[key]


def run_python(target: list[str], args: list[str], monkeypatch) -> tuple[object, str]:
    """Run `python SCRIPT ARGS` or `python -m MODULE ARGS` in this process, its argparse parsers stopping after
    parsing."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [target[-1], *args])
        if target[0] == "-m":
            return _run_quietly(lambda: runpy.run_module(target[1], run_name="__main__", alter_sys=True))
        return _run_quietly(lambda: runpy.run_path(str(ROOT / target[0]), run_name="__main__"))


def with_help(args: list[str]) -> list[str]:
    return [*args[: args.index("--")], "--help", *args[args.index("--") :]] if "--" in args else [*args, "--help"]


def grid_points(grid: list[str]) -> list[list[str]]:
    """The overrides of every point of a sweep's `--grid key=v1,v2 ...` (their product)."""
    axes = [[f"--{key}={value}" for value in values.split(",")] for key, values in (item.split("=", 1) for item in grid)]
    return [list(point) for point in itertools.product(*axes)]


def check_python(argv: list[str], monkeypatch) -> list[str]:
    """Problems of a `python ...` call made through uv run."""
    import main_linear  # here, not at the top: `pytest -m "not slow"` need not import Lightning for this file
    import main_pretrain

    if argv[0] == "-m":
        target, args = argv[:2], argv[2:]
    else:
        target, args = argv[:1], argv[1:]
    if target == ["main_pretrain.py"] or target == ["main_linear.py"]:
        problem = print_config(main_pretrain if target == ["main_pretrain.py"] else main_linear, args)
        return [] if problem is None else [f"--print_config: {problem}"]
    if target[0] != "-m" and not (ROOT / target[0]).is_file():
        return [f"{target[0]} does not exist"]
    problems = []
    outcome, output = run_python(target, with_help(args), monkeypatch)
    if outcome != 0:
        problems.append(f"--help gives {outcome!r}: {output.strip()[-400:]}")
    if {"-h", "--help"} & set(args[: args.index("--")] if "--" in args else args):
        return problems  # the documented command is the help
    outcome, output = run_python(target, args, monkeypatch)
    if not isinstance(outcome, _Parsed):
        return [*problems, f"its arguments are not accepted ({outcome!r}): {output.strip()[-400:]}"]
    options = vars(outcome.namespace)
    overrides = args[args.index("--") + 1 :] if "--" in args else []
    if isinstance(options.get("config"), str) and options["config"].endswith(".yaml"):
        for point in grid_points(options.get("grid") or []):
            pretraining = ["fit", "--config", options["config"], *point, *overrides]
            if (problem := print_config(main_pretrain, pretraining)) is not None:
                problems.append(f"its pretraining runs do not resolve ({shlex.join(pretraining)}): {problem}")
    if isinstance(options.get("linear"), str):
        linear = ["fit", "--config", options["linear"], *(options.get("linear_override") or [])]
        if (problem := print_config(main_linear, linear)) is not None:
            problems.append(f"its linear runs do not resolve ({shlex.join(linear)}): {problem}")
    return problems


def registered_markers() -> set[str]:
    """The marker names of pyproject.toml's `markers = ["name: what", ...]` (tomllib is not in Python 3.10)."""
    listed = re.search(r"^markers\s*=\s*\[(.*?)\]", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S)
    return set(re.findall(r"[\"']\s*(\w+)\s*:", listed.group(1))) if listed else set()


def check_pytest(args: list[str]) -> list[str]:
    problems = []
    for index, arg in enumerate(args):
        if arg == "-m":
            unknown = set(re.findall(r"\w+", args[index + 1])) - {"not", "and", "or"} - registered_markers()
            problems += [f"pytest marker {name!r} is not registered in pyproject.toml" for name in sorted(unknown)]
        elif not arg.startswith("-") and (index == 0 or args[index - 1] not in ("-m", "-k")):
            if not (ROOT / arg.split("::")[0]).exists():
                problems.append(f"{arg} does not exist")
    return problems


def missing_paths(argv: list[str]) -> list[str]:
    """Arguments (or the value after `=`) naming a path of the checkout that does not exist."""
    top_level = {entry.name for entry in ROOT.iterdir() if not entry.name.startswith(".")} - UNCHECKED_TOP_LEVEL
    problems = []
    for arg in argv[1:]:
        for candidate in {arg, arg.split("=", 1)[-1]}:
            if "/" in candidate and candidate.split("/")[0] in top_level and not (ROOT / candidate).exists():
                problems.append(f"{candidate} does not exist")
    return problems


def check_call(argv: list[str], monkeypatch) -> list[str]:
    problems = missing_paths(argv)
    if argv[0] == "srun":  # a Slurm job's task (a job file's last line): srun's options, then the task's command
        task = argv[1:]
        while task and task[0].startswith("-"):
            task = task[1:]
        return [*problems, *check_python(task[1:], monkeypatch)] if task[:1] == ["python"] else problems
    if argv[0] != "uv":
        return problems
    if argv[1] != "run":
        return [*problems, "uv's only subcommand here is `run`"]
    rest = argv[2:]
    while rest and rest[0].startswith("--"):
        rest = rest[1:]
    if not rest:
        return [*problems, "nothing to run"]
    if rest[0] == "python":
        return [*problems, *check_python(rest[1:], monkeypatch)]
    if rest[0] == "pytest":
        return [*problems, *check_pytest(rest[1:])]
    return [*problems, f"{rest[0]!r}: only python and pytest are run through uv here"]


def doc_calls(scratch: Path):
    """(file, calls, skipped placeholders) of every documentation file."""
    for path in DOCS:
        commands, placeholders = shell_commands(path)
        directory = scratch / path.stem
        directory.mkdir()
        yield path, recorded_calls(path, commands, directory), placeholders


@pytest.mark.slow  # about 50 s: every main_* command resolves its config in this process
def test_every_documented_command_runs_as_printed(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    failures, checked, skipped = [], 0, 0
    for _, calls, placeholders in doc_calls(tmp_path):
        skipped += len(placeholders)
        for command, argv in calls:
            checked += 1
            failures += [f"{command.where()}\n    -> {problem}" for problem in check_call(argv, monkeypatch)]
    print(f"{checked} documented program calls checked, {skipped} commands with placeholders skipped")
    assert checked > 0, "no documented command found"
    assert not failures, "documented commands that do not run as printed:\n" + "\n".join(failures)


YAML_FILES = [*sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "tables").glob("*.yaml"))]
HEADER_COMMAND = re.compile(r"#\s+((?:uv run (?:--locked )?)?python\s.*)")


def header_commands(path: Path) -> tuple[list[Command], list[int]]:
    """The commands of a YAML file's leading comment, and the numbers of its lines that name `python ` outside them.
    A command is a comment line `#   python ...` or `#   uv run python ...`, continued by the next comment line while
    it ends in `\\`; it is run as `uv run python ...`."""
    commands, outside, pending = [], [], None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if pending is None:
            if not (match := HEADER_COMMAND.match(line)):
                outside += [number] if "python " in line else []
                continue
            pending = (number, [match.group(1)])
        else:
            pending[1].append(text)
        if not text.endswith("\\"):
            start, parts = pending
            commands.append(Command(path, start, number, " ".join(part.removesuffix("\\").strip() for part in parts), inline=True))
            pending = None
    return commands, outside


@pytest.mark.slow  # resolves each header's main_* commands in this process
def test_every_command_in_a_config_or_table_header_runs_as_printed(tmp_path, monkeypatch):
    """A config's header may show how to run it (a linear stage, tau-norm's second stage, JCL's visualisation
    runs): those commands are checked as the documents' are, with `python` as `uv run python`."""
    monkeypatch.chdir(ROOT)
    failures, checked = [], 0
    for path in YAML_FILES:
        commands, outside = header_commands(path)
        failures += [f"{shown(path)}:{number}: names `python ` outside a command line (`#   python ...`, continued by `\\`)" for number in outside]
        if not commands:
            continue
        scratch = tmp_path / path.stem
        scratch.mkdir()
        for command, argv in recorded_calls(path, commands, scratch):
            checked += 1
            failures += [f"{command.where()}\n    -> {problem}" for problem in check_call(["uv", "run", *argv] if argv[0] == "python" else argv, monkeypatch)]
    assert checked >= 8, f"only {checked} header commands found"
    assert not failures, "header commands that do not run as printed:\n" + "\n".join(failures)


def test_a_header_command_is_read_with_its_continuations_and_prose_naming_python_is_flagged(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("# A config.\n#   uv run python main_pretrain.py fit --config configs/moco_digits.yaml \\\n#       --trainer.max_epochs 2\n"
                    "# then: python main_linear.py fit\n#   python -m analysis knn --help\nseed_everything: 0\n# python main_pretrain.py\n")
    commands, outside = header_commands(path)
    assert [(command.line, command.last_line, command.text) for command in commands] == [
        (2, 3, "uv run python main_pretrain.py fit --config configs/moco_digits.yaml --trainer.max_epochs 2"),
        (5, 5, "python -m analysis knn --help")]
    assert outside == [4]


def test_the_readme_and_the_docs_hold_commands_and_the_readme_fits_300_lines():
    commands = [command for path in DOCS for command in shell_commands(path)[0]]
    assert any(command.file.name == "README.md" and "main_pretrain.py fit" in command.text for command in commands)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.slow  # imports Lightning and resolves a config
def test_a_command_with_an_unknown_override_fails_naming_file_line_and_command(tmp_path, monkeypatch):
    """The check can fail: a misspelt override, a script option that does not exist, a missing config, a Slurm
    task's misspelt override and a sweep's bad value in the second point of its grid."""
    monkeypatch.chdir(ROOT)
    page = tmp_path / "page.md"
    page.write_text("# page\n\n```bash\nuv run python main_pretrain.py fit --config configs/moco_digits.yaml \\\n"
                    "    --model.init_args.temprature 0.1\nuv run python scripts/compare.py runs/a --out runs/b --colour red\n"
                    "srun python main_pretrain.py fit --config configs/no_such_config.yaml\n"
                    "srun --ntasks=2 python main_pretrain.py fit --config configs/moco_digits.yaml --model.init_args.temprature=0.1\n"
                    "uv run python scripts/sweep.py --config configs/moco_digits.yaml --out runs/s --grid model.init_args.temperature=0.1,warm\n```\n")
    commands, _ = shell_commands(page)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    calls = recorded_calls(page, commands, scratch)
    assert [(command.line, argv[0]) for command, argv in calls] == [(4, "uv"), (6, "uv"), (7, "srun"), (8, "srun"), (9, "uv")]
    problems = [check_call(argv, monkeypatch) for _, argv in calls]
    assert "temprature" in problems[0][0] and "print_config" in problems[0][0]
    assert "not accepted" in problems[1][-1] and "unrecognized arguments: --colour red" in problems[1][-1]
    assert problems[2][0] == "configs/no_such_config.yaml does not exist" and "no_such_config.yaml" in problems[2][1]
    assert len(problems[3]) == 1 and "temprature" in problems[3][0]
    assert len(problems[4]) == 1 and "--model.init_args.temperature=warm" in problems[4][0]
    assert calls[0][0].where() == (f"{page}:4: uv run python "
                                   "main_pretrain.py fit --config configs/moco_digits.yaml --model.init_args.temprature 0.1")


def test_relative_links_of_the_readme_and_the_docs_resolve():
    """Every relative link target exists, and an anchor names a heading of the target file."""
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def expand_braces(pattern: str) -> list[str]:
    """`configs/{moco,sce}_digits.yaml` -> both paths (bash's brace expansion, one level at a time)."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [path for choice in match[1].split(",") for path in expand_braces(pattern[: match.start()] + choice + pattern[match.end():])]


def prose_paths(text: str) -> list[str]:
    """The repository paths the prose names in its code spans: tokens whose first component is a top-level entry of
    the checkout and that hold a `/` (`methods/moco.py`, `configs/linear_*.yaml`, `tests/test_cli.py::test_x`,
    `engine/cli/lightning_cli.py:168`), placeholders `<...>` left out."""
    top_level = {entry.name for entry in ROOT.iterdir() if not entry.name.startswith(".")} - UNCHECKED_TOP_LEVEL
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    paths = []
    for span in re.findall(r"`([^`\n]+)`", prose):
        for token in span.split():
            token = re.sub(r"(::\S*|:\d[\d–-]*)$", "", token.strip(",;()'\""))
            if "/" in token and token.split("/")[0] in top_level and not PLACEHOLDER.search(token):
                paths.append(token)
    return paths


def test_every_repository_path_the_prose_names_exists():
    missing = [
        f"{page.relative_to(ROOT)}: {path}"
        for page in DOCS
        for path in prose_paths(page.read_text())
        if not all(any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists() for pattern in expand_braces(path))
    ]
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_path_check_reads_spans_globs_braces_and_line_numbers():
    text = "See `methods/moco.py:12`, `configs/{moco,sce}_digits.yaml`, `configs/linear_*.yaml` and `tests/test_cli.py::test_a`;\n"
    text += "not `<run>/last.ckpt`, `runs/x/y`, `python -m analysis` nor\n```bash\nmethods/none.py\n```\n"
    assert prose_paths(text) == ["methods/moco.py", "configs/{moco,sce}_digits.yaml", "configs/linear_*.yaml", "tests/test_cli.py"]
    assert expand_braces("configs/{moco,sce}_digits.yaml") == ["configs/moco_digits.yaml", "configs/sce_digits.yaml"]
