"""`FineTune`: semi-supervised fine-tuning, the whole pretrained trunk and a linear head trained on the labelled
images of a label fraction (`main_linear.py`, configs `finetune_*.yaml`).

SimCLR (Chen et al., ICML 2020, Sec. 4 "Semi-supervised learning" and Table 7) and BYOL (Grill et al., NeurIPS 2020,
Table 2) evaluate a representation this way on 1% and 10% of ImageNet's labels: the pretrained trunk (without
its projection head) plus a linear classifier, all of it trained with cross-entropy on the labelled subset, BatchNorm
in training mode. The subset is the DataModule's `data.label_subset` (SimCLR's `1percent.txt` / `10percent.txt`, or
a stratified, seeded fraction; `datamodules.subsets`).

It is the linear stage with the trunk trained (`LinearProbe.trains_trunk`): the same strict trunk load from a
pretraining checkpoint or an official release (`model.pretrained_format`), the same checks and evaluation. What
differs is written here:
- the head starts at zero, as google-research/simclr's fine-tuning runs set `--zero_init_logits_layer=True`
  (model.py: the `head_supervised` parameters assigned zeros), so the first steps train the head alone;
- the default optimizer is SimCLR's fine-tuning optimizer (google-research/simclr model_util.py `get_optimizer`:
  momentum 0.9 with Nesterov; `learning_rate_schedule`: cosine decay to 0 without restarts, no warm-up by
  `--warmup_epochs=0`), at 0.05 per 256 images and without weight decay (the configs' headers give the sources);
- the logits are the network's prediction: `val/top1` (the linear probe's are `val/probe_top1`);
- it runs under `finetune/` beside its pretraining checkpoint.

A fine-tuned checkpoint exports its trunk like a pretraining checkpoint (`python -m interop.export`).
"""

import dataclasses

import torch.nn as nn

from engine.optim import OptimizerSpec, ScheduleSpec
from methods.linear import LinearProbe


class FineTune(LinearProbe):
    wrong_checkpoint_hint = " (a pretraining checkpoint to fine-tune is --model.pretrained_ckpt)"
    trains_trunk = True
    run_folder = "finetune"

    def __init__(
        self,
        optimizer: OptimizerSpec = OptimizerSpec(name="sgd", lr=0.05, lr_scaling="linear", weight_decay=0.0, momentum=0.9, nesterov=True),
        schedule: ScheduleSpec = ScheduleSpec(decay="cosine"),
        **kwargs,
    ):
        """
        Args:
            optimizer, schedule: of the whole network, trunk and head in one group.
            **kwargs: the LinearProbe arguments (pretrained_ckpt, pretrained_format, backbone, random_init: a randomly
                initialised trunk trained on the same labels, the supervised baseline; knn_k, ...) and MethodBase's.
        """
        super().__init__(optimizer=optimizer, schedule=schedule, **kwargs)
        # the checkpoint records the trunk it trained, read from the pretraining checkpoint when not given: the export
        # (interop.export) builds the trunk from it
        self.hparams["backbone"] = dataclasses.asdict(self.backbone_spec)

    def init_head(self, head: nn.Linear) -> None:
        nn.init.zeros_(head.weight)  # google-research/simclr --zero_init_logits_layer
        nn.init.zeros_(head.bias)
