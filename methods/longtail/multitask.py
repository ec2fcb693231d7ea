"""The multi-task baselines of PaCo supplementary, Sec. F (Tables 13 and 14): a classifier trained with
cross-entropy (Table 13) or Balanced Softmax (Table 14, "rebalance in center learning") plus a
supervised contrastive loss, re-weighted per class with the effective-number weights of Cui et al.
(CVPR 2019), added with a loss weight (0.05-1.0 in Table 14).

The contrastive term is PaCo's sample contrast without the centres: the same MoCo machinery (query
and key views, momentum encoder, labelled queue), each query's loss the mean of -log p over its
same-class samples, weighted by Cui et al.'s class-balanced weight of its class, w_c proportional to 1 / E_c with
the effective number E_c = (1 - beta^{n_c}) / (1 - beta), normalised to sum to the number of classes
(richardaecn/class-balanced-loss class_balanced_loss.py CB_loss), beta 0.999 (the supplement, Sec. F: "the
re-weighting method of Cui et al."). UNVERIFIED: the supplement gives no code for these baselines; GPaCo's later
MultiTaskLoss.cal_weight_for_classes (GPaCo/LT/losses.py at fe56535) writes mean(E) / E_c but takes Python's sum and
len over the (1, C) array it builds, so every class weighs 1 there (no re-weighting); GPaCo's later
multi-task code (GPaCo/LT/moco/builder.py at fe56535) contrasts both views without a momentum encoder (keys through
the online encoder, with gradient), puts the classifier on both views and has a head without BatchNorm; here the
contrast is PaCo's (query anchors, momentum keys). Table 13's "CE +
Balanced Softmax" row (Balanced Softmax applied inside the contrast) is not defined precisely enough to reproduce.
"""

from typing import Literal

import torch
import torch.nn.functional as F

from backbones import MLPSpec
from methods.longtail.base import LongTailClassifier, SupervisedMoCoMixin
from methods.losses import check_hyperparameters, paco_loss
from methods.momentum import MomentumSpec


def class_balanced_weights(class_counts: torch.Tensor, beta: float) -> torch.Tensor:
    """Per class, Cui et al.'s class-balanced weight (CVPR 2019): the inverse of the effective number E_c = (1 -
    beta^n_c) / (1 - beta), normalised so that the classes' weights sum to their number (richardaecn/class-balanced-loss
    CB_loss). A class without training images (never an anchor) weighs 0 and is left out of the normalisation."""
    present = class_counts > 0
    inverse = torch.where(present, (1.0 - beta) / (1.0 - torch.pow(beta, class_counts.double())), 0.0)
    return (inverse * present.sum() / inverse.sum()).float()


class MultiTaskContrast(SupervisedMoCoMixin, LongTailClassifier):
    views = ("query", "key")

    def __init__(
        self,
        classifier_loss: Literal["ce", "balanced_softmax"] = "ce",
        contrast_weight: float = 0.5,
        reweight_beta: float = 0.999,
        temperature: float = 0.2,
        queue_size: int = 8192,
        projector: MLPSpec = MLPSpec(hidden_dim=2048, output_dim=128),
        momentum: MomentumSpec = MomentumSpec(base=0.999),
        in_batch: Literal["local", "global"] = "local",
        **kwargs,
    ):
        """
        Args:
            classifier_loss: `ce` (Table 13) or `balanced_softmax` (Table 14) on the classifier.
            contrast_weight: the loss weight of the re-weighted contrastive term (Table 14: 0.05-1.0).
            reweight_beta: beta of the effective number of samples, in [0, 1) (GPaCo/LT/losses.py: 0.999).
            temperature, queue_size, projector, momentum, in_batch: the contrast's settings, as PaCo's.
            **kwargs: the LongTailClassifier arguments (backbone, optimizer, schedule, ...).
        """
        if classifier_loss not in ("ce", "balanced_softmax"):
            raise ValueError(f"model.classifier_loss must be 'ce' or 'balanced_softmax', got {classifier_loss!r}")
        if not 0 <= reweight_beta < 1:
            raise ValueError(f"model.reweight_beta must lie in [0, 1), got {reweight_beta}")
        if contrast_weight < 0:
            raise ValueError(f"model.contrast_weight must be >= 0, got {contrast_weight}")
        check_hyperparameters("model.", temperature=temperature)
        super().__init__(**kwargs)
        self.classifier_loss, self.contrast_weight = classifier_loss, contrast_weight
        self.reweight_beta, self.temperature = reweight_beta, temperature
        self.init_supervised_moco(projector, momentum, queue_size, in_batch)

    def trains_with_log_prior(self) -> bool:
        return self.classifier_loss == "balanced_softmax"

    def step(self, batch):
        labels = batch["label"]
        features, query, key = self.embed_query_and_key(batch)
        logits = self.classifier(features)
        if self.classifier_loss == "balanced_softmax":
            logits = logits + self.log_prior
        anchors, keys, anchor_labels, _ = self.loss_batch(query, key, labels)
        anchor_weights = class_balanced_weights(self.class_counts, self.reweight_beta).to(query.device)[anchor_labels]
        contrast = paco_loss(
            anchors, keys, self.queue.read(), anchor_labels, self.queue.read_labels(), center_logits=None,
            alpha=1.0, temperature=self.temperature, anchor_weights=anchor_weights,
        )  # fmt: skip
        self.enqueue(key, labels)
        self.log("train/contrast_loss", contrast)
        return F.cross_entropy(logits, labels) + self.contrast_weight * contrast, None
