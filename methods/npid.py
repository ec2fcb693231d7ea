"""Instance discrimination with a memory bank (NPID, Wu et al., CVPR 2018), the model behind Wang &
Liu's study of the contrastive loss (CVPR 2021; author code WangFeng18/
UnsupervisedLearningCodes).

One augmented view of each image goes through the online encoder. Its positive is the image's own
memory-bank entry and its negatives are all other entries, so the denominator of the ordinary loss
covers the whole bank (7.1). With `loss: hard`, only the `num_hard` most similar negatives stay in the
denominator (their hard contrastive loss). After the loss, the bank entries of the batch move towards
the new embeddings with momentum 0.5 (7.2). The bank holds one entry per training image; its size is
read from the DataModule at setup, or from the checkpoint when a trained model is loaded.
`log_eps: 1.0e-7` is the author code's -log(p + 1e-7) (its `objective.py`, both losses); 0 is -log p.

Multi-crop (not in NPID's code): the local crops are further anchors with the same positive entry and bank; the loss
is the mean over the anchors, as MoCo's over its queries (juliendenize/eztorch shuffle_momentum_queue_base.py); only
the view's embedding moves the bank.
"""

import warnings
from typing import Literal

import torch

from methods.losses import check_hyperparameters, contrastive_loss
from methods.pretrain import PretrainMethod
from methods.queues import MemoryBank


class NPID(PretrainMethod):
    views = ("image",)
    multi_crop = True

    def __init__(
        self,
        temperature: float = 0.07,
        loss: Literal["ordinary", "hard"] = "ordinary",
        num_hard: int = 4095,
        bank_momentum: float = 0.5,
        log_eps: float = 0.0,
        **kwargs,
    ):
        """
        Args:
            temperature: tau of the contrastive loss (Wang & Liu sweep 0.05 ... 1.0).
            loss: `ordinary` (every negative in the denominator) or `hard` (the hardest `num_hard`).
            num_hard: negatives the hard loss keeps per anchor. The author code keeps the top 4,096 of
                the whole 50,000-entry CIFAR bank, the anchor's own entry included, i.e. 4,095 negatives.
            bank_momentum: m in v_i <- normalize(m v_i + (1 - m) f(x_i)) (0.5 in NPID and Wang & Liu).
            log_eps: the loss is -log(p + log_eps) per image; the author code's 1e-7 caps it near 16.1
                and scales the gradient by p / (p + 1e-7) (large at small tau and early in training).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, ...).
        """
        check_hyperparameters("model.", temperature=temperature, num_hard=num_hard, log_eps=log_eps)
        if loss not in ("ordinary", "hard"):
            raise ValueError(f"model.loss must be 'ordinary' or 'hard', got {loss!r}")
        if not 0.0 <= bank_momentum < 1.0:
            raise ValueError(f"model.bank_momentum must lie in [0, 1), got {bank_momentum}")
        super().__init__(**kwargs)
        self.temperature = temperature
        self.num_hard = num_hard if loss == "hard" else None
        self.bank_momentum = bank_momentum
        self.log_eps = log_eps
        self.bank: MemoryBank | None = None

    def build_bank(self, size: int) -> None:
        self.bank = MemoryBank(size, self.projection_dim).to(self.device)

    def check_data(self, datamodule, world_size: int) -> None:
        super().check_data(datamodule, world_size)
        train = (getattr(datamodule, "splits", None) or {}).get("train")
        if train is None:
            return
        if self.bank is not None and len(self.bank.entries) != len(train):  # a second fit on other data: stale entries, or an IndexError
            raise ValueError(f"NPID's memory bank holds one entry per image of the training split it was built for ({len(self.bank.entries)}), "
                             f"but {type(datamodule).__name__}'s has {len(train)}: train a new model on this data")
        if self.num_hard is not None and self.num_hard >= len(train) - 1:
            warnings.warn(f"model.init_args.num_hard {self.num_hard} keeps all {len(train) - 1} negatives of the {len(train)}-entry bank: "
                          "the hard loss is the ordinary one here")

    def setup(self, stage: str) -> None:
        if self.bank is None:
            if self.trainer.datamodule is None:
                raise ValueError("NPID sizes its memory bank from the DataModule's training split; pass a datamodule")
            self.build_bank(len(self.trainer.datamodule.splits["train"]))
        super().setup(stage)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.bank is None:  # loaded outside a Trainer: the checkpoint knows the bank's size
            self.build_bank(len(checkpoint["state_dict"]["bank.entries"]))

    def step(self, batch):
        anchors, features = self.embed_crops(batch["views"], ("image", *self.local_crops))
        index = batch["index"]
        bank = self.bank.read()  # the entries before this step's update
        loss = torch.stack([
            contrastive_loss(anchor, bank[index], bank, self.temperature, num_hard=self.num_hard, exclude=index, log_eps=self.log_eps)
            for anchor in anchors
        ]).mean()
        self.bank.update(self.gather(index), self.gather(anchors[0]), self.bank_momentum)
        return loss, features
