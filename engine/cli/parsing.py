"""The config as the CLI reads and keeps it: a parser whose mistakes end in one `error:` line (`fail`), and the resolved
config written beside the run, into its W&B run and into every checkpoint (`SaveConfigToRun`)."""

import copy
import os
from functools import cached_property
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

from engine.checkpoint_record import RECORD_KEY
from engine.cli.errors import condense_parser_error, fail


class ContrastlabArgumentParser(LightningArgumentParser):
    def __init__(self, *args, **kwargs):
        # argparse would read `--trainer.max_epoch` as `--trainer.max_epochs`: a typo must never change a run quietly
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_path(self, path, *args, **kwargs):
        """A YAML syntax error of a config file names the file, line and column (jsonargparse parses the file's text,
        so its error says "<unicode string>")."""
        if self.exit_on_error and not os.environ.get("CONTRASTLAB_TRACEBACK"):
            try:
                yaml.compose(Path(path).read_text())  # syntax only: what the text means is jsonargparse's to read
            except yaml.MarkedYAMLError as error:
                mark = error.problem_mark or error.context_mark
                where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                fail(f"config file {str(path)!r}{where}: {', '.join(part for part in (error.context, error.problem) if part)}")
            except (OSError, yaml.YAMLError):
                pass  # an unreadable path or another problem: jsonargparse reports it
        return super().parse_path(path, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if os.environ.get("CONTRASTLAB_TRACEBACK") or not self.exit_on_error:
            return super().error(message, ex)
        fail(f"{condense_parser_error(message)} (run with --help for the accepted options)")


class SaveConfigToRun(SaveConfigCallback):
    """Write the resolved config next to the run and, with W&B, into the run's config so that runs
    can be compared by hyperparameter."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        if isinstance(trainer.logger, WandbLogger):
            trainer.logger.experiment.config.update(self.config.as_dict(), allow_val_change=True)

    @cached_property
    def resolved_config(self) -> dict:
        """The config in plain YAML types, dumped once per run (0.3 s a dump under cProfile, for a Digits-M config)."""
        return yaml.safe_load(self.parser.dump(self.config, skip_none=False))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Every checkpoint carries the resolved config (plain YAML types, so `weights_only` loads read it) and the
        number of processes that trained it (with the batch size, the global batch a resumed run must keep)."""
        record = checkpoint.setdefault(RECORD_KEY, {})
        record["config"] = copy.deepcopy(self.resolved_config)
        record["world_size"] = trainer.world_size
