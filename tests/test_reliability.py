"""Issue 12's guarantees: exact resume, nothing lost on interruption, seeds, non-finite losses, bad
inputs, checkpoint compatibility (engine/, the CLI, the DataModule's resumable order)."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from helpers import TINY_PROJECTOR, cpu_trainer, digits
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_cli import CONFIGS, LINEAR_DIGITS, PRETRAIN_DIGITS, ROOT, TINY_RUN, run_failing
from test_paco import TINY_BN_PROJECTOR

import main_linear
import main_pretrain
import methods.probed_trunk
import datamodules.base
import methods.moco
from backbones import BackboneSpec
from datamodules import SplitFileDataModule
from datamodules.base import seed_draw
from datamodules.samplers import ClassPrioritySampler, EpochSampler
from engine.checkpoint_record import VERSION, CheckpointMismatch, compatible
from engine.files import SameDirectoryCheckpointIO, WriteFailed, write_atomically
from engine.non_finite import NonFiniteLossError, NonFiniteLossGuard
from engine.preemption import LastCheckpointOnSigterm, PreemptionSignals
from engine.random_state import RandomStateCheckpoint
from methods import NPID, SCE, CrossEntropy, LinearProbe, MoCoV2, PaCo
from methods.momentum import MomentumSpec

FAST_BACKBONE = BackboneSpec(name="timm:test_resnet")  # the digits configs' trunk (0.37 M parameters)
QUERY_KEY = {"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}
MOMENTUM = MomentumSpec(base=0.9, schedule="cosine", shuffle_bn=True, split_bn=2)  # draws a permutation per step
METHODS = {
    "moco": (lambda: MoCoV2(backbone=FAST_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MOMENTUM, knn_k=0), QUERY_KEY),
    "sce": (
        lambda: SCE(backbone=FAST_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MOMENTUM, knn_k=0),
        {"weak": {"preset": "crop_flip"}, "strong": {"preset": "mocov2"}},
    ),
    "paco": (lambda: PaCo(backbone=FAST_BACKBONE, projector=TINY_BN_PROJECTOR, queue_size=64, momentum=MOMENTUM), QUERY_KEY),
    "npid": (lambda: NPID(backbone=FAST_BACKBONE, projector=TINY_PROJECTOR, knn_k=0), {"image": {"preset": "npid"}}),
}
BATCHES_PER_EPOCH, TOTAL_STEPS = 2, 5


# ----------------------------------------------------------------- exact resume


class BatchIndices(Callback):
    """The sample indices of every training batch, in order."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch["index"].tolist())


def train(method: str, directory, ckpt_path=None, save_at_step=None, workers=0):
    """TOTAL_STEPS optimizer steps of a tiny method on Digits-M, from scratch or from a checkpoint; with
    `save_at_step`, a checkpoint is written at that step as a preemption would. The views are drawn on the device,
    or with `workers`, per image in that many DataLoader workers."""
    L.seed_everything(0, verbose=False)
    build, views = METHODS[method]
    indices = BatchIndices()
    callbacks = [RandomStateCheckpoint(), indices]
    if save_at_step:
        callbacks.append(ModelCheckpoint(dirpath=directory, filename="{step}", every_n_train_steps=save_at_step, save_top_k=-1))
    trainer = cpu_trainer(directory, max_steps=TOTAL_STEPS, limit_train_batches=BATCHES_PER_EPOCH, limit_val_batches=0,
                          enable_checkpointing=save_at_step is not None, callbacks=callbacks)
    model = build()
    data = digits(views, batch_size=8, num_workers=workers, pipeline="cpu") if workers else digits(views, batch_size=8, pipeline="gpu")
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer, model, indices.seen


def assert_identical(straight, resumed, where="") -> None:
    if isinstance(straight, dict):
        assert straight.keys() == resumed.keys(), where
        for key in straight:
            assert_identical(straight[key], resumed[key], f"{where}.{key}")
    elif isinstance(straight, (list, tuple)):
        assert len(straight) == len(resumed), where
        for position, (a, b) in enumerate(zip(straight, resumed)):
            assert_identical(a, b, f"{where}[{position}]")
    elif isinstance(straight, torch.Tensor):
        assert torch.equal(straight, resumed), where
    else:
        assert straight == resumed, where


@pytest.mark.parametrize(
    "method, save_at_step, workers",
    [("moco", 3, 0), ("moco", 2, 0), ("sce", 3, 0), ("paco", 3, 0), ("npid", 3, 0), ("moco", 3, 2)],
    ids=["moco-mid-epoch", "moco-end-of-epoch", "sce-mid-epoch", "paco-mid-epoch", "npid-mid-epoch", "moco-mid-epoch-views-in-2-workers"],
)
@pytest.mark.slow
def test_resuming_from_a_checkpoint_gives_bit_identical_state_and_continues_the_data_order(method, save_at_step, workers, tmp_path):
    straight, straight_model, straight_seen = train(method, tmp_path / "straight", save_at_step=save_at_step, workers=workers)
    checkpoint = tmp_path / "straight" / f"step={save_at_step}.ckpt"
    resumed, resumed_model, resumed_seen = train(method, tmp_path / "resumed", ckpt_path=checkpoint, workers=workers)
    assert resumed.global_step == straight.global_step == TOTAL_STEPS
    # parameters, momentum encoder, queue (with its labels and pointer) or memory bank: every tensor of the state
    assert_identical(straight_model.state_dict(), resumed_model.state_dict(), "state_dict")
    assert_identical(straight.optimizers[0].state_dict(), resumed.optimizers[0].state_dict(), "optimizer")
    assert_identical(straight.lr_scheduler_configs[0].scheduler.state_dict(), resumed.lr_scheduler_configs[0].scheduler.state_dict(), "scheduler")
    if "train/momentum" in straight.callback_metrics:
        assert straight.callback_metrics["train/momentum"] == resumed.callback_metrics["train/momentum"]
    # the data order continues where the checkpoint was written; no image twice within an epoch
    assert resumed_seen == straight_seen[save_at_step:]
    for epoch_start in range(0, TOTAL_STEPS, BATCHES_PER_EPOCH):
        epoch = sum(straight_seen[epoch_start : epoch_start + BATCHES_PER_EPOCH], [])
        assert len(set(epoch)) == len(epoch)


def test_the_epoch_order_depends_on_seed_and_epoch_only_and_resumes_at_a_position():
    sampler = EpochSampler(10, seed=1)
    sampler.set_epoch(2)
    order = list(sampler)
    other_seed = EpochSampler(10, seed=2)
    other_seed.set_epoch(2)
    assert sorted(order) == list(range(10)) and list(EpochSampler(10, seed=1)) != order != list(other_seed)
    resumed = EpochSampler(10, seed=1)
    resumed.resume(2, 6)
    assert list(resumed) == order[6:]
    resumed.set_epoch(3)  # the next epoch starts at its beginning
    assert len(list(resumed)) == 10
    whole = list(EpochSampler(10, seed=1))
    ranks = [list(EpochSampler(10, seed=1, num_replicas=3, rank=rank)) for rank in range(3)]
    assert [ranks[rank][turn] for turn in range(4) for rank in range(3)] == whole + whole[:2]  # dealt in turn, padded


