"""Training samplers whose epoch order is a function of (seed, epoch) and which resume mid-epoch
(`EpochSampler`), and the class-priority samplers for long-tailed data (Kang et al., "Decoupling
representation and classifier for long-tailed recognition", ICLR 2020, sampling strategies; official code
facebookresearch/classifier-balancing), selected with `data.sampler` on any DataModule: each draw picks a class j with probability p_j,
then one of its images uniformly."""

from typing import Literal

import numpy as np
from torch.utils.data import DistributedSampler

SAMPLING_EXPONENTS = {"instance": 1.0, "square_root": 0.5, "class_balanced": 0.0}  # q of p_j ∝ n_j^q


def class_sampling_probabilities(counts: np.ndarray, policy: str, progress: float = 0.0) -> np.ndarray:
    """p_j of each class: ∝ n_j^q over the classes with images (q of `SAMPLING_EXPONENTS`); `progressive`
    is (1 - t/T) p^instance + t/T p^class_balanced with `progress` = t/T (Kang et al. 2020)."""
    counts = np.asarray(counts, dtype=np.float64)
    if policy == "progressive":
        return (1 - progress) * class_sampling_probabilities(counts, "instance") + progress * class_sampling_probabilities(counts, "class_balanced")
    weights = np.where(counts > 0, counts ** SAMPLING_EXPONENTS[policy], 0.0)
    return weights / weights.sum()


class EpochSampler(DistributedSampler):
    """Every image once per epoch in a random order drawn from (seed, epoch) only (instance sampling),
    padded to a multiple of the number of processes; every process draws the same order and takes every
    `num_replicas`-th index from `rank` on. Being a DistributedSampler, Lightning keeps it under DDP and
    calls `set_epoch` every epoch. `resume(epoch, position)` makes the next iteration that epoch's from
    its `position`-th index on (a run resumed mid-epoch sees the rest of the epoch's order, no image
    twice or skipped); a new epoch starts at 0. Subclasses draw another `epoch_order`."""

    def __init__(self, dataset_size: int, seed: int = 0, num_replicas: int = 1, rank: int = 0):
        super().__init__(range(dataset_size), num_replicas=num_replicas, rank=rank, seed=seed)
        self.position = 0

    def epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        """The `total_size` dataset indices of the epoch, for all processes."""
        return np.resize(rng.permutation(len(self.dataset)), self.total_size)  # pads with the first indices

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        super().set_epoch(epoch)

    def resume(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position

    def __iter__(self):
        order = self.epoch_order(np.random.default_rng((self.seed, self.epoch)))
        return iter(order[self.rank : self.total_size : self.num_replicas][self.position :].tolist())


class ClassPrioritySampler(EpochSampler):
    """Each epoch draws as many images as the training set holds (padded to a multiple of the number of
    processes): a class from `class_sampling_probabilities`, then one of its images uniformly."""

    def __init__(
        self,
        labels: np.ndarray,
        num_classes: int,
        policy: Literal["class_balanced", "square_root", "progressive"],
        total_epochs: int | None = None,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        if (labels < 0).any():
            raise ValueError(f"data.sampler: {policy} draws by class, but {int((labels < 0).sum())} training images are unlabelled (label -1)")
        if policy == "progressive" and (total_epochs is None or total_epochs < 1):
            raise ValueError(f"data.sampler: progressive needs the number of epochs from trainer.max_epochs (>= 1), got {total_epochs}")
        super().__init__(len(labels), seed=seed, num_replicas=num_replicas, rank=rank)
        self.policy, self.total_epochs = policy, total_epochs
        self.class_counts = np.bincount(labels, minlength=num_classes)
        self.by_class = np.argsort(labels, kind="stable")  # image indices grouped by class, class 0 first
        self.class_starts = np.cumsum(self.class_counts) - self.class_counts

    def class_probabilities(self) -> np.ndarray:
        """p_j of the current epoch."""
        progress = self.epoch / self.total_epochs if self.policy == "progressive" else 0.0
        return class_sampling_probabilities(self.class_counts, self.policy, progress)

    def epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        classes = rng.choice(len(self.class_counts), size=self.total_size, p=self.class_probabilities())
        return self.by_class[self.class_starts[classes] + rng.integers(self.class_counts[classes])]
