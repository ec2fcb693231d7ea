"""PaCo on RIDE multi-expert trunks: the PaCo supplement's Tables 10 (ImageNet-LT, RIDEResNet-50 and
RIDEResNeXt-50) and 12 (iNaturalist 2018), with 1, 2 or 3 experts and without knowledge distillation.

The trunk (`backbones.ride`, Wang et al., ICLR 2021) shares its early stages and gives one pooled feature
per expert. Each expert is a PaCo learner on its branch: its own class centres (a linear layer with bias
on its unnormalised feature), its own projection head (Linear-BN-ReLU-Linear) and its own labelled key
queue. The key view goes once through the momentum copy of the whole trunk and of every head (shuffle-BN
as in PaCo), so the shared stages serve every expert. The loss is the mean over experts of `paco_loss`
on that expert's query, key, queue and centre logits (with the training-split log prior); prediction is
the argmax of the experts' raw centre logits averaged, as RIDE averages its experts' logits
(`torch.stack(outs, dim=1).mean(dim=1)` in RIDEResNet.py and ride_resnet_cifar.py).

Sources and what is UNVERIFIED. The PaCo repository (dvlab-research/Parametric-Contrastive-Learning:
PaCo/LT, LT/, GPaCo/LT) holds no RIDE code in the snapshot searched, and the supplement says only which
trunks were used; the per-expert centres, heads and queues and the mean of the expert losses are this
codebase's reading (UNVERIFIED). RIDE itself sums its per-expert ("individual") losses (RIDELoss in
model/loss.py), i.e. E times this mean. RIDE's cosine classifier (s = 30), its diversity (KL) term, its
expert-assignment router and its distillation are not part of this method.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones import MLPSpec
from methods.longtail.paco import PaCo
from methods.queues import KeyQueue


class PerExpert(nn.Module):
    """One module per expert, module e applied to expert e's slice of a (B, E, ...) input."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.experts = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([module(x[:, e]) for e, module in enumerate(self.experts)], dim=1)


class PaCoRIDE(PaCo):
    """PaCo's arguments, applied to every expert. The experts are those of a RIDE `backbone`
    (`ride_resnet50`, `ride_resnext50`, `ride_resnet32`; `kwargs.num_experts` sets E); any other trunk is
    one expert, as RIDE builds the plain ResNet for one expert, so that PaCoRIDE on it is PaCo."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        released = self.classifier  # a release's centres, loaded by LongTailClassifier when pretrained_ckpt is given
        self.classifier = PerExpert([nn.Linear(self.feature_dim, self.num_classes) for _ in range(self.num_experts)])
        if kwargs.get("pretrained_ckpt") is not None:  # a PaCo release: one expert (no RIDE trunk loads its weights)
            self.classifier.experts[0].load_state_dict(released.state_dict())

    @property
    def num_experts(self) -> int:
        return getattr(self.backbone, "num_experts", 1)

    def build_projector(self, spec: MLPSpec) -> nn.Module:
        return PerExpert([spec.build(self.feature_dim) for _ in range(self.num_experts)])

    def build_queue(self, size: int, key_dim: int) -> KeyQueue:
        # One ring of labelled keys, row i holding the E experts' keys of one sample, each a random unit vector at start.
        queue = KeyQueue(size, self.num_experts * key_dim, num_classes=self.num_classes)
        queue.keys.copy_(F.normalize(self.expert_view(queue.keys), dim=-1).flatten(1))
        return queue

    def expert_view(self, rows: torch.Tensor) -> torch.Tensor:
        """(N, E, ·) from trunk features (N, E, D) or (N, D) and from queue rows (N, E·d)."""
        return rows.view(len(rows), self.num_experts, -1)

    def target_encode(self, images: torch.Tensor) -> torch.Tensor:
        # (B, d, E): `target_embed` normalises dim 1, which is then each expert's key
        return self.target_projector(self.expert_view(self.target_backbone(images))).transpose(1, 2)

    def embed_query_and_key(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, E, ·) per-expert trunk features, normalised query projections and momentum keys."""
        features = self.expert_view(self.backbone(batch["views"]["query"]))
        query = F.normalize(self.projector(features), dim=-1)
        return features, query, self.target_embed(batch["views"]["key"]).transpose(1, 2)

    def step(self, batch):
        labels = batch["label"]
        features, local_query, local_key = self.embed_query_and_key(batch)
        query, key, batch_labels, center_logits = self.loss_batch(local_query, local_key, labels, self.classifier(features))
        queue, queue_labels = self.expert_view(self.queue.read()), self.queue.read_labels()
        expert_losses = [self.paco_term(query[:, e], key[:, e], queue[:, e], batch_labels, queue_labels, center_logits[:, e])
                         for e in range(self.num_experts)]
        self.enqueue(local_key.flatten(1), labels)
        return torch.stack(expert_losses).mean(), None

    def classify(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.expert_view(self.backbone(images))).mean(dim=1)