def test_the_seed_of_each_draw_follows_its_place_in_the_epoch_through_a_resume_and_across_processes():
    seeded = EpochSampler(10, seed=1, draw_seeds=True)
    seeded.set_epoch(2)
    draws = list(seeded)
    assert [index for index, _ in draws] == order_of_epoch(2)  # the order is the one without seeds
    seeds = [seed for _, seed in draws]
    assert len(set(seeds)) == 10 and all(0 <= seed < 2**63 for seed in seeds)
    resumed = EpochSampler(10, seed=1, draw_seeds=True)
    resumed.resume(2, 6)
    assert list(resumed) == draws[6:]
    resumed.set_epoch(3)
    assert not set(seed for _, seed in resumed) & set(seeds)  # another epoch, other seeds
    assert not set(seed for _, seed in EpochSampler(10, seed=2, draw_seeds=True)) & set(seed for _, seed in EpochSampler(10, seed=1, draw_seeds=True))
    ranks = [list(EpochSampler(10, seed=1, num_replicas=3, rank=rank, draw_seeds=True)) for rank in range(3)]
    dealt = [ranks[rank][turn] for turn in range(4) for rank in range(3)]
    whole = list(EpochSampler(10, seed=1, draw_seeds=True))
    assert dealt[:10] == whole  # each process the seeds of its own places
    padding = dealt[10:]  # the first images again, as draws of their own
    assert [index for index, _ in padding] == [index for index, _ in whole[:2]] and not {seed for _, seed in padding} & {seed for _, seed in whole}
    labels = np.repeat(np.arange(3), [6, 3, 1])
    for policy in ("class_balanced", "square_root", "progressive"):  # the long-tail samplers: the same order, with seeds
        plain, with_seeds = (ClassPrioritySampler(labels, 3, policy, total_epochs=4, seed=1, draw_seeds=draw_seeds) for draw_seeds in (False, True))
        long_tail_draws = list(with_seeds)
        assert [index for index, _ in long_tail_draws] == list(plain) and len({seed for _, seed in long_tail_draws}) == len(long_tail_draws)


def test_a_draw_seeds_numpy_apart_from_torch():
    """torch's Mersenne Twister keeps the low 32 bits of a seed: NumPy's global generator seeded with the same bits
    would give the same stream (timm's RandAugment would then pick its operations from the crop's draws)."""
    seed = (7 << 40) | 123456789
    seed_draw(seed)
    assert not np.array_equal(np.random.get_state()[1], np.random.RandomState(seed & 0xFFFFFFFF).get_state()[1])
    assert torch.initial_seed() == seed


def test_several_processes_without_workers_draw_each_sample_from_its_seed_and_keep_the_main_generators(monkeypatch):
    """Without DataLoader workers, the ranks of a DDP run augmented in their main processes from generators that
    seed_everything seeds alike: every rank drew rank 0's views. Each draw now has its seed there too, and the
    generators the training draws from are put back after it."""
    datamodule = digits({"query": {"preset": "mocov2"}}, pipeline="cpu")
    datamodule.setup("fit")
    assert not datamodule.train_sampler(0).draw_seeds  # one process: its generators, as before
    monkeypatch.setattr(datamodules.base, "process_group", lambda: {"num_replicas": 2, "rank": 1})
    sampler = datamodule.train_sampler(0)
    (index, seed), *_ = iter(sampler)
    dataset = datamodule.served(datamodule.splits["train"], datamodule.views)[0]
    torch.manual_seed(5)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    views = dataset[(index, seed)]["views"]["query"]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])
    torch.manual_seed(6)  # other main-process states: the same draw
    assert torch.equal(dataset[(index, seed)]["views"]["query"], views)
    assert not torch.equal(dataset[(index, seed + 1)]["views"]["query"], views)


def order_of_epoch(epoch: int) -> list[int]:
    sampler = EpochSampler(10, seed=1)
    sampler.set_epoch(epoch)
    return list(sampler)


# views that draw from torch's generator (MoCo v2's), from Python's and NumPy's (timm's RandAugment) and from Python's (TCL's AutoAugment)
VIEWS_OF_EVERY_SOURCE = {"mocov2": {"preset": "mocov2"}, "randaugment": {"preset": "randaugment"}, "tcl": {"preset": "autoaugment", "policy": "cifar10", "operations": "tcl"}}


@pytest.mark.slow
def test_views_drawn_in_workers_are_the_same_for_one_or_two_workers():
    """Each draw's views come from its seed: which worker serves a batch changes nothing (without the seeds, one
    worker draws every batch from its own stream and two workers alternate theirs)."""
    def first_batches(workers: int) -> list[dict]:
        data = digits(VIEWS_OF_EVERY_SOURCE, batch_size=8, num_workers=workers, pipeline="cpu")
        data.setup()
        batches = iter(data.train_dataloader())
        return [next(batches) for _ in range(3)]

    one, two = first_batches(1), first_batches(2)
    assert [batch["index"].tolist() for batch in one] == [batch["index"].tolist() for batch in two]
    for a, b in zip(one, two):
        for view in VIEWS_OF_EVERY_SOURCE:
            assert torch.equal(a["views"][view], b["views"][view]), view
    assert not torch.equal(one[0]["views"]["mocov2"], one[0]["views"]["randaugment"])  # two draws differ


# ----------------------------------------------------------------- nothing lost
class SignalAtStep(Callback):
    """Sends this process a signal as a training step starts, as a scheduler (SIGTERM) or Ctrl-C (SIGINT) does."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)



class SigtermAtTheFirstBatch(Callback):
    """Sends this process SIGTERM as the run's first training batch starts, once (a run that resumes has a step)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0 and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_stop_inside_a_window_of_gradient_accumulation_waits_for_its_step_and_the_run_resumes_exactly(tmp_path):
    """With accumulate_grad_batches 2, a SIGTERM at the first batch stopped the run after it: last.ckpt kept that
    batch's queue push and BatchNorm statistics but not its gradient, and the resumed run stepped on half a window."""
    command = ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.limit_train_batches=4", "--trainer.accumulate_grad_batches=2",
               "--trainer.max_epochs=2", "--trainer.precision=32-true", "--trainer.logger=false", "--data.init_args.batch_size=16"]
    main_pretrain.cli_main([*command, f"--trainer.default_root_dir={tmp_path / 'straight'}"])
    interrupted = [*command, f"--trainer.default_root_dir={tmp_path / 'interrupted'}"]
    with pytest.raises(SystemExit) as stopped:
        main_pretrain.cli_main([*interrupted, "--trainer.callbacks+=test_reliability.SigtermAtTheFirstBatch"])
    last = tmp_path / "interrupted" / "checkpoints" / "last.ckpt"
    assert stopped.value.code == 143 and torch.load(last, weights_only=True)["global_step"] == 1  # the window's step, then the stop
    main_pretrain.cli_main([*interrupted, "--ckpt_path=last"])
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", weights_only=True)
    resumed = torch.load(last, weights_only=True)
    assert straight["global_step"] == resumed["global_step"] == 4
    assert_identical(straight["state_dict"], resumed["state_dict"], "state_dict")


