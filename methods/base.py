"""The LightningModules every method builds on.

- `MethodBase`: what every trainable method shares: the one constructor (the trunk `self.backbone`, optimizer,
  schedule, number of classes, channels-last, compilation; subclasses pass these on as `**kwargs`), the one
  evaluation path (`methods.evaluation.EvaluationMixin`), the named views it consumes and the checks that the
  DataModule provides them (and fills its queues), views drawn on the device (`data.pipeline: gpu`),
  channels-last images, all-gathers across processes, progress in epochs, the optimizer and its per-step
  schedule, and the one training-step contract of both families: a method implements `step(batch) -> (loss,
  features)`, `features` being the online trunk features its probe learns from, or None (a classifier).
- `PretrainMethod` (`methods/pretrain.py`) adds what a pretraining method has: projector, online probe, kNN
  monitor, multi-crop.
- The long-tail classifiers (PaCo and its baselines) build on `MethodBase` in `methods/longtail/`.
"""

import warnings
from dataclasses import dataclass
from typing import Literal

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn

from backbones import BackboneSpec
from engine.compat import attached_trainer
from engine.config import as_spec, save_plain_hyperparameters
from engine.optim import (
    OptimizerSpec,
    ScheduleSpec,
    clip_gradients_per_parameter_,
    configure_optimization,
    optimizer_steps_per_epoch,
    parameter_groups,
    schedule_length,
    schedule_weight_decay_,
)
from engine.checkpoint_record import CheckpointRecord
from methods.contract import check_method_class
from methods.evaluation import EvaluationMixin
from methods.queues import KeyQueue


def several_processes() -> bool:
    """Whether this run is one of several processes (DDP): what the gathers and shuffle-BN exchange over."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass
class CompileSpec:
    """`torch.compile` of the trunks, online and momentum (nearly all FLOPs and kernel launches of a step),
    in place (`nn.Module.compile`): parameters, state-dict keys and checkpoints stay those of the eager
    modules. `reduce-overhead` adds CUDA graphs, `max-autotune` searches kernels too (slow first steps)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    backend: str = "inductor"
    fullgraph: bool = False


