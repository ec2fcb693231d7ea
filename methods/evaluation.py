"""Evaluation of every trained module: pretraining (online probe + kNN monitor), the long-tail classifiers
(top-1 by many / medium / few-shot group) and the linear stage, through one `EvaluationMixin`.

The kNN monitor is the weighted kNN of NPID (cosine similarity, k nearest, votes exp(s / T)) of the evaluation
features against the training split under the evaluation view.
"""

import torch
import torch.nn.functional as F


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


def shot_accuracies(
    predictions: torch.Tensor, labels: torch.Tensor, train_counts: torch.Tensor, many_above: int = 100, few_below: int = 20
) -> dict[str, float]:
    """Top-1 accuracy over all samples, and the long-tail groups of Liu et al. (OLTR) as PaCo's
    `shot_acc` computes them: a class is many-shot with more than `many_above` training images, few-shot
    with fewer than `few_below`, medium otherwise; a group's accuracy is the mean of its classes'
    accuracies. Classes without evaluation samples and empty groups are left out (PaCo's shot-group accuracy)."""
    num_classes = len(train_counts)
    correct = torch.zeros(num_classes, dtype=torch.float64, device=labels.device).index_add_(0, labels, (predictions == labels).double())
    seen = torch.zeros(num_classes, dtype=torch.float64, device=labels.device).index_add_(0, labels, torch.ones_like(labels, dtype=torch.float64))
    per_class = correct / seen.clamp(min=1)
    counts = train_counts.to(labels.device)
    groups = {"many": counts > many_above, "medium": (counts >= few_below) & (counts <= many_above), "few": counts < few_below}
    results = {"top1": float((predictions == labels).double().mean())}
    for name, members in groups.items():
        members = members & (seen > 0)
        if members.any():
            results[f"{name}_top1"] = float(per_class[members].mean())
    return results


def topk_accuracy(scores: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    return (top == labels[:, None]).any(dim=1).float().mean()


def ranked_classes(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(N, 1 + k): the argmax, then the k highest classes; top-1 is scored on the argmax and top-k on `topk`, as
    torchmetrics' accuracy does (the two differ only on tied logits)."""
    top = logits.topk(min(k, logits.shape[1]), dim=1).indices if k > 1 else logits.new_empty(len(logits), 0, dtype=torch.long)
    return torch.cat([logits.argmax(dim=1, keepdim=True), top], dim=1)


class EvaluationMixin:
    """The one evaluation path. A module sets `self.num_classes`, calls `init_evaluation` and implements
    `evaluation_outputs(images) -> (features, logits)` (by default its trunk's features and its probe's logits).

    On the evaluation split (dataloader 0) it collects the ranked predictions of the logits, the labels and, for
    the kNN monitor, the L2-normalised features; on the kNN bank (dataloader 1) features and labels. At the end of
    the epoch it gathers them across processes in rank order and logs `{stage}/{prefix}top1` (and `top5` with more
    than 5 classes), the top-1 of each shot group when `shot_bounds` is set, and `{stage}/knn_top1` (`knn_top5`).
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
            raise ValueError(f"need 0 < few_shot_below <= many_shot_above, got {shot_bounds[1]}, {shot_bounds[0]}")
        self.knn_k, self.knn_temperature = knn_k, knn_temperature
        self.metric_prefix, self.shot_bounds = prefix, shot_bounds
        self.top_ks = (1, 5) if self.num_classes > 5 else (1,)
        self._collected: dict[str, list[torch.Tensor]] = {}

    def evaluation_outputs(self, images: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Trunk features (for the kNN monitor; None without one) and class logits of evaluation images."""
        features = self.backbone(images)
        return features, self.probe(features)

    def _evaluation_step(self, batch: dict, dataloader_idx: int) -> None:
        if dataloader_idx == 0:
            features, logits = self.evaluation_outputs(batch["image"])
            self._collect("ranked", ranked_classes(logits, max(self.top_ks)))
            self._collect("labels", batch["label"])
        elif self.knn_k:  # the kNN bank
            features = self.backbone(batch["image"])
            self._collect("bank_labels", batch["label"])
        if self.knn_k:
            self._collect("features" if dataloader_idx == 0 else "bank_features", F.normalize(features.float(), dim=1))

    def _collect(self, name: str, tensor: torch.Tensor) -> None:
        self._collected.setdefault(name, []).append(tensor)

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx)

    def _finish_evaluation(self, stage: str) -> None:
        collected, self._collected = self._collected, {}
        if "ranked" not in collected:
            return
        gathered = {name: self.all_gather(torch.cat(parts)) for name, parts in collected.items()}
        gathered = {name: tensor.flatten(0, 1) if self.trainer.world_size > 1 else tensor for name, tensor in gathered.items()}
        ranked, labels = gathered["ranked"], gathered["labels"]
        labelled = labels >= 0  # unlabelled evaluation images (label -1) are not scored
        if labelled.any():
            hits = ranked[labelled] == labels[labelled, None]
            for k in self.top_ks:  # column 0 is the argmax, columns 1.. the top-k
                self.log(f"{stage}/{self.metric_prefix}top{k}", (hits[:, 0] if k == 1 else hits[:, 1 : k + 1].any(dim=1)).float().mean())
        if self.shot_bounds is not None:
            groups = shot_accuracies(ranked[:, 0], labels, self.class_counts, *self.shot_bounds)
            for name in ("many_top1", "medium_top1", "few_top1"):
                if name in groups:
                    self.log(f"{stage}/{name}", groups[name])
        if "bank_features" in gathered and not self.trainer.sanity_checking:
            bank_labelled = gathered["bank_labels"] >= 0  # unlabelled bank images cannot vote
            scores = knn_predict(
                gathered["features"],
                gathered["bank_features"][bank_labelled],
                gathered["bank_labels"][bank_labelled],
                self.num_classes,
                self.knn_k,
                self.knn_temperature,
            )
            for k in self.top_ks:
                self.log(f"{stage}/knn_top{k}", topk_accuracy(scores, labels, k))

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._finish_evaluation("test")
