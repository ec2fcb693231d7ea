"""Callbacks of a pretraining run: collapse monitors at validation, an embedding map at the end.

In a config (both skip modules that are not a `methods.PretrainMethod`, e.g. the long-tail classifiers, and
`enabled: false` turns either off):

    trainer:
      callbacks:
        - class_path: analysis.CollapseMonitor
          init_args: {every_n_epochs: 10, max_samples: 1024}
        - class_path: analysis.EmbeddingMap
          init_args: {max_classes: 10}

`CollapseMonitor`, at the validation that ends every `every_n_epochs`-th epoch: each image of a fixed random subset
of the validation split is drawn under two of the method's training views (its first two; a one-view method's view
twice, two independent draws) with the same augmentations at every call, drawn from a seed of their own (the
training random streams are left as they were), and embedded in eval mode by the online trunk and projector (before
any predictor). It logs, as `val/<name>` (to the loggers and results_val.json):

- `rankme_trunk`, `rankme_projector`: RankMe (Garrido et al. 2023, `analysis.metrics.rankme`) of the trunk features
  and of the projector outputs of the first view; at most min(images, dimensions);
- `projector_std`: SimSiam's collapse indicator, the per-dimension std of the L2-normalised projector output averaged
  over dimensions (Chen & He 2021, Sec. 4.1): 0 when collapsed, about 1/sqrt(d) for an isotropic Gaussian;
- `projector_uniformity`: -L_uniformity (t = 2, Wang & Isola 2020) of the L2-normalised projector outputs of the
  first view (`RepresentationAnalysis`'s `uniformity` is of the evaluation view's embeddings, after any predictor:
  another quantity, under another name);
- `projector_alignment`: L_align (alpha = 2, Wang & Isola 2020) between the L2-normalised projector outputs of the
  two views: 0 when the two augmentations of an image map to one point.

`EmbeddingMap`, when training ends: the t-SNE map of the validation embeddings by class
(`analysis.embedding_map`), written to `<default_root_dir>/analysis/embedding_map.png` and, when a `WandbLogger` is
attached, logged to W&B as the image `val/embedding_map`; not in a `fast_dev_run`.

Both take no more validation images than the run validates on (`trainer.limit_val_batches`) and nothing when it
does not validate.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import Subset

from analysis.embedding_map import MAX_LEGEND_CLASSES, Space, write_embedding_map
from analysis.metrics import alignment, normalised_std, rankme, uniformity
from analysis.representation import checked_view, eval_mode, first_crops, fixed_choice, isolated_randomness, split_dataset
from datamodules.base import ContrastiveDataModule
from methods import PretrainMethod

__all__ = ["CollapseMonitor", "EmbeddingMap", "collapse_metrics"]


def trunk_and_projector(model: PretrainMethod, batches) -> tuple[Tensor, Tensor]:
    """Trunk features and projector outputs (before any predictor, not normalised) of batches of one view, in fp32;
    a view of several crops per image (`count: N`) gives its first crop."""
    features, projected = [], []
    for images in batches:
        trunk = model.backbone(first_crops(images))
        features.append(trunk.float())
        projected.append(model.projector(trunk).float())
    return torch.cat(features), torch.cat(projected)


@torch.no_grad()
def collapse_metrics(model: PretrainMethod, datamodule: ContrastiveDataModule, split: str = "val", views: Sequence[str] | None = None,
                     max_samples: int = 1024, seed: int = 0) -> dict[str, float]:
    """The numbers `CollapseMonitor` logs (module docstring), on up to `max_samples` images of `split`; `views`: the
    two training views (default: the method's first two, or its one view twice)."""
    names = list(views or model.views[:2])
    if len(names) == 1:
        names *= 2
    if len(names) != 2:
        raise ValueError(f"views must name two training views, got {names}")
    names = [checked_view(model, datamodule, name) for name in names]
    dataset = split_dataset(datamodule, split)
    subset = Subset(dataset, fixed_choice(range(len(dataset)), max_samples, seed))
    with eval_mode(model), isolated_randomness(seed, model.device):
        (features, projected), (_, projected_other) = [
            trunk_and_projector(model, datamodule.view_batches(subset, name, model.device)) for name in names
        ]
    embedded, embedded_other = F.normalize(projected, dim=1), F.normalize(projected_other, dim=1)
    return {
        "rankme_trunk": rankme(features).item(),
        "rankme_projector": rankme(projected).item(),
        "projector_std": normalised_std(projected).item(),
        "projector_uniformity": -uniformity(embedded).item(),
        "projector_alignment": alignment(embedded, embedded_other).item(),
    }


def validation_samples(trainer, datamodule: ContrastiveDataModule, split: str, max_samples: int) -> int:
    """Up to `max_samples`, no more images of `split` than the run validates on (`trainer.limit_val_batches`: a number
    of batches or a share of the split), and 0 when the DataModule has no such split."""
    datamodule.setup()
    if split not in datamodule.splits:
        return 0
    size, limit = len(datamodule.splits[split]), trainer.limit_val_batches
    validated = limit * datamodule.batch_size if isinstance(limit, int) else math.floor(limit * size)
    return min(max_samples, size, validated)


def applies_to(pl_module, callback: Callback) -> bool:
    if isinstance(pl_module, PretrainMethod):
        return True
    rank_zero_info(f"{type(callback).__name__}: {type(pl_module).__name__} is not a pretraining method (no projector to watch); skipped")
    return False


class CollapseMonitor(Callback):
    def __init__(self, every_n_epochs: int = 10, split: str = "val", max_samples: int = 1024, views: list[str] | None = None, seed: int = 0,
                 enabled: bool = True):
        """
        Args:
            every_n_epochs: measure at the validations that end epochs n, 2n, ... (a validation must run then:
                `trainer.check_val_every_n_epoch`) and at the run's last validation, whose numbers are its results.
            split: the DataModule split measured.
            max_samples: size of the fixed random subset of that split (RankMe is at most min(N, D)).
            views: the two training views of each image (default: the method's first two, or its one view twice).
            seed: of the subset and of its augmentations.
            enabled: false turns the monitor off (where a run sets it up by default).
        """
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self.every_n_epochs, self.split, self.max_samples, self.views, self.seed = every_n_epochs, split, max_samples, views, seed
        self.enabled, self.active = enabled, False

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.active = self.enabled and applies_to(pl_module, self)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # the results' validation: the last epoch's, a max_steps stop's, or the one after a fit that missed it
        # (engine.cli.results.validate_the_end_if_missed, a `validate`)
        last = trainer.should_stop or trainer.state.fn == "validate" or (trainer.max_epochs is not None and trainer.current_epoch == trainer.max_epochs - 1)
        if trainer.sanity_checking or not trainer.is_global_zero or not self.active or ((trainer.current_epoch + 1) % self.every_n_epochs and not last):
            return
        samples = validation_samples(trainer, trainer.datamodule, self.split, self.max_samples)
        if samples < 2:
            return
        for name, value in collapse_metrics(pl_module, trainer.datamodule, self.split, self.views, samples, self.seed).items():
            pl_module.log(f"{self.split}/{name}", value, rank_zero_only=True)


class EmbeddingMap(Callback):
    def __init__(self, split: str = "val", space: Space = "trunk", max_samples: int = 2048, max_classes: int = 10, seed: int = 0,
                 out_dir: str | None = None, enabled: bool = True):
        """
        Args:
            split: the DataModule split mapped.
            space: `trunk` (the L2-normalised trunk features) or `embedding` (the online branch's L2-normalised output).
            max_samples: size of the fixed random subset of that split (t-SNE costs O(N log N) per iteration).
            max_classes: map the images of the first classes in label order only (one legend colour each, at most 20).
            seed: of the subset and of t-SNE.
            out_dir: where the PNG goes (default: `<trainer.default_root_dir>/analysis`).
            enabled: false turns the map off (where a run sets it up by default).
        """
        if space not in ("trunk", "embedding"):
            raise ValueError(f"space must be 'trunk' or 'embedding', got {space!r}")
        if not 1 <= max_classes <= MAX_LEGEND_CLASSES:
            raise ValueError(f"max_classes must lie in [1, {MAX_LEGEND_CLASSES}] (one legend colour each), got {max_classes}")
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self.split, self.space, self.max_samples, self.max_classes, self.seed, self.out_dir = split, space, max_samples, max_classes, seed, out_dir
        self.enabled, self.active = enabled, False

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.active = self.enabled and applies_to(pl_module, self)

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or trainer.fast_dev_run or not self.active:
            return
        samples = validation_samples(trainer, trainer.datamodule, self.split, self.max_samples)
        if samples < 2:
            return
        directory = Path(self.out_dir or Path(trainer.default_root_dir) / "analysis")
        title = f"{type(pl_module).__name__}, step {trainer.global_step}, {self.split}, {self.space}"
        path = write_embedding_map(pl_module, trainer.datamodule, directory / "embedding_map.png", self.split, self.space,
                                   samples, self.max_classes, self.seed, title)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(f"{self.split}/embedding_map", [str(path)], step=trainer.global_step)
