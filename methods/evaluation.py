"""Evaluation of every trained module: pretraining (online probe + kNN monitor), the long-tail classifiers
(top-1 by many / medium / few-shot group) and the linear stage, through one `EvaluationMixin`. The accuracies are
torchmetrics'; the kNN vote is written here (torchmetrics has none).

The kNN monitor is the weighted kNN of NPID (cosine similarity, k nearest, votes exp(s / T)) of the evaluation
features against the training split under the evaluation view.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy, MulticlassStatScores


@torch.no_grad()
def knn_predict(
    queries: torch.Tensor,
    bank: torch.Tensor,
    bank_labels: torch.Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.07,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Class scores (Q, C) of the NPID weighted kNN: each of the k most similar bank entries votes for
    its class with weight exp(similarity / temperature). Inputs are L2-normalised rows."""
    k = min(k, bank.shape[0])
    scores = []
    for chunk in queries.split(chunk_size):
        similarity, neighbours = (chunk @ bank.T).topk(k, dim=1)
        votes = torch.zeros(chunk.shape[0], num_classes, device=chunk.device, dtype=similarity.dtype)
        scores.append(votes.scatter_add_(1, bank_labels[neighbours], (similarity / temperature).exp()))
    return torch.cat(scores)


def knn_topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k accuracy of kNN class scores; images labelled -1 are not scored. Tied scores rank by class index (top-1
    is the argmax), and a class is among an image's top k only with a vote: where its neighbours hold fewer than k
    classes, the others tie at 0 (torchmetrics' top-k counted some of them; DINO's eval_knn.py, for the same
    reason, narrows its top 5 to the top min(5, k) classes, which leaves them in for k >= 5)."""
    values, indices = scores.sort(dim=1, descending=True, stable=True)
    k = min(k, scores.shape[1])
    hit = ((indices[:, :k] == labels[:, None]) & (values[:, :k] > 0)).any(dim=1)
    scored = labels >= 0
    return (hit & scored).sum() / scored.sum().clamp(min=1)


def shot_accuracies(class_stats: torch.Tensor, train_counts: torch.Tensor, many_above: int = 100, few_below: int = 20) -> dict[str, float]:
    """Top-1 accuracy over all samples, and the long-tail groups of Liu et al. (OLTR) as PaCo's `shot_acc` computes
    them, from torchmetrics' per-class stat scores (C, 5: tp, fp, tn, fn, support): a class is many-shot with more
    than `many_above` training images, few-shot with fewer than `few_below`, medium otherwise; a group's accuracy is
    the mean of its classes' accuracies. Classes without evaluation samples and empty groups are left out (PaCo's
    shot-group accuracy)."""
    correct, seen = class_stats[:, 0].double(), class_stats[:, 4].double()
    per_class = correct / seen.clamp(min=1)
    counts = train_counts.to(class_stats.device)
    groups = {"many": counts > many_above, "medium": (counts >= few_below) & (counts <= many_above), "few": counts < few_below}
    results = {"top1": float(correct.sum() / seen.sum().clamp(min=1))}
    for name, members in groups.items():
        members = members & (seen > 0)
        if members.any():
            results[f"{name}_top1"] = float(per_class[members].mean())
    return results


class EvaluationMixin:
    """The one evaluation path. A module sets `self.num_classes`, calls `init_evaluation` and implements
    `evaluation_outputs(images) -> (features, logits)` (by default its trunk's features and its probe's logits).

    On the evaluation split (dataloader 0), torchmetrics accumulates the top-k accuracies of the logits (and, with
    `shot_bounds`, the per-class counts of the shot groups) and synchronises them across processes; images labelled
    -1 are not scored. For the kNN monitor it collects the L2-normalised features and labels of the evaluation split
    and of the kNN bank (dataloader 1), gathered across processes in rank order at the end of the epoch. It logs
    `{stage}/{prefix}top1` (and `top5` with more than 5 classes), the top-1 of each shot group, and
    `{stage}/knn_top1` (`knn_top5`).
    """

    def init_evaluation(
        self, knn_k: int = 0, knn_temperature: float = 0.07, prefix: str = "probe_", shot_bounds: tuple[int, int] | None = None
    ) -> None:
        """prefix: of the logits' metric names (`probe_`: an online or linear probe; empty: a classifier's own);
        shot_bounds: (many_shot_above, few_shot_below) training images per class, counted in `self.class_counts`."""
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        if knn_k < 0 or knn_temperature <= 0:
            raise ValueError(f"knn_k must be >= 0 and knn_temperature > 0, got {knn_k}, {knn_temperature}")
        if shot_bounds is not None and not 0 < shot_bounds[1] <= shot_bounds[0]:
            raise ValueError(f"model.init_args.few_shot_below {shot_bounds[1]} and many_shot_above {shot_bounds[0]}: need 0 < few_shot_below <= many_shot_above")
        self.knn_k, self.knn_temperature = knn_k, knn_temperature
        self.metric_prefix, self.shot_bounds = prefix, shot_bounds
        self.logits_trained = True  # False: the logits' classifier had no labelled image to learn from (not reported)
        self.top_ks = (1, 5) if self.num_classes > 5 else (1,)
        classes = {"num_classes": self.num_classes, "ignore_index": -1}
        self.accuracies = nn.ModuleDict({f"top{k}": MulticlassAccuracy(top_k=k, average="micro", **classes) for k in self.top_ks})
        self.class_stats = MulticlassStatScores(average=None, **classes) if shot_bounds is not None else None
        self._collected: dict[str, list[torch.Tensor]] = {}

    def evaluation_outputs(self, images: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Trunk features (for the kNN monitor; None without one) and class logits of evaluation images."""
        features = self.backbone(images)
        return features, self.probe(features)

    def evaluated_trunk(self) -> nn.Module:
        """The trunk of the encoder the method's paper evaluates (DINO's teacher, as facebookresearch/dino eval_knn.py
        and eval_linear.py read it), which the kNN monitor votes with and the few-shot probes read; the online probe
        reads the online trunk it learns from."""
        return self.target_backbone if self.evaluated_encoder == "momentum" else self.backbone

    def _evaluation_step(self, batch: dict, dataloader_idx: int) -> None:
        labels = batch["label"]
        if dataloader_idx == 0:
            features, logits = self.evaluation_outputs(batch["image"])
            for accuracy in self.accuracies.values():
                accuracy.update(logits, labels)
            if self.class_stats is not None:
                self.class_stats.update(logits, labels)
            if self.knn_k and self.evaluated_trunk() is not self.backbone:
                features = self.evaluated_trunk()(batch["image"])
        elif self.knn_k:  # the kNN bank
            features = self.evaluated_trunk()(batch["image"])
        if self.knn_k:
            split = "" if dataloader_idx == 0 else "bank_"
            self._collect(f"{split}labels", labels)
            if dataloader_idx == 1:
                self._collect("bank_indices", batch["index"])  # -1: an evaluation shard's padding, not a bank image
            self._collect(f"{split}features", F.normalize(features.float(), dim=1))

    def _collect(self, name: str, tensor: torch.Tensor) -> None:
        self._collected.setdefault(name, []).append(tensor)

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx)

    def _finish_evaluation(self, stage: str) -> None:
        collected, self._collected = self._collected, {}
        top1 = self.accuracies["top1"]
        if not top1.update_called:  # no evaluation batch ran
            return
        # images scored on any process (each is a true positive or a false negative): none when every label is -1
        scored = bool(self.trainer.strategy.reduce(top1.tp + top1.fn, reduce_op="sum") > 0)
        for k, accuracy in zip(self.top_ks, self.accuracies.values()):
            if scored and self.logits_trained:
                self.log(f"{stage}/{self.metric_prefix}top{k}", accuracy.compute())
            accuracy.reset()
        if self.class_stats is not None:
            # without training-split counts (validated from Python without a DataModule) there are no shot groups
            groups = shot_accuracies(self.class_stats.compute(), self.class_counts, *self.shot_bounds) if self.class_counts.any() else {}
            self.class_stats.reset()
            for name in ("many_top1", "medium_top1", "few_top1"):
                if name in groups:
                    self.log(f"{stage}/{name}", groups[name])
        if "bank_features" in collected and not self.trainer.sanity_checking:
            gathered = {name: self.gather(torch.cat(parts)) for name, parts in collected.items()}
            self._warn_of_a_partial_bank(stage, int((gathered["bank_indices"] >= 0).sum()))
            bank_labelled = gathered["bank_labels"] >= 0  # unlabelled bank images and the shards' padding cannot vote
            scores = knn_predict(
                gathered["features"],
                gathered["bank_features"][bank_labelled],
                gathered["bank_labels"][bank_labelled],
                self.num_classes,
                self.knn_k,
                self.knn_temperature,
            )
            for k in self.top_ks:
                self.log(f"{stage}/knn_top{k}", knn_topk_accuracy(scores, gathered["labels"], k))

    def _warn_of_a_partial_bank(self, stage: str, banked: int) -> None:
        """`trainer.limit_{stage}_batches` limits every loader of the stage, the kNN bank's too (a folder dataset's
        first classes only, its images being sorted by class): the vote then runs among part of the training set."""
        loaders = self.trainer.val_dataloaders if stage == "val" else self.trainer.test_dataloaders
        full = len(loaders[1].dataset)
        if banked < full:
            rank_zero_warn(f"the kNN bank holds {banked} of the {full} training images (trainer.limit_{stage}_batches limits its loader too): "
                           f"{stage}/knn_top1 votes among them only")

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._finish_evaluation("test")
