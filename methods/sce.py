"""SCE: Similarity Contrastive Estimation (Denize et al., WACV 2023).

The online branch predicts, for each strong view, a distribution over {its positive key} + the queue
whose target mixes the one-hot of InfoNCE with the relations of the weak view to the queue under the
momentum encoder:  w = coeff * onehot(0) + (1 - coeff) * softmax([0, k.queue] / tau_m)  (SCE's p, s
and w, restated in SCE supplementary, Sec. B). coeff = 1 is MoCo v2's InfoNCE, coeff = 0 ReSSL's
relational target plus the "ceiling" term (SCE Proposition 1, proved in SCE supplementary, Sec. B). The
weak view goes to the momentum branch, the strong one to the online branch (official code and configs;
the comments of SCE supplementary, Algorithm 1 have them swapped).

- asymmetric (small datasets): weak -> target, strong (+ the local crops of multi-crop, if any) -> online;
- symmetric (ImageNet): two strong global views, each a target for every other crop; the keys of
  both global views are enqueued (2 keys per image and step).
"""

import torch
import torch.nn as nn

from backbones import MLPSpec
from engine.config import RampSpec, as_spec
from methods.losses import check_hyperparameters, sce_loss
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod
from methods.queues import KeyQueue


class SCE(MomentumMixin, PretrainMethod):
    multi_crop = True

    def __init__(
        self,
        temperature: float = 0.1,
        temperature_momentum: float = 0.05,
        coeff: float = 0.5,
        queue_size: int = 65536,
        symmetric: bool = False,
        mask_positive_target: bool = False,
        predictor: MLPSpec | None = None,
        temperature_momentum_warmup: RampSpec | None = None,
        coeff_warmup: RampSpec | None = None,
        momentum: MomentumSpec = MomentumSpec(base=0.999),
        **kwargs,
    ):
        """
        Args:
            temperature: tau of the online distribution (SCE supplementary, Table 2: 0.1 or 0.2).
            temperature_momentum: tau_m of the target relations (SCE supplementary, Table 2: 0.03-0.10).
            coeff: lambda, the weight of the one-hot (InfoNCE) target; 0.5 in every paper setting.
            queue_size: K, keys kept from previous steps (4,096 CIFAR, 16,384 STL/Tiny, 65,536 ImageNet).
            symmetric: the ImageNet loss (views global1/global2) instead of the small-dataset one
                (views weak/strong).
            mask_positive_target: give the positive slot of the target a logit of -inf (SCE
                Proposition 1, supplementary Sec. B) instead of 0 (official code, Algorithm 1); negligible in practice.
            predictor: an MLP after the online projector (ImageNet recipe); the target has none.
            temperature_momentum_warmup, coeff_warmup: optional ramps from `start` to the configured
                value over the first epochs (eztorch options, off in every paper config).
            momentum: EMA momentum (0.99 CIFAR, 0.996 STL/Tiny, 0.99 cosine to 1 ImageNet), shuffle-BN.
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...); its
                `local_crops` (multi-crop, e.g. the 192/160/128/96 px crops of the ImageNet 5-crop run) go to the
                online branch, each predicted from every target view.
        """
        check_hyperparameters("model.", temperature=temperature, temperature_momentum=temperature_momentum, coeff=coeff)
        super().__init__(**kwargs)
        self.temperature, self.temperature_momentum, self.coeff = temperature, temperature_momentum, coeff
        self.symmetric, self.mask_positive_target = symmetric, mask_positive_target
        self.temperature_momentum_warmup = temperature_momentum_warmup and as_spec(RampSpec, temperature_momentum_warmup)
        self.coeff_warmup = coeff_warmup and as_spec(RampSpec, coeff_warmup)
        if self.temperature_momentum_warmup:  # a ramp's values are its parameter's, from its start on
            check_hyperparameters("model.temperature_momentum_warmup.start as ", temperature_momentum=self.temperature_momentum_warmup.start)
        if self.coeff_warmup:
            check_hyperparameters("model.coeff_warmup.start as ", coeff=self.coeff_warmup.start)
        if predictor is not None:
            self.predictor: nn.Module = as_spec(MLPSpec, predictor).build(self.projection_dim)
        self.target_views = ("global1", "global2") if symmetric else ("weak",)
        self.views = ("global1", "global2") if symmetric else ("weak", "strong")
        self.online_views = (("global1", "global2") if symmetric else ("strong",)) + self.local_crops
        self.keys_per_sample = len(self.target_views)
        self.init_momentum(momentum)
        self.queue = KeyQueue(queue_size, self.projection_dim)

    def scheduled(self) -> tuple[float, float]:
        """(tau_m, coeff) at the current step, after their optional warm-ups."""
        tau_m, coeff = self.temperature_momentum, self.coeff
        if self.temperature_momentum_warmup:
            tau_m = self.temperature_momentum_warmup.value_at(tau_m, self.epochs_done)
        if self.coeff_warmup:
            coeff = self.coeff_warmup.value_at(coeff, self.epochs_done)
        return tau_m, coeff

    def step(self, batch):
        views = batch["views"]
        targets = [self.target_embed(views[name]) for name in self.target_views]
        online, features = self.embed_crops(views, self.online_views, len(self.online_views) - len(self.local_crops))
        # Every online crop is predicted from every target view but its own (a symmetric global view is
        # both a target and an online crop, at the same index); the loss is the mean over these pairs.
        pairs = [(t, q) for t in range(len(targets)) for q in range(len(online)) if not (self.symmetric and q == t)]
        tau_m, coeff = self.scheduled()
        queue = self.queue.read()
        losses = [
            sce_loss(online[q], targets[t], queue, self.temperature, tau_m, coeff, self.mask_positive_target)
            for t, q in pairs
        ]
        self.queue.push(self.gather(torch.cat(targets)))
        if self.temperature_momentum_warmup or self.coeff_warmup:
            self.log_dict({"train/temperature_momentum": tau_m, "train/coeff": coeff}, on_step=True, on_epoch=False)
        return torch.stack(losses).mean(), features
