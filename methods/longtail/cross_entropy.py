"""Cross-entropy baselines of long-tailed recognition (Cui et al., ICCV 2021).

`CrossEntropy` is the first baseline family: plain cross-entropy, Balanced Softmax (`loss:
balanced_softmax`, the log prior added to the logits in training) and the tau-normalised classifier of
Kang et al. (ICLR 2020), a post-hoc rescaling of the trained weights, w_k / ||w_k||^tau without the bias
(their `tau_normalization` code), chosen on the validation split:

    python main_pretrain.py validate --config configs/ce_cifar100_lt.yaml --ckpt_path runs/ce_cifar100_lt/checkpoints/last.ckpt --model.init_args.tau_norm 1.0

A published model is evaluated the same way from its own file (`interop.official`: PaCo's releases, a
torchvision or timm classifier), e.g. `validate --config configs/paco_imagenet_lt.yaml
--model.init_args.pretrained_ckpt paco_r50.pth`.
"""

from typing import Literal

import torch
import torch.nn.functional as F

from methods.longtail.base import LongTailClassifier


def tau_normalised(weight: torch.Tensor, tau: float) -> torch.Tensor:
    """Kang et al.'s tau-normalised classifier weights w_k / ||w_k||^tau (rows are classes)."""
    return weight / weight.norm(dim=1, keepdim=True).pow(tau)


class CrossEntropy(LongTailClassifier):
    """Cross-entropy, Balanced Softmax and tau-normalisation baselines (PaCo supplementary, Tables 9, 11, 13)."""

    views = ("image",)
    evaluation_settings = (*LongTailClassifier.evaluation_settings, "tau_norm")  # tau is chosen on a trained model (Kang et al.)

    def __init__(self, loss: Literal["ce", "balanced_softmax"] = "ce", tau_norm: float = 0.0, **kwargs):
        """
        Args:
            loss: `ce` or `balanced_softmax` (cross-entropy of the logits plus the log prior, Ren et al. 2020).
            tau_norm: tau of the post-hoc weight normalisation at evaluation (0: the raw classifier, bias included;
                facebookresearch/classifier-balancing tau_norm.py sweeps p over linspace(0, 2, 21) without the
                bias, so its p = 0 row is the classifier without its bias, which no value here gives).
            **kwargs: the LongTailClassifier arguments (backbone, optimizer, schedule, ...).
        """
        if loss not in ("ce", "balanced_softmax"):
            raise ValueError(f"model.loss must be 'ce' or 'balanced_softmax', got {loss!r}")
        if not tau_norm >= 0:  # NaN too: every logit would be NaN
            raise ValueError(f"model.tau_norm must be >= 0, got {tau_norm}")
        super().__init__(**kwargs)
        if tau_norm and self.loaded_tau_norm:
            raise ValueError(f"model.tau_norm {tau_norm:g}: model.pretrained_ckpt holds a classifier exported already tau-normalised "
                             f"(tau {self.loaded_tau_norm:g}, its export record), which would be normalised twice: give model.tau_norm 0")
        self.loss, self.tau_norm = loss, tau_norm

    def step(self, batch):
        logits = self.classifier(self.backbone(batch["views"]["image"]))
        if self.loss == "balanced_softmax":
            logits = logits + self.log_prior
        return F.cross_entropy(logits, batch["label"]), None

    def trains_with_log_prior(self) -> bool:
        return self.loss == "balanced_softmax"

    def classify(self, images):
        if not self.tau_norm:
            return super().classify(images)
        return self.backbone(images) @ tau_normalised(self.classifier.weight, self.tau_norm).T
