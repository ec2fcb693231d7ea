"""PaCo: Parametric Contrastive Learning (Cui et al., ICCV 2021), as dvlab-research's PaCo/LT code
trains it (PaCo's LT/moco/builder.py and LT/losses.py).

A supervised MoCo: the query view goes through the online trunk and an MLP head with BatchNorm, the
key view through the momentum copies (shuffle-BN across processes); the queue keeps past keys **with
their labels**. The class centres are the rows of the classifier (weights and bias) applied to the
**unnormalised** pooled trunk feature, so they learn through the same loss (PaCo supplementary,
Eqs. 13-14): every query contrasts against [centres | other queries, keys, queue], with weight 1 on
its own centre and alpha on each same-class sample. With `rebalance` (all long-tailed runs) the centre
logits carry the log prior of the training split in training only (balanced softmax, PaCo
supplementary, Sec. F and Table 14); prediction is the argmax of the raw centre logits, with no
separate probe. The official `linear_k` (a momentum copy of the centres) is never used by the loss or
at inference, so it is not built.
"""

from typing import Literal

import torch

from backbones import MLPSpec
from methods.longtail.base import LongTailClassifier, SupervisedMoCoMixin
from methods.losses import check_hyperparameters, paco_loss
from methods.momentum import MomentumSpec


class PaCo(SupervisedMoCoMixin, LongTailClassifier):
    views = ("query", "key")

    def __init__(
        self,
        alpha: float = 0.05,
        temperature: float = 0.2,
        beta: float = 1.0,
        gamma: float = 1.0,
        queue_size: int = 8192,
        rebalance: bool = True,
        projector: MLPSpec = MLPSpec(hidden_dim=2048, output_dim=128),
        momentum: MomentumSpec = MomentumSpec(base=0.999),
        in_batch: Literal["local", "global"] = "local",
        **kwargs,
    ):
        """
        Args:
            alpha: weight of each sample positive against 1 on the own centre (0.05; 0.01 on CIFAR-LT).
            temperature: tau of the sample contrast (0.2; 0.05 CIFAR-LT, 0.07 ResNeXt-50); the centre
                logits are not divided by it (supt = 1 in the official code).
            beta, gamma: the official code's weight of the own centre and of the sample terms in the
                denominator; 1 in every PaCo experiment (maintainer, PaCo issue #12).
            queue_size: K, labelled keys kept from previous steps (8192; 1024 on CIFAR-LT).
            rebalance: add log(class frequency) to the centre logits in training (False for the
                balanced full-ImageNet runs).
            projector: the MLP head, Linear-BN-ReLU-Linear (2048-2048-128; 64-64-32 on ResNet-32).
            momentum: EMA momentum of the key branch (0.999) and shuffle-BN settings.
            in_batch: `local` (the official per-GPU contrast) or `global` (the batch of all processes,
                as one process with the global batch), see `SupervisedMoCoMixin.loss_batch`.
            **kwargs: the LongTailClassifier arguments (backbone, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature, alpha=alpha, beta=beta, gamma=gamma)
        if gamma == 0 and alpha > 0:  # positives then leave the denominator: the loss is unbounded below
            raise ValueError("model.gamma = 0 with model.alpha > 0 makes the PaCo loss unbounded below")
        if alpha == beta == 0:  # no positive left: the official loss is 0 / 0, this one 0 with no gradient
            raise ValueError("model.alpha = model.beta = 0 leaves the PaCo loss no positive (nothing would train)")
        super().__init__(**kwargs)
        self.alpha, self.temperature, self.beta, self.gamma = alpha, temperature, beta, gamma
        self.rebalance = rebalance
        self.init_supervised_moco(projector, momentum, queue_size, in_batch)

    def trains_with_log_prior(self) -> bool:
        return self.rebalance

    def step(self, batch):
        labels = batch["label"]
        features, local_query, local_key = self.embed_query_and_key(batch)
        # centres on the unnormalised trunk feature (PaCo/LT/moco/builder.py: the avgpool output, not the projection)
        query, key, batch_labels, center_logits = self.loss_batch(local_query, local_key, labels, self.classifier(features))
        loss = self.paco_term(query, key, self.queue.read(), batch_labels, self.queue.read_labels(), center_logits)
        self.enqueue(local_key, labels)
        return loss, None

    def paco_term(self, query, key, queue, labels, queue_labels, center_logits) -> torch.Tensor:
        """`paco_loss` with this model's alpha, tau, beta and gamma, and the training split's class prior (rebalance)."""
        prior = self.class_counts / self.class_counts.sum() if self.rebalance else None
        return paco_loss(query, key, queue, labels, queue_labels, center_logits=center_logits, alpha=self.alpha,
                         temperature=self.temperature, beta=self.beta, gamma=self.gamma, class_prior=prior)
