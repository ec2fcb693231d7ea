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
    and the deprecation that its own pytree helper triggers in torch (lightning/pytorch/utilities/_pytree.py) at
    every fit. The warnings a model or DataModule expects by design (`expected_warnings`) are added in the run's
    hooks, inside the same scope."""
    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        for logger in loggers:
            logger.addFilter(no_advertisement)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeFilter(no_advertisement)
