"""SimSiam: Exploring Simple Siamese Representation Learning (Chen & He, CVPR 2021), as facebookresearch/simsiam.

One network, no momentum encoder and no negatives: each view's prediction p = h(z) matches the other view's
projection z under a stop-gradient, D = -cos, averaged over both view orders (paper Eq. 3-4, Algorithm 1;
main_simsiam.py, simsiam/builder.py). The predictor is a bottleneck MLP (2048-512-2048, simsiam/builder.py).
Its learning rate is fixed, not decayed (main_simsiam.py `--fix-pred-lr`, paper Table 1): the configs name
it in `optimizer.fixed_lr_modules`. The projector ends with BN without affine parameters; the official one's last
Linear is the ResNet's own `fc`, whose bias it keeps but never trains (simsiam/builder.py), as here when the
projector is configured with that bias (`last_bias: true`).

Multi-crop (not in SimSiam's code, nor in solo-learn's): each local crop's prediction matches the projections of both
global views, as BYOL's local crops regress both targets (solo-learn solo/methods/byol.py); the loss is the mean over
every (global projection, other crop) pair, the official mean of the two view orders extended.
"""

import torch
import torch.nn as nn

from backbones import MLPSpec
from engine.config import as_spec
from methods.losses import simsiam_loss
from methods.pretrain import PretrainMethod


class SimSiam(PretrainMethod):
    views = ("first", "second")
    multi_crop = True

    def __init__(self, predictor: MLPSpec = MLPSpec(hidden_dim=512, output_dim=2048), **kwargs):
        """
        Args:
            predictor: h, Linear-BN-ReLU-Linear with a 512-d bottleneck and a bias on its output (simsiam/builder.py).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        super().__init__(**kwargs)
        self.predictor = as_spec(MLPSpec, predictor).build(self.projection_dim)
        last_linear = [module for module in self.projector if isinstance(module, nn.Linear)][-1]
        if last_linear.bias is not None and isinstance(self.projector[-1], nn.BatchNorm1d):
            last_linear.bias.requires_grad_(False)  # cancelled by the BN after it: kept at its initial value

    def step(self, batch):
        crops = self.crops(batch["views"], self.views + self.local_crops)
        outputs, features = self.encode_crops(crops, self.backbone, self.project_and_predict, len(self.views))
        (projection1, prediction1), (projection2, prediction2) = outputs[:2]
        losses = [simsiam_loss(prediction1, prediction2, projection1, projection2)]
        # a local crop in both prediction slots: the mean of its two pairs
        losses += [simsiam_loss(prediction, prediction, projection1, projection2) for _, prediction in outputs[2:]]
        return torch.stack(losses).mean(), features
