"""`LinearProbe`: the second stage, a linear classifier on a frozen pretrained trunk (`main_linear.py`).

The trunk is loaded **strictly** from the `backbone.*` weights of a pretraining checkpoint (the online
trunk, as MoCo's `main_lincls.py` uses `encoder_q`), frozen and kept in eval mode (BatchNorm
statistics frozen), and run without gradients; only the linear layer learns. The checkpoint must be a
`PretrainMethod`'s, written by a compatible contrastlab version (`engine.reliability`): a long-tail
classifier's or a linear probe's is refused. The default optimizer is the MoCo / SCE small-dataset
protocol (SGD lr 30, momentum 0.9, no weight decay, x0.1 at epochs 60 and 80 of 100; MoCo's main_lincls.py, CEA-LIST/SCE's linear configs).
The pretraining checkpoint is a model argument, never `ckpt_path` (which would try to restore this
module from it).
"""

import contextlib
import dataclasses
import importlib
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from backbones import BackboneSpec, load_state_strictly
from engine.config import as_spec, save_plain_hyperparameters
from engine.optim import OptimizerSpec, ScheduleSpec, configure_optimization, parameter_groups
from engine.reliability import RECORD_KEY, CheckpointRecord, checkpoint_class
from interop import official_trunk
from interop.files import read_checkpoint
from methods.base import PretrainMethod
from methods.evaluation import EvaluationMixin


