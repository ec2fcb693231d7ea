"""Evaluation shared by pretraining (online probe + kNN monitor) and the linear stage.

`EvaluationMixin` expects `self.backbone` (images -> pooled features) and `self.probe` (a linear layer
on those features). On the evaluation split (dataloader 0) it reports the probe's top-1/top-5 and
collects L2-normalised features; on the kNN bank (dataloader 1, the training split under the
evaluation view) it collects features and labels; at the end of the epoch it classifies the
evaluation features with the weighted kNN of NPID (cosine similarity, k nearest, votes exp(s / T)).
"""

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy


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


class EvaluationMixin:
    def init_evaluation(self, num_classes: int, knn_k: int, knn_temperature: float) -> None:
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if knn_k < 0 or knn_temperature <= 0:
            raise ValueError(f"knn_k must be >= 0 and knn_temperature > 0, got {knn_k}, {knn_temperature}")
        self.num_classes = num_classes
        self.knn_k, self.knn_temperature = knn_k, knn_temperature
        top_ks = (1, 5) if num_classes > 5 else (1,)
        self.probe_metrics = torch.nn.ModuleDict(
            {
                f"{stage}_top{k}": MulticlassAccuracy(num_classes, top_k=k, average="micro", ignore_index=-1)
                for stage in ("val", "test")
                for k in top_ks
            }
        )
        self._collected: dict[str, list[torch.Tensor]] = {}

    def _evaluation_step(self, batch: dict, dataloader_idx: int, stage: str) -> None:
        features = self.backbone(batch["image"])
        role = "query" if dataloader_idx == 0 else "bank"
        if role == "query":
            logits = self.probe(features)
            for name, metric in self.probe_metrics.items():
                if name.startswith(stage):
                    metric.update(logits, batch["label"])
                    self.log(f"{stage}/probe_{name.split('_')[1]}", metric, add_dataloader_idx=False)
        if self.knn_k:
            self._collected.setdefault(f"{role}_features", []).append(F.normalize(features.float(), dim=1))
            self._collected.setdefault(f"{role}_labels", []).append(batch["label"])

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx, "val")

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx, "test")

    def _finish_knn(self, stage: str) -> None:
        collected, self._collected = self._collected, {}
        if "bank_features" not in collected or self.trainer.sanity_checking:
            return
        gathered = {name: self.all_gather(torch.cat(parts)) for name, parts in collected.items()}
        gathered = {name: tensor.flatten(0, 1) if self.trainer.world_size > 1 else tensor for name, tensor in gathered.items()}
        labelled = gathered["bank_labels"] >= 0  # unlabelled bank images (label -1) cannot vote
        scores = knn_predict(
            gathered["query_features"],
            gathered["bank_features"][labelled],
            gathered["bank_labels"][labelled],
            self.num_classes,
            self.knn_k,
            self.knn_temperature,
        )
        for k in (1, 5) if self.num_classes > 5 else (1,):
            self.log(f"{stage}/knn_top{k}", topk_accuracy(scores, gathered["query_labels"], k))

    def on_validation_epoch_end(self) -> None:
        self._finish_knn("val")

    def on_test_epoch_end(self) -> None:
        self._finish_knn("test")
