"""The argument parser of the scripts (`scripts/`, `python -m analysis`, `python -m interop.export`, `benchmarks/`):
argparse's, with a bad argument reported as the CLI reports a bad value, one `error:` line and exit status 2,
instead of argparse's usage block followed by its error line."""

import argparse
import sys


class ScriptArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        sys.stderr.write(f"error: {self.prog}: {message} (`{self.prog} --help` lists the arguments)\n")
        sys.exit(2)