class SigtermInLastValidation(Callback):
    """Sends this process SIGTERM at the first batch of the last epoch's validation, as a scheduler may."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and trainer.current_epoch == trainer.max_epochs - 1 and batch_idx == 0 and dataloader_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_a_run_stopped_during_its_last_validation_resumes_to_the_results_of_its_final_weights(tmp_path):
    """Lightning counts the stopped epoch as done: the resumed run trains nothing and would validate nothing."""
    run_dir = tmp_path / "run"
    command = ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_epochs=2", "--trainer.logger=false", f"--trainer.default_root_dir={run_dir}"]
    with pytest.raises(SystemExit) as stopped:
        main_pretrain.cli_main([*command, "--trainer.callbacks+=test_reliability.SigtermInLastValidation"])
    assert stopped.value.code == 143 and not (run_dir / "results_val.json").exists()
    cli = main_pretrain.cli_main([*command, "--ckpt_path=last"])
    results = json.loads((run_dir / "results_val.json").read_text())
    assert results["global_step"] == results["val_global_step"] == cli.trainer.global_step == 4 and results["epoch"] == 2
    assert {"val/knn_top1", "val/probe_top1", "train/time_s"} <= results["metrics"].keys()

@pytest.mark.parametrize("signal_step", [2, 3], ids=["mid-epoch", "last-step-of-an-epoch"])
@pytest.mark.slow
def test_sigterm_saves_the_step_it_interrupts_as_last_ckpt_and_the_run_resumes_exactly(signal_step, tmp_path):
    straight, straight_model, straight_seen = train("moco", tmp_path / "straight")
    L.seed_everything(0, verbose=False)
    build, views = METHODS["moco"]
    directory = tmp_path / "interrupted"
    # a checkpoint callback that saves nothing of its own within this run (at the end of an epoch it would write the
    # interrupted step too): last.ckpt can only be the SIGTERM save's
    never_within_the_run = ModelCheckpoint(directory, save_last=True, every_n_epochs=TOTAL_STEPS + 1)
    callbacks = [RandomStateCheckpoint(), LastCheckpointOnSigterm(), PreemptionSignals(), SignalAtStep(signal.SIGTERM, signal_step), never_within_the_run]
    interrupted = cpu_trainer(directory, max_steps=TOTAL_STEPS, limit_train_batches=BATCHES_PER_EPOCH, limit_val_batches=0,
                              enable_checkpointing=True, callbacks=callbacks)
    with pytest.raises(SIGTERMException):  # Lightning finishes the batch, then stops
        interrupted.fit(build(), digits(views, batch_size=8, pipeline="gpu"))
    last = directory / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == signal_step + 1  # the interrupted step is in it
    resumed, resumed_model, resumed_seen = train("moco", tmp_path / "resumed", ckpt_path=last)
    assert_identical(straight_model.state_dict(), resumed_model.state_dict(), "state_dict")
    assert resumed_seen == straight_seen[signal_step + 1 :]


class SignalInValidation(Callback):
    """Sends this process a signal as the first validation batch of a fit ends; counts the validation
    batches and the training batches after the first validation batch."""

    def __init__(self, signum: int | None = None):
        self.signum, self.validation_batches, self.training_batches_after = signum, 0, 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.validation_batches += 1
        if self.signum is not None and self.validation_batches == 1:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.training_batches_after += self.validation_batches > 0


def train_validating(directory, *callbacks, ckpt_path=None):
    """`train` of MoCo v2 with a validation (2 batches of the validation split, 2 of the kNN bank, which its kNN
    monitor reads) after every epoch, and the signal callbacks of a run."""
    L.seed_everything(0, verbose=False)
    views = METHODS["moco"][1]
    build = lambda: MoCoV2(backbone=FAST_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=MOMENTUM, knn_k=5)  # noqa: E731
    indices = BatchIndices()
    callbacks = [RandomStateCheckpoint(), LastCheckpointOnSigterm(), PreemptionSignals(), ModelCheckpoint(directory, save_last=True), indices, *callbacks]
    trainer = cpu_trainer(directory, max_steps=TOTAL_STEPS, limit_train_batches=BATCHES_PER_EPOCH, limit_val_batches=2,
                          enable_checkpointing=True, callbacks=callbacks)
    model = build()
    trainer.fit(model, digits(views, batch_size=8, pipeline="gpu"), ckpt_path=ckpt_path)
    return trainer, model, indices.seen


@pytest.mark.slow
def test_validation_draws_nothing_that_training_draws(tmp_path):
    """The same run with and without validation trains to the same parameters: the evaluation loaders seed
    their workers from generators of their own."""
    _, validated_model, validated_seen = train_validating(tmp_path / "validated")
    _, model, seen = train("moco", tmp_path / "not-validated")
    assert validated_seen == seen
    assert_identical(model.state_dict(), validated_model.state_dict(), "state_dict")


@pytest.mark.slow
def test_sigterm_during_validation_stops_at_the_next_validation_batch_and_the_run_resumes_exactly(tmp_path):
    """A preemption's grace period can be shorter than a validation: the stop comes at the next validation
    batch, not after the next training step; the resumed run skips the rest of that validation and trains
    on exactly as the uninterrupted run."""
    straight, straight_model, straight_seen = train_validating(tmp_path / "straight")
    signalled = SignalInValidation(signal.SIGTERM)
    with pytest.raises(SIGTERMException):
        train_validating(tmp_path / "interrupted", signalled)
    assert (signalled.validation_batches, signalled.training_batches_after) == (1, 0)  # stopped within validation
    last = tmp_path / "interrupted" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == BATCHES_PER_EPOCH
    counted = SignalInValidation()
    resumed, resumed_model, resumed_seen = train_validating(tmp_path / "resumed", counted, ckpt_path=last)
    assert counted.validation_batches == 4  # epoch 1's validation only
    assert resumed.global_step == TOTAL_STEPS and resumed_seen == straight_seen[BATCHES_PER_EPOCH:]
    assert_identical(straight_model.state_dict(), resumed_model.state_dict(), "state_dict")


def pretend_slurm_job(tmp_path, monkeypatch) -> None:
    """Slurm's variables of job 4242 and a fake `scontrol` that appends its arguments to scontrol.log."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    for name, value in dict(SLURM_NTASKS="1", SLURM_JOB_NAME="pretrain", SLURM_JOB_ID="4242", SLURM_NODELIST="node1",
                            SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0").items():
        monkeypatch.setenv(name, value)


def test_sigusr1_under_slurm_during_validation_checkpoints_and_requeues_before_the_next_training_step(tmp_path, monkeypatch):
    pretend_slurm_job(tmp_path, monkeypatch)
    signalled = SignalInValidation(signal.SIGUSR1)
    train_validating(tmp_path / "job", signalled)  # Lightning trains on until Slurm ends the job
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = torch.load(tmp_path / "job" / "hpc_ckpt_1.ckpt", weights_only=True)
    assert hpc["global_step"] == BATCHES_PER_EPOCH  # written in the validation after epoch 0, before step 3


@pytest.mark.slow
def test_sigusr1_under_slurm_checkpoints_the_step_it_interrupts_and_the_requeued_job_resumes_exactly(tmp_path, monkeypatch):
    """Slurm's `--signal=SIGUSR1@90`: Lightning writes hpc_ckpt_1.ckpt and requeues the job (a fake `scontrol`
    here); the requeued job, started in the same directory without --ckpt_path, resumes from it."""
    straight, straight_model, straight_seen = train("moco", tmp_path / "straight")
    pretend_slurm_job(tmp_path, monkeypatch)
    L.seed_everything(0, verbose=False)
    build, views = METHODS["moco"]
    job = tmp_path / "job"
    callbacks = [RandomStateCheckpoint(), PreemptionSignals(), SignalAtStep(signal.SIGUSR1, 2)]
    cpu_trainer(job, max_steps=TOTAL_STEPS, limit_train_batches=BATCHES_PER_EPOCH, limit_val_batches=0, callbacks=callbacks).fit(
        build(), digits(views, batch_size=8, pipeline="gpu"))  # Lightning trains on until Slurm ends the job
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert torch.load(job / "hpc_ckpt_1.ckpt", weights_only=True)["global_step"] == 3  # the interrupted step, finished
    requeued, requeued_model, requeued_seen = train("moco", job)
    assert requeued.global_step == TOTAL_STEPS and requeued_seen == straight_seen[3:]
    assert_identical(straight_model.state_dict(), requeued_model.state_dict(), "state_dict")  # queue and momentum encoder too


