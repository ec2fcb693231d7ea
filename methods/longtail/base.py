"""Long-tailed recognition: the classifier base of PaCo and its baselines (Cui et al., ICCV 2021).

`LongTailClassifier` is a trunk whose pooled feature feeds a linear classifier (PaCo's class centres,
bias included). The per-class counts of the training split are read from the DataModule when training
or evaluation starts (and kept in the checkpoint): they give the log prior of balanced softmax and the
many / medium / few-shot groups. A prediction is the argmax of the raw classifier logits (no prior at
inference, Ren et al. 2020; PaCo issue #26); validation and test log top-1 (top-5 too with more than 5 classes) and
the top-1 of each group every epoch (`val/top1`, `val/many_top1`, `val/medium_top1`, `val/few_top1`).

`SupervisedMoCoMixin` is the MoCo machinery that PaCo and the multi-task baselines share: an MLP head
on the trunk feature, momentum copies of trunk and head, and a queue of keys with their labels.
"""

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from backbones import MLPSpec
from engine.config import as_spec
from engine.optim import OptimizerSpec
from interop import load_official_classifier
from methods.base import MethodBase
from methods.momentum import MomentumMixin, MomentumSpec
from methods.queues import KeyQueue


class LongTailClassifier(MethodBase):
    evaluation_settings = ("many_shot_above", "few_shot_below")  # the shot groups an evaluation reports

    def __init__(
        self,
        optimizer: OptimizerSpec = OptimizerSpec(name="sgd", lr=0.05, weight_decay=5e-4, momentum=0.9),
        trainable_convs: str | None = None,
        many_shot_above: int = 100,
        few_shot_below: int = 20,
        pretrained_ckpt: str | None = None,
        pretrained_format: str | None = None,
        **kwargs,
    ):
        """
        Args:
            optimizer: the optimizer (lr per 256 images when scaled).
            trainable_convs: when set, only the Conv2d layers under this trunk module train (PaCo's
                Places-LT run: `layer4.2`, the last block of a ResNet-152); BatchNorm stays trainable.
            many_shot_above, few_shot_below: the group bounds in training images per class (100, 20).
            pretrained_ckpt, pretrained_format: a published classifier whose trunk and classifier replace the
                initial ones, e.g. a PaCo release (`interop.official`; format read from its keys by default).
            **kwargs: the MethodBase arguments (backbone, schedule, num_classes, channels_last, compile).
        """
        super().__init__(optimizer=optimizer, **kwargs)
        self.init_evaluation(prefix="", shot_bounds=(many_shot_above, few_shot_below))
        self.classifier = nn.Linear(self.feature_dim, self.num_classes)
        self.loaded_tau_norm = 0.0  # the tau a loaded classifier was exported with (interop.export --tau-norm)
        if pretrained_ckpt is not None:
            self.loaded_tau_norm = load_official_classifier(self.backbone, self.classifier, pretrained_ckpt, pretrained_format, self.backbone_spec)
        if trainable_convs is not None:
            self._freeze_convs_outside(trainable_convs)
        self.register_buffer("class_counts", torch.zeros(self.num_classes, dtype=torch.long))

    def _freeze_convs_outside(self, prefix: str) -> None:
        modules = dict(self.backbone.named_modules())
        if not prefix or prefix not in modules:  # "" names the trunk itself, which holds no Conv2d of that name: all frozen
            raise ValueError(f"model.trainable_convs {prefix!r} is not a module of the backbone")
        for name, module in modules.items():
            if isinstance(module, nn.Conv2d) and not (name == prefix or name.startswith(prefix + ".")):
                module.requires_grad_(False)

    # ----------------------------------------------------------------- prediction
    def classify(self, images: torch.Tensor) -> torch.Tensor:
        """Logits used for prediction: the raw classifier on the trunk features."""
        return self.classifier(self.backbone(images))

    # ----------------------------------------------------------------- class counts and prior
    @property
    def log_prior(self) -> torch.Tensor:
        """log(n_k / sum n + 1e-9), the balanced-softmax offset exactly as PaCo's code (PaCo's LT/losses.py)."""
        counts = self.class_counts.float()
        return torch.log(counts / counts.sum() + 1e-9)

    def check_data(self, datamodule, world_size: int) -> None:
        super().check_data(datamodule, world_size)
        counts = torch.as_tensor(datamodule.train_class_counts())
        empty = (counts == 0).nonzero().flatten().tolist()
        if len(counts) != self.num_classes or empty:
            raise ValueError(
                f"model.num_classes is {self.num_classes} but the training split of {type(datamodule).__name__} has "
                f"{len(counts)} classes" + (f", {len(empty)} of them without any image (classes {empty[:10]})" if empty else "")
            )
        self.class_counts.copy_(counts)
        sampler = getattr(datamodule, "sampler", "instance")
        if self.trains_with_log_prior() and sampler != "instance":
            warnings.warn(
                f"{type(self).__name__} adds the log prior of the training split's class counts in training, which "
                f"corrects for the label distribution the batches are drawn from (Ren et al. 2020, Eq. 4), while "
                f"data.init_args.sampler {sampler!r} draws the classes in other proportions: the classes are rebalanced "
                "twice, towards the tail; give sampler instance, or the loss without the prior"
            )

    def trains_with_log_prior(self) -> bool:
        """Whether training adds the log class prior to the logits (Balanced Softmax, PaCo's rebalance)."""
        return False

    def evaluation_outputs(self, images: torch.Tensor) -> tuple[None, torch.Tensor]:
        # in fp32 at any training precision, as PaCo's validate() (LT/paco_lt.py, paco_cifar.py; paco_fp16_places.py
        # autocasts its training only): bf16 logits tie, and the argmax gives a tie to the lowest class, a head class
        with torch.autocast(images.device.type, enabled=False):
            return None, self.classify(images.float())

    def results_context(self) -> dict:
        release = {"pretrained_ckpt": self.hparams.pretrained_ckpt} if self.hparams.pretrained_ckpt is not None else {}  # a release evaluated
        return super().results_context() | release


