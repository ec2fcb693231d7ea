"""Barlow Twins (Zbontar et al., ICML 2021), as facebookresearch/barlowtwins main.py.

Two views of each image go one after the other through the same trunk and projector (8192-8192-8192 without biases
on ImageNet), so that BatchNorm sees one view per batch as in the official forward. The projections of the whole
global batch are standardised per dimension and their cross-correlation matrix is driven to the identity: each
dimension invariant to the augmentations (the diagonal to 1), the dimensions decorrelated (the rest to 0, weighted
by lambda = 0.0051), Eq. 1.

Across processes the projections are gathered with their gradients, so W processes train exactly as one process on
the global batch. The official code all-reduces the cross-correlation without autograd (main.py), which gives 1/W of
that gradient on W GPUs (lightly's loss had the same bug, fixed by lightly PR #1980): its configs say where this
departs from the official multi-GPU runs.

Multi-crop (not in the paper): local crops add the pairs (global view, local crop); the loss is the mean over every
pair of a global view and another crop, the official one with the two views only.
"""

import torch

from methods.losses import barlow_twins_loss, check_hyperparameters
from methods.pretrain import PretrainMethod


class BarlowTwins(PretrainMethod):
    views = ("global1", "global2")
    multi_crop = True

    def __init__(self, off_diagonal_weight: float = 0.0051, loss_scale: float = 1.0, **kwargs):
        """
        Args:
            off_diagonal_weight: lambda, the weight of the redundancy-reduction term (0.0051, main.py `--lambd`).
            loss_scale: a factor on the loss (1 in the official code since June 2021, whose bias learning rate
                0.0048 = 0.2 x 0.024 replaced `--scale-loss 0.024`; solo-learn keeps the factor: 0.1 on CIFAR).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, local_crops, ...).
        """
        check_hyperparameters("model.", off_diagonal_weight=off_diagonal_weight, loss_scale=loss_scale)
        super().__init__(**kwargs)
        self.off_diagonal_weight, self.loss_scale = off_diagonal_weight, loss_scale

    def step(self, batch):
        crops = self.crops(batch["views"], self.views + self.local_crops)
        projections, features = self.encode_crops(crops, self.backbone, self.projector, len(self.views))
        projections = [self.gather_with_grad(projection) for projection in projections]
        pairs = [(first, second) for first in range(len(self.views)) for second in range(first + 1, len(crops))]
        losses = [barlow_twins_loss(projections[a], projections[b], self.off_diagonal_weight, self.loss_scale) for a, b in pairs]
        return torch.stack(losses).mean(), features
