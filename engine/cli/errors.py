"""How a run ends on a bad input: one `error:` line naming the value and where it came from, exit status 2, before
anything is written (CONTRASTLAB_TRACEBACK=1 keeps the traceback instead)."""

import os
import re
import sys
from contextlib import contextmanager
from typing import Callable

from engine.config import flattened, load_yaml


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
    if choices := literal_choices(lines):  # a value outside a union of fixed choices (trainer.precision): the value and the choices
        return f'Parser key "{".init_args.".join(keys)}": {choices}' if keys else choices
    reasons = [line.lstrip("- ") for line in lines[1:] if not line.startswith(NOISE) and not line.startswith("Parser key")]
    head = f'Parser key "{".init_args.".join(keys)}"' if keys else None if lines[0].startswith(NOISE) else lines[0].rstrip(":")
    if not reasons:
        return full_keys(head or message)
    return full_keys(f"{head}: {reasons[-1]}" if head else reasons[-1])


def full_keys(message: str) -> str:
    """A misspelt key of a class's arguments named by its whole key: jsonargparse names it relative to the class
    (`Parser key "model": Option 'temprature' is not accepted`, `... unrecognized arguments: --optimizer.lrr=0.1`)."""
    found = re.fullmatch(r'Parser key "(model|data)": (.*)', message, re.S)
    if found is None:
        return message
    section, reason = found.groups()
    reason = re.sub(r"Option '([^']+)' is not accepted", rf"Option '{section}.init_args.\1' is not accepted", reason)
    return re.sub(r"unrecognized arguments: --(\S+)", rf"unrecognized arguments: --{section}.init_args.\1", reason)


def literal_choices(lines: list[str]) -> str | None:
    """For a value that none of a union of `Literal`s (and None) accepts: the value given and every choice, which
    jsonargparse spreads over its "Subtypes:" and "Given value:" lines."""
    subtypes = next((line.removeprefix("Subtypes: ") for line in lines if line.startswith("Subtypes: [")), None)
    given = next((line.removeprefix("Given value: ") for line in lines if line.startswith("Given value: ")), None)
    if subtypes is None or given is None:
        return None
    members = re.findall(r"typing\.Literal\[([^\]]*)\]|<class 'NoneType'>", subtypes)
    if not any(members) or subtypes.count("typing.Literal[") + subtypes.count("<class 'NoneType'>") != len(members):
        return None  # another kind of type among them: the general reason below
    return f"got {given!r}, expected one of {', '.join(member for member in members if member)}"


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
    must be > 0", a view's "view 'query': scale must be ..."): name it by its key in the run's config
    ("model.init_args.optimizer.lr", "data.init_args.views.query.scale") and say where the value came from: the last
    of the command line's `--config`/`-c` files and arguments that sets it (or a dict above it), else the class's
    default. A message about several values, or that names no key of the config, is kept."""
    if view := re.fullmatch(r"view '([^']+)': (\w+) (must .*)", message, flags=re.DOTALL):
        in_config = located(f"data.views.{view[1]}.{view[2]} {view[3]}", config, command_line)
        return message if in_config.startswith("data.views.") else in_config
    name, _, rest = message.partition(" ")
    parts = name.split(".")
    parts = parts[1:] if parts[0] in ("model", "data") else parts  # "model.temperature": an argument of the model itself
    keys = [key for key in flattened(config) if key.split(".")[:2] in (["model", "init_args"], ["data", "init_args"])
            and key.split(".")[2:] == parts]
    got = rest.rpartition(" got ")[2]
    several_values = " got " in rest and ", " in got and not got.startswith(("[", "("))  # "a must ... and b ..., got 1, 2", not a list
    if len(keys) != 1 or not rest or several_values:
        return message
    key, source = keys[0], "the default of its class"
    tokens = [token for token in command_line if isinstance(token, str)]
    for position, token in enumerate(tokens):
        flag, has_value, value = token.partition("=")
        if flag in ("--config", "-c"):
            path = value if has_value else (tokens[position + 1] if position + 1 < len(tokens) else "")
            if any(sets(plain(set_key), plain(key)) for set_key in flattened(read_yaml(path))):
                source = f"from {path}"
        elif flag.startswith("--") and sets(plain(flag.removeprefix("--")), plain(key)):
            source = "given on the command line"
    return f"{key} {rest} ({source})"


def sets(given: str, key: str) -> bool:
    """Whether giving the config key `given` sets `key`: the key itself or a dict above it."""
    return given == key or key.startswith(given + ".")


def plain(key: str) -> str:
    """A config key without its `init_args` levels (`--model.temperature` and `--model.init_args.temperature` name the same value)."""
    return key.replace(".init_args.", ".")


def read_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as file:
            return load_yaml(file) or {}
    except (OSError, yaml.YAMLError):
        return {}
