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
