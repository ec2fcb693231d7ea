"""The final metrics of a run: printed, and written to `<default_root_dir>/results_<stage>.json`, which
`scripts/sweep.py` and `scripts/compare.py` collect."""

import json
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from engine.compat import epochs_trained
from engine.files import read_checkpoint, read_json_object, write_atomically

FIT_RESULTS = "results_val.json"  # a fit's results file
EARLIER_FIT_RESULTS = "results_val.earlier.json"  # those of the fit before, while a resumed fit goes on (`set_aside_earlier_results`)
SUMMARY_KEYS = ("probe_top1", "probe_top5", "knn_top1", "knn_top5", "top1", "many_top1", "medium_top1", "few_top1")
# Each top-1 selects its best validation, and the numbers reported with it are that validation's: PaCo's paco_lt.py
# keeps the epoch of the best overall top-1 (`is_best = acc > best_acc`) and reports its shot groups, not each group's best.
SELECTED_WITH = {"top1": ("many_top1", "medium_top1", "few_top1"), "probe_top1": ("probe_top5",), "knn_top1": ("knn_top5",)}


class FinalValidation(Callback):
    """A fit validates the weights it ends with, so that its results are theirs. Lightning validates the epochs e
    with (e + 1) % check_val_every_n_epoch == 0 and not the step where max_steps stops a run inside an epoch: the
    last of NPID's 201 epochs (validated every 10) or a max_steps run would report an earlier validation as final.
    Here the last epoch is validated in any case, and so is the step where max_steps stops the run.
    `validated_step`, the global step of the latest validation (kept in checkpoints), is written with the results,
    and `validated_metrics`, the names that validation logged: Lightning keeps every metric ever logged in
    `callback_metrics`, so a monitor that measures every n epochs would otherwise leave an earlier epoch's value
    beside the final ones. `best`: for each top-1 (`SELECTED_WITH`), the validation where it was highest, its step and
    epoch and its numbers (kept in checkpoints): several official codes print the best epoch's accuracy (PaCo's
    `best_acc1`, SwAV's and DINO's eval_linear.py), which the results file records beside the last."""

    def __init__(self):
        self.validated_step: int | None = None
        self.validated_metrics: set[str] | None = None
        self.best: dict[str, dict] = {}
        self._metrics_before: dict = {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch == trainer.max_epochs - 1
        if trainer.enable_validation and isinstance(trainer.check_val_every_n_epoch, int) and last_epoch:
            trainer.check_val_every_n_epoch = 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.enable_validation and 0 < trainer.max_steps <= trainer.global_step:
            if isinstance(trainer.check_val_every_n_epoch, int):
                trainer.check_val_every_n_epoch = 1
            trainer.should_stop = True  # Lightning validates a batch after which the run stops (`_should_check_val_fx`)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._metrics_before = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated_step = trainer.global_step
            # a value logged by this validation is a new tensor (Lightning computes each epoch's anew)
            self.validated_metrics = {name for name, value in trainer.callback_metrics.items() if self._metrics_before.get(name) is not value}
            for key, companions in SELECTED_WITH.items():
                names = [name for name in (f"val/{key}", *(f"val/{other}" for other in companions)) if name in self.validated_metrics]
                if not names or names[0] != f"val/{key}":
                    continue
                values = {name: float(trainer.callback_metrics[name]) for name in names}
                if names[0] not in self.best or values[names[0]] > self.best[names[0]]["metrics"][names[0]]:  # the first of equal ones, as best_acc1
                    self.best[names[0]] = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "metrics": values}

    def state_dict(self) -> dict:
        return {"validated_step": self.validated_step, "best": self.best}

    def load_state_dict(self, state_dict: dict) -> None:
        self.validated_step = state_dict.get("validated_step")
        self.best = state_dict.get("best", {})


