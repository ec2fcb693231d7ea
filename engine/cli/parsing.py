"""The config as the CLI reads and keeps it: a parser whose mistakes end in one `error:` line (`fail`), and the resolved
config written beside the run, into its W&B run and into every checkpoint (`SaveConfigToRun`)."""

import copy
import os
import re
from functools import cached_property
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback
from lightning.pytorch.loggers import WandbLogger

from engine.checkpoint_record import RECORD_KEY
from engine.cli.errors import condense_parser_error, fail
from engine.cli.results import set_aside_earlier_results
from engine.config import SAFE_LOADER, load_yaml
from engine.files import write_run_file


# The Trainer's arguments that Lightning reads as a number of batches when an int and as a share when a float
# (`limit_val_batches: 1` one batch, `1.0` all of them). jsonargparse gives their Union[int, float] values as floats
# (Lightning-AI/pytorch-lightning issue 21259 for val_check_interval), so each is read back as the user wrote it.
BATCH_COUNTS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches", "overfit_batches", "val_check_interval")


def batch_counts_written_as_integers(command_line: list[str]) -> set[str]:
    """The `BATCH_COUNTS` whose value, where the command line last sets it (a `--config`/`-c` file's trainer section, at
    its top or under a subcommand, a `--trainer` mapping or file, or a `--trainer.KEY` argument, in order), is written
    as an integer."""

    def trainer_of(value) -> dict:
        nested = [value.get(name) for name in ("fit", "validate", "test", "predict")] if isinstance(value, dict) else []
        found = [part.get("trainer") for part in [value, *nested] if isinstance(part, dict)]
        return next((trainer for trainer in reversed(found) if isinstance(trainer, dict)), {})

    def read(text: str):  # a YAML text, or the path of a YAML file
        try:
            return load_yaml(Path(text).read_text()) if Path(text).is_file() else load_yaml(text)
        except (OSError, ValueError, yaml.YAMLError):
            return None  # the parser reports it

    written, words = {}, iter(command_line)
    for word in words:
        key, separator, value = word.partition("=")
        text = value if separator else None
        if key in ("--config", "-c", "--trainer"):
            loaded = read(text if text is not None else next(words, ""))
            trainer = loaded if key == "--trainer" and isinstance(loaded, dict) else trainer_of(loaded)
            written |= {name: trainer[name] for name in BATCH_COUNTS if name in trainer}
        elif key.startswith("--trainer.") and key.removeprefix("--trainer.") in BATCH_COUNTS:
            written[key.removeprefix("--trainer.")] = read(text if text is not None else next(words, ""))
    return {name for name, value in written.items() if isinstance(value, int) and not isinstance(value, bool)}


def batch_counts_as_written(trainer, command_line: list[str]) -> dict[str, int]:
    """The Trainer's batch counts written as integers, which the parser made floats (`BATCH_COUNTS`)."""
    return {name: int(trainer[name]) for name in batch_counts_written_as_integers(command_line)
            if isinstance(trainer.get(name), float) and trainer[name].is_integer()}


def integer_batch_counts(trainer) -> dict[str, int]:
    """The `BATCH_COUNTS` the run reads as integers (set by `batch_counts_as_written`), which a dump of the config
    writes as floats again."""
    return {name: trainer[name] for name in BATCH_COUNTS if type(trainer.get(name)) is int}


def check_run_values(config, subcommand: str | None) -> None:
    """Values Lightning accepts but a run of this project cannot use, refused before anything is written: a seed that
    is not an explicit integer, an accumulation of no batch (a ZeroDivisionError once training started), a fit of no
    epoch or step (it wrote its files and trained nothing), the checkpoint `best` of a fit in another process and a run
    without checkpoints or without last.ckpt."""
    seed = config.get("seed_everything")
    if not isinstance(seed, int) or isinstance(seed, bool):  # true means seed 0 every time (Lightning >= 2.2 seeds None as 0: Lightning-AI/pytorch-lightning #18846)
        fail(f"seed_everything must be an explicit integer (a config's seed_everything or --seed_everything), got {seed!r}")
    trainer = config["trainer"]
    accumulate = trainer.get("accumulate_grad_batches")
    if not (isinstance(accumulate, int) and accumulate >= 1):
        fail(f"trainer.accumulate_grad_batches must be an integer >= 1, got {accumulate!r}")
    if subcommand == "fit" and 0 in (trainer.get("max_epochs"), trainer.get("max_steps")):
        stop = "max_epochs" if trainer.get("max_epochs") == 0 else "max_steps"
        fail(f"trainer.{stop} 0 trains nothing: give the run's length (or evaluate a checkpoint with validate or test)")
    if subcommand == "fit" and trainer.get("max_epochs") == -1 and trainer.get("max_steps") in (None, -1):
        fail("trainer.max_epochs -1 without trainer.max_steps: the learning-rate and momentum schedules run over the run's length, "
             "which an open-ended run has not; give max_epochs, or max_steps (max_time only stops a run)")
    optimizer = ((config.get("model") or {}).get("init_args") or {}).get("optimizer") or {}
    if optimizer.get("fused") is True and trainer.get("gradient_clip_val"):  # Lightning's RuntimeError at the first step, after the files
        fail("model.init_args.optimizer.fused true with trainer.gradient_clip_val: a fused step unscales mixed-precision gradients "
             "itself, after the clip would have cut their loss-scaled norms; set optimizer.fused: null (not fused where the trainer clips)")
    if config.get("ckpt_path") == "best":  # Lightning's name for the best checkpoint of this process's fit: a new process has none
        fail("ckpt_path 'best' names the best checkpoint of a fit in this process, which a new process has not written: give last or a checkpoint file")
    if trainer.get("enable_checkpointing") is False:  # Lightning refuses it beside the `checkpoint` callback every run has
        fail("trainer.enable_checkpointing false: every run keeps checkpoints/last.ckpt, which a resume, the linear stage and "
             "the sweeps read; --checkpoint.save_top_k 0 keeps no other checkpoint")
    if (config.get("checkpoint") or {}).get("save_last") is not True:  # a SIGTERM or max_time stop would save nothing to resume from
        fail(f"checkpoint.save_last {(config.get('checkpoint') or {}).get('save_last')!r}: every run keeps checkpoints/last.ckpt, which a stop "
             "(SIGTERM, max_time) writes and a resume, the linear stage and the sweeps read; --checkpoint.save_top_k 0 keeps no other checkpoint")


