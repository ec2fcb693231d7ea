"""Stopping at the first non-finite loss (or skipping such batches) before its update."""

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from engine.compat import batch_in_epoch


class NonFiniteLossError(FloatingPointError):
    """Training produced a non-finite loss."""


class NonFiniteLossGuard(Callback):
    """Stops training at the first non-finite loss, before its backward pass and optimizer step, so the
    parameters, the optimizer and every checkpoint keep the last finite step; `NonFiniteLossError` names
    the global step, the loss and the training values logged with it. (`Trainer(detect_anomaly=True)`
    finds the operation but slows every step down; `EarlyStopping(check_finite=True)` sees one metric
    at the end of an epoch.) Under DDP the processes agree (one all-reduce per step) and stop together.

    With `skip_batch`, a non-finite batch is dropped instead: its gradients are discarded before the
    optimizer step, which then changes no parameter and no optimizer state. The step still counts
    (learning rate and momentum schedules advance, the momentum encoder moves towards the unchanged
    online one) and what the forward pass wrote stays written (queue keys, memory-bank entries,
    BatchNorm statistics): after `max_consecutive_skips` skipped batches in a row, the next non-finite
    one stops the run all the same, since a queue or bank holding non-finite entries does not heal.
    Skipping is for a single process only: under DDP the backward pass averages the gradients of all
    processes, so one process's non-finite loss spoils every process's gradient while their own losses
    look finite; Lightning's own skip, `training_step` returning None, is "not supported for multi-GPU"
    for the same reason (a process that skips its backward leaves the others waiting in the all-reduce).
    """

    def __init__(self, skip_batch: bool = False, max_consecutive_skips: int = 10):
        """
        Args:
            skip_batch: drop non-finite batches instead of stopping (single process only).
            max_consecutive_skips: with `skip_batch`, stop at a non-finite batch after this many skipped in a row.
        """
        if max_consecutive_skips < 1:
            raise ValueError(f"non_finite.max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.skip_batch, self.max_consecutive_skips = skip_batch, max_consecutive_skips
        self.consecutive_skips = 0
        self.drop_gradients = False

    def check_processes(self, world_size: int) -> None:
        """`skip_batch` refused beyond one process: the CLI asks before the run writes anything, `setup` again."""
        if self.skip_batch and world_size > 1:
            raise ValueError(
                f"non_finite.skip_batch works in a single process only, this run has {world_size}: "
                "set it to false (the run then stops at a non-finite loss)"
            )

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.check_processes(trainer.world_size)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        finite = bool(torch.isfinite(loss.detach()).all())
        if trainer.strategy.reduce_boolean_decision(finite, all=True):
            self.consecutive_skips = 0
            return
        terms = ", ".join(f"{name} {float(value):.4g}" for name, value in trainer.callback_metrics.items() if name.startswith("train/"))
        where = f"global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_in_epoch(trainer)})"
        message = f"non-finite training loss at {where}: loss {float(loss.detach()):.4g}; latest logged values: {terms}"
        self.consecutive_skips += 1
        if not self.skip_batch or self.consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteLossError(f"{message}. Stopped before this step's update; the checkpoints hold earlier steps only")
        rank_zero_warn(f"{message}; batch skipped ({self.consecutive_skips} in a row)")
        self.drop_gradients = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.drop_gradients:
            optimizer.zero_grad(set_to_none=True)  # an optimizer skips parameters without a gradient
            self.drop_gradients = False


def check_guard_processes(trainer) -> None:
    """The run's guard refuses `skip_batch` with more than one process (`NonFiniteLossGuard.check_processes`)."""
    for guard in (callback for callback in trainer.callbacks if isinstance(callback, NonFiniteLossGuard)):
        guard.check_processes(trainer.world_size)