@pytest.mark.parametrize(
    "signum, status, saved_step, position",
    # at step 2, the first of epoch 1 (two batches an epoch): SIGTERM finishes it and saves it, mid-epoch (no epoch-end
    # checkpoint could hold it); Ctrl-C leaves the epoch-0 checkpoint
    [(signal.SIGTERM, 143, 3, {"epoch": 1, "batches": 1}), (signal.SIGINT, 1, 2, {"epoch": 1, "batches": 0})],
    ids=["SIGTERM", "SIGINT"],
)
@pytest.mark.slow
def test_a_signalled_cli_run_exits_with_a_loadable_last_ckpt(signum, status, saved_step, position, tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    handler = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python ignores SIGINT when started in the background
    try:
        with pytest.raises(SystemExit) as exit_info:
            main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_epochs=3", "--trainer.limit_val_batches=0",
                                    "--trainer.logger=false", "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}",
                                    "--trainer.callbacks+=test_reliability.SignalAtStep", f"--trainer.callbacks.signum={int(signum)}",
                                    "--trainer.callbacks.step=2"])
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl-C while it shuts down, and leaves it so
    assert exit_info.value.code == status
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == saved_step
    assert checkpoint["DigitsDataModule"] == position  # where the data order resumes
    if signum == signal.SIGTERM:
        assert "stopped by SIGTERM after global step 3 (checkpoints/last.ckpt): resume with --ckpt_path last" in capsys.readouterr().err
        assert "weights_only" not in caplog.text  # Lightning's note on a save that does not say what it keeps


SIGNALLED_RUN = [*TINY_RUN, "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.precision=32-true"]


def sigterm_at_first_step(run_dir, step: int = 0, max_epochs: int = 2) -> None:
    """A CLI run stopped by SIGTERM in its first step (before any epoch-end checkpoint), or in the given one."""
    with pytest.raises(SystemExit):
        main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, f"--trainer.max_epochs={max_epochs}", f"--trainer.default_root_dir={run_dir}",
                                "--trainer.callbacks+=test_reliability.SignalAtStep", f"--trainer.callbacks.signum={int(signal.SIGTERM)}",
                                f"--trainer.callbacks.step={step}"])


@pytest.mark.slow
def test_a_run_resumed_from_a_signal_checkpoint_keeps_writing_the_same_last_ckpt(tmp_path):
    run_dir = tmp_path / "run"
    sigterm_at_first_step(run_dir)
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}", "--ckpt_path=last"])
    assert not list((run_dir / "checkpoints").glob("last-v*.ckpt"))  # no last-v1.ckpt beside a stale last.ckpt
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


SLURM_JOB = dict(SLURM_NTASKS="1", SLURM_JOB_NAME="pretrain", SLURM_JOB_ID="4242", SLURM_NODELIST="node1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")


@pytest.mark.slow
def test_a_requeued_slurm_job_without_an_hpc_checkpoint_resumes_from_last_ckpt(tmp_path, monkeypatch, capsys):
    """Preempted by SIGTERM (or a failed node) before any SIGUSR1: the requeued job runs the same command."""
    run_dir = tmp_path / "run"
    sigterm_at_first_step(run_dir)
    for name, value in SLURM_JOB.items():
        monkeypatch.setenv(name, value)
    command = ["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}"]
    assert run_failing(main_pretrain, command, capsys).endswith("already holds a run: resume it with --ckpt_path last, or start a new one under another trainer.default_root_dir")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    cli = main_pretrain.cli_main(command)
    assert cli.trainer.global_step == 4 and cli.trainer.ckpt_path == str(run_dir / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_a_new_slurm_job_in_a_directory_with_an_hpc_checkpoint_is_refused_unless_requeued(tmp_path, monkeypatch, capsys):
    """Only a requeued job (SLURM_RESTART_COUNT > 0) continues the run of its directory without --ckpt_path."""
    run_dir = tmp_path / "run"
    sigterm_at_first_step(run_dir)
    shutil.copyfile(run_dir / "checkpoints" / "last.ckpt", run_dir / "hpc_ckpt_1.ckpt")
    for name, value in SLURM_JOB.items():
        monkeypatch.setenv(name, value)
    command = ["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}"]
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.is_file()}
    assert run_failing(main_pretrain, command, capsys).endswith("already holds a run: resume it with --ckpt_path last, or start a new one under another trainer.default_root_dir")
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.is_file()} == before
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    other = tmp_path / "other.ckpt"  # a job script that started from another run's checkpoint repeats its ckpt_path
    shutil.copyfile(run_dir / "checkpoints" / "last.ckpt", other)
    assert main_pretrain.cli_main([*command, f"--ckpt_path={other}"]).trainer.ckpt_path == str(run_dir / "hpc_ckpt_1.ckpt")



@pytest.mark.parametrize("resume, newer", [("requeued-slurm-job", "last"), ("requeued-slurm-job", "hpc"), ("ckpt_path-last", "hpc")])
@pytest.mark.slow
def test_a_resumed_run_restores_the_newer_of_its_last_ckpt_and_its_hpc_checkpoint(resume, newer, tmp_path, monkeypatch):
    """A SIGUSR1 checkpoint before the time limit and a last.ckpt written after it (an epoch's end, a SIGTERM), or
    the reverse: the requeued job and `--ckpt_path last` continue from whichever is newer, losing no step."""
    run_dir = tmp_path / "run"
    sigterm_at_first_step(run_dir, step=2)  # in epoch 1: last.ckpt holds step 3, epoch=0-step=2.ckpt the end of epoch 0
    last, hpc = run_dir / "checkpoints" / "last.ckpt", run_dir / "hpc_ckpt_1.ckpt"
    shutil.copyfile(run_dir / "checkpoints" / "epoch=0-step=2.ckpt", hpc)
    older, newest = (hpc, last) if newer == "last" else (last, hpc)
    os.utime(older, (newest.stat().st_mtime - 60,) * 2)
    for name, value in (SLURM_JOB | {"SLURM_RESTART_COUNT": "2"} if resume == "requeued-slurm-job" else {}).items():
        monkeypatch.setenv(name, value)
    cli = main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}",
                                  *(["--ckpt_path=last"] if resume == "ckpt_path-last" else [])])
    assert cli.trainer.ckpt_path == str(newest) and cli.trainer.global_step == 4


def test_shuffle_bn_without_effect_in_one_process_is_no_changed_setting_but_is_with_split_bn_or_several_processes():
    """The one-device PaCo configs said `shuffle_bn: true` before they said `false`: the same computation in one
    process without split-BN, so their runs resume; with split-BN, or on several processes, it is another run."""
    from engine.cli.resume import changed_setting

    def config(shuffle_bn: bool, split_bn: int = 1) -> dict:
        return {"model": {"class_path": "methods.PaCo", "init_args": {"momentum": {"shuffle_bn": shuffle_bn, "split_bn": split_bn}}}}

    def checkpoint(shuffle_bn: bool, split_bn: int = 1, world_size: int = 1) -> dict:
        return {"contrastlab": {"config": config(shuffle_bn, split_bn), "world_size": world_size}}

    assert changed_setting(checkpoint(True), config(False), 1) is None
    assert changed_setting(checkpoint(True), config(False), None) is None  # before the processes are known
    assert changed_setting(checkpoint(True, split_bn=8), config(False, split_bn=8), 1).startswith("model.init_args.momentum.shuffle_bn False")
    assert changed_setting(checkpoint(True, world_size=4), config(False), 4).startswith("model.init_args.momentum.shuffle_bn False")

