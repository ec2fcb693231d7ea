"""The final metrics of a run: printed, and written to `<default_root_dir>/results_<stage>.json`, which
`scripts/sweep.py` and `scripts/compare.py` collect."""

import json
from pathlib import Path

from engine.files import write_atomically

SUMMARY_KEYS = ("probe_top1", "probe_top5", "knn_top1", "knn_top5", "top1", "many_top1", "medium_top1", "few_top1")


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
    found = {key: metrics[f"{stage}/{key}"] for key in SUMMARY_KEYS if f"{stage}/{key}" in metrics}
    if found:
        print(f"\n{stage} results: " + "  ".join(f"{key} {100 * value:.2f}%" for key, value in found.items()))
    if trainer.fast_dev_run:
        return  # a smoke run's numbers are no run's results
    position = position or {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
    write_results(Path(trainer.default_root_dir) / results, position, metrics)
