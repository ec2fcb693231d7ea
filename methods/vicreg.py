"""VICReg: Variance-Invariance-Covariance Regularization (Bardes et al., ICLR 2022), as facebookresearch/vicreg
main_vicreg.py.

Two views of each image go one after the other through the same trunk and expander (8192-8192-8192), so that
BatchNorm sees one view per batch as in the official forward. The loss (Eq. 6) keeps the two embeddings close
(invariance, the mean squared difference), keeps every dimension's standard deviation over the batch above gamma = 1
(variance, a hinge) and decorrelates the dimensions (covariance, the squared off-diagonal covariances), weighted
25 / 25 / 1.

The embeddings of every process are gathered with their gradients before the variance and covariance terms, as the
official `FullGatherLayer` does (gathered, not summed: the all-reduce of the first draft of lightly PR #979), so W
processes train exactly as one process on the global batch.

Multi-crop (not in the paper): local crops add the pairs (global view, local crop); the loss is the mean over every
pair of a global view and another crop, the official one with the two views only.
"""

import torch

from methods.losses import check_hyperparameters, vicreg_loss
from methods.pretrain import PretrainMethod


class VICReg(PretrainMethod):
    views = ("global1", "global2")
    multi_crop = True

    def __init__(
        self,
        invariance_weight: float = 25.0,
        variance_weight: float = 25.0,
        covariance_weight: float = 1.0,
        gamma: float = 1.0,
        epsilon: float = 1e-4,
        **kwargs,
    ):
        """
        Args:
            invariance_weight, variance_weight, covariance_weight: lambda, mu, nu of Eq. 6 (25, 25, 1: main_vicreg.py
                `--sim-coeff`, `--std-coeff`, `--cov-coeff`).
            gamma: the target standard deviation of the variance hinge (1); epsilon: added to the variance under
                the square root (1e-4).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, local_crops, ...).
        """
        weights = dict(invariance_weight=invariance_weight, variance_weight=variance_weight, covariance_weight=covariance_weight)
        check_hyperparameters("model.", gamma=gamma, epsilon=epsilon, **weights)
        super().__init__(**kwargs)
        self.loss_parameters = weights | dict(gamma=gamma, epsilon=epsilon)

    def step(self, batch):
        crops = self.crops(batch["views"], self.views + self.local_crops)
        embeddings, features = self.encode_crops(crops, self.backbone, self.projector, len(self.views))
        embeddings = [self.gather_with_grad(embedding) for embedding in embeddings]
        pairs = [(first, second) for first in range(len(self.views)) for second in range(first + 1, len(crops))]
        losses = [vicreg_loss(embeddings[a], embeddings[b], **self.loss_parameters) for a, b in pairs]
        return torch.stack(losses).mean(), features
