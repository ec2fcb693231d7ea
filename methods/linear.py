"""`LinearProbe`: the second stage, a linear classifier on a frozen pretrained trunk (`main_linear.py`).

The trunk is loaded **strictly** from the trunk weights of a pretraining checkpoint that its method's paper evaluates
(`backbone.*`, the online trunk, as MoCo's `main_lincls.py` uses `encoder_q`; DINO's `target_backbone.*`, as its
`eval_linear.py` takes the teacher; `pretrained_encoder` chooses), frozen and kept in eval mode (BatchNorm
statistics frozen; `trunk_mode: train` runs it in train mode while the classifier trains, as TCL's train.py), and run
without gradients; only the linear layer learns. The checkpoint must be a
`PretrainMethod`'s, written by a compatible contrastlab version (`engine.checkpoint_record`): a long-tail
classifier's or a linear probe's is refused. The default optimizer is the MoCo / SCE small-dataset
protocol (SGD lr 30, momentum 0.9, no weight decay, x0.1 at epochs 60 and 80 of 100; MoCo's main_lincls.py, CEA-LIST/SCE's linear configs).
The pretraining checkpoint is a model argument, never `ckpt_path` (which would try to restore this
module from it). `methods.finetune.FineTune` is the same model with the trunk trained too (`trains_trunk`).
"""

import dataclasses
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from jsonargparse import Namespace
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from backbones import BackboneSpec, load_state_strictly
from engine.checkpoint_record import CheckpointMismatch
from engine.config import as_spec
from engine.files import read_checkpoint
from engine.optim import OptimizerSpec, ScheduleSpec
from interop.official import MOMENTUM_TRUNK_FORMATS, detect_format, exported_backbone
from methods.base import MethodBase
from methods.checkpoints import method_class
from methods.probed_trunk import probed_trunk, trunk_as_trained


