"""SimCLR (Chen et al., ICML 2020) with the NT-Xent loss of google-research/simclr (`objective.add_contrastive_loss`).

Both views of every image go through the same online encoder in one batch (as the official code
concatenates them, so BatchNorm sees all 2B images). Each embedding's positive is the other view of
its image and its negatives are the other 2B_g - 2 embeddings of the global batch, gathered from every
process with their gradients. `nt_xent` averages over the 2B_g anchors (solo-learn's `simclr_loss_func`);
google-research/simclr's `objective.add_contrastive_loss` sums the means of the two directions, twice that
(`sum_of_directions`): the scale its lr and weight decay were tuned at, which LARS does not undo for the
parameters it excludes from adaptation, nor for the weight decay of those it adapts.
With `num_hard`, Wang & Liu's hard contrastive loss (their experiments use NPID's memory bank) replaces NT-Xent over the
batch's negatives (the author code's simclr.py, WangFeng18/UnsupervisedLearningCodes, trains SimCLR with the ordinary loss).

Multi-crop (not in SimCLR's code): the local crops' embeddings join the contrast, every other crop of an anchor's image
its positive (`nt_xent_multi_crop`, vturrisi/solo-learn solo/methods/simclr.py); forwarded as `crop_batching` says.
"""

import torch

from methods.losses import check_hyperparameters, contrastive_loss, nt_xent, nt_xent_multi_crop
from methods.pretrain import PretrainMethod


class SimCLR(PretrainMethod):
    views = ("first", "second")
    multi_crop = True

    def __init__(self, temperature: float = 0.5, num_hard: int | None = None, sum_of_directions: bool = False, **kwargs):
        """
        Args:
            temperature: tau of NT-Xent (0.5 in SimCLR's CIFAR-10 recipe, 0.1 on ImageNet).
            num_hard: None for NT-Xent; n for Wang & Liu's hard contrastive loss, which keeps only each
                anchor's n most similar negatives of the 2B_g - 2 in the denominator.
            sum_of_directions: False for the mean over the 2B_g anchors; True for google-research/simclr's
                scale, the sum of each direction's mean (loss_a + loss_b of `objective.add_contrastive_loss`),
                twice the mean.
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature, num_hard=num_hard)
        if num_hard is not None and kwargs.get("local_crops"):
            raise ValueError(f"model.num_hard {num_hard} with model.local_crops {list(kwargs['local_crops'])}: the hard loss is for two views only")
        super().__init__(**kwargs)
        self.temperature, self.num_hard = temperature, num_hard
        self.directions = 2 if sum_of_directions else 1

    def step(self, batch):
        first, second = batch["views"]["first"], batch["views"]["second"]
        features, embeddings = self.embed(torch.cat([first, second]))
        z1, z2 = embeddings.chunk(2)
        z1, z2 = self.gather_with_grad(z1), self.gather_with_grad(z2)
        if self.local_crops:
            local, _ = self.embed_crops(batch["views"], self.local_crops)
            crops = torch.stack([z1, z2, *(self.gather_with_grad(z) for z in local)], dim=1)
            return self.directions * nt_xent_multi_crop(crops, self.temperature), features
        if self.num_hard is None:
            return self.directions * nt_xent(z1, z2, self.temperature), features
        # The hard loss over the same 2B_g anchors: the negatives of an anchor are the batch without itself
        # and its other view (its positive), as in NT-Xent's denominator.
        z = torch.cat([z1, z2])
        anchors = torch.arange(len(z), device=z.device)
        partners = anchors.roll(len(z1))
        excluded = torch.stack([anchors, partners], dim=1)
        loss = contrastive_loss(z, z[partners], z, self.temperature, num_hard=self.num_hard, exclude=excluded)
        return self.directions * loss, features
