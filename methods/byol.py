"""BYOL: Bootstrap Your Own Latent (Grill et al., NeurIPS 2020), as deepmind-research/byol does it.

Each view goes through the online network (trunk, projector, predictor) and the target network (trunk,
projector), an exponential moving average of the online one that receives no gradient. The online prediction
of each view regresses the normalised target projection of the other view: 2 - 2 cos, summed over both view
orders (paper Eq. 2; byol/byol_experiment.py `_loss_fn`). The target momentum rises from tau_base to 1 with a
cosine over training, tau = 1 - (1 - tau_base)(cos(pi k / K) + 1) / 2 (byol/utils/schedules.py `target_ema`), the
update made after each optimizer step (byol/byol_experiment.py `_update_fn`). The online linear classifier that
the official loss adds on the detached features is the base's online probe.

Multi-crop (not in BYOL's code): the local crops go through the online network only, and each one's prediction
regresses the targets of both global views; the terms of every (global target, other crop) pair are summed, the
official sum of the two view orders extended (vturrisi/solo-learn solo/methods/byol.py `training_step`).
"""

import torch.nn as nn

from backbones import MLPSpec
from engine.config import as_spec
from methods.losses import byol_loss
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod


class BYOL(MomentumMixin, PretrainMethod):
    views = ("first", "second")
    multi_crop = True

    def __init__(
        self,
        predictor: MLPSpec = MLPSpec(hidden_dim=4096, output_dim=256, last_bias=False),
        momentum: MomentumSpec = MomentumSpec(base=0.996, schedule="cosine_byol", shuffle_bn=False),
        independent_target_init: bool = True,
        **kwargs,
    ):
        """
        Args:
            predictor: q_theta, an MLP of the projector's shape (4096 hidden with BN and ReLU, 256 out; paper section 3.3).
            momentum: tau_base (0.996 for 1000 epochs, 0.99 for 100-300; byol/configs/byol.py) and its schedule
                (`cosine_byol`); no shuffle-BN (BYOL's BatchNorm statistics are the global batch's: trainer.sync_batchnorm).
            independent_target_init: draw the target's initial weights separately, as the official code
                (byol/byol_experiment.py `_make_initial_state`: "initialized using different rngs"), instead of copying
                the online network (solo-learn, lightly).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        super().__init__(**kwargs)
        self.predictor = as_spec(MLPSpec, predictor).build(self.projection_dim)
        self.init_momentum(momentum)
        if independent_target_init:
            self.target_backbone.load_state_dict(self.backbone_spec.build()[0].state_dict())
            for module in self.target_projector.modules():  # build_mlp's layers with their default initialisation
                if isinstance(module, (nn.Linear, nn.BatchNorm1d)):
                    module.reset_parameters()

    def step(self, batch):
        views = batch["views"]
        predictions, features = self.embed_crops(views, self.views + self.local_crops, len(self.views))  # per_crop: each view its own forward, as the official code
        target1, target2 = self.target_embed(views["first"]), self.target_embed(views["second"])
        loss = byol_loss(predictions[0], predictions[1], target1, target2)
        for prediction in predictions[2:]:  # a local crop in both prediction slots: its two pairs
            loss = loss + byol_loss(prediction, prediction, target1, target2)
        return loss, features
