"""A callback that records a momentum method's targets around every optimizer step, to check the EMA update:
after step s each target parameter is m_s * (its value before the step) + (1 - m_s) * (the online one after it)."""

import torch
from lightning.pytorch.callbacks import Callback


def target_and_online(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    pairs = model.momentum_pairs()
    return (
        [p.detach().clone() for _, target in pairs for p in target.parameters()],
        [p.detach().clone() for online, _ in pairs for p in online.parameters()],
    )


class RecordEMA(Callback):
    def __init__(self):
        self.before: list[torch.Tensor] = []
        self.steps: dict[int, tuple] = {}  # 0-based optimizer step: (targets before, targets after, online after)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = target_and_online(pl_module)[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step - 1] = (self.before, *target_and_online(pl_module))

    def largest_deviation(self, step: int, momentum: float) -> float:
        """max |target after - (m target before + (1 - m) online after)| at optimizer step `step`."""
        before, after, online = self.steps[step]
        return max((t - (momentum * b + (1 - momentum) * o)).abs().max().item() for b, t, o in zip(before, after, online))