def cut_short(path: Path) -> None:
    """What a copy interrupted half-way, or a full disk, leaves of a checkpoint."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def uninterrupted_two_epochs(tmp_path_factory) -> dict:
    """last.ckpt of a two-epoch CLI run that nothing interrupted."""
    run_dir = tmp_path_factory.mktemp("straight")
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}"])
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.parametrize("resume", ["ckpt_path-last", "requeued-slurm-job"])
@pytest.mark.slow
def test_a_truncated_last_ckpt_resumes_from_the_newest_readable_checkpoint_with_a_warning_and_ends_as_an_uninterrupted_run(
        resume, uninterrupted_two_epochs, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    sigterm_at_first_step(run_dir, step=2)  # in epoch 1: last.ckpt holds step 3, epoch=0-step=2.ckpt the end of epoch 0
    last, older = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "epoch=0-step=2.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3 and older.is_file()
    cut_short(last)
    if resume == "requeued-slurm-job":
        for name, value in (SLURM_JOB | {"SLURM_RESTART_COUNT": "1"}).items():
            monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning) as warned:
        cli = main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *SIGNALLED_RUN, "--trainer.max_epochs=2", f"--trainer.default_root_dir={run_dir}",
                                      *(["--ckpt_path=last"] if resume == "ckpt_path-last" else [])])
    messages = "\n".join(str(warning.message) for warning in warned)
    assert f"{last} could not be read as a checkpoint: " in messages
    assert f": taking {older} instead, the newest readable checkpoint of this run" in messages
    assert cli.trainer.ckpt_path == str(older) and cli.trainer.global_step == 4
    resumed = torch.load(last, weights_only=True)
    for key in ("state_dict", "optimizer_states", "DigitsDataModule"):
        assert_identical(uninterrupted_two_epochs[key], resumed[key], key)


@pytest.mark.slow
def test_a_truncated_last_ckpt_without_another_readable_checkpoint_is_one_error_line_and_nothing_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    sigterm_at_first_step(run_dir)  # last.ckpt only: stopped before the first epoch ended
    last = run_dir / "checkpoints" / "last.ckpt"
    cut_short(last)
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    with_the_configs_logger = [argument for argument in SIGNALLED_RUN if argument != "--trainer.logger=false"]  # W&B writes into the run directory
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *with_the_configs_logger, f"--trainer.default_root_dir={run_dir}", "--ckpt_path=last"], capsys)
    assert line.startswith(f"error: {last} could not be read as a checkpoint: ")
    assert line.endswith("; this run holds no other readable checkpoint: start a new run under another trainer.default_root_dir")
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before


@pytest.mark.slow
def test_a_sigusr1_outside_slurm_kills_a_training_subprocess_and_last_ckpt_still_loads(tmp_path):
    """Outside Slurm nothing handles SIGUSR1: the process dies at once, as if killed, and the checkpoint
    of the last epoch must survive (Slurm's SIGUSR1 is Lightning's: an hpc checkpoint and a requeue)."""
    last = tmp_path / "checkpoints" / "last.ckpt"
    process = subprocess.Popen([sys.executable, str(ROOT / "main_pretrain.py"), "fit", "--config", PRETRAIN_DIGITS, *TINY_RUN,
                                "--trainer.max_epochs=1000", "--trainer.limit_val_batches=0", "--trainer.logger=false",
                                "--trainer.precision=32-true", f"--trainer.default_root_dir={tmp_path}"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900  # generous: a loaded machine is slow, not wrong
    while not last.is_file() and process.poll() is None and time.monotonic() < deadline:  # the first epoch's checkpoint
        time.sleep(0.1)
    process.send_signal(signal.SIGUSR1)
    stderr = process.communicate(timeout=60)[1]
    assert process.returncode == -signal.SIGUSR1, stderr[-2000:]
    assert torch.load(last, weights_only=True)["global_step"] >= 2


def test_an_interrupted_checkpoint_write_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    last = tmp_path / "last.ckpt"
    checkpoint_io = SameDirectoryCheckpointIO()
    checkpoint_io.save_checkpoint({"global_step": 2, "weights": torch.ones(4)}, last)

    partials = []

    def killed_while_writing(checkpoint, path):
        Path(path).write_bytes(b"half a checkpoint")
        partials.append(Path(path))
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_io.save_checkpoint({"global_step": 3, "weights": torch.zeros(4)}, last)
    monkeypatch.undo()
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert [partial.parent for partial in partials] == [tmp_path]  # written next to it: a rename, never a copy
    assert sorted(tmp_path.iterdir()) == [last]  # the interrupted write's partial file is removed


def test_a_file_is_flushed_to_disk_before_it_is_renamed_over_the_old_one_and_the_rename_after(tmp_path, monkeypatch):
    # without the first flush a machine that goes down after the rename can leave an empty or truncated last.ckpt
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda descriptor: (events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}"))), fsync(descriptor)))
    monkeypatch.setattr(os, "replace", lambda source, target: (events.append(("replace", str(target))), replace(source, target)))
    last = tmp_path / "last.ckpt"
    SameDirectoryCheckpointIO().save_checkpoint({"global_step": 3}, last)
    assert [(event, Path(name).parent if event == "fsync" and name.endswith(".partial") else name) for event, name in events] == [
        ("fsync", tmp_path), ("replace", str(last)), ("fsync", str(tmp_path))]
    assert torch.load(last, weights_only=True)["global_step"] == 3


def test_two_writers_of_one_file_at_once_each_publish_a_whole_file(tmp_path):
    table = tmp_path / "table.md"

    def first_writer(partial):
        partial.write_text("the first writer's ")
        write_atomically(table, lambda other: other.write_text("the second writer's table"))  # in the middle of it
        assert table.read_text() == "the second writer's table"
        with partial.open("a") as stream:
            stream.write("table")

    write_atomically(table, first_writer)
    assert table.read_text() == "the first writer's table"
    assert sorted(tmp_path.iterdir()) == [table]


def test_a_name_of_up_to_255_bytes_is_written_and_a_longer_one_is_refused_naming_it(tmp_path):
    longest = tmp_path / ("a" * 255)  # the partial file's name is cut to fit beside it
    write_atomically(longest, lambda partial: partial.write_text("whole"))
    assert longest.read_text() == "whole" and sorted(tmp_path.iterdir()) == [longest]
    too_long = tmp_path / ("b" * 256)
    with pytest.raises(WriteFailed, match=re.escape(f"cannot write {too_long}: File name too long")):
        write_atomically(too_long, lambda partial: partial.write_text("whole"))
    assert sorted(tmp_path.iterdir()) == [longest]


def test_fit_in_a_directory_that_holds_a_run_is_refused_naming_how_to_resume_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"an earlier run")
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run_dir}"], capsys)
    assert line == f"error: {run_dir / 'checkpoints' / 'last.ckpt'} already holds a run: resume it with --ckpt_path last, or start a new one under another trainer.default_root_dir"
    assert sorted(path.name for path in run_dir.rglob("*")) == ["checkpoints", "last.ckpt"]  # nothing written


# ----------------------------------------------------------------- seeds
def test_every_shipped_config_sets_an_explicit_integer_seed():
    for config in CONFIGS:
        seed = yaml.safe_load(config.read_text()).get("seed_everything")
        assert type(seed) is int, f"{config.name}: seed_everything {seed!r}"


class StepLosses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss"].item())


def first_epoch_losses(seed: int, run_dir) -> list[float]:
    cli = main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--seed_everything={seed}", "--trainer.limit_train_batches=3",
                                  "--trainer.limit_val_batches=0", "--trainer.logger=false",
                                  f"--trainer.default_root_dir={run_dir}", "--trainer.callbacks+=test_reliability.StepLosses"])
    return next(callback for callback in cli.trainer.callbacks if isinstance(callback, StepLosses)).losses


@pytest.mark.slow
def test_the_same_seed_gives_identical_first_epoch_losses_and_another_seed_different_ones(tmp_path):
    first, again, other = (first_epoch_losses(seed, tmp_path / name) for seed, name in ((3, "a"), (3, "b"), (4, "c")))
    assert len(first) == 3 and first == again
    assert all(a != b for a, b in zip(first, other))


@pytest.mark.parametrize("seed", ["true", "false"])
def test_a_seed_that_is_not_an_integer_is_refused(seed, tmp_path, capsys):
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, f"--seed_everything={seed}", f"--trainer.default_root_dir={tmp_path}"], capsys)
    assert line == f"error: seed_everything must be an explicit integer (a config's seed_everything or --seed_everything), got {seed.title()}"


def test_a_config_without_a_seed_is_refused(tmp_path, capsys):
    config = tmp_path / "unseeded.yaml"
    config.write_text(Path(PRETRAIN_DIGITS).read_text().replace("seed_everything: 0\n", ""))
    line = run_failing(main_pretrain, ["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path}"], capsys)
    assert line.startswith("error: seed_everything must be an explicit integer") and line.endswith("got True")


# ----------------------------------------------------------------- non-finite losses
def nan_at_calls(monkeypatch, module, name: str, bad_calls) -> None:
    """Make the loss function `module.name` return NaN at the given calls (0-based; one call per training step)."""
    original, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        calls.append(None)
        loss = original(*args, **kwargs)
        return loss * float("nan") if len(calls) - 1 in bad_calls else loss

    monkeypatch.setattr(module, name, patched)


@pytest.mark.slow
def test_a_non_finite_loss_stops_the_run_at_its_step_naming_it_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    nan_at_calls(monkeypatch, methods.moco, "info_nce", {3})  # 2 steps per epoch: the second step of epoch 1
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.max_epochs=2", "--trainer.limit_val_batches=1", "--trainer.precision=32-true",
                                       "--trainer.logger=false", f"--trainer.default_root_dir={run_dir}"], capsys)
    assert line.startswith("error: non-finite training loss at global step 3 (epoch 1, batch 1): loss nan; latest logged values: ")
    assert "train/loss nan" in line and "train/probe_loss " in line
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2  # the end of epoch 0: the failing step saved nothing
    assert all(value.isfinite().all() for value in checkpoint["state_dict"].values() if value.is_floating_point())
    assert not (run_dir / "results_val.json").exists()


def train_with_nan(monkeypatch, tmp_path, bad_steps, guard: NonFiniteLossGuard, steps: int = 4):
    """A tiny MoCo v2 whose InfoNCE is NaN at the given steps; returns the trainer and the online trunk's
    first weights before each step and after the last."""
    nan_at_calls(monkeypatch, methods.moco, "info_nce", bad_steps)
    weights = []

    class Weights(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            weights.append(pl_module.backbone.conv1[0].weight.detach().clone())

    L.seed_everything(0, verbose=False)
    build, views = METHODS["moco"]
    trainer = cpu_trainer(tmp_path, max_steps=steps, limit_val_batches=0, callbacks=[guard, Weights()])
    model = build()
    try:
        trainer.fit(model, digits(views, batch_size=8, pipeline="gpu"))
    finally:
        weights.append(model.backbone.conv1[0].weight.detach().clone())
    return trainer, weights


def test_skip_batch_drops_a_non_finite_batch_and_training_goes_on(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match=r"non-finite training loss at global step 1 .*; batch skipped \(1 in a row\)") as caught:
        trainer, weights = train_with_nan(monkeypatch, tmp_path, {1}, NonFiniteLossGuard(skip_batch=True))
    assert not [warning for warning in caught if "requires_grad" in str(warning.message)]  # the message reads the loss off its graph
    assert trainer.global_step == 4
    changed = [not torch.equal(before, after) for before, after in zip(weights, weights[1:])]
    assert changed == [True, False, True, True]  # step 1 updated nothing; the optimizer's momentum did not move it either


def test_skip_batch_with_two_processes_is_one_error_line_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, f"--trainer.default_root_dir={run_dir}", "--trainer.logger=false",
                                       "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp", "--non_finite.skip_batch=true"], capsys)
    assert line == "error: non_finite.skip_batch works in a single process only, this run has 2: set it to false (the run then stops at a non-finite loss)"
    assert not run_dir.exists()


def test_skip_batch_stops_after_too_many_non_finite_batches_in_a_row(tmp_path, monkeypatch):
    guard = NonFiniteLossGuard(skip_batch=True, max_consecutive_skips=2)
    with pytest.warns(UserWarning, match="batch skipped"), pytest.raises(NonFiniteLossError, match="at global step 3 "):
        train_with_nan(monkeypatch, tmp_path, {1, 2, 3}, guard)


# ----------------------------------------------------------------- checkpoint compatibility
@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory) -> Path:
    """last.ckpt of a one-epoch MoCo v2 run through main_pretrain.py."""
    run_dir = tmp_path_factory.mktemp("pretrain")
    main_pretrain.cli_main(["fit", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.limit_val_batches=0", "--trainer.logger=false",
                            "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}"])
    return run_dir / "checkpoints" / "last.ckpt"


def with_record(source: Path, target: Path, **record) -> Path:
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["contrastlab"] |= record
    torch.save(checkpoint, target)
    return target


def test_every_checkpoint_records_the_version_the_method_and_the_resolved_config(cli_checkpoint):
    record = torch.load(cli_checkpoint, weights_only=True)["contrastlab"]
    assert record["version"] == re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert record["module"] == "methods.moco.MoCoV2"
    config = record["config"]
    assert config["seed_everything"] == 0 and config["model"]["class_path"] == "methods.MoCoV2"
    assert config["model"]["init_args"]["queue_size"] == 64 and config["data"]["init_args"]["batch_size"] == 16  # the overrides
    assert yaml.safe_load((cli_checkpoint.parents[1] / "config.yaml").read_text()) == config  # the run's config.yaml: the same config


@pytest.mark.parametrize(
    "saved, current, loads",
    [("0.1.7", "0.1.0", True), ("0.2.0", "0.1.0", False), ("1.4.2", "1.0.0", True), ("2.0.0", "1.9.0", False)],
)
def test_compatible_versions_follow_semantic_versioning(saved, current, loads):
    assert compatible(saved, current) == loads


def test_loading_a_checkpoint_of_an_incompatible_version_says_so(cli_checkpoint, tmp_path):
    major, minor = map(int, VERSION.split(".")[:2])
    MoCoV2.load_from_checkpoint(with_record(cli_checkpoint, tmp_path / "patch.ckpt", version=f"{major}.{minor}.99"))
    newer = with_record(cli_checkpoint, tmp_path / "minor.ckpt", version=f"{major}.{minor + 1}.0")
    with pytest.raises(CheckpointMismatch, match=rf"was written by contrastlab {major}.{minor + 1}.0 \(methods.moco.MoCoV2\), which this contrastlab {VERSION} cannot load"):
        MoCoV2.load_from_checkpoint(newer)


def test_resuming_from_an_incompatible_or_foreign_checkpoint_is_one_error_line(cli_checkpoint, tmp_path, capsys):
    incompatible = with_record(cli_checkpoint, tmp_path / "old.ckpt", version="0.0.3")
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, foreign)
    for path, expected in ((incompatible, "was written by contrastlab 0.0.3 (methods.moco.MoCoV2), which this contrastlab"),
                           (foreign, "is not a Lightning checkpoint and holds no contrastlab record (version, module class)")):
        line = run_failing(main_pretrain, ["fit", "--config", PRETRAIN_DIGITS, f"--ckpt_path={path}", f"--trainer.default_root_dir={tmp_path / 'run'}"], capsys)
        assert line.startswith(f"error: ckpt_path '{path}' {expected}")


def test_an_evaluation_takes_the_knn_settings_from_its_command_line_and_refuses_other_model_arguments(cli_checkpoint, tmp_path, capsys):
    """Lightning puts the checkpoint's hyperparameters over the model arguments of `validate`: knn_k 5 was evaluated as
    200, and a temperature or trunk given there was dropped without a word."""
    run_dir = tmp_path / "run"
    evaluation = ["validate", "--config", PRETRAIN_DIGITS, *TINY_RUN, "--trainer.logger=false",
                  f"--trainer.default_root_dir={run_dir}", f"--ckpt_path={cli_checkpoint}"]
    assert main_pretrain.cli_main([*evaluation, "--model.init_args.knn_k=5", "--model.knn_temperature=0.1"]).model.knn_k == 5
    assert yaml.safe_load((run_dir / "config_validate.yaml").read_text())["model"]["init_args"]["knn_temperature"] == 0.1
    results = json.loads((run_dir / "results_validate.json").read_text())
    assert (results["knn_k"], results["knn_temperature"]) == (5, 0.1)  # what its numbers are of
    shutil.rmtree(run_dir)
    for override, value, trained in (("--model.init_args.temperature=0.5", "0.5", "0.2"), ("--model.backbone.name=resnet18", "'resnet18'", "'timm:test_resnet'")):
        line = run_failing(main_pretrain, [*evaluation, override], capsys)
        key = override.partition("=")[0].removeprefix("--").replace("model.backbone", "model.init_args.backbone")
        assert line == (f"error: {key} {value} given on the command line, but validate evaluates the model of its checkpoint, trained with "
                        f"{trained}; an evaluation may change knn_k, knn_temperature")
        assert not run_dir.exists()


def test_a_checkpoint_written_before_the_record_existed_loads_with_a_warning(cli_checkpoint, tmp_path):
    checkpoint = torch.load(cli_checkpoint, weights_only=True)
    del checkpoint["contrastlab"]  # as every checkpoint of the runs measured before issue 12
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match="holds no contrastlab record .written before checkpoints recorded the version.: loaded without a version check"):
        model = MoCoV2.load_from_checkpoint(tmp_path / "old.ckpt")
    assert torch.equal(model.queue.keys, checkpoint["state_dict"]["queue.keys"])
    with pytest.warns(UserWarning, match="model.pretrained_ckpt .* holds no contrastlab record"):
        state, _, _ = methods.probed_trunk.probed_trunk(str(tmp_path / "old.ckpt"), None, None)
    assert state.keys() == {name.removeprefix("backbone.") for name in checkpoint["state_dict"] if name.startswith("backbone.")}


def record_only_checkpoint(model, path: Path) -> Path:
    """A checkpoint as the module's own `on_save_checkpoint` records it (no Trainer needed)."""
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def test_the_linear_stage_refuses_a_checkpoint_of_another_method_family_in_one_line(tmp_path, capsys):
    checkpoints = {
        "methods.linear.LinearProbe": record_only_checkpoint(LinearProbe(random_init=True, backbone=FAST_BACKBONE), tmp_path / "probe.ckpt"),
        "methods.longtail.cross_entropy.CrossEntropy": record_only_checkpoint(CrossEntropy(backbone=FAST_BACKBONE), tmp_path / "ce.ckpt"),
    }
    for module, path in checkpoints.items():
        line = run_failing(main_linear, ["fit", "--config", LINEAR_DIGITS, f"--model.pretrained_ckpt={path}", f"--trainer.default_root_dir={tmp_path / 'run'}"], capsys)
        assert line == (f"error: model.init_args.pretrained_ckpt '{path}' is a {module} checkpoint: the linear stage "
                        "probes the trunk of a pretraining method (methods.PretrainMethod, e.g. methods.MoCoV2) (given on the command line)")


