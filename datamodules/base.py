"""The DataModule base: named views for pretraining, an evaluation view, and the kNN bank.

Batches:
- training: `{"views": {name: tensor, ...}, "label": y, "index": i}`, one tensor per configured view
  (shape (B, C, H, W), or (B, N, C, H, W) for a view with `count: N`);
- evaluation: `{"image": x, "label": y, "index": i}`.

`pipeline: cpu` (the default, the reference) augments each image with PIL in the DataLoader workers, each draw
from a seed of its own that the training sampler gives it (`ViewsDataset`: the same views with one worker or
many, and after a resume; without workers, from the main process's random stream).
The mode (`datamodules.pipeline.Pipeline`: cpu, resident, streamed, encoded) is decided once, at construction
(`pipeline_mode`), and every loader and view of the DataModule follows it.
With `pipeline: gpu` the views are drawn per batch on the training device after the transfer
(`augment_on_device`, called by the method's `on_after_batch_transfer`), every random parameter per
sample (`datamodules.batched`), from uint8 images that are either
- resident on the device (`resident: true`, the default where all images have one size): the whole
  training split is decoded once into one uint8 tensor that moves to the device with the first batch
  (CIFAR-10: 150 MB), and the loader delivers batches of indices and labels only;
- or delivered by the DataLoader workers per batch: raw uint8 images of one size (`resident: false`), or,
  for folders of images of any size, the encoded files, decoded on the device (`datamodules.encoded`).

`val_dataloader()` returns the validation split and, when `knn_bank` is on, the labelled bank of the kNN
monitor under the evaluation view: the `bank` split where a dataset has one (STL-10 pretrains on
unlabelled images too, label -1, but its bank is the labelled training set), else the training split.
`data.sampler` picks how training images are drawn (every image once per epoch, or one of Kang et al.'s
class-priority samplers for long-tailed data, `datamodules.samplers.ClassPrioritySampler`), in an
order drawn from (seed, epoch); the DataModule's state in a checkpoint is where training is in that
order (epoch, batches done), so a run resumed mid-epoch continues it (`state_dict`).
`train_class_counts()` gives the training images per class, read from the labels without decoding images.
A subclass only says where its splits come from (`build_splits`), its class count, image size,
normalisation, default evaluation view and the layout it expects under `data.root`.
"""

import os
import random
from pathlib import Path
import typing
from typing import Any, Callable, Iterator, Literal

import lightning as L
import numpy as np
import torch
import torchvision
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset, Sampler

from datamodules.encoded import EncodedImages, collate_encoded
from datamodules.pipeline import Pipeline, pipeline_mode
from datamodules.samplers import ClassPrioritySampler, EpochSampler, EvaluationShard
from datamodules.subsets import LabelSubset, labelled_subset
from datamodules.transforms import build_view
from engine.compat import data_position
from engine.config import as_spec
from engine.devices import process_group



def dataset_labels(dataset: Dataset) -> np.ndarray:
    """The labels of a dataset of `(image, label)` pairs, read without decoding an image: its `labels` or
    `targets`, through `Subset`-like (`dataset` + `indices`) and wrapping (`base`) datasets."""
    if hasattr(dataset, "indices") and hasattr(dataset, "dataset"):
        return dataset_labels(dataset.dataset)[np.asarray(dataset.indices, dtype=np.int64)]
    for attribute in ("labels", "targets"):
        if hasattr(dataset, attribute):
            return np.asarray(getattr(dataset, attribute), dtype=np.int64)
    if hasattr(dataset, "base"):
        return dataset_labels(dataset.base)
    raise ValueError(f"cannot read the labels of a {type(dataset).__name__} without decoding its images: it needs a `labels` or `targets` attribute")


Sampler = Literal["instance", "class_balanced", "square_root", "progressive"]
SAMPLERS = typing.get_args(Sampler)


