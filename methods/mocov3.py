"""MoCo v3 (Chen, Xie & He, ICCV 2021), as facebookresearch/moco-v3 does it, with a ResNet or a ViT trunk.

Both views go through the online encoder (trunk, projector, predictor) and the momentum encoder (trunk,
projector); each view's query is contrasted with the other view's keys of the global batch, gathered from
every process without gradient, in InfoNCE without a queue, scaled by 2 tau (paper Algorithm 1;
moco/builder.py `contrastive_loss`); the two terms are summed. The momentum rises to 1 with a cosine
(`--moco-m-cos`), the momentum encoder updated before the keys of each step (here after the previous
optimizer step: the `cosine_mocov3` schedule, the same sequence). The heads (moco/builder.py): ResNet,
projector 2048-4096-256 ending in BN without affine parameters and predictor 256-4096-256; ViT, a 3-layer
projector and a predictor ending in that BN too; no Linear has a bias. BatchNorm statistics are the global
batch's (SyncBN, main_moco.py): trainer.sync_batchnorm, no shuffle-BN.

Multi-crop (not in MoCo v3's code): the local crops are further queries of the online encoder, each contrasted with
the keys of both global views; the terms of every (global key, other crop) pair are summed, the official sum of the
two view orders extended (juliendenize/eztorch eztorch/models/siamese/mocov3.py `training_step`).
"""

from backbones import MLPSpec
from engine.config import as_spec
from methods.losses import check_hyperparameters, mocov3_loss
from methods.momentum import MomentumMixin, MomentumSpec
from methods.pretrain import PretrainMethod


class MoCoV3(MomentumMixin, PretrainMethod):
    views = ("first", "second")
    multi_crop = True

    def __init__(
        self,
        temperature: float = 1.0,
        predictor: MLPSpec = MLPSpec(hidden_dim=4096, output_dim=256, last_bias=False),
        momentum: MomentumSpec = MomentumSpec(base=0.99, schedule="cosine_mocov3", shuffle_bn=False),
        **kwargs,
    ):
        """
        Args:
            temperature: tau (1.0 for ResNet-50, the default of main_moco.py; 0.2 for ViTs, CONFIG.md `--moco-t=.2`).
            predictor: the MLP after the online projector (ResNet 256-4096-256; ViT adds BN without affine at its end).
            momentum: m (0.99; 0.996 for the 1000-epoch ResNet run) with `cosine_mocov3`; no shuffle-BN.
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature)
        super().__init__(**kwargs)
        self.temperature = temperature
        self.predictor = as_spec(MLPSpec, predictor).build(self.projection_dim)
        self.init_momentum(momentum)

    def step(self, batch):
        views = batch["views"]
        queries, features = self.embed_crops(views, self.views + self.local_crops, len(self.views))  # per_crop: each view its own forward, as moco/builder.py
        key1, key2 = self.gather(self.target_embed(views["first"])), self.gather(self.target_embed(views["second"]))
        offset = self.global_rank * len(queries[0])  # this process's keys in the gathered batch
        loss = mocov3_loss(queries[0], key2, self.temperature, offset) + mocov3_loss(queries[1], key1, self.temperature, offset)
        for query in queries[2:]:
            loss = loss + mocov3_loss(query, key1, self.temperature, offset) + mocov3_loss(query, key2, self.temperature, offset)
        return loss, features