def test_main_linear_given_a_pretraining_checkpoint_as_ckpt_path_points_to_model_pretrained_ckpt(cli_checkpoint, tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = run_failing(main_linear, ["fit", "--config", LINEAR_DIGITS, f"--ckpt_path={cli_checkpoint}", f"--trainer.default_root_dir={run_dir}"], capsys)
    assert line == (f"error: ckpt_path '{cli_checkpoint}' is a methods.moco.MoCoV2 checkpoint, but this run's model is methods.LinearProbe: "
                    "--ckpt_path resumes or evaluates a run of the same model (a pretraining checkpoint to probe is --model.pretrained_ckpt)")
    assert not run_dir.exists()


TINY_PROBE = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
              "--data.init_args.train_variants=1", "--data.init_args.eval_variants=1"]


@pytest.mark.slow
def test_a_probe_runs_under_its_pretraining_run_and_resuming_it_with_another_pretrained_ckpt_is_refused(cli_checkpoint, tmp_path, capsys):
    pretrained, other = tmp_path / "moco" / "checkpoints" / "last.ckpt", tmp_path / "other" / "last.ckpt"
    for copy in (pretrained, other):
        copy.parent.mkdir(parents=True)
        shutil.copy(cli_checkpoint, copy)
    probe = ["fit", "--config", LINEAR_DIGITS, *TINY_PROBE]
    cli = main_linear.cli_main([*probe, f"--model.pretrained_ckpt={pretrained}"])
    probe_dir = tmp_path / "moco" / "linear"
    assert cli.trainer.default_root_dir == str(probe_dir) and (probe_dir / "results_val.json").is_file()
    assert yaml.safe_load((probe_dir / "config.yaml").read_text())["trainer"]["default_root_dir"] == str(probe_dir)
    before = {path: path.stat().st_mtime_ns for path in probe_dir.rglob("*")}
    for ckpt_path in ("last", probe_dir / "checkpoints" / "last.ckpt"):
        line = run_failing(main_linear, [*probe, f"--model.pretrained_ckpt={other}", f"--trainer.default_root_dir={probe_dir}", f"--ckpt_path={ckpt_path}"], capsys)
        assert line.endswith(f"holds a probe of model.pretrained_ckpt '{pretrained}', not of '{other}': resuming it would restore the trunk of "
                             f"'{pretrained}'; probe '{other}' under another trainer.default_root_dir")
    assert {path: path.stat().st_mtime_ns for path in probe_dir.rglob("*")} == before
    assert main_linear.cli_main([*probe, f"--model.pretrained_ckpt={other}"]).trainer.default_root_dir == str(tmp_path / "other" / "linear")
    # the config records the encoder probed, as a run did before the default became null: such a run resumes
    assert yaml.safe_load((probe_dir / "config.yaml").read_text())["model"]["init_args"]["pretrained_encoder"] == "online"
    resumed = main_linear.cli_main([*probe, f"--model.pretrained_ckpt={pretrained}", f"--trainer.default_root_dir={probe_dir}", "--ckpt_path=last"])
    assert resumed.trainer.current_epoch == 1 and resumed.model.hparams.pretrained_encoder == "online"
    # the file itself resumes as `last` does: the null default is settled before the comparison (it was refused, as a run with None)
    by_file = main_linear.cli_main([*probe, f"--model.pretrained_ckpt={pretrained}", f"--trainer.default_root_dir={probe_dir}",
                                    f"--ckpt_path={probe_dir / 'checkpoints' / 'last.ckpt'}"])
    assert by_file.model.hparams.pretrained_encoder == "online"
    # the file without --model.pretrained_ckpt: the probe's own, as a validate reads it (refused before as 'pretrained_ckpt None')
    own = main_linear.cli_main([*probe, f"--trainer.default_root_dir={probe_dir}", f"--ckpt_path={probe_dir / 'checkpoints' / 'last.ckpt'}"])
    assert own.model.hparams.pretrained_ckpt == str(pretrained)


