"""Tiny, deterministic configurations of the real components, shared by the tests."""

import copy

import lightning as L
import torch

from backbones import BackboneSpec, MLPSpec
from datamodules import DigitsDataModule

TINY_BACKBONE = BackboneSpec(name="resnet18")  # ImageNet stem: ~8x fewer FLOPs than the small stem at 32 px
TINY_PROJECTOR = MLPSpec(hidden_dim=64, output_dim=32, batch_norm=False)


def digits(views: dict, batch_size: int = 32, **kwargs) -> DigitsDataModule:
    return DigitsDataModule(batch_size=batch_size, num_workers=0, views=views, train_variants=1, eval_variants=1, **kwargs)


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
        return frozen.contrastive_step(batch)[0].item()