class LinearProbe(MethodBase):
    views = ("image",)
    wrong_checkpoint_hint = " (a pretraining checkpoint to probe is --model.pretrained_ckpt)"
    monitors_representations = False  # its trunk is frozen: the pretraining run monitored it
    trains_trunk = False  # the trunk is frozen in eval mode and run without gradients (FineTune trains it)
    run_folder = "linear"  # where it runs beside its pretraining checkpoint (`probe_run_directory`)
    evaluation_settings = ("knn_k", "knn_temperature")  # the kNN evaluation's vote: no part of the trained model

    def __init__(
        self,
        pretrained_ckpt: str | None = None,
        pretrained_format: str | None = None,
        pretrained_encoder: Literal["online", "momentum"] | None = None,
        backbone: BackboneSpec | None = None,
        random_init: bool = False,
        trunk_mode: Literal["eval", "train"] = "eval",
        optimizer: OptimizerSpec = OptimizerSpec(name="sgd", lr=30.0, weight_decay=0.0, momentum=0.9),
        schedule: ScheduleSpec = ScheduleSpec(decay="step", milestones=[60, 80], gamma=0.1),
        knn_k: int = 200,
        knn_temperature: float = 0.07,
        **kwargs,
    ):
        """
        Args:
            pretrained_ckpt: the pretraining checkpoint whose trunk is probed (`pretrained_encoder`).
            pretrained_format: `contrastlab`, or the official layout of a published checkpoint (`moco`, `sce`,
                `paco`, `supcon`, `jcl`, `npid`, `torchvision`, `timm`; `interop.official`); by default read from its keys.
            pretrained_encoder: which trunk of a contrastlab checkpoint: `online` (what MoCo's main_lincls.py and most
                papers probe) or `momentum`, the EMA copy; null: the one the pretraining method's paper evaluates
                (`evaluated_encoder`, as the kNN monitor and `interop.export`): DINO's teacher (eval_linear.py
                `--checkpoint_key teacher`), every other method's online trunk. An official release is read as its
                format reads it (DINO's full checkpoint: the teacher); an export holds the one trunk it was exported from.
            backbone: the trunk of an official checkpoint or of a random-init baseline; a contrastlab checkpoint's
                is the one it recorded, of which `backbone` may choose the features probed (`kwargs.features`).
            random_init: probe a randomly initialised trunk instead (a baseline); needs `backbone`
                and no checkpoint.
            trunk_mode: `eval`, the frozen trunk in eval mode throughout (MoCo's main_lincls.py and most papers); `train`,
                in train mode while the classifier trains, as chaitanyaanimesh/Tuned-Contrastive-Learning train.py
                (`model.train()`, the trunk's requires_grad False): BatchNorm normalises with each batch's statistics and
                updates its running ones, which the evaluation then uses. Its weights stay frozen either way.
            optimizer, schedule: the linear classifier's optimizer and learning-rate schedule.
            knn_k, knn_temperature: kNN evaluation of the frozen features (0 disables it).
            **kwargs: the MethodBase arguments (num_classes, channels_last, compile).
        """
        if random_init == (pretrained_ckpt is not None):
            raise ValueError("give exactly one of model.pretrained_ckpt (a pretraining checkpoint) or model.random_init: true (a probe "
                             "resumed or evaluated with --ckpt_path last needs its --model.pretrained_ckpt again)")
        if trunk_mode not in ("eval", "train"):
            raise ValueError(f"model.trunk_mode must be 'eval' or 'train', got {trunk_mode!r}")
        if self.trains_trunk and trunk_mode == "train":
            raise ValueError("model.trunk_mode 'train' is the mode of a frozen trunk; fine-tuning trains its trunk in train mode already")
        state, spec, pretraining = probed_trunk(pretrained_ckpt, pretrained_format, backbone, pretrained_encoder) if pretrained_ckpt else (None, backbone, None)
        if spec is None:
            raise ValueError("model.backbone is required when the checkpoint does not record its backbone")
        if state is not None:  # the checkpoint's weights replace any initial weights: do not fetch them
            spec = dataclasses.replace(as_spec(BackboneSpec, spec), weights=None)
        super().__init__(backbone=spec, optimizer=optimizer, schedule=schedule, **kwargs)
        if state is not None:
            target = f"backbone {self.backbone_spec.name!r} (small_input={self.backbone_spec.small_input})"
            load_state_strictly(self.backbone, state, f"model.pretrained_ckpt {pretrained_ckpt!r}", target)
        # fine-tuning trains every trunk parameter, those its pretraining held fixed too (MoCo v3's patch projection and
        # sin-cos positions: facebookresearch/moco-v3 fine-tunes through DeiT, whose are parameters)
        self.backbone.requires_grad_(self.trains_trunk)
        if not self.trains_trunk:  # Lightning trains every module in the mode it is in when the fit starts
            self.backbone.train(trunk_mode == "train")
        self.probe = nn.Linear(self.feature_dim, self.num_classes)
        self.init_head(self.probe)
        # a fine-tuned network's logits are its own prediction (`val/top1`), a probe's those of a probe (`val/probe_top1`)
        self.init_evaluation(knn_k, knn_temperature, prefix="" if self.trains_trunk else "probe_")
        self.pretraining = pretraining
        self.pretrained_step = pretraining["step"] if pretraining is not None and isinstance(pretraining["step"], int) else None

    def results_context(self) -> dict:
        # the step of the weights probed: a pretraining resumed since trains on, and its last.ckpt is then others (scripts/compare.py)
        return super().results_context() | {"pretrained_ckpt": self.hparams.pretrained_ckpt, "pretrained_step": self.pretrained_step}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["pretrained_step"] = self.pretrained_step  # the step of the trunk this checkpoint holds

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A resumed or evaluated probe restores its own trunk, whatever model.pretrained_ckpt holds now."""
        super().on_load_checkpoint(checkpoint)
        restored = checkpoint.get("pretrained_step", self.pretrained_step)
        if restored != self.pretrained_step:
            rank_zero_warn(f"this probe's trunk is of step {restored} of model.pretrained_ckpt {self.hparams.pretrained_ckpt!r}, which holds "
                           f"step {self.pretrained_step} now (its pretraining trained on): the probe's numbers are of step {restored}")
        self.pretrained_step = restored

    def init_head(self, head: nn.Linear) -> None:
        nn.init.normal_(head.weight, std=0.01)  # MoCo main_lincls: N(0, 0.01), bias 0
        nn.init.zeros_(head.bias)

    @classmethod
    def settle_arguments(cls, init_args) -> None:
        """A null `pretrained_encoder` is recorded as the encoder it probes: the checkpoint's method's `evaluated_encoder`;
        for an official release the one its format reads (DINO's teacher: `momentum`), `online` for any other release,
        export or checkpoint that names no class (a run recorded before the default was null said `online`). A given
        `backbone` is recorded as the trunk probed (`trunk_as_trained`: the checkpoint's or export's recorded trunk,
        with the features asked for), not as the parser's defaults filled it in. A file that cannot be read, or a
        trunk that disagrees with it, is left to `__init__`'s error."""
        path = init_args.get("pretrained_ckpt")
        if path is None:
            return
        source = f"model.pretrained_ckpt {path!r}"
        given = init_args.get("backbone")
        try:
            checkpoint = read_checkpoint(path, source)
            read_as = init_args.get("pretrained_format") or detect_format(checkpoint, None, source)
            method = method_class(checkpoint, source) if read_as == "contrastlab" else None
            recorded = exported_backbone(path, source) or (checkpoint.get("hyper_parameters", {}).get("backbone") if read_as == "contrastlab" else None)
            probed = trunk_as_trained(recorded, given.as_dict() if isinstance(given, Namespace) else given, source)
        except (ValueError, CheckpointMismatch):
            return
        if init_args.get("pretrained_encoder") is None:
            init_args["pretrained_encoder"] = method[1].evaluated_encoder if method is not None else "momentum" if read_as in MOMENTUM_TRUNK_FORMATS else "online"
        if given is not None and recorded is not None:  # the parser fills a given trunk's other fields with defaults
            probed = dataclasses.asdict(dataclasses.replace(as_spec(BackboneSpec, probed), weights=None))  # as `__init__` builds it
            init_args["backbone"] = Namespace(probed) if isinstance(given, Namespace) else probed

    @classmethod
    def default_run_directory(cls, init_args: dict, dataset: str, seed: int) -> str:
        return probe_run_directory(init_args.get("pretrained_ckpt"), dataset, seed, cls.run_folder)

    @classmethod
    def check_resume(cls, saved_hyperparameters: dict, init_args: dict, source: str) -> None:
        """A probe's checkpoint is resumed or evaluated only with the pretraining checkpoint it probed (restoring it
        would bring back that trunk, whatever model.pretrained_ckpt now says), which must still exist."""
        probed, given = saved_hyperparameters.get("pretrained_ckpt"), init_args.get("pretrained_ckpt")
        if given is None and not init_args.get("random_init"):  # the probe's own, as Lightning reads it from a checkpoint file
            init_args["pretrained_ckpt"] = given = probed
        if probed is not None and not Path(probed).expanduser().is_file():
            # the probe's trunk is built from it (for a --ckpt_path file, Lightning reads it from the checkpoint,
            # over the command line)
            raise CheckpointMismatch(
                f"{source} holds a probe of model.pretrained_ckpt {probed!r}, which is not an existing file here (moved or "
                f"deleted): the probe's trunk is built from it; put that pretraining checkpoint back at {probed!r}"
            )
        if probed is not None and given is not None and not same_file(probed, given):
            raise CheckpointMismatch(
                f"{source} holds a probe of model.pretrained_ckpt {probed!r}, not of {given!r}: resuming it would restore the "
                f"trunk of {probed!r}; probe {given!r} under another trainer.default_root_dir"
            )

    def check_data(self, datamodule, world_size: int) -> None:
        """Fail when the data cannot feed the probe; say which checkpoint is probed, and warn when it was pretrained on
        another dataset or image size (the CLI calls this before anything is written)."""
        super().check_data(datamodule, world_size)
        if self.pretraining is None:
            return
        seen, self.pretraining = self.pretraining, None  # said once: the CLI checks before the run, `setup` again
        rank_zero_info(
            f"{'fine-tuning' if self.trains_trunk else 'probing'} model.pretrained_ckpt {self.hparams.pretrained_ckpt!r}: {seen['method']}, trunk {seen['backbone']}, pretrained on "
            f"{seen['dataset']} ({seen['image_size']} px), epoch {seen['epoch']}, step {seen['step']}"
        )
        probe = (type(datamodule).__name__, datamodule.image_size)
        if seen["dataset"] != "?" and (seen["dataset"], seen["image_size"]) != probe:
            rank_zero_warn(
                f"model.pretrained_ckpt {self.hparams.pretrained_ckpt!r} was pretrained on {seen['dataset']} at {seen['image_size']} px, "
                f"this probe runs on {probe[0]} at {probe[1]} px"
            )

    def expected_warnings(self) -> tuple[str, ...]:
        frozen = () if self.trains_trunk else (r"Found \d+ module\(s\) in eval mode at the start of training",)  # the frozen trunk
        return (*super().expected_warnings(), *frozen)

    def train(self, mode: bool = True):
        """Keep a frozen trunk in eval mode whatever Lightning switches (BN statistics stay fixed), or with `trunk_mode:
        train` in the classifier's mode (TCL's train.py)."""
        super().train(mode)
        if not self.trains_trunk:
            self.backbone.train(mode and self.hparams.trunk_mode == "train")
        return self

    def step(self, batch: dict) -> tuple[torch.Tensor, None]:
        with torch.set_grad_enabled(self.trains_trunk and torch.is_grad_enabled()):
            features = self.backbone(batch["views"]["image"])
        logits = self.probe(features)
        self.log("train/top1", (logits.argmax(1) == batch["label"]).float().mean())
        return F.cross_entropy(logits, batch["label"]), None


def same_file(path: str, other: str) -> bool:
    return Path(path).expanduser().absolute() == Path(other).expanduser().absolute() or (
        Path(path).exists() and Path(other).exists() and Path(path).samefile(other))


def probe_run_directory(pretrained_ckpt: str | None, dataset: str, seed: int, stage: str = "linear") -> str:
    """Where a probe (`stage` linear) or a fine-tuning (`finetune`) runs unless trainer.default_root_dir says otherwise:
    in the run directory of its pretraining checkpoint (the folder above `checkpoints/`, else the checkpoint's own
    folder), under `<stage>/`, where `scripts/compare.py` and `scripts/sweep.py` look for `linear/`; a random trunk's
    under `runs/<stage>_random_<dataset>_s<seed>`."""
    if pretrained_ckpt is None:
        return f"runs/{stage}_random_{dataset}_s{seed}"
    folder = Path(pretrained_ckpt).parent
    return str((folder.parent if folder.name == "checkpoints" else folder) / stage)

