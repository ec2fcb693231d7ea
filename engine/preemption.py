"""Stopping a run without losing a step: SIGTERM and Slurm's requeue signal, acted on between two batches by every
process at the same batch, and `last.ckpt` written at that step; `trainer.max_time` counted per process; a run that
stopped inside an epoch (max_steps, max_time) resumes inside that epoch."""

import signal
import sys

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, Timer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from engine.compat import (
    checkpoint_and_requeue,
    close_finished_epoch,
    cluster_environment,
    processed_epochs,
    reopen_stopped_epoch,
    save_last_checkpoint_unless_saved,
    stop_at_the_end_of_this_step,
)
from engine.files import last_checkpoint_path
from engine.optim import schedule_length


class LastCheckpointOnSigterm(Callback):
    """On SIGTERM, Lightning finishes the current batch and raises `SIGTERMException`; this writes `last.ckpt`
    of that step (through the strategy's checkpoint IO, as every checkpoint), so a preempted run resumed
    with `--ckpt_path last` loses no step. Other exceptions write nothing: Ctrl-C (KeyboardInterrupt) can
    arrive in the middle of a step, and an error's state (a non-finite loss's) is not one to resume
    from, which is why this is not `ModelCheckpoint(save_on_exception=True)`: that saves on any exception."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.fast_dev_run:
            return  # a smoke run (`fast_dev_run`) leaves no checkpoint to resume from
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
                trainer.save_checkpoint(last_checkpoint_path(callback), weights_only=False)  # the whole state, to resume from


class LastCheckpointAtEveryEpoch(Callback):
    """`last.ckpt` at the end of every epoch, and of the step where max_time stops a run. Lightning's ModelCheckpoint
    writes it when it validates, which under `check_val_every_n_epoch` n > 1 (5, 10 or 20 in most configs) is every
    n-th epoch: a run killed (a node failure, an out-of-memory kill) or interrupted by Ctrl-C lost up to n - 1 epochs,
    and a run stopped by max_time resumed from its last validated epoch."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
                save_last_checkpoint_unless_saved(trainer, callback)


