"""`PretrainMethod`: the base of a self-supervised or contrastive pretraining method, on `methods.base.MethodBase`.

It adds the projector, the online linear probe (its own parameter group), the kNN monitor and multi-crop:
`local_crops` names further data views (any resolution, `count: N` crops each) that a method with `multi_crop`
feeds to the branch that takes every crop, and `encode_crops` passes a branch's crops through trunk and head one
crop at a time or, as the official `MultiCropWrapper` of SwAV and DINO, batched by resolution (`crop_batching`). A
method subclass sets `views` and implements `step`: which view goes through which branch, which loss, what is
enqueued. Everything else lives here and in `MethodBase`.
"""

from typing import Literal, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from backbones import MLPSpec
from engine.config import as_spec
from methods.base import MethodBase


CropBatching = Literal["per_crop", "by_resolution"]


class PretrainMethod(MethodBase):
    multi_crop = False  # the method feeds `local_crops` to one of its branches (else it refuses them)
    # How `encode_crops` passes a branch's crops through trunk and head: `per_crop`, each crop its own forward, so that
    # BatchNorm sees one crop per batch (MoCo, SCE's and ReSSL's official code; Barlow Twins and VICReg run each view
    # separately); `by_resolution`, one trunk forward per run of consecutive crops of one resolution and one head
    # forward on all crops (the `MultiCropWrapper` of facebookresearch/dino utils.py and the forward of
    # facebookresearch/swav src/resnet50.py).
    crop_batching: CropBatching = "per_crop"
    evaluation_settings = ("knn_k", "knn_temperature")  # the kNN monitor's vote: no part of the trained model

    def __init__(
        self,
        projector: MLPSpec = MLPSpec(),
        local_crops: Sequence[str] = (),
        crop_batching: CropBatching | None = None,
        probe_lr: float = 0.1,
        probe_views: Literal["first", "global"] = "first",
        probe_like_trunk: bool = False,
        knn_k: int = 200,
        knn_temperature: float = 0.07,
        **kwargs,
    ):
        """
        Args:
            projector: the projection head on the trunk's pooled features.
            local_crops: names of further data views fed, after the method's own views, to the branch of a
                multi-crop method that takes every crop (e.g. the 6 x 96 px crops of SwAV, a view with `count: 6`;
                each view sets its own `size` and `scale`).
            crop_batching: how `encode_crops` passes a branch's crops through trunk and head, `per_crop` or
                `by_resolution`; null keeps the method's own, its official code's (solo-learn forwards every crop
                on its own, solo/methods/base.py training_step, also for SwAV and DINO).
            probe_lr: learning rate of the online linear probe (its own parameter group, no weight decay, scaled by
                the batch only with `probe_like_trunk`); the probe sees detached features only.
            probe_views: `first`: the probe learns from the online trunk's features of the first view; `global`:
                of every global view the online trunk encodes, its loss the mean over them (solo-learn's online
                classifier: solo/methods/base.py training_step, over the num_large_crops crops).
            probe_like_trunk: true scales `probe_lr` with the batch as `optimizer.lr_scaling` scales the trunk's, and
                where the optimizer is LARS adapts the probe's weight (and its bias, unless
                `optimizer.exclude_bias_and_norm`) as the trunk's parameters (solo-learn's classifier group in its
                optimizer, solo/methods/base.py learnable_params; classifier_lr scaled in solo/args/pretrain.py).
            knn_k: neighbours of the kNN monitor (0 disables it); knn_temperature: its vote temperature.
            **kwargs: the MethodBase arguments (backbone, optimizer, schedule, num_classes, channels_last, compile).
        """
        if not probe_lr > 0:
            raise ValueError(f"model.probe_lr must be > 0, got {probe_lr}")
        if crop_batching not in (None, *CropBatching.__args__):
            raise ValueError(f"model.crop_batching must be 'per_crop' or 'by_resolution' (or null: the method's own), got {crop_batching!r}")
        if probe_views not in ("first", "global"):
            raise ValueError(f"model.probe_views must be 'first' or 'global', got {probe_views!r}")
        if local_crops and not self.multi_crop:
            raise ValueError(f"model.local_crops {list(local_crops)}: {type(self).__name__} has no branch for local crops (multi-crop)")
        super().__init__(**kwargs)
        self.local_crops = tuple(local_crops)
        self.crop_batching = crop_batching or type(self).crop_batching
        projector = as_spec(MLPSpec, projector)
        self.projector = projector.build(self.feature_dim)
        self.projection_dim = projector.output_dim
        self.predictor: nn.Module = nn.Identity()  # a method with a predictor head replaces it
        self.probe = nn.Linear(self.feature_dim, self.num_classes)
        self.probe_lr, self.probe_views, self.probe_like_trunk = probe_lr, probe_views, probe_like_trunk
        self.init_evaluation(knn_k, knn_temperature)

    # ----------------------------------------------------------------- shared helpers
    def embed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Online branch: trunk features and the L2-normalised projection (after the predictor, if any)."""
        features = self.backbone(images)
        return features, F.normalize(self.predictor(self.projector(features)), dim=1)

    def project_and_predict(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head of a method that reads the projection before the predictor too (SimSiam's targets, NNCLR's
        nearest-neighbour queries): the L2-normalised projection and prediction of trunk features."""
        projection = self.projector(features)
        return F.normalize(projection, dim=1), F.normalize(self.predictor(projection), dim=1)

    def crops(self, views: dict[str, torch.Tensor], names: Sequence[str]) -> list[torch.Tensor]:
        """Every crop of the named views, in order: a view with `count: N`, shaped (B, N, C, H, W), gives N crops."""
        return [crop for name in names for crop in (views[name].unbind(1) if views[name].ndim == 5 else [views[name]])]

    def probe_features(self, *per_view: torch.Tensor) -> torch.Tensor:
        """What `step` returns for the probe, from the online trunk features of each global view: the first view's
        alone, or with `probe_views: global` all of them, B rows per view (concatenated only then)."""
        return per_view[0] if self.probe_views == "first" else torch.cat(per_view)

    def encode_crops(self, crops: Sequence[torch.Tensor], trunk: nn.Module, head, global_crops: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`head(trunk(crop))` for each crop, batched as `crop_batching` says, and the trunk features of the first
        `global_crops` crops, concatenated (for the online probe). `by_resolution` concatenates each run of consecutive
        crops of one resolution into one trunk forward and runs the head once on all of them, so that its BatchNorm
        sees every crop. A head may return a tuple (`project_and_predict`): each crop's output is then a tuple."""
        if self.crop_batching == "per_crop":
            features = [trunk(crop) for crop in crops]
            return [head(feature) for feature in features], self.probe_features(*features[:global_crops])
        runs: list[list[torch.Tensor]] = []
        for crop in crops:
            if runs and runs[-1][0].shape[-2:] == crop.shape[-2:]:
                runs[-1].append(crop)
            else:
                runs.append([crop])
        features = torch.cat([trunk(torch.cat(run)) for run in runs])
        outputs, batch = head(features), crops[0].shape[0]
        per_crop = list(zip(*(output.split(batch) for output in outputs))) if isinstance(outputs, tuple) else list(outputs.split(batch))
        return per_crop, features[: global_crops * batch]  # a view, no copy

    def embed_crops(self, views: dict[str, torch.Tensor], names: Sequence[str], global_crops: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Online projections (`embed`) of every crop of the named views, in order, and the trunk features of the
        first `global_crops` crops, concatenated, for the online probe."""
        head = lambda features: F.normalize(self.predictor(self.projector(features)), dim=1)  # noqa: E731
        return self.encode_crops(self.crops(views, names), self.backbone, head, global_crops)

    def check_data(self, datamodule, world_size: int) -> None:
        super().check_data(datamodule, world_size)
        # the probe learns from the training batches' labels: of unlabelled images nothing, and its chance-level
        # accuracy would read as the run's result
        self.logits_trained = getattr(datamodule, "training_labels", True)
        if not self.logits_trained:
            rank_zero_warn(f"the online probe learns from labelled training images and {type(datamodule).__name__}'s have no labels: "
                           "val/probe_* are not reported (probe the trunk with main_linear.py on a labelled dataset)")

    # ----------------------------------------------------------------- training
    def probe_loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the online probe on the features `step` returns (`probe_features`: B rows per view, the
        first view's first; a step may return every global view's, of which `probe_views: first` reads the first),
        the mean over every view's samples; unlabelled samples (label -1) are left out."""
        if self.probe_views == "first":
            features = features[: len(labels)]
        elif len(features) > len(labels):
            labels = labels.repeat(len(features) // len(labels))
        per_sample = F.cross_entropy(self.probe(features), labels.clamp(min=0), reduction="none")
        labelled = (labels >= 0).float()
        return (per_sample * labelled).sum() / labelled.sum().clamp(min=1)

    def method_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self.named_parameters() if not name.startswith("probe.")]

    def optimizer_groups(self) -> list[dict]:
        """The method's groups, then the probe's own: its learning rate, no weight decay, scaled with the batch and
        LARS-adapted only with `probe_like_trunk`."""
        if not self.probe_like_trunk:
            return super().optimizer_groups() + [{"params": list(self.probe.parameters()), "lr": self.probe_lr, "weight_decay": 0.0, "lars_exclude": True}]
        like_trunk = {"batch_scaled_lr": self.probe_lr, "weight_decay": 0.0}
        return super().optimizer_groups() + [
            like_trunk | {"params": [self.probe.weight], "lars_exclude": False},
            like_trunk | {"params": [self.probe.bias], "lars_exclude": self.optimizer_spec.exclude_bias_and_norm},
        ]
