"""ReSSL: Relational Self-Supervised Learning (Zheng et al., NeurIPS 2021; KyleZheng1997/ReSSL).

No positive pair: the online branch matches, over the queue only, the relation distribution of the
weak view under the momentum (teacher) encoder, sharpened by a lower temperature:
    L = -sum_j softmax(k.queue / tau_t)_j  log softmax(q.queue / tau_s)_j,   tau_s 0.1, tau_t 0.04.
The teacher sees the weak view (crop + flip), the student the strong MoCo v2 view (official
`aug=[moco_aug, target_aug]`), plus optional small crops (ImageNet multi-crop); teacher keys are
enqueued after the loss. ReSSL is SCE with coeff = 0 without the positive slot and the ceiling term.
"""

import torch

from methods.losses import check_hyperparameters, ressl_loss
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod
from methods.queues import KeyQueue


class ReSSL(MomentumMixin, PretrainMethod):
    views = ("weak", "strong")
    multi_crop = True

    def __init__(
        self,
        temperature: float = 0.1,
        temperature_momentum: float = 0.04,
        queue_size: int = 131072,
        momentum: MomentumSpec = MomentumSpec(base=0.999),
        **kwargs,
    ):
        """
        Args:
            temperature: tau_s of the student distribution (0.1).
            temperature_momentum: tau_t of the teacher distribution (0.04; SCE's Table 2 tunes it).
            queue_size: K (131,072 on ImageNet, 4,096 CIFAR, 16,384 STL/Tiny).
            momentum: teacher EMA momentum (0.999 ImageNet, 0.99 / 0.996 small datasets) and shuffle-BN.
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...); its
                `local_crops` (multi-crop: the 192/160/128/96 px crops of the ImageNet 5-crop run) go to the student.
        """
        check_hyperparameters("model.", temperature=temperature, temperature_momentum=temperature_momentum)
        super().__init__(**kwargs)
        self.temperature, self.temperature_momentum = temperature, temperature_momentum
        self.online_views = ("strong", *self.local_crops)
        self.init_momentum(momentum)
        self.queue = KeyQueue(queue_size, self.projection_dim)

    def step(self, batch):
        key = self.target_embed(batch["views"]["weak"])
        online, features = self.embed_crops(batch["views"], self.online_views)
        queue = self.queue.read()
        loss = torch.stack([ressl_loss(query, key, queue, self.temperature, self.temperature_momentum) for query in online]).mean()
        self.queue.push(self.gather(key))
        return loss, features