class SupervisedMoCoMixin(MomentumMixin):
    """PaCo's MoCo part (PaCo's LT/moco/builder.py) for a `LongTailClassifier`."""

    def init_supervised_moco(self, projector: MLPSpec | dict, momentum: MomentumSpec | dict, queue_size: int, in_batch: str) -> None:
        """The head, the momentum copies and the queue, and which batch the loss contrasts (`loss_batch`)."""
        if in_batch not in ("local", "global"):
            raise ValueError(f"model.in_batch must be 'local' or 'global', got {in_batch!r}")
        self.in_batch = in_batch
        projector = as_spec(MLPSpec, projector)
        self.projector = self.build_projector(projector)
        self.init_momentum(momentum)
        self.queue = self.build_queue(queue_size, projector.output_dim)

    def build_projector(self, spec: MLPSpec) -> nn.Module:
        """The head on the trunk feature (PaCoRIDE builds one per expert)."""
        return spec.build(self.feature_dim)

    def build_queue(self, size: int, key_dim: int) -> KeyQueue:
        # PaCo starts its queue from random keys with random labels: early steps see spurious positives
        # (rows unit-norm here; the official code normalises its random matrix per column).
        return KeyQueue(size, key_dim, num_classes=self.num_classes)

    def loss_batch(self, query: torch.Tensor, key: torch.Tensor, labels: torch.Tensor, center_logits: torch.Tensor | None = None):
        """The anchors and in-batch samples of the loss (query, key, labels, centre logits). `local`: this
        process's own, as the official code computes the loss per GPU on its local anchors (PaCo's
        LT/moco/builder.py), so the contrast set depends on the GPU layout. `global`: every process's,
        gathered in rank order, the queries and centre logits with their gradients, so that W processes
        with B images train as one process with W·B (each process computes the loss of the whole batch; the
        all-gather's backward sums the processes' gradients and DDP averages them, which gives that loss's gradient)."""
        if self.in_batch == "local":
            return query, key, labels, center_logits
        gathered_logits = None if center_logits is None else self.gather_with_grad(center_logits)
        return self.gather_with_grad(query), self.gather(key), self.gather(labels), gathered_logits

    def embed_query_and_key(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unnormalised trunk features and normalised projection of the query view (online), and the
        normalised momentum key of the key view (shuffle-BN across processes)."""
        features = self.backbone(batch["views"]["query"])
        return features, F.normalize(self.projector(features), dim=1), self.target_embed(batch["views"]["key"])

    def enqueue(self, key: torch.Tensor, labels: torch.Tensor) -> None:
        """After the loss, so this step's keys serve from the next step on; gathered in rank order."""
        self.queue.push(self.gather(key), self.gather(labels))
