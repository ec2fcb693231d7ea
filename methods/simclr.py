"""SimCLR (Chen et al., ICML 2020) with the NT-Xent loss of google-research/simclr (spec_selfsup 3).

Both views of every image go through the same online encoder in one batch (as the official code
concatenates them, so BatchNorm sees all 2B images). Each embedding's positive is the other view of
its image and its negatives are the other 2B_g - 2 embeddings of the global batch, gathered from every
process with their gradients. `nt_xent` averages over the 2B_g anchors; the official loss sums the two
directions, i.e. is twice this value (LARS, SimCLR's optimizer, is insensitive to that scale).
"""

import torch

from methods.base import PretrainMethod
from methods.config import check_positive
from methods.losses import nt_xent


class SimCLR(PretrainMethod):
    views = ("first", "second")

    def __init__(self, temperature: float = 0.5, **kwargs):
        """
        Args:
            temperature: tau of NT-Xent (0.5 in SimCLR's CIFAR-10 recipe, 0.1 on ImageNet).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        super().__init__(**kwargs)
        check_positive("temperature", temperature)
        self.temperature = temperature

    def contrastive_step(self, batch):
        first, second = batch["views"]["first"], batch["views"]["second"]
        features, embeddings = self.embed(torch.cat([first, second]))
        z1, z2 = embeddings.chunk(2)
        loss = nt_xent(self.gather_with_grad(z1), self.gather_with_grad(z2), self.temperature)
        return loss, features[: len(first)]
