"""Training samplers whose epoch order is a function of (seed, epoch) and which resume mid-epoch
(`EpochSampler`), and the class-priority samplers for long-tailed data (Kang et al., "Decoupling
representation and classifier for long-tailed recognition", ICLR 2020, Sec. 3.1; drawn as the official code
facebookresearch/classifier-balancing draws them), selected with `data.sampler` on any DataModule."""

from typing import Literal

import numpy as np
from torch.utils.data import DistributedSampler

DRAW_SEEDS_KEY = 1  # the third word of the key of `EpochSampler`'s draw seeds, after (seed, epoch)
SAMPLING_EXPONENTS = {"instance": 1.0, "square_root": 0.5, "class_balanced": 0.0}  # q of p_j ∝ n_j^q


def class_sampling_probabilities(counts: np.ndarray, policy: str, progress: float = 0.0) -> np.ndarray:
    """p_j of each class: ∝ n_j^q over the classes with images (q of `SAMPLING_EXPONENTS`); `progressive`
    is (1 - progress) p^instance + progress p^class_balanced (Kang et al. 2020, Sec. 3.1: progress = t/T)."""
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
    twice or skipped); a new epoch starts at 0. Subclasses draw another `epoch_order`.

    With `draw_seeds`, each index comes with the seed of its draw, `(index, seed)`, also a function of (seed,
    epoch) and of its place in the epoch's order only: DataLoader workers draw each image's views from it
    (`datamodules.base.ViewsDataset`), so that they are the same however many workers serve the batches and
    whether or not the run was resumed."""

    def __init__(self, dataset_size: int, seed: int = 0, num_replicas: int = 1, rank: int = 0, draw_seeds: bool = False):
        super().__init__(range(dataset_size), num_replicas=num_replicas, rank=rank, seed=seed)
        self.position, self.draw_seeds = 0, draw_seeds

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
        mine = slice(self.rank, self.total_size, self.num_replicas)
        indices = self.epoch_order(np.random.default_rng((self.seed, self.epoch)))[mine][self.position :].tolist()
        if not self.draw_seeds:
            return iter(indices)
        # a generator of their own, keyed apart from the order's: the order is the same with or without seeds
        seeds = np.random.default_rng((self.seed, self.epoch, DRAW_SEEDS_KEY)).integers(2**63, size=self.total_size)
        return zip(indices, seeds[mine][self.position :].tolist())


class EvaluationShard(DistributedSampler):
    """Every `num_replicas`-th image from `rank` on, in order, then padding up to the length of the longest shard:
    indices from `len(dataset)` on, which `EvalDataset` serves labelled -1 (no metric counts them). The processes of
    a distributed evaluation together score each image once, in as many batches each (DDP and the preemption
    agreement run a collective per batch). torch's DistributedSampler, which Lightning gives evaluation loaders
    otherwise, repeats up to W - 1 real images instead. Without `num_replicas` and `rank`, the process group's."""

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)  # num_samples: the longest shard

    def __iter__(self):
        return iter(range(self.rank, self.total_size, self.num_replicas))


# classifier-balancing config/ImageNet_LT/{feat_balance,cls_crt}.yaml: ClassAwareSampler with num_samples_cls 4
IMAGES_PER_CLASS_VISIT = 4


def cycled_images(classes: np.ndarray, by_class: np.ndarray, class_starts: np.ndarray, class_counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """An image of each drawn class, taken in turn from a shuffled cycle of that class's images: no image of a class
    comes twice before all of them came once (classifier-balancing data/ClassAwareSampler.py `RandomCycleIter`)."""
    images = np.empty(len(classes), dtype=np.int64)
    order = np.argsort(classes, kind="stable")  # the draws grouped by class, each class's in draw order
    labels, starts, draws = np.unique(classes[order], return_index=True, return_counts=True)
    for label, start, drawn in zip(labels, starts, draws):
        count = class_counts[label]
        cycles = [rng.permutation(count) for _ in range(-(-drawn // count))]
        images[order[start : start + drawn]] = by_class[class_starts[label] + np.concatenate(cycles)[:drawn]]
    return images


class ClassPrioritySampler(EpochSampler):
    """The draws of `policy`, as the official code makes them (the classes are those with images):
    - `class_balanced` (data/ClassAwareSampler.py): the classes are visited in shuffled rounds, each class once per
      round, and each visit takes the class's next `IMAGES_PER_CLASS_VISIT` images; an epoch holds the largest
      class's size times the number of classes.
    - `square_root` (data/MixedPrioritizedSampler.py, nroot 2): each draw picks an image with probability ∝ its
      class's n_j^½ / n_j (classes ∝ n_j^½, images uniformly, with replacement); an epoch holds the training split's size.
    - `progressive` (data/ClassPrioritySampler.py, lam null): each draw picks a class from
      `class_sampling_probabilities` with t/T = epoch / (max_epochs - 1) (`np.linspace(0, 1, epochs)`: class-balanced
      in the last epoch), then the class's next image; an epoch holds the training split's size.
    A class's images come in shuffled cycles (`cycled_images`). The official iterators carry their place in a cycle
    from one epoch into the next; here each epoch starts new cycles, so that its order depends on (seed, epoch) alone
    and a run resumes mid-epoch exactly. Padded to a multiple of the number of processes."""

    def __init__(
        self,
        labels: np.ndarray,
        num_classes: int,
        policy: Literal["class_balanced", "square_root", "progressive"],
        total_epochs: int | None = None,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        draw_seeds: bool = False,
    ):
        if (labels < 0).any():
            raise ValueError(f"data.sampler: {policy} draws by class, but {int((labels < 0).sum())} training images are unlabelled (label -1)")
        if policy == "progressive" and (total_epochs is None or total_epochs < 1):
            raise ValueError(f"data.sampler: progressive needs the number of epochs from trainer.max_epochs (>= 1), got {total_epochs}")
        self.class_counts = np.bincount(labels, minlength=num_classes)
        epoch_size = int(self.class_counts.max() * np.count_nonzero(self.class_counts)) if policy == "class_balanced" else len(labels)
        super().__init__(epoch_size, seed=seed, num_replicas=num_replicas, rank=rank, draw_seeds=draw_seeds)
        self.policy, self.total_epochs = policy, total_epochs
        self.by_class = np.argsort(labels, kind="stable")  # image indices grouped by class, class 0 first
        self.class_starts = np.cumsum(self.class_counts) - self.class_counts

    def class_probabilities(self) -> np.ndarray:
        """p_j of the current epoch."""
        progress = min(self.epoch, self.total_epochs - 1) / (self.total_epochs - 1) if self.policy == "progressive" and self.total_epochs > 1 else 0.0
        return class_sampling_probabilities(self.class_counts, self.policy, progress)

    def epoch_order(self, rng: np.random.Generator) -> np.ndarray:
        if self.policy == "square_root":
            classes = rng.choice(len(self.class_counts), size=self.total_size, p=self.class_probabilities())
            return self.by_class[self.class_starts[classes] + rng.integers(self.class_counts[classes])]
        if self.policy == "class_balanced":
            present = np.flatnonzero(self.class_counts)
            visits = -(-self.total_size // IMAGES_PER_CLASS_VISIT)
            rounds = [rng.permutation(present) for _ in range(-(-visits // len(present)))]
            classes = np.repeat(np.concatenate(rounds)[:visits], IMAGES_PER_CLASS_VISIT)[: self.total_size]
        else:
            classes = rng.choice(len(self.class_counts), size=self.total_size, p=self.class_probabilities())
        return cycled_images(classes, self.by_class, self.class_starts, self.class_counts, rng)