@pytest.mark.slow
def test_a_probe_evaluated_after_its_pretraining_trained_on_records_the_step_of_the_trunk_it_restores(cli_checkpoint, tmp_path):
    """Its checkpoint brings back the trunk it probed: its numbers are of that step, not of what the file holds now."""
    pretrained = tmp_path / "moco" / "checkpoints" / "last.ckpt"
    pretrained.parent.mkdir(parents=True)
    shutil.copy(cli_checkpoint, pretrained)
    main_linear.cli_main(["fit", "--config", LINEAR_DIGITS, *TINY_PROBE, "--trainer.logger=false", f"--model.pretrained_ckpt={pretrained}"])
    probe_dir = tmp_path / "moco" / "linear"
    step = json.loads((probe_dir / "results_val.json").read_text())["pretrained_step"]
    trained_on = torch.load(pretrained, weights_only=True)
    trained_on["global_step"] = step + 5  # the pretraining resumed since
    torch.save(trained_on, pretrained)
    with pytest.warns(UserWarning, match=rf"this probe's trunk is of step {step} of model.pretrained_ckpt .*, which holds step {step + 5} now"):
        main_linear.cli_main(["validate", "--config", LINEAR_DIGITS, *TINY_PROBE, "--trainer.logger=false", f"--trainer.default_root_dir={probe_dir}",
                              f"--ckpt_path={probe_dir / 'checkpoints' / 'last.ckpt'}"])
    assert json.loads((probe_dir / "results_validate.json").read_text())["pretrained_step"] == step