def seed_draw(seed: int) -> None:
    """Seed the generators that per-image transforms draw from with the seed of one draw (0 <= seed < 2**63):
    torch's CPU generator (its Mersenne Twister keeps the low 32 bits; `torch.manual_seed` would also seed other
    devices, 80 us a draw), Python's (every bit), and NumPy's global one with the high bits (with the low ones it
    would repeat torch's stream: timm's RandAugment would pick its operations from the crop's draws)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed >> 32)


class ViewsDataset(Dataset):
    """Wraps a dataset of `(image, label)` pairs into training samples with several named views. Given
    `(index, seed)` (`EpochSampler(draw_seeds=True)`: in DataLoader workers, and in the main process of each of
    several processes), the views of that draw come from its seed: torch's, Python's and NumPy's generators, which the
    transforms draw from, are seeded with it first; in the main process they are put back after the draw, so that the
    training draws what it would have drawn."""

    def __init__(self, base: Dataset, views: dict[str, Callable]):
        self.base, self.views = base, views

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int | tuple[int, int]) -> dict[str, Any]:
        if not isinstance(index, tuple):
            image, label = self.base[index]
            return {"views": {name: view(image) for name, view in self.views.items()}, "label": label, "index": index}
        index, seed = index
        in_main_process = torch.utils.data.get_worker_info() is None
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state()) if in_main_process else None
        seed_draw(seed)
        try:
            return self[index]
        finally:
            if saved is not None:
                torch.set_rng_state(saved[0])
                random.setstate(saved[1])
                np.random.set_state(saved[2])


class RawImageDataset(Dataset):
    """Training samples as uint8 (C, H, W) tensors, augmented later on the device."""

    def __init__(self, base: Dataset):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image, label = self.base[index]
        pixels = torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)).permute(2, 0, 1)
        return {"image": pixels, "label": label, "index": index}


class IndexBatches(Dataset):
    """Training batches of indices and labels only, for images resident on the device. The DataLoader's
    fetcher hands a whole batch of sampled indices to `__getitems__`, so a batch costs one indexing and no
    per-sample collation (the loader's `collate_fn` is `already_batched`)."""

    def __init__(self, labels: np.ndarray):
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"label": int(self.labels[index]), "index": index}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return {"label": self.labels[index], "index": index}


