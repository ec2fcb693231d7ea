"""Supervised contrastive learning (Khosla et al., NeurIPS 2020) and Tuned Contrastive Learning
(Animesh & Chandraker, WACV 2025), one method with the loss as a config choice (HobbitLong/SupContrast losses.py, TCL's loss/tcl.py).

Every image arrives as V augmented crops (one data view with `count: V`); all V·B crops go through
the same encoder and projector, and the normalised projections of the whole global batch are gathered
with their gradients, so every anchor contrasts against the crops of every process (the papers ran
under DataParallel: their batch sizes are global, TCL's train.py). No queue, no memory bank: the
TCL paper avoids them to compare the two losses directly (TCL supplement 2.1).

Positives are the other crops of the anchor's class (`positives: class`, the supervised setting) or of
the anchor's own image (`positives: instance`, self-supervised TCL, TCL supplementary, Sec. 2.3). The second stage is a
linear classifier on the frozen trunk (`main_linear.py`, configs/linear_tcl_<dataset>.yaml).

Multi-crop: the local crops are further views of each image in the same loss (SupContrast's loss takes any number of
views), forwarded as `crop_batching` says. solo-learn's SupCon (solo/methods/supcon.py) contrasts every crop too, with
its loss that sums the positives inside the log; this keeps SupContrast's.
"""

from typing import Literal

import torch

from methods.losses import check_hyperparameters, supcon_loss, tcl_loss
from methods.pretrain import PretrainMethod


class SupCon(PretrainMethod):
    views = ("crops",)
    multi_crop = True

    def __init__(
        self,
        loss: Literal["supcon", "tcl"] = "supcon",
        positives: Literal["class", "instance"] = "class",
        temperature: float = 0.1,
        base_temperature: float | None = None,
        k1: float = 5000.0,
        k2: float = 1.0,
        **kwargs,
    ):
        """
        Args:
            loss: `supcon` (L_out, positives kept in the denominator) or `tcl` (adds k1·Σ_P e^{-s} to
                the denominator and weighs the negatives by k2, TCL supplementary, Eq. 6 with D of Eqs. 19-22).
            positives: `class` (same label, supervised) or `instance` (the other crops of the same image).
            temperature: tau of both losses (0.1 in both papers' supervised settings).
            base_temperature: SupCon only, the official loss factor tau / base_temperature; None means
                base_temperature = tau (factor 1), the SupCon baseline of the TCL paper, trained with
                the same learning rate as TCL; 0.07 reproduces HobbitLong/SupContrast (x1.43 at tau 0.1).
            k1: TCL only, weight of the hard-positive term (4000-5000 supervised, 1 self-supervised).
            k2: TCL only, weight of the negatives (1 supervised, 1.5 self-supervised).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        if loss not in ("supcon", "tcl"):
            raise ValueError(f"model.loss must be 'supcon' or 'tcl', got {loss!r}")
        if positives not in ("class", "instance"):
            raise ValueError(f"model.positives must be 'class' or 'instance', got {positives!r}")
        check_hyperparameters("model.", temperature=temperature, base_temperature=base_temperature, k1=k1, k2=k2)
        super().__init__(**kwargs)
        self.loss, self.positives, self.k1, self.k2 = loss, positives, k1, k2
        self.temperature = temperature
        self.base_temperature = temperature if base_temperature is None else base_temperature

    def check_data(self, datamodule, world_size: int) -> None:
        super().check_data(datamodule, world_size)
        crops = getattr(datamodule.views["crops"], "count", 1)
        if crops < 2:
            raise ValueError(f"data.views.crops.count must be >= 2 (the crops of one image are positives), got {crops}")
        train = (getattr(datamodule, "splits", None) or {}).get("train")
        if self.positives == "class" and train is not None and hasattr(datamodule, "train_class_counts"):
            unlabelled = len(train) - sum(datamodule.train_class_counts())  # label -1: every one of them would be one class
            if unlabelled:
                raise ValueError(f"model.positives class takes the images of a class as positives, but {unlabelled} of the {len(train)} training "
                                 f"images of {type(datamodule).__name__} have no label: give model.positives instance, or a labelled training split")

    def step(self, batch):
        crops = batch["views"]["crops"]  # (B, V, C, H, W)
        batch_size, num_crops = crops.shape[:2]
        features, projections = self.embed(crops.flatten(0, 1))
        projections = projections.view(batch_size, num_crops, -1)
        if self.local_crops:
            local, _ = self.embed_crops(batch["views"], self.local_crops)
            projections = torch.cat([projections, torch.stack(local, dim=1)], dim=1)
        # Gathered in rank order with gradients, so the negatives of every anchor span the global batch;
        # as (B, V·D) rows, whose gradient is contiguous (gloo's backward scatters strided ones out of order).
        projections = self.gather_with_grad(projections.reshape(batch_size, -1)).view(-1, projections.shape[1], self.projection_dim)
        # Instance positives: labels None makes image i of the gathered batch its own class.
        labels = self.gather(batch["label"]) if self.positives == "class" else None
        if self.loss == "tcl":
            loss = tcl_loss(projections, labels, self.temperature, self.k1, self.k2)
        else:
            loss = supcon_loss(projections, labels, self.temperature, self.base_temperature)
        return loss, self.probe_features(*features.view(batch_size, num_crops, -1).unbind(1))