def load_backbone_state(checkpoint_path: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The `backbone.*` weights (prefix removed) and the backbone spec stored in a pretraining checkpoint."""
    checkpoint = read_checkpoint(checkpoint_path, f"model.pretrained_ckpt {checkpoint_path!r}")
    state = {
        key.removeprefix("backbone."): value
        for key, value in checkpoint.get("state_dict", {}).items()
        if key.startswith("backbone.")
    }
    if not state:
        raise ValueError(f"model.pretrained_ckpt {checkpoint_path!r} holds no 'backbone.*' weights: not a contrastlab pretraining checkpoint")
    recorded = checkpoint_class(checkpoint, f"model.pretrained_ckpt {checkpoint_path!r}")
    if recorded is not None and not issubclass(recorded[1], PretrainMethod):
        raise ValueError(
            f"model.pretrained_ckpt {checkpoint_path!r} is a {recorded[0]} checkpoint, not a pretraining one: the linear "
            "stage probes the trunk of a pretraining method (methods.PretrainMethod, e.g. methods.MoCoV2)"
        )
    return state, checkpoint.get("hyper_parameters", {}).get("backbone")


class LinearProbe(CheckpointRecord, EvaluationMixin, L.LightningModule):
    views = ("image",)

    def __init__(
        self,
        pretrained_ckpt: str | None = None,
        pretrained_format: str | None = None,
        backbone: BackboneSpec | None = None,
        random_init: bool = False,
        num_classes: int = 10,
        optimizer: OptimizerSpec = OptimizerSpec(name="sgd", lr=30.0, weight_decay=0.0, momentum=0.9),
        schedule: ScheduleSpec = ScheduleSpec(decay="step", milestones=[60, 80], gamma=0.1),
        knn_k: int = 200,
        knn_temperature: float = 0.07,
    ):
        """
        Args:
            pretrained_ckpt: the pretraining checkpoint whose `backbone.*` weights are probed.
            pretrained_format: `contrastlab`, or the official layout of a published checkpoint (`moco`, `sce`,
                `paco`, `supcon`, `jcl`, `npid`, `torchvision`, `timm`; `interop.official`); by default read from its keys.
            backbone: the trunk; by default the one recorded in the checkpoint.
            random_init: probe a randomly initialised trunk instead (a baseline); needs `backbone`
                and no checkpoint.
            num_classes: classes of the dataset (linked from the DataModule by the CLI).
            optimizer, schedule: the linear classifier's optimizer and learning-rate schedule.
            knn_k, knn_temperature: kNN evaluation of the frozen features (0 disables it).
        """
        super().__init__()
        save_plain_hyperparameters(self)
        if random_init == (pretrained_ckpt is not None):
            raise ValueError("give exactly one of model.pretrained_ckpt (a pretraining checkpoint) or model.random_init: true")
        state, stored_spec = (official_trunk(pretrained_ckpt, pretrained_format, backbone) or load_backbone_state(pretrained_ckpt)) if pretrained_ckpt else (None, None)
        if backbone is None and stored_spec is None:
            raise ValueError("model.backbone is required when the checkpoint does not record its backbone")
        spec = as_spec(BackboneSpec, backbone if backbone is not None else stored_spec)
        if state is not None:  # the checkpoint's weights replace any initial weights: do not fetch them
            spec = dataclasses.replace(spec, weights=None)
        self.backbone, feature_dim = spec.build()
        if state is not None:
            target = f"backbone {spec.name!r} (small_input={spec.small_input})"
            load_state_strictly(self.backbone, state, f"model.pretrained_ckpt {pretrained_ckpt!r}", target)
        self.backbone.requires_grad_(False).eval()
        self.probe = nn.Linear(feature_dim, num_classes)
        nn.init.normal_(self.probe.weight, std=0.01)  # MoCo main_lincls: N(0, 0.01), bias 0
        nn.init.zeros_(self.probe.bias)
        self.optimizer_spec = as_spec(OptimizerSpec, optimizer)
        self.schedule_spec = as_spec(ScheduleSpec, schedule)
        self.num_classes = num_classes
        self.init_evaluation(knn_k, knn_temperature)
        self.pretraining = pretraining_summary(pretrained_ckpt) if pretrained_ckpt else None

    def check_data(self, datamodule, world_size: int) -> None:
        """Fail when the data cannot feed the probe; say which checkpoint is probed, and warn when it was pretrained on
        another dataset or image size (the CLI calls this before anything is written)."""
        if tuple(datamodule.view_names) != self.views:
            raise ValueError(f"LinearProbe trains on one view named 'image', but data.views provides {list(datamodule.view_names)}")
        if self.pretraining is None:
            return
        seen = self.pretraining
        rank_zero_info(
            f"probing model.pretrained_ckpt {self.hparams.pretrained_ckpt!r}: {seen['method']}, trunk {seen['backbone']}, pretrained on "
            f"{seen['dataset']} ({seen['image_size']} px), epoch {seen['epoch']}, step {seen['step']}"
        )
        probe = (type(datamodule).__name__, datamodule.image_size)
        if seen["dataset"] != "?" and (seen["dataset"], seen["image_size"]) != probe:
            rank_zero_warn(
                f"model.pretrained_ckpt {self.hparams.pretrained_ckpt!r} was pretrained on {seen['dataset']} at {seen['image_size']} px, "
                f"this probe runs on {probe[0]} at {probe[1]} px"
            )

    def train(self, mode: bool = True):
        """Keep the frozen trunk in eval mode whatever Lightning switches (BN statistics stay fixed)."""
        super().train(mode)
        self.backbone.eval()
        return self

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            features = self.backbone(batch["views"]["image"])
        logits = self.probe(features)
        loss = F.cross_entropy(logits, batch["label"])
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1", (logits.argmax(1) == batch["label"]).float().mean())
        return loss

    def configure_optimizers(self):
        groups = parameter_groups(self.probe.named_parameters(), self.optimizer_spec)
        return configure_optimization(self.trainer, groups, self.optimizer_spec, self.schedule_spec)


def pretraining_summary(checkpoint_path: str) -> dict:
    """What a pretraining checkpoint says about itself: its method, trunk, dataset (the DataModule class) and image size,
    epoch and step; `?` for what it does not record (e.g. a file in another format)."""
    try:
        checkpoint = torch.load(Path(checkpoint_path).expanduser(), map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        checkpoint = {}
    record = checkpoint.get(RECORD_KEY) or {}
    data = (record.get("config") or {}).get("data") or {}
    dataset = data.get("class_path")
    image_size = (data.get("init_args") or {}).get("image_size")
    if dataset is not None and image_size is None:  # a class attribute (Digits-M, CIFAR: 32 px)
        module_name, _, class_name = dataset.rpartition(".")
        with contextlib.suppress(ImportError):
            image_size = getattr(getattr(importlib.import_module(module_name), class_name, None), "image_size", None)
    return {
        "method": record.get("module", "?"),
        "backbone": (checkpoint.get("hyper_parameters", {}).get("backbone") or {}).get("name", "?"),
        "dataset": dataset.rsplit(".", 1)[-1] if dataset else "?",
        "image_size": "?" if image_size is None else image_size,
        "epoch": checkpoint.get("epoch", "?"),
        "step": checkpoint.get("global_step", "?"),
    }


def probe_run_directory(pretrained_ckpt: str | None, dataset: str, seed: int) -> str:
    """Where a probe runs unless trainer.default_root_dir says otherwise: in the run directory of its pretraining
    checkpoint (the folder above `checkpoints/`, else the checkpoint's own folder), under `linear/`, where
    `scripts/compare.py` and `scripts/sweep.py` look; a random trunk's under `runs/linear_random_<dataset>_s<seed>`."""
    if pretrained_ckpt is None:
        return f"runs/linear_random_{dataset}_s{seed}"
    folder = Path(pretrained_ckpt).parent
    return str((folder.parent if folder.name == "checkpoints" else folder) / "linear")