def fail_on_syntax_error(path, text: str) -> None:
    """End with one line naming the file, line and column of a YAML syntax error, worded by PyYAML's Python parser
    (libyaml's words differ, and a PyYAML without libyaml would give those)."""
    try:
        yaml.compose(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        fail(f"config file {str(path)!r}{where}: {', '.join(part for part in (error.context, error.problem) if part)}")
    except yaml.YAMLError:
        pass  # another problem: jsonargparse reports it


class ContrastlabArgumentParser(LightningArgumentParser):
    def __init__(self, *args, **kwargs):
        # argparse would read `--trainer.max_epoch` as `--trainer.max_epochs`: a typo must never change a run quietly
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_path(self, path, *args, **kwargs):
        """A YAML syntax error of a config file names the file, line and column (jsonargparse parses the file's text,
        so its error says "<unicode string>")."""
        if self.exit_on_error and not os.environ.get("CONTRASTLAB_TRACEBACK"):
            try:  # syntax only: what the text means is jsonargparse's to read
                text = Path(path).read_text()
                yaml.compose(text, Loader=SAFE_LOADER)
            except yaml.YAMLError:
                fail_on_syntax_error(path, text)
            except OSError:
                pass  # an unreadable path: jsonargparse reports it
        return super().parse_path(path, *args, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if os.environ.get("CONTRASTLAB_TRACEBACK") or not self.exit_on_error:
            return super().error(message, ex)
        fail(f"{condense_parser_error(message)} (run with --help for the accepted options)")


class SaveConfigToRun(SaveConfigCallback):
    """Write the resolved config next to the run (`config.yaml`), into every checkpoint and, with W&B, into the
    run's config so that runs can be compared by hyperparameter. The CLI builds it with `save_to_log_dir=False`:
    config.yaml is written here from the one dump of the run that the checkpoints also read (Lightning's own save
    would dump and validate the config again: 0.12 s for a Digits-M config on this project's 2-core CPU, 0.045 s
    for the dump alone)."""

    @cached_property
    def resolved_text(self) -> str:
        """The config as YAML text, as jsonargparse's `save` would write it, without validating it again (the CLI
        validated it when it parsed it), with the batch counts as the run reads them (`BATCH_COUNTS`)."""
        text = self.parser.dump(self.config, skip_none=False, skip_validation=True)
        for name, count in integer_batch_counts(self.config.get("trainer") or {}).items():  # `limit_val_batches: 1.0` would be all batches
            text = re.sub(rf"^(  {name}: ){count}\.0$", rf"\g<1>{count}", text, count=1, flags=re.MULTILINE)
        return text

    @cached_property
    def resolved_config(self) -> dict:
        """The config in plain YAML types."""
        return load_yaml(self.resolved_text)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved:
            # the run directory, beside its checkpoints and results, whatever the loggers write where (Lightning's
            # log_dir is the first logger's: the working directory of a plain WandbLogger, where every run overwrote it)
            # a `validate` or `test` in the training run's directory keeps the config the run was trained with
            stage = getattr(stage, "value", stage)  # Lightning passes its TrainerFn, a str enum
            name = self.config_filename if stage == "fit" else f"{Path(self.config_filename).stem}_{stage}.yaml"
            if trainer.is_global_zero:
                write_run_file(os.path.join(trainer.default_root_dir, name), self.resolved_text)
                if stage == "fit":  # the directory now describes this fit, whose results are yet to come
                    set_aside_earlier_results(Path(trainer.default_root_dir))
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.experiment.config.update(self.config.as_dict(), allow_val_change=True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Every checkpoint carries the resolved config (plain YAML types, so `weights_only` loads read it) and the
        number of processes that trained it (with the batch size, the global batch a resumed run must keep)."""
        record = checkpoint.setdefault(RECORD_KEY, {})
        record["config"] = copy.deepcopy(self.resolved_config)
        record["world_size"] = trainer.world_size
