"""How a run ends on a bad input: one `error:` line naming the value and where it came from, exit status 2, before
anything is written (CONTRASTLAB_TRACEBACK=1 keeps the traceback instead)."""

import os
import re
import sys
from contextlib import contextmanager
from typing import Callable


def fail(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


@contextmanager
def one_error_line(*errors: type[BaseException], describe: Callable[[BaseException], str] = str):
    """End the run with one `error:` line for these errors."""
    try:
        yield
    except errors as error:
        if os.environ.get("CONTRASTLAB_TRACEBACK"):
            raise
        fail(describe(error))


NOISE = ("Does not validate", "Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>", "- Problem with given class_path")


def condense_parser_error(message: str) -> str:
    """jsonargparse explains a bad subclass config over many lines (every union member it tried); keep
    the key it concerns (nested keys of a subclass joined through its `init_args`) and the most
    specific reason."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return message
    keys = [match.group(1) for line in lines if (match := re.fullmatch(r'Parser key "(.+)":', line))]
    reasons = [line.lstrip("- ") for line in lines[1:] if not line.startswith(NOISE) and not line.startswith("Parser key")]
    head = f'Parser key "{".init_args.".join(keys)}"' if keys else None if lines[0].startswith(NOISE) else lines[0].rstrip(":")
    if not reasons:
        return head or message
    return f"{head}: {reasons[-1]}" if head else reasons[-1]


def last_line(error: BaseException) -> str:
    """An error's own message, also when a DataLoader worker raised it: the worker's traceback, re-raised in the
    training process as the message, ends with `<module>.<class>: <message>`."""
    line = str(error).strip().splitlines()[-1]
    return line.removeprefix(f"{type(error).__module__}.{type(error).__qualname__}: ")


def root_cause(error: BaseException) -> BaseException:
    """The original exception under jsonargparse's wrapping (e.g. a ValueError from a constructor)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def located(message: str, config: dict, command_line: list[str]) -> str:
    """A constructor names a bad value by its place in its class ("optimizer.lr must be >= 0", "model.temperature
    must be > 0"): name it by its key in the run's config ("model.init_args.optimizer.lr") and say where the value
    came from: the command line, a config file (`--config`), or the class's default. A message that names no key
    of the config is kept as it is."""
    name, _, rest = message.partition(" ")
    parts = name.split(".")
    parts = parts[1:] if parts[0] in ("model", "data") else parts  # "model.temperature": an argument of the model itself
    keys = [key for key in flat_keys(config) if key.split(".")[:2] in (["model", "init_args"], ["data", "init_args"])
            and key.split(".")[2:] == parts]
    if len(keys) != 1 or not rest:
        return message
    key = keys[0]
    given = [argument for argument in command_line if isinstance(argument, str) and argument.startswith("--")]
    if any(plain(argument.removeprefix("--").partition("=")[0]) == plain(key) for argument in given):
        source = "given on the command line"
    else:
        files = [path for flag, path in zip(command_line, command_line[1:]) if flag == "--config"]
        files += [argument.partition("=")[2] for argument in given if argument.startswith("--config=")]
        setting = [path for path in files if plain(key) in {plain(k) for k in flat_keys(read_yaml(path))}]
        source = f"from {setting[-1]}" if setting else "the default of its class"
    return f"{key} {rest} ({source})"


def plain(key: str) -> str:
    """A config key without its `init_args` levels (`--model.temperature` and `--model.init_args.temperature` name the same value)."""
    return key.replace(".init_args.", ".")


def flat_keys(value, prefix: str = "") -> list[str]:
    if isinstance(value, dict) and value:
        return [key for name, item in value.items() for key in flat_keys(item, f"{prefix}{name}.")]
    return [prefix.rstrip(".")]


def read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as file:
            return yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError):
        return {}