class PreemptionSignals(Callback):
    """Acts on a scheduler's signals between two batches, on every process at the same batch.

    Lightning's own handlers act inside the signal handler: on the requeue signal under Slurm (SIGUSR1,
    `sbatch --signal=SIGUSR1@90`) it writes `hpc_ckpt_<n>.ckpt` and runs `scontrol requeue` at once, which
    can be inside a step (after the step enqueued its keys, before its optimizer step: the requeued run
    would enqueue them twice); on SIGTERM it broadcasts from inside the handler, a collective that can pair
    with another collective of a process that is elsewhere, and the processes then wait on each other.
    Here a signal only marks the request; after each training step, and after each validation batch
    of a fit (a kNN monitor over a large bank can outlast Slurm's 90 s of notice), the processes agree in
    one all-reduce, then all of them act at the same batch: Lightning's own checkpoint-and-requeue for the
    requeue signal; for SIGTERM, Lightning's own stop at the end of a training step (it raises
    `SIGTERMException`), and the same exception at once during validation, which Lightning's loops do
    not check. `LastCheckpointOnSigterm` then writes `last.ckpt`. A run resumed from a checkpoint written
    during validation goes on with the next training step: Lightning skips the rest of that validation (its
    metrics are missing from the logs); the training is the uninterrupted run's, since validation draws no
    random number from the generator the training draws from (`datamodules.base`)."""

    def __init__(self):
        self.requested = {signal.SIGTERM: False, signal.SIGUSR1: False}
        self.requeue_signal: int | None = None
        self.agreement_group = None

    def on_train_start(self, trainer, pl_module) -> None:
        # Lightning registered its handlers for this fit and restores the original ones at teardown
        signal.signal(signal.SIGTERM, self._request)
        environment = cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.requeue_signal = environment.requeue_signal
            signal.signal(self.requeue_signal, self._request)
        self.trainer = trainer
        if trainer.world_size > 1 and dist.get_backend() != "gloo":
            # the processes agree on the CPU, so that a GPU run never waits here for its device to catch up
            self.agreement_group = dist.new_group(backend="gloo")

    def _request(self, signum: int, frame) -> None:
        if signum == signal.SIGTERM and not self.requested[signal.SIGTERM] and self.trainer.strategy.launcher is not None:
            self.trainer.strategy.launcher.kill(signum)  # processes Lightning started itself get it too
        self.requested[signal.SIGTERM if signum == signal.SIGTERM else signal.SIGUSR1] = True

    def _agreed_stop(self, trainer, pl_module) -> bool:
        """Runs the requeue if any process received its signal; whether any process received SIGTERM."""
        stop, requeue = self.requested[signal.SIGTERM], self.requested[signal.SIGUSR1]
        if trainer.world_size > 1:  # one all-reduce of two CPU bytes
            flags = torch.tensor([stop, requeue], dtype=torch.uint8)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.agreement_group)
            stop, requeue = (bool(flag) for flag in flags.tolist())
        if requeue:
            self.requested[signal.SIGUSR1] = False
            checkpoint_and_requeue(trainer, self.requeue_signal)
        return stop

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if ends_an_optimizer_step(trainer, batch_idx) and self._agreed_stop(trainer, pl_module):
            stop_at_the_end_of_this_step(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return  # a validate run has nothing to save; the sanity check comes before the handlers
        if self._agreed_stop(trainer, pl_module):
            stop_at_the_end_of_this_step(trainer)
            raise SIGTERMException()


def ends_an_optimizer_step(trainer, batch_idx: int) -> bool:
    """Whether training batch `batch_idx` closes a window of `accumulate_grad_batches` (its optimizer step follows it),
    as Lightning counts them: every N-th batch and an epoch's last. A stop between two would save the window's queue
    pushes and BatchNorm statistics without its accumulated gradients, and the resumed run would step on part of it."""
    windows = trainer.accumulate_grad_batches
    return windows == 1 or (batch_idx + 1) % windows == 0 or batch_idx + 1 == trainer.num_training_batches


class ProcessTimeLimit(Timer):
    """`trainer.max_time` as the time of this process: Lightning's own Timer carries the elapsed time over a
    resumption, so a job resubmitted with the same limit would train nothing. A run stopped by it has not ended: the
    CLI writes no results and says to resume it."""

    def load_state_dict(self, state_dict: dict) -> None:
        """The time of an earlier process does not count."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if ends_an_optimizer_step(trainer, batch_idx):  # the time is checked where a stop loses nothing
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def cut_short(self, trainer) -> bool:
        """Whether the time ran out before the run's end: training had steps left (to max_steps, or to the end of its
        epochs). A run whose last step and time end together has ended, and reports its results."""
        remaining = self.time_remaining()
        if remaining is None or remaining > 0:
            return False
        return not (0 <= trainer.max_steps <= trainer.global_step or trainer.global_step >= schedule_length(trainer))

    def exit_if_cut_short(self, trainer, max_time) -> None:
        """End the process as a SIGTERM does (status 143), saying how to resume, when the time ran out before the run's end."""
        if self.cut_short(trainer):
            sys.stderr.write(f"stopped at trainer.max_time {max_time} (this process's time) after global step {trainer.global_step} "
                             "(checkpoints/last.ckpt): resume with --ckpt_path last\n")
            sys.exit(128 + signal.SIGTERM)


class ResumeInStoppedEpoch(Callback):
    """A run that Lightning stopped inside an epoch (max_steps, max_time) resumes with the next batch of that epoch:
    Lightning counts such an epoch as completed and would start the next one, while the DataModule's state
    (`ContrastiveDataModule.state_dict`) holds the batches trained of it. A run stopped at the end of an epoch resumes
    with the next epoch, with or without max_steps (`close_finished_epoch`)."""

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        position = checkpoint.get(type(trainer.datamodule).__qualname__) if trainer.datamodule is not None else None
        if not position:
            return
        if position.get("batches") and processed_epochs(checkpoint) > position["epoch"]:
            reopen_stopped_epoch(checkpoint)
        elif position.get("batches") == 0 and position.get("epoch", 0) > 0 and processed_epochs(checkpoint) == position["epoch"]:
            close_finished_epoch(checkpoint)
