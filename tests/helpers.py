"""Tiny, deterministic configurations of the real components, shared by the tests."""

import copy
import multiprocessing
import socket
from contextlib import closing

import lightning as L
import torch
import torch.multiprocessing as mp

from backbones import BackboneSpec, MLPSpec
from datamodules import DigitsDataModule

TINY_BACKBONE = BackboneSpec(name="resnet18")  # ImageNet stem: ~8x fewer FLOPs than the small stem at 32 px
# the Digits-M configs' trunk (0.37 M parameters): the tests that train for several steps take a third of the time
# they take with TINY_BACKBONE
SMALL_TRUNK = BackboneSpec(name="timm:test_resnet")
TINY_PROJECTOR = MLPSpec(hidden_dim=64, output_dim=32, batch_norm=False)


def digits(views: dict, batch_size: int = 32, num_workers: int = 0, **kwargs) -> DigitsDataModule:
    return DigitsDataModule(batch_size=batch_size, num_workers=num_workers, views=views, train_variants=1, eval_variants=1, **kwargs)


def first_batch(datamodule: DigitsDataModule) -> dict:
    """The first training batch of a DataModule, set up here."""
    datamodule.setup()
    return next(iter(datamodule.train_dataloader()))


def free_port() -> int:
    """A TCP port no other process listens on now, for the rendezvous of a test's processes: a fixed port would
    be taken by the processes of another test running at the same time (the suite runs on parallel workers)."""
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_processes(worker, args: tuple, nprocs: int = 2, join: bool = True):
    """`nprocs` processes running `worker(rank, *args)`, forked from Python's fork server, which imports torch,
    Lightning, the project and the worker's test module once per test process: a spawned process imports them
    itself (about 9 s on the 2-core test machine) and a process forked from a test process would inherit its
    OpenMP threads' state."""
    multiprocessing.set_forkserver_preload(["torch", "lightning.pytorch", "main_pretrain", "helpers", worker.__module__])
    return mp.start_processes(worker, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def cpu_trainer(tmp_path, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    return L.Trainer(**(options | kwargs))


def fixed_batch_loss(model, batch: dict, queue: torch.Tensor) -> float:
    """A queue method's loss on fixed views against a fixed queue, on a copy (nothing is updated)."""
    frozen = copy.deepcopy(model).train()
    frozen.queue.keys.copy_(queue)
    with torch.no_grad():
        return frozen.step(batch)[0].item()


def randomised(module: torch.nn.Module, seed: int = 2) -> torch.nn.Module:
    """BatchNorm statistics and affine parameters away from their initial values (exported and imported with the weights)."""
    generator = torch.Generator().manual_seed(seed)
    for child in module.modules():
        if isinstance(child, torch.nn.BatchNorm2d):
            child.running_mean.copy_(torch.randn(child.num_features, generator=generator) * 0.1)
            child.running_var.copy_(torch.rand(child.num_features, generator=generator) + 0.5)
            child.weight.data.copy_(torch.rand(child.num_features, generator=generator) + 0.5)
            child.bias.data.copy_(torch.randn(child.num_features, generator=generator) * 0.1)
    return module


def loss_before_and_after_training(model, views: dict, tmp_path, steps: int = 10, batch_size: int = 32) -> tuple[float, float]:
    """The method's loss on one fixed Digits-M batch (on a copy, BatchNorm in training mode) before and after
    `steps` training steps on Digits-M: what the lowers-the-loss tests compare."""
    batch = first_batch(digits(views, batch_size=batch_size))

    def loss() -> float:
        with torch.no_grad():
            return copy.deepcopy(model).train().step(batch)[0].item()

    before = loss()
    cpu_trainer(tmp_path, max_steps=steps, limit_val_batches=0).fit(model, digits(views, batch_size=batch_size))
    return before, loss()