def final_validation(trainer) -> FinalValidation | None:
    """The run's `FinalValidation` callback (the CLI adds one to every run), if it has one."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, FinalValidation)), None)


def set_aside_earlier_results(run_dir: Path) -> None:
    """A fit that starts in a directory holding the results of an earlier fit (a finished run resumed, say with a larger
    max_steps) moves them to EARLIER_FIT_RESULTS: until it ends, the directory is of an unfinished run, whose config.yaml
    holds the new settings (sweeps, tables and compare.py take results_val.json as the run's end). Rank 0 only."""
    if (run_dir / FIT_RESULTS).is_file():
        (run_dir / FIT_RESULTS).replace(run_dir / EARLIER_FIT_RESULTS)


def end_of_fit(trainer, model, datamodule) -> None:
    """After a fit: a fit that trained nothing (a finished run resumed) gets back the results it set aside, when they
    are of its final step; the final weights are validated if no validation measured them, and the results written."""
    run_dir = Path(trainer.default_root_dir)
    earlier = run_dir / EARLIER_FIT_RESULTS
    if trainer.is_global_zero and not trainer.callback_metrics and not (run_dir / FIT_RESULTS).exists() and earlier.is_file():
        try:
            of_this_step = read_json_object(earlier, "results file").get("global_step") == trainer.global_step
        except ValueError:  # unreadable: the final weights are measured again below
            of_this_step = False
        if of_this_step:
            earlier.replace(run_dir / FIT_RESULTS)
    validate_the_end_if_missed(trainer, model, datamodule)
    report_results(trainer, "val", FIT_RESULTS)


def validate_the_end_if_missed(trainer, model, datamodule) -> None:
    """After a fit: validate the final weights if no validation of the final step ran, or if the run's results file
    is missing. Lightning counts an epoch stopped by SIGTERM during its validation as done, so a run stopped during
    its very last validation resumes as finished and validates nothing (FinalValidation cannot reach it); a finished
    run whose results file was removed (unreadable, or to measure it again) resumes without training, and would
    otherwise write none. Its W&B run has ended with the fit: the numbers go to the results file only."""
    final = final_validation(trainer)
    if final is None or not trainer.enable_validation or trainer.fast_dev_run:
        return
    results_kept = trainer.strategy.broadcast((Path(trainer.default_root_dir) / FIT_RESULTS).is_file())  # rank 0 writes it
    nothing_to_report = not trainer.callback_metrics and not results_kept  # a fit that trained here has its metrics to report
    if final.validated_step == trainer.global_step and not nothing_to_report:
        return
    trained = dict(trainer.callback_metrics)
    loggers, trainer.loggers = trainer.loggers, []
    try:
        trainer.validate(model, datamodule=datamodule, verbose=False)
    finally:
        trainer.loggers = loggers
    trainer.callback_metrics.update({name: value for name, value in trained.items() if name not in trainer.callback_metrics})


def write_results(path: Path, position: dict, metrics: dict[str, float]) -> None:
    """Write the final metrics and what they are of (`position`) atomically (a reader never sees half a file)."""
    record = {**position, "metrics": metrics}
    write_atomically(path, lambda partial: partial.write_text(json.dumps(record, indent=1, sort_keys=True)))


def report_results(trainer, stage: str, results: str, position: dict | None = None) -> None:
    """Print the final metrics of `stage` ("val" or "test") and write them to `<default_root_dir>/<results>`, with
    `position`: what weights they measure (by default the trainer's epoch and global step: a `fit`)."""
    if not trainer.is_global_zero:
        return
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items() if value.numel() == 1}
    if not metrics:  # nothing ran (e.g. a finished run resumed): keep the results it wrote
        return
    final = final_validation(trainer)
    if position is None and final is not None and final.validated_metrics is not None:  # a fit: its val/* of the last validation only
        metrics = {name: value for name, value in metrics.items() if not name.startswith("val/") or name in final.validated_metrics}
    found = {key: metrics[f"{stage}/{key}"] for key in SUMMARY_KEYS if f"{stage}/{key}" in metrics}
    if found:
        print(f"\n{stage} results: " + "  ".join(f"{key} {100 * value:.2f}%" for key, value in found.items()))
    if trainer.fast_dev_run:
        return  # a smoke run's numbers are no run's results
    if position is None:  # a fit: its epoch and step, the step of the validation its val/* numbers come from, the best ones
        position = {"epoch": epochs_trained(trainer), "global_step": trainer.global_step, "val_global_step": final.validated_step if final else None,
                    "best": final.best if final else {}}
    write_results(Path(trainer.default_root_dir) / results, position | trainer.lightning_module.results_context(), metrics)


def evaluated_position(trainer) -> dict:
    """The checkpoint an evaluation restored and its global step (the trainer's epoch and step are 0 in an
    evaluation); a null step when it restored none (the config's own weights, e.g. a linear probe's trunk)."""
    path = trainer.ckpt_path
    if path is None or not Path(path).is_file():
        return {"checkpoint": path, "global_step": None}
    checkpoint = read_checkpoint(path, f"ckpt_path {str(path)!r}")  # memory-mapped: only the step is read
    return {"checkpoint": str(path), "global_step": checkpoint.get("global_step")}