def already_batched(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return batch


def uint8_image_array(dataset: Dataset) -> np.ndarray | None:
    """The images of a dataset that holds them as one uint8 (N, H, W, 3) RGB array in memory, through
    `Subset`-like datasets: a Digits-M split (`uint8_images()`) or torchvision's CIFAR (`data`, no transform);
    None for any other dataset."""
    if hasattr(dataset, "indices") and hasattr(dataset, "dataset"):
        images = uint8_image_array(dataset.dataset)
        return None if images is None else images[np.asarray(dataset.indices, dtype=np.int64)]
    if hasattr(dataset, "uint8_images"):
        images = dataset.uint8_images()
    elif isinstance(dataset, torchvision.datasets.CIFAR10) and dataset.transform is None:  # CIFAR-100 is a subclass
        images = dataset.data
    else:
        return None
    return images if images.dtype == np.uint8 and images.ndim == 4 and images.shape[-1] == 3 else None


def decode_all(dataset: Dataset, num_workers: int) -> tuple[torch.Tensor, np.ndarray]:
    """Every image of a dataset of one image size as one uint8 (N, C, H, W) tensor, and the labels of the images it
    holds: a copy of a dataset held as one array (the same bytes as decoding each image, without a PIL round trip
    per image), else decoded by `num_workers` DataLoader workers (seeded by a generator of their own: decoding draws
    no number from the global generator, which the views draw from), where an unreadable file's replacement
    (`datamodules.folders.ImageFiles`) comes with its own label."""
    images = uint8_image_array(dataset)
    if images is not None:
        return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous(), dataset_labels(dataset)
    loader = DataLoader(RawImageDataset(dataset), batch_size=1024, num_workers=num_workers, generator=torch.Generator())
    batches = list(loader)
    return torch.cat([batch["image"] for batch in batches]), torch.cat([batch["label"] for batch in batches]).numpy()


class EvalDataset(Dataset):
    def __init__(self, base: Dataset, transform: Callable):
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index >= len(self.base):  # an evaluation shard's padding (`EvaluationShard`): an image no metric counts
            image, _ = self.base[index % len(self.base)]
            return {"image": self.transform(image), "label": -1, "index": -1}
        image, label = self.base[index]
        return {"image": self.transform(image), "label": label, "index": index}


class ContrastiveDataModule(L.LightningDataModule):
    """Base of every DataModule. Subclasses set `num_classes`, `image_size`, `mean`, `std` (before
    calling this `__init__`) and implement `build_splits`."""

    num_classes: int
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    expected_layout: str = ""  # what must be under data.root, for the errors ("" when no root is needed)
    how_to_get = ""  # where the files come from, for the missing-root error
    uniform_image_size = True  # False where images vary in size: `pipeline: gpu` then decodes files on the device
    training_labels = True  # False where no training image has a label: an online probe learns nothing from them

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 256,
        num_workers: int = 4,
        views: dict[str, dict[str, Any]] | None = None,
        eval_view: dict[str, Any] | None = None,
        knn_bank: bool = True,
        pin_memory: bool = True,
        pipeline: Literal["cpu", "gpu"] = "cpu",
        sampler: Sampler = "instance",
        resident: bool = True,
        label_subset: LabelSubset | None = None,
    ):
        """
        Args:
            root: where the dataset lives on disk.
            batch_size: images per device and step.
            num_workers: DataLoader worker processes per device.
            views: named training views, `{name: {preset: ..., **params}}`; the method decides which
                view feeds which branch, so the names must be the ones the method consumes.
            eval_view: the evaluation pipeline (default: `default_eval_view()`, the SCE supplement D
                protocol at the dataset's resolution).
            knn_bank: also serve the labelled training images under `eval_view` during validation (kNN monitor), to
                a model that votes with them (one of `knn_k` 0, e.g. a long-tail classifier, is served none).
            pin_memory: pin host memory for faster host-to-GPU copies.
            pipeline: where the training views are drawn: `cpu` (per image, PIL, in the DataLoader
                workers) or `gpu` (per batch on the training device, whichever it is, CPU included: the
                same parameters, drawn per sample; the presets of the `augment` family only).
            sampler: how the training images of an epoch are drawn (Kang et al. 2020): `instance`, each
                image once in random order; `class_balanced` and `square_root`, a class with probability
                proportional to n^0 or n^(1/2) (n its training images), then one of its images; `progressive`,
                from instance- to class-balanced linearly over `trainer.max_epochs`.
            resident: with `pipeline: gpu` and images of one size, decode the training split once and keep it
                on the training device as one uint8 tensor (N x 3 x H x W bytes per process: CIFAR-10 150 MB,
                STL-10 with its unlabelled images 2.9 GB); false streams raw batches through the workers.
            label_subset: train on a labelled part of the training split only (`datamodules.subsets.LabelSubset`: a
                stratified, seeded `fraction` of every class, or the images a `list_file` names, e.g. SimCLR's ImageNet
                `1percent.txt`), as semi-supervised fine-tuning does; the kNN bank is then that part too.
        """
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {num_workers}")
        self.root = self._checked_root(root)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.knn_bank = knn_bank
        self.pin_memory = pin_memory
        self.pipeline = pipeline
        if sampler not in SAMPLERS:  # the CLI checks the Literal; from Python, the first batch would fail with a KeyError
            raise ValueError(f"data.sampler {sampler!r} is not one of {', '.join(SAMPLERS)}")
        self.sampler = sampler
        self.label_subset = None if label_subset is None else as_spec(LabelSubset, label_subset)  # checked here, before anything is written
        self.mode = pipeline_mode(pipeline, resident, self.uniform_image_size)
        self.resident_images: torch.Tensor | None = None  # the decoded training split, once decoded (RESIDENT)
        self.resident_labels: np.ndarray | None = None  # the labels of the images decoded
        self.encoded_training: EncodedImages | None = None  # what the training loader serves (ENCODED)
        defaults = {"size": self.image_size, "mean": self.mean, "std": self.std}
        self.views = {name: build_view(name, spec, defaults, pipeline) for name, spec in (views or {}).items()}
        self.eval_transform = build_view("eval_view", eval_view or self.default_eval_view(), defaults)
        # the side of each view's images (its `size`, else the dataset's), which a ViT trunk checks (MethodBase.check_data)
        given = {**(views or {}), "eval_view": eval_view or self.default_eval_view()}
        self.view_sizes = {name: spec.get("size", self.image_size) for name, spec in given.items()}
        self.splits: dict[str, Dataset] | None = None
        self.resume_at = {"epoch": 0, "batches": 0}

    @property
    def view_names(self) -> tuple[str, ...]:
        return tuple(self.views)

    @property
    def resident(self) -> bool:
        return self.mode is Pipeline.RESIDENT

    def default_eval_view(self) -> dict[str, Any]:
        """Evaluation view of small and medium datasets: the image at the dataset's resolution (SCE supplementary, Sec. D)."""
        return {"preset": "center"}

    def _checked_root(self, root: str | None) -> Path | None:
        name = type(self).__name__
        if root is None:
            if self.expected_layout:
                raise ValueError(f"data.root is required for {name}: the folder that holds {self.expected_layout}")
            return None
        path = Path(root).expanduser()
        if not path.is_dir():
            expected = f": {name} expects {self.expected_layout} under it" if self.expected_layout else ""
            source = f" ({self.how_to_get})" if self.how_to_get else ""
            raise ValueError(f"data.root {str(root)!r} is not an existing directory{expected}{source}")
        return path

    def build_splits(self) -> dict[str, Dataset]:
        """Return `{"train": ..., "val": ..., "test": ...}` (and optionally `"bank"`) datasets of
        `(image, label)` pairs; label -1 marks an unlabelled image."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            self.splits = self.build_splits()
            if self.label_subset is not None:
                self.keep_labelled_subset()

    def keep_labelled_subset(self) -> None:
        """Replace the training split by the part `label_subset` keeps; the labels of the rest are unknown to the run,
        so the kNN monitor votes with that part too (a separate bank split, STL-10's, is dropped)."""
        train = self.splits["train"]
        description = f"the training split of {type(self).__name__}"
        self.splits["train"] = labelled_subset(train, dataset_labels(train), self.label_subset, description)
        self.splits.pop("bank", None)

    def train_class_counts(self) -> list[int]:
        """Training images per class of the actual training split (long-tailed where the DataModule
        makes it so), `num_classes` long; unlabelled images (label -1) are not counted."""
        self.setup()
        labels = dataset_labels(self.splits["train"])
        return np.bincount(labels[labels >= 0], minlength=self.num_classes).tolist()

    def check_sampler(self, max_epochs: int | None) -> None:
        """`data.sampler`'s own checks against the training split and the run's `trainer.max_epochs` (the CLI calls
        this before a run writes anything; the sampler itself is built with the training DataLoader)."""
        if self.sampler != "instance":
            ClassPrioritySampler(dataset_labels(self.splits["train"]), self.num_classes, self.sampler, max_epochs)

    def train_sampler(self, seed: int) -> EpochSampler:
        """The sampler of `data.sampler`, at the point of the epoch where a resumed run stopped. Where DataLoader
        workers draw the views, it gives each draw its seed: a worker's own random streams start anew with every
        process (a resumed run's workers would draw other views than an uninterrupted run's) and depend on which
        worker serves a batch."""
        processes = process_group()
        # several processes drawing from the main process's generators, seeded alike, would give every rank rank 0's views
        draw_seeds = self.mode is Pipeline.CPU and (self.num_workers > 0 or processes["num_replicas"] > 1)
        if self.sampler == "instance":
            sampler = EpochSampler(len(self.splits["train"]), seed, **processes, draw_seeds=draw_seeds)
        else:
            total_epochs = self.trainer.max_epochs if self.trainer is not None else None
            sampler = ClassPrioritySampler(dataset_labels(self.splits["train"]), self.num_classes, self.sampler, total_epochs, seed,
                                           **processes, draw_seeds=draw_seeds)
        sampler.resume(self.resume_at["epoch"], self.resume_at["batches"] * self.batch_size)
        return sampler

    def expected_warnings(self) -> tuple[str, ...]:
        """Messages of the warnings this DataModule triggers by design; the CLI silences them for its runs."""
        # Lightning knows only DataLoaders with a state_dict as resumable mid-epoch; the training sampler here is
        # repositioned from the DataModule's own state instead (`state_dict`)
        expected = ("You're resuming from a checkpoint that ended before the epoch ended",)
        # a resident training set's loader serves indices, without workers: Lightning's advice to add workers does not apply
        return expected + (("The 'train_dataloader' does not have many workers",) if self.resident else ())

    def state_dict(self) -> dict[str, int]:
        """Where training is in the data order: the epoch and how many of its batches are trained (saved in
        every checkpoint; a checkpoint written at the end of an epoch resumes with the next one)."""
        if self.trainer is None or self.trainer.state.fn != TrainerFn.FITTING:
            return {}
        epoch, batches = data_position(self.trainer)
        if batches >= self.trainer.num_training_batches:
            epoch, batches = epoch + 1, 0
        return {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.resume_at = dict(state_dict)

    def _loader(self, dataset: Dataset, train: bool, sampler: Sampler | None = None, generator: torch.Generator | None = None,
                num_workers: int | None = None, collate_fn: Callable | None = None) -> DataLoader:
        num_workers = self.num_workers if num_workers is None else num_workers
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=train,  # equal batches: split-BN groups and queue updates assume it
            num_workers=num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            persistent_workers=num_workers > 0,
            # a generator of the loader's own even for evaluation: creating an iterator then draws no number
            # from the global generator that the training views draw from, so a validation (or a resume that
            # skips one) does not change what the training draws
            generator=generator if generator is not None else torch.Generator().manual_seed(0),
            collate_fn=collate_fn,
        )

    def training_dataset(self, train: Dataset) -> tuple[Dataset, Callable | None]:
        """What the training DataLoader serves, and its collate function (None: PyTorch's default)."""
        if self.mode is Pipeline.RESIDENT:
            if self.resident_images is None:
                self.resident_images, self.resident_labels = decode_all(train, self.num_workers)
            return IndexBatches(self.resident_labels), already_batched
        served, collate_fn = self.served(train, self.views)
        if self.mode is Pipeline.ENCODED:  # kept: its files decode the batches
            self.encoded_training = served
        return served, collate_fn

    def served(self, dataset: Dataset, views: dict[str, Callable]) -> tuple[Dataset, Callable | None]:
        """What a DataLoader serves of `dataset` for drawing `views` from each image (the training split when it
        is not resident, and the analysed subsets), and its collate function."""
        if self.mode is Pipeline.CPU:
            return ViewsDataset(dataset, views), None
        if self.mode is Pipeline.ENCODED:
            return self.encoded(dataset), collate_encoded
        return RawImageDataset(dataset), None

    def encoded(self, dataset: Dataset) -> EncodedImages:
        """`dataset` (an `ImageFiles`, or a Subset-like of one) read for decoding on the device (`datamodules.encoded`)."""
        return EncodedImages.of(dataset, type(self).__name__)

    def train_dataloader(self) -> DataLoader:
        if not self.views:
            raise ValueError("data.views is empty: the training split needs at least one named view")
        self.setup()
        train = self.splits["train"]
        dataset, collate_fn = self.training_dataset(train)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # the run's seed_everything
        # The worker seeds come from a generator of the loader's own: creating the iterator draws no number from the
        # global generator, so the main process's random streams, which draw the batched views (and the per-image
        # views without workers), are a resumed run's as an uninterrupted one's (engine.random_state.RandomStateCheckpoint).
        # Views drawn in workers come from the sampler's seed of each draw (`train_sampler`).
        return self._loader(dataset, train=True, sampler=self.train_sampler(seed), generator=torch.Generator().manual_seed(seed),
                            num_workers=0 if self.resident else None, collate_fn=collate_fn)  # indices need no workers

    def images_on_device(self, batch: dict) -> tuple[torch.Tensor | list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The uint8 images of a transferred training batch (`pipeline: gpu`) on the batch's device, their labels and
        their sample indices. An encoded image that proves unreadable there is replaced by another of the batch, whose
        label and index it then takes (NPID writes a sample's embedding into the bank entry of its index)."""
        labels, index = batch["label"], batch["index"]
        if self.mode is Pipeline.RESIDENT:
            if self.resident_images.device != labels.device:  # moved once, with the first batch; no host copy is kept
                self.resident_images = self.resident_images.to(labels.device)
            return self.resident_images[index], labels, index
        if self.mode is Pipeline.ENCODED:
            images, shown = self.encoded_training.decode(batch["image"], labels.device)
            if shown != list(range(len(shown))):
                rows = torch.tensor(shown, device=labels.device)
                labels, index = labels[rows], index[rows]
            return images, labels, index
        return batch["image"], labels, index

    def view_batches(self, dataset: Dataset, view: str, device: torch.device) -> Iterator[torch.Tensor]:
        """`dataset` under training view `view` on `device`, batch by batch, drawn where the pipeline draws the
        training views (what the representation analysis embeds). A resident pipeline draws from raw batches
        here: only the training split is resident."""
        served, collate_fn = self.served(dataset, {view: self.views[view]})
        for batch in DataLoader(served, batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_fn):
            if self.mode is Pipeline.CPU:
                yield batch["views"][view]
            elif self.mode is Pipeline.ENCODED:
                yield self.views[view](served.decode(batch["image"], device)[0])
            else:
                yield self.views[view](batch["image"].to(device))

    def augment_on_device(self, batch: dict) -> dict:
        """Draw the training views from a transferred batch of raw images (`pipeline: gpu`)."""
        if self.mode is Pipeline.CPU or "views" in batch:
            return batch
        images, labels, index = self.images_on_device(batch)
        views = {name: view(images) for name, view in self.views.items()}
        return {"views": views, "label": labels, "index": index}

    def _eval_loaders(self, split: str) -> list[DataLoader]:
        """The split's loader and the kNN bank's; with several processes each scores its own shard (`EvaluationShard`)."""
        self.setup()
        datasets = [EvalDataset(self.splits[split], self.eval_transform)]
        model = self.trainer.lightning_module if self.trainer is not None else None
        if self.knn_bank and getattr(model, "knn_k", None) != 0:  # a pass over the training split the model would not read
            datasets.append(EvalDataset(self.splits.get("bank", self.splits["train"]), self.eval_transform))
        processes = process_group()
        return [self._loader(dataset, train=False, sampler=EvaluationShard(dataset, **processes) if processes["num_replicas"] > 1 else None)
                for dataset in datasets]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders("val")

    def test_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders("test")
