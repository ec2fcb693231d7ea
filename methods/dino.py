"""DINO: self-distillation with no labels (Caron et al., ICCV 2021), as facebookresearch/dino main_dino.py.

A student and a teacher of the same architecture (trunk, then the DINO head: a 3-layer GELU MLP to a 256-d
bottleneck, L2 normalisation, a weight-normalised linear layer to K outputs) see the crops of each image: the teacher
the 2 global views, the student every crop (global and local, multi-crop). The teacher's outputs are centred (an EMA
over the global batch, momentum 0.9) and sharpened (temperature 0.04, or warmed up to 0.07 per epoch), the student's
softened (0.1); the loss is the cross-entropy of every student crop against every other global crop's teacher
distribution (Eq. 2-3, Algorithm 1). The teacher is not trained: it follows the student by EMA (momentum 0.996 to 1).

The rest of the official recipe goes through the base: AdamW with the cosine weight-decay schedule 0.04 -> 0.4
(`optimizer.weight_decay_end`), gradients clipped per parameter to norm 3 (`optimizer.clip_grad_per_parameter`), the
last layer frozen in the first epoch (`freeze_last_layer_epochs`, a `frozen_modules` hook), the crops batched by
resolution as the official `MultiCropWrapper`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import weight_norm

from backbones import MLPSpec
from engine.compat import attached_trainer
from methods.losses import check_hyperparameters, dino_loss
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod

DINO_HEAD = MLPSpec(hidden_dim=2048, output_dim=256, num_layers=3, batch_norm=False, activation="gelu")


class DINO(MomentumMixin, PretrainMethod):
    views = ("global1", "global2")
    multi_crop = True
    crop_batching = "by_resolution"
    momentum_modules = ("backbone", "projector", "last_layer")
    evaluated_encoder = "momentum"  # the teacher: facebookresearch/dino eval_linear.py and eval_knn.py, --checkpoint_key teacher

    def __init__(
        self,
        out_dim: int = 65536,
        norm_last_layer: bool = True,
        student_temperature: float = 0.1,
        teacher_temperature: float = 0.04,
        warmup_teacher_temperature: float = 0.04,
        warmup_teacher_temperature_epochs: int = 0,
        center_momentum: float = 0.9,
        freeze_last_layer_epochs: int = 1,
        projector: MLPSpec = DINO_HEAD,
        momentum: MomentumSpec = MomentumSpec(base=0.996, schedule="cosine_byol", shuffle_bn=False),
        **kwargs,
    ):
        """
        Args:
            out_dim: K, the outputs of the last layer (65536, main_dino.py `--out_dim`).
            norm_last_layer: keep the last layer's weight norms at 1 (frozen `g`); the boosted ViT-S run sets false.
            student_temperature: 0.1. teacher_temperature: the teacher's after the warm-up (0.04 by default, the
                "vanilla" recipe; 0.07 in the README's boosted run), from `warmup_teacher_temperature` (0.04) over
                `warmup_teacher_temperature_epochs` epochs (0; 30 in the boosted run), linearly per epoch.
            center_momentum: of the teacher centre's EMA (0.9).
            freeze_last_layer_epochs: epochs during which the last layer does not move (1).
            projector: the DINO head's MLP (2048 hidden, GELU, 256-d bottleneck; trunc-normal init as DINOHead).
            momentum: the teacher's EMA momentum, 0.996 to 1 by a per-step cosine (`cosine_byol`: after step i of N,
                1 - 0.004 (1 + cos(pi i / N)) / 2, main_dino.py `momentum_schedule` with utils.py `cosine_scheduler`).
            **kwargs: the PretrainMethod arguments (backbone, optimizer, schedule, local_crops, ...).
        """
        check_hyperparameters("model.", student_temperature=student_temperature, teacher_temperature=teacher_temperature,
                              center_momentum=center_momentum)  # fmt: skip
        check_hyperparameters("model.warmup_", teacher_temperature=warmup_teacher_temperature)
        if out_dim < 1 or warmup_teacher_temperature_epochs < 0 or freeze_last_layer_epochs < 0:
            raise ValueError(f"model: out_dim ({out_dim}) must be >= 1, warmup_teacher_temperature_epochs "
                             f"({warmup_teacher_temperature_epochs}) and freeze_last_layer_epochs ({freeze_last_layer_epochs}) >= 0")  # fmt: skip
        super().__init__(projector=projector, **kwargs)
        self.student_temperature, self.center_momentum = student_temperature, center_momentum
        self.teacher_temperatures = (warmup_teacher_temperature, teacher_temperature, warmup_teacher_temperature_epochs)
        self.freeze_last_layer_epochs = freeze_last_layer_epochs
        for layer in self.projector.modules():  # DINOHead's initialisation, before its last layer exists
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                if layer.bias is not None:  # a head with BatchNorm has none before its norms
                    nn.init.zeros_(layer.bias)
        self.last_layer = weight_norm(nn.Linear(self.projection_dim, out_dim, bias=False))
        norms = self.last_layer.parametrizations.weight.original0
        norms.data.fill_(1.0)
        norms.requires_grad_(not norm_last_layer)
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.step_means: list[torch.Tensor] = []  # the teacher outputs' global-batch means of this optimizer step's batches
        self.init_momentum(momentum)
        if self.momentum_spec.shuffle_bn or self.momentum_spec.split_bn > 1:  # it never reaches `target_embed`'s shuffle
            raise ValueError(f"model.momentum: DINO's teacher sees the views unshuffled (main_dino.py), so shuffle_bn must be false and split_bn 1, "
                             f"got {self.momentum_spec.shuffle_bn} and {self.momentum_spec.split_bn}")

    def head(self, projector: nn.Module, last_layer: nn.Module):
        return lambda pooled: last_layer(F.normalize(projector(pooled), dim=-1))

    def teacher_temperature(self) -> float:
        """The teacher temperature of the current epoch: `np.linspace(warmup, final, warmup_epochs)` indexed by the
        epoch (its last warm-up epoch already at the final value), then the final value (main_dino.py `DINOLoss`)."""
        start, final, epochs = self.teacher_temperatures
        trainer = attached_trainer(self)
        epoch = trainer.current_epoch if trainer is not None else 0
        return final if epoch >= epochs else start + (final - start) * epoch / max(epochs - 1, 1)

    def update_center(self) -> None:
        """The centre moves once per optimizer step, after its loss, towards the mean raw teacher output of its global
        batch (main_dino.py `update_center`, each iteration): with accumulated batches, the mean of their means."""
        mean = self.step_means[0] if len(self.step_means) == 1 else torch.stack(self.step_means).mean(dim=0)
        self.center.lerp_(mean.to(self.center.dtype), 1.0 - self.center_momentum)
        self.step_means.clear()

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.update_center()

    def on_fit_start(self) -> None:
        super().on_fit_start()
        epochs, warm_up = self.trainer.max_epochs or 0, self.teacher_temperatures[2]  # main_dino.py refuses a longer warm-up than the run
        self.warn_if_never_reached("warmup_teacher_temperature_epochs", warm_up, warm_up - 1, epochs, "epochs",
                                   "the teacher temperature never reaches model.init_args.teacher_temperature")
        self.warn_if_never_reached("freeze_last_layer_epochs", self.freeze_last_layer_epochs, self.freeze_last_layer_epochs, epochs, "epochs",
                                   "the last layer never trains")

    def frozen_modules(self) -> list[nn.Module]:
        return [self.last_layer] if self.trainer.current_epoch < self.freeze_last_layer_epochs else []

    def step(self, batch):
        crops = self.crops(batch["views"], self.views + self.local_crops)
        student, features = self.encode_crops(crops, self.backbone, self.head(self.projector, self.last_layer), len(self.views))
        with torch.no_grad():
            teacher, _ = self.encode_crops(crops[: len(self.views)], self.target_backbone, self.head(self.target_projector, self.target_last_layer))
        temperature = self.teacher_temperature()
        loss = dino_loss(torch.stack(student), torch.stack(teacher), self.center, self.student_temperature, temperature)
        self.step_means.append(self.mean_over_processes(torch.cat(teacher)))
        if attached_trainer(self) is not None:
            self.log("train/teacher_temperature", temperature, on_step=True, on_epoch=False)
        return loss, features
