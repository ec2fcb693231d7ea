"""Noise a user cannot act on, silenced for the duration of a run (`quiet_run`)."""

import logging
import warnings
from contextlib import contextmanager

LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def no_advertisement(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("💡 Tip: For seamless cloud logging")


@contextmanager
def quiet_run():
    """Silence, for this run only, noise a user cannot act on: Lightning's advertisement for LitLogger at every start,
    the deprecation that its own pytree helper triggers in torch (lightning/pytorch/utilities/_pytree.py) at every
    fit, and its warning that `args` was given beside a command line: the project's commands that build the CLI from
    their own arguments (`python -m analysis`, the key distribution, the benchmarks) printed their sys.argv. The
    warnings a model or DataModule expects by design (`expected_warnings`) are added in the run's hooks, inside the
    same scope."""
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
        for logger in loggers:
            logger.addFilter(no_advertisement)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(no_advertisement)
