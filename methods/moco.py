"""MoCo v2 (He et al., CVPR 2020; Chen et al., arXiv 2003.04297), as in facebookresearch/moco with
`--mlp --moco-t 0.2 --aug-plus --cos` (facebookresearch/moco main_moco.py).

The query view goes through the online encoder, the key view through the momentum encoder (with
shuffle-BN); InfoNCE puts the positive key in column 0 against the queue of past keys; the keys are
enqueued after the loss. The official code updates the momentum encoder at the start of the forward,
this one right after each optimizer step: the same sequence of updates except for the very last.

Multi-crop (not in MoCo's code): the local crops are further queries of the online encoder, each contrasted with the
key view's key and the queue; the loss is the mean over the queries (juliendenize/eztorch, the SCE authors' MoCo,
eztorch/models/siamese/shuffle_momentum_queue_base.py, its asymmetric `training_step`); only the key is enqueued.
"""

import torch

from methods.losses import check_hyperparameters, info_nce
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod
from methods.queues import KeyQueue


class MoCoV2(MomentumMixin, PretrainMethod):
    views = ("query", "key")
    multi_crop = True

    def __init__(
        self,
        temperature: float = 0.2,
        queue_size: int = 65536,
        momentum: MomentumSpec = MomentumSpec(base=0.999),
        **kwargs,
    ):
        """
        Args:
            temperature: tau of InfoNCE (0.2 for MoCo v2).
            queue_size: K, negatives kept from previous steps (65,536 on ImageNet).
            momentum: EMA momentum of the key encoder (0.999, constant) and shuffle-BN settings.
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature)
        super().__init__(**kwargs)
        self.temperature = temperature
        self.init_momentum(momentum)
        self.queue = KeyQueue(queue_size, self.projection_dim)

    def step(self, batch):
        queries, features = self.embed_crops(batch["views"], ("query", *self.local_crops))
        key = self.target_embed(batch["views"]["key"])
        queue = self.queue.read()
        loss = torch.stack([info_nce(query, key, queue, self.temperature) for query in queries]).mean()
        self.queue.push(self.gather(key))
        return loss, features