# ----------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "config, override, expected",
    [
        ("moco_digits", "--model.init_args.queue_size=many", 'Parser key "model.init_args.queue_size": Expected a <class \'int\'>. Got value: many'),
        ("moco_digits", "--model.init_args.temperature=0", "model.init_args.temperature must be > 0, got 0.0 (given on the command line)"),
        ("sce_digits", "--model.init_args.coeff=1.5", "model.init_args.coeff must lie in [0, 1], got 1.5 (given on the command line)"),
        ("tcl_digits", "--model.init_args.k1=-1", "model.init_args.k1 must be >= 0, got -1.0 (given on the command line)"),
        ("paco_digits_lt", "--model.init_args.temperature=-0.1", "model.init_args.temperature must be > 0, got -0.1 (given on the command line)"),
        ("moco_digits", "--model.init_args.optimizer.lr=-1", "model.init_args.optimizer.lr must be >= 0, got -1 (given on the command line)"),  # as given, not scaled to -0.5
        ("ce_digits_lt", "--model.init_args.optimizer.weight_decay=-1e-4", "model.init_args.optimizer.weight_decay must be >= 0, got -0.0001 (given on the command line)"),
        # refused while configure_optimizers built it, with a traceback, after config.yaml and run.lock were written
        ("vicreg_digits", "--model.init_args.optimizer.fused=true", "optimizer.fused: true, but LARS has no fused kernel (it runs multi-tensor)"),
        # trainer values Lightning refuses when it builds the trainer: a traceback of 35-40 lines before
        ("moco_digits", "--trainer.max_time=48h", "error: `Timer(duration='48h')` is not a valid duration. Expected a string in the format DD:HH:MM:SS."),
        ("moco_digits", "--trainer.devices=0", "error: `Trainer(devices='0')` value is not a valid input using cpu accelerator."),
        # a ZeroDivisionError once training started, after config.yaml and run.lock were written
        ("moco_digits", "--trainer.accumulate_grad_batches=0", "error: trainer.accumulate_grad_batches must be an integer >= 1, got 0"),
        ("moco_digits", "--trainer.max_epochs=0", "error: trainer.max_epochs 0 trains nothing"),  # it wrote its files and exited 0
        # an OverflowError in configure_optimizers (the schedules' length of an open-ended run), after its files
        ("moco_digits", "--trainer.max_epochs=-1", "error: trainer.max_epochs -1 without trainer.max_steps: the learning-rate and momentum schedules"),
        # torch's SGD refused it in configure_optimizers, after the files; LARS ignored it
        ("vicreg_digits", "--model.init_args.optimizer.nesterov=true", "optimizer.nesterov: true needs name: sgd with momentum > 0, got name lars with momentum 0.9"),
        # Lightning's "found ModelCheckpoint in callbacks list" did not say how to keep fewer checkpoints
        ("moco_digits", "--trainer.enable_checkpointing=false", "error: trainer.enable_checkpointing false: every run keeps checkpoints/last.ckpt"),
    ],
)
def test_an_out_of_range_or_mistyped_value_ends_with_one_error_line_naming_it(config, override, expected, tmp_path, capsys):
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", str(ROOT / "configs" / f"{config}.yaml"), f"--trainer.default_root_dir={run_dir}", override], capsys)
    assert expected in line
    assert not run_dir.exists()


def test_a_fused_optimizer_with_the_trainers_gradient_clipping_is_one_error_line_before_anything_is_written(tmp_path, capsys):
    """Lightning refused it with a RuntimeError at the first step under mixed precision, after config.yaml and run.lock."""
    run_dir = tmp_path / "run"
    line = run_failing(main_pretrain, ["fit", "--config", str(ROOT / "configs" / "moco_digits.yaml"), f"--trainer.default_root_dir={run_dir}",
                                       "--model.init_args.optimizer.fused=true", "--trainer.gradient_clip_val=1.0"], capsys)
    assert line.startswith("error: model.init_args.optimizer.fused true with trainer.gradient_clip_val: a fused step unscales")
    assert not run_dir.exists()


def test_fewer_than_one_key_view_per_query_is_refused(tmp_path, capsys):
    config = tmp_path / "jcl.yaml"
    config.write_text((ROOT / "configs" / "jcl_digits.yaml").read_text().replace("count: 3}", "count: 0}"))
    line = run_failing(main_pretrain, ["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'run'}"], capsys)
    assert line == f"error: data.init_args.views.keys.count must be an integer >= 1, got 0 (from {config})"  # JCL's M'


def test_an_empty_split_file_is_refused_naming_it(tmp_path):
    (tmp_path / "train.txt").write_text("\n")
    (tmp_path / "val.txt").write_text("val/a.jpg 0\n")
    with pytest.raises(ValueError, match=re.escape(f"data.train_file '{tmp_path / 'train.txt'}' lists no images")):
        SplitFileDataModule(root=str(tmp_path), train_file=str(tmp_path / "train.txt"), val_file=str(tmp_path / "val.txt"), views={"image": {"preset": "npid"}})
