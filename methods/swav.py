"""SwAV: Swapping Assignments between multiple Views (Caron et al., NeurIPS 2020), as facebookresearch/swav
main_swav.py.

Every crop (2 global views and the local crops of multi-crop) is embedded on the unit sphere and scored against K
learnable prototypes (cosine scores, the prototypes renormalised before every step). For each global view, the codes
of the global batch, an equipartition of its samples over the prototypes, come from 3 Sinkhorn-Knopp iterations
(epsilon 0.05) without gradient; every other crop predicts them from its own scores at temperature 0.1 (the swapped
prediction, Eq. 1-3). The trunk runs once per resolution and the head once on all crops, as the official forward.

With small batches a queue of past global-view embeddings joins the codes' computation: it starts at
`queue_start_epoch` and is used once full (main_swav.py `use_the_queue`). The prototypes are frozen for the first
`freeze_prototypes_steps` optimizer steps (`freeze_prototypes_niters`).

Across processes the embeddings are gathered (no gradient) and the codes are computed over the global batch and the
queue, which holds the gathered embeddings: the official `distributed_sinkhorn` sums over the same samples, spread
over the processes, so the codes are the same, and the queue of a checkpoint is the whole queue.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.compat import attached_trainer, data_position
from engine.optim import schedule_length
from methods.losses import check_hyperparameters, sinkhorn_knopp, swav_loss
from methods.pretrain import PretrainMethod
from methods.queues import EmbeddingQueue


class SwAV(PretrainMethod):
    views = ("global1", "global2")
    multi_crop = True
    crop_batching = "by_resolution"

    def __init__(
        self,
        num_prototypes: int = 3000,
        temperature: float = 0.1,
        epsilon: float = 0.05,
        sinkhorn_iterations: int = 3,
        queue_size: int = 0,
        queue_start_epoch: int = 15,
        freeze_prototypes_steps: int = 313,
        **kwargs,
    ):
        """
        Args:
            num_prototypes: K (3000 on ImageNet, `--nmb_prototypes`).
            temperature: of the predictions (0.1); epsilon, sinkhorn_iterations: of the codes (0.05, 3).
            queue_size: past embeddings per global view in the codes' computation, over all processes (3840 in the
                official 256-image runs, 0: none, as its 4096-image runs); a multiple of the global batch.
            queue_start_epoch: the epoch from which the queue is filled (15, `--epoch_queue_starts`).
            freeze_prototypes_steps: optimizer steps during which the prototypes do not move (313 at 4096
                images, about one epoch; 5005 at 256).
            **kwargs: the PretrainMethod arguments (backbone, projector, optimizer, schedule, local_crops, ...).
        """
        check_hyperparameters("model.", temperature=temperature, epsilon=epsilon, sinkhorn_iterations=sinkhorn_iterations)
        for name, value, least in (("num_prototypes", num_prototypes, 1), ("queue_size", queue_size, 0),
                                   ("queue_start_epoch", queue_start_epoch, 0), ("freeze_prototypes_steps", freeze_prototypes_steps, 0)):  # fmt: skip
            if value < least:
                raise ValueError(f"model.{name} must be >= {least}, got {value}")
        super().__init__(**kwargs)
        self.temperature, self.epsilon, self.sinkhorn_iterations = temperature, epsilon, sinkhorn_iterations
        self.queue_start_epoch, self.freeze_prototypes_steps = queue_start_epoch, freeze_prototypes_steps
        self.prototypes = nn.Linear(self.projection_dim, num_prototypes, bias=False)
        self.queues = nn.ModuleList([EmbeddingQueue(queue_size, self.projection_dim) for _ in self.views]) if queue_size else None

    def check_data(self, datamodule, world_size: int) -> None:
        super().check_data(datamodule, world_size)
        global_batch = datamodule.batch_size * world_size
        if self.queues is not None and self.queues[0].size % global_batch:
            size = self.queues[0].size
            raise ValueError(
                f"model.init_args.queue_size {size} must be a multiple of the global batch {global_batch} (data.init_args.batch_size x "
                f"{world_size} processes), as facebookresearch/swav trims it: {size - size % global_batch}"
            )

    def on_fit_start(self) -> None:
        super().on_fit_start()
        start, frozen = self.queue_start_epoch, self.freeze_prototypes_steps
        if self.queues is not None:
            self.warn_if_never_reached("queue_start_epoch", start, start, self.trainer.max_epochs or 0, "epochs", "the queue is never filled")
        self.warn_if_never_reached("freeze_prototypes_steps", frozen, frozen, schedule_length(self.trainer), "steps", "the prototypes never train")

    def frozen_modules(self) -> list[nn.Module]:
        return [self.prototypes] if self.trainer.global_step < self.freeze_prototypes_steps else []

    def step(self, batch):
        with torch.no_grad():  # back on the unit sphere before every step
            self.prototypes.weight.copy_(F.normalize(self.prototypes.weight, dim=1))
        crops = self.crops(batch["views"], self.views + self.local_crops)
        embeddings, features = self.encode_crops(crops, self.backbone, lambda pooled: F.normalize(self.projector(pooled), dim=1), len(self.views))
        scores = self.prototypes(torch.stack(embeddings))
        codes = torch.stack([self.codes(view, embeddings[view]) for view in range(len(self.views))])
        return swav_loss(scores, codes, self.temperature), features

    @torch.no_grad()
    def codes(self, view: int, embeddings: torch.Tensor) -> torch.Tensor:
        """The codes of this process's samples of a global view: Sinkhorn-Knopp over the global batch and, once
        full, the queue, which then receives the global batch."""
        batch = self.gather(embeddings)
        known = batch
        if self.queues is not None:
            started, full = self.queue_state(len(batch))
            if full:
                known = torch.cat([self.queues[view].read(), batch])
            if started:
                self.queues[view].push(batch)
        codes = sinkhorn_knopp(known @ self.prototypes.weight.T, self.epsilon, self.sinkhorn_iterations)[-len(batch) :]
        return codes.narrow(0, self.global_rank * len(embeddings), len(embeddings))

    def queue_state(self, global_batch: int) -> tuple[bool, bool]:
        """(started, full) at this step: the queue receives a global batch at every step from the first of
        `queue_start_epoch` on, and is full once that made `queue_size` rows (read from the training progress)."""
        trainer = attached_trainer(self)
        epoch, batches = data_position(trainer) if trainer is not None else (0, 0)
        if epoch < self.queue_start_epoch:
            return False, False
        earlier_epochs = (epoch - self.queue_start_epoch) * trainer.num_training_batches if epoch > self.queue_start_epoch else 0
        return True, (earlier_epochs + batches) * global_batch >= self.queues[0].size
