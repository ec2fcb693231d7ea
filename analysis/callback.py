"""`RepresentationAnalysis`: Wang & Liu's analysis at every validation of a pretraining run.

In a config:

    trainer:
      callbacks:
        - class_path: analysis.RepresentationAnalysis
          init_args: {max_samples: 2048}

It logs `val/uniformity` (-L_uniformity), `val/tolerance`, `val/negative_entropy` and
`val/local_separation` (so they reach the loggers and results_val.json), writes the local-separation
and entropy histograms to `<default_root_dir>/analysis/epochNNN_*.png` and, when a `WandbLogger` is
active, logs them to W&B as images. See `analysis.representation` for what each number is.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger

from analysis.representation import analyse

__all__ = ["RepresentationAnalysis"]


class RepresentationAnalysis(Callback):
    def __init__(
        self,
        split: str = "val",
        max_samples: int = 2048,
        view: str | None = None,
        temperature: float | None = None,
        figures: bool = True,
        out_dir: str | None = None,
    ):
        """
        Args:
            split: the DataModule split analysed.
            max_samples: size of the fixed random subset of that split (the metrics cost O(N^2)).
            view: the training view of the anchors (default: the method's first view).
            temperature: of the entropy over negatives (default: the method's `temperature`).
            figures: write (and send to W&B) the histograms at every validation.
            out_dir: where the figures go (default: `<trainer.default_root_dir>/analysis`).
        """
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self.split, self.max_samples, self.view, self.temperature = split, max_samples, view, temperature
        self.figures, self.out_dir = figures, out_dir

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        if trainer.datamodule is None:
            raise ValueError("RepresentationAnalysis needs the run's DataModule (its splits and views)")
        report = analyse(pl_module, trainer.datamodule, self.split, self.view, self.temperature, self.max_samples)
        for name, value in report.scalars().items():
            pl_module.log(f"{self.split}/{name}", value, rank_zero_only=True)
        if not self.figures:
            return
        directory = Path(self.out_dir or Path(trainer.default_root_dir) / "analysis")
        title = f"{type(pl_module).__name__}, epoch {trainer.current_epoch}"
        figures = report.write_figures(directory, prefix=f"epoch{trainer.current_epoch:03d}_", title=title)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                for name, path in figures.items():
                    logger.log_image(f"{self.split}/{name}", [str(path)], step=trainer.global_step)
