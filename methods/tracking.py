"""The class path `methods.tracking.WandbRun`, which the `config.yaml` of runs started before the run plumbing moved
to `engine/` names: resuming such a run with its saved config finds the logger here."""

from engine.tracking import WandbRun

__all__ = ["WandbRun"]