class MethodBase(EvaluationMixin, CheckpointRecord, L.LightningModule):
    """Base of every model the CLI trains (`main_pretrain.py`, `main_linear.py`); subclasses set `views` and implement
    `step`. Its checkpoints record the contrastlab version and the method class (`engine.checkpoint_record`)."""

    views: tuple[str, ...] = ()  # names of the data views the method consumes
    local_crops: tuple[str, ...] = ()  # further views of multi-crop (`PretrainMethod`), consumed as well
    keys_per_sample: int = 1  # keys a queue receives per training image and step
    compiled_modules = ("backbone", "target_backbone")  # those a method has are compiled with `compile`
    wrong_checkpoint_hint = ""  # added to the CLI's error when --ckpt_path holds another model's checkpoint
    monitors_representations = True  # the CLI offers the collapse monitor and the embedding map (analysis.monitors)
    # The trunk the method's paper evaluates (linear probe, kNN, transfer): `online`, or `momentum` where it is the EMA
    # teacher's (DINO); what `python -m interop.export` writes unless told otherwise.
    evaluated_encoder: Literal["online", "momentum"] = "online"
    # Arguments that a `validate` / `test` of a checkpoint takes from its own config and command line, not from the
    # checkpoint's hyperparameters (which Lightning's CLI puts over every other model argument): tau-norm's tau, the
    # kNN monitor's k. Any other model argument given on the command line of an evaluation is refused (engine.compat).
    evaluation_settings: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_method_class(cls, MethodBase)

    def __init__(
        self,
        backbone: BackboneSpec = BackboneSpec(),
        optimizer: OptimizerSpec = OptimizerSpec(),
        schedule: ScheduleSpec = ScheduleSpec(),
        num_classes: int = 10,
        channels_last: bool = False,
        compile: CompileSpec | None = None,
    ):
        """
        Args:
            backbone: the trunk, see `backbones.build_backbone`.
            optimizer: optimizer, learning rate (per 256 images when scaled) and weight decay.
            schedule: warm-up and decay of the learning rate, applied per optimizer step.
            num_classes: classes of the dataset, for evaluation (linked from the DataModule by the CLI).
            channels_last: keep convolution weights and input images in channels-last memory layout
                (faster convolutions on recent GPUs and on CPUs with oneDNN, the same numbers).
            compile: `torch.compile` the trunks (`CompileSpec`; null: eager).
        """
        super().__init__()
        save_plain_hyperparameters(self)  # with the arguments of every subclass's __init__
        self.num_classes = num_classes
        self.backbone_spec = as_spec(BackboneSpec, backbone)
        self.backbone, self.feature_dim = self.backbone_spec.build()
        self.optimizer_spec = as_spec(OptimizerSpec, optimizer)
        self.schedule_spec = as_spec(ScheduleSpec, schedule)
        self.channels_last = channels_last
        self.compile_spec = compile and as_spec(CompileSpec, compile)

    @classmethod
    def settle_arguments(cls, init_args) -> None:
        """Replace, in a parsed config's `init_args`, a default that the run resolves from its inputs by the value it
        resolves to, so that the config the run records says what it used (the CLI calls this before it writes it)."""

    @classmethod
    def default_run_directory(cls, init_args: dict, dataset: str, seed: int) -> str | None:
        """Where a run of this class goes when trainer.default_root_dir is not given; None: Lightning's default."""
        return None

    @classmethod
    def check_resume(cls, saved_hyperparameters: dict, init_args: dict, source: str) -> None:
        """Refuse (`CheckpointMismatch`) a checkpoint of this class that the configured run must not restore."""

    def results_context(self) -> dict:
        """What the run's results are of besides its own weights, written beside them in `results_*.json`: the evaluation
        settings (a kNN's k, tau-norm's tau), which a `validate` may set otherwise than the training did."""
        return {name: self.hparams[name] for name in self.evaluation_settings if name in self.hparams}

    def expected_warnings(self) -> tuple[str, ...]:
        """Messages of the warnings this model triggers by design; the CLI silences them for its runs."""
        # `on_after_batch_transfer` draws the views on the device from the DataModule's `augment_on_device`: Lightning's
        # warning that the module's hook is used although a DataModule is given tells nothing
        return ("You have overridden `on_after_batch_transfer` in `LightningModule` but have passed in a `LightningDataModule`",)

    def check_data(self, datamodule, world_size: int) -> None:
        """Fail before training when the data cannot feed this method (the CLI calls this before
        anything is written; `setup` calls it again, at every stage, for runs started from Python). An override calls
        super (`methods.contract`)."""
        provided = tuple(getattr(datamodule, "view_names", ()))
        consumed = self.views + self.local_crops
        if sorted(provided) != sorted(consumed):
            raise ValueError(
                f"{type(self).__name__} consumes the views {list(consumed)} but data.views provides "
                f"{list(provided)}; rename or remove views so that they match (no view is computed unused)"
            )
        batch, train = datamodule.batch_size, (getattr(datamodule, "splits", None) or {}).get("train")
        images = len(train) if train is not None else None  # None: a DataModule of batches only (tests' stand-ins)
        if images is not None and images // world_size < batch:  # the last incomplete batch is dropped (equal batches): nothing would train
            raise ValueError(
                f"data.init_args.batch_size {batch} is larger than the {images} training images"
                f"{f' ({images // world_size} per process of {world_size})' if world_size > 1 else ''}: no full batch to train on"
            )
        if batch < 2 and any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in self.modules()):
            raise ValueError(f"data.init_args.batch_size {batch}: BatchNorm needs at least 2 images per batch to normalise over")
        keys_per_step = self.keys_per_sample * batch * world_size
        for name, module in self.named_modules():
            if isinstance(module, KeyQueue) and module.size < keys_per_step:
                raise ValueError(
                    f"{name} size {module.size} is smaller than the {keys_per_step} keys enqueued per step "
                    f"(data.init_args.batch_size {batch} x {world_size} processes x {self.keys_per_sample})"
                )
            if isinstance(module, KeyQueue) and images is not None and module.size > images * self.keys_per_sample:
                warnings.warn(
                    f"{name} size {module.size} is larger than the {images * self.keys_per_sample} keys of one epoch of "
                    f"{images} training images: it holds keys of the same images from earlier epochs"
                )
        self.check_patch_sizes(getattr(datamodule, "view_sizes", {}))

    def check_patch_sizes(self, view_sizes: dict) -> None:
        """A ViT trunk takes images of its img_size only (timm's strict_img_size) or, with dynamic sizes (DINO's position
        interpolation), of any multiple of its patch: a view of another size failed at the first step, after the files."""
        embed = getattr(self.backbone, "patch_embed", None)
        if embed is None or getattr(embed, "img_size", None) is None:
            return
        for name, size in view_sizes.items():
            where = "data.init_args.eval_view" if name == "eval_view" else f"data.init_args.views.{name}"
            if isinstance(size, int) and embed.strict_img_size and (size, size) != tuple(embed.img_size):
                raise ValueError(f"{where} gives {size} px images, but the ViT trunk takes {embed.img_size[0]} px ones only: give that size, "
                                 "or model.backbone.kwargs.position_interpolation dino for crops of several sizes")
            if isinstance(size, int) and not embed.strict_img_size and not embed.dynamic_img_pad and size % embed.patch_size[0]:
                raise ValueError(f"{where} gives {size} px images, which the ViT trunk's {embed.patch_size[0]} px patches do not divide: "
                                 f"give a multiple of {embed.patch_size[0]}")

    def warn_if_never_reached(self, setting: str, value: int, takes_effect_at: int, run_length: int, unit: str, consequence: str) -> None:
        """A setting whose effect comes at epoch or step `takes_effect_at` (0-based) of a run of `run_length` (over max_epochs)."""
        if value > 0 and takes_effect_at >= run_length > 0:
            warnings.warn(f"model.init_args.{setting} {value} is too long for the run's {run_length} {unit}: {consequence}", stacklevel=2)

    def setup(self, stage: str) -> None:
        if self.trainer.datamodule is not None:  # every stage: a check may settle what the evaluation reports (the probe)
            self.check_data(self.trainer.datamodule, self.trainer.world_size)
        if self.channels_last:
            self.to(memory_format=torch.channels_last)

    def configure_model(self) -> None:
        if self.compile_spec is not None:
            spec = self.compile_spec
            for name in self.compiled_modules:
                if hasattr(self, name):
                    getattr(self, name).compile(mode=spec.mode, backend=spec.backend, fullgraph=spec.fullgraph)

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        if attached_trainer(self) is not None and self.trainer.training and self.trainer.datamodule is not None:
            batch = self.trainer.datamodule.augment_on_device(batch)
        if self.channels_last:
            to_channels_last = lambda x: x.contiguous(memory_format=torch.channels_last) if x.ndim == 4 else x  # noqa: E731
            if "views" in batch:
                batch["views"] = {name: to_channels_last(images) for name, images in batch["views"].items()}
            if "image" in batch:
                batch["image"] = to_channels_last(batch["image"])
        return batch

    @property
    def epochs_done(self) -> float:
        """Training progress in epochs, counted in optimizer steps (what per-step ramps of loss
        hyper-parameters read)."""
        return self.trainer.global_step / optimizer_steps_per_epoch(self.trainer)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate a tensor from all processes in rank order (no gradient), e.g. keys to enqueue."""
        if not several_processes():
            return tensor
        return self.all_gather(tensor).flatten(0, 1)

    def gather_with_grad(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate a tensor from all processes in rank order, keeping the gradient to every
        process's rows (its backward all-reduces), so that in-batch negatives span the global batch
        (SimCLR, SupCon): with DDP's gradient averaging, W processes then compute the gradient of the
        single-process loss on the concatenated batch."""
        if not several_processes():
            return tensor
        gathered = self.all_gather(tensor, sync_grads=True)
        if gathered.requires_grad:  # gloo's backward scatters a strided gradient in the wrong order
            gathered.register_hook(lambda grad: grad.contiguous())
        return gathered.flatten(0, 1)

    def mean_over_processes(self, rows: torch.Tensor) -> torch.Tensor:
        """The mean of `rows` over the global batch, without gradient: the local sum, all-reduced (a centre
        over every process's batch, DINO's; one vector crosses the network, not the rows)."""
        with torch.no_grad():
            total, count = rows.sum(dim=0), rows.shape[0]
            if several_processes():
                dist.all_reduce(total)
                count *= dist.get_world_size()
            return total / count

    def step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The method's part: the training loss of a batch and the online trunk features for the probe
        (None when the method has no probe)."""
        raise NotImplementedError

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, features = self.step(batch)
        self.log("train/loss", loss, prog_bar=True)
        if features is None:
            return loss
        probe_loss = self.probe_loss(features.detach(), batch["label"])  # the probe never trains the trunk
        self.log("train/probe_loss", probe_loss)
        return loss + probe_loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        optimizer = self.trainer.optimizers[0]
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)
        if self.optimizer_spec.weight_decay_end is not None:  # a weight-decay schedule (optimizer.weight_decay_end)
            steps = (self.trainer.global_step, schedule_length(self.trainer))  # over max_epochs, as the lr (engine.optim)
            self.log("train/weight_decay", schedule_weight_decay_(optimizer, *steps, self.optimizer_spec), on_step=True, on_epoch=False)

    def frozen_modules(self) -> list[nn.Module]:
        """Modules whose gradients are dropped before this optimizer step, so that it leaves them as they are (no
        update, no weight decay, no momentum): a method's hook (SwAV's prototypes, DINO's last layer at first)."""
        return []

    def on_before_optimizer_step(self, optimizer) -> None:
        # after backward (and DDP's averaging, and unscaling): the gradients the step will use
        if self.optimizer_spec.clip_grad_per_parameter is not None:
            clip_gradients_per_parameter_([param for _, param in self.method_parameters()], self.optimizer_spec.clip_grad_per_parameter)
        for module in self.frozen_modules():
            for param in module.parameters():
                param.grad = None

    def method_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The method's own named parameters (a pretraining method's online probe is not one)."""
        return list(self.named_parameters())

    def optimizer_groups(self) -> list[dict]:
        """The optimizer's parameter groups: every parameter, weight decay as `optimizer` says."""
        return parameter_groups(self.method_parameters(), self.optimizer_spec)

    def configure_optimizers(self):
        return configure_optimization(self.trainer, self.optimizer_groups(), self.optimizer_spec, self.schedule_spec)
