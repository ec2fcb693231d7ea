"""No training step of any method reads a device value on the host (issue 11: no host-device
synchronisation inside the step).

On an accelerator, an operation whose result size or value the host needs (`.item()`, `bool(t)`,
`nonzero`, boolean-mask indexing, `unique`, ...) makes the CPU wait for the GPU, so the next step's
kernels are not queued while this one runs. On the CPU nothing waits, but the same operations are
dispatched: a dispatch mode records them during real training steps, with the project's stack frame that
issued them. The same holds for a tensor the project's code makes from host data during a step
(`torch.tensor(data, device=...)`, `x.new_tensor(data)`): on an accelerator that is a blocking host-to-device
copy, which waits for the queued work. (`torch.cuda.set_sync_debug_mode` checks all of this on a GPU:
benchmarks/throughput.py.)
"""

import traceback
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from engine import devices
from engine.cli import ContrastlabCLI
from methods import MethodBase

ROOT = Path(__file__).parents[1]
aten = torch.ops.aten
HOST_READS = {
    aten._local_scalar_dense,  # .item(), bool(), int(), float() of a tensor
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique2,
    aten.unique_dim,
    aten.bincount,  # its output size is the largest value
    aten.repeat_interleave,  # with tensor repeats, the output size
}
PROJECT_FOLDERS = ("methods", "datamodules", "backbones", "engine")


def boolean_indexing(func, args) -> bool:
    """`x[mask]` and `x[mask] = v`: the result size depends on how many entries are true."""
    if func.overloadpacket not in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        return False
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices)


def made_from_host_data_by_the_project(func) -> bool:
    """`torch.tensor(data)` or `x.new_tensor(data)` called by the project's code itself (the numbers a method
    logs with `self.log` are made tensors by Lightning)."""
    if func.overloadpacket is not aten.lift_fresh:
        return False
    caller = [frame for frame in traceback.extract_stack()[:-2] if "/torch/" not in frame.filename][-1]
    return Path(caller.filename).parent.name in PROJECT_FOLDERS


class HostReads(TorchDispatchMode):
    """Records every host-reading operation (and tensor made from host data) issued from the project's code,
    as 'file:line in function'."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in HOST_READS or boolean_indexing(func, args) or made_from_host_data_by_the_project(func):
            stack = traceback.extract_stack()
            frames = [frame for frame in stack if Path(frame.filename).parent.name in PROJECT_FOLDERS]
            loading = any("torch/utils/data/" in frame.filename for frame in stack)  # in DataLoader workers, off the step
            # a checkpoint (last.ckpt at an epoch's end) reads every tensor and generator state to write it, off the step
            saving = any(frame.filename.endswith("checkpoint_connector.py") and frame.name == "dump_checkpoint" for frame in stack)
            if frames and not (loading or saving):
                frame = frames[-1]
                self.found.append(f"{Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} in {frame.name} ({func})")
        return func(*args, **(kwargs or {}))


class RecordSteps(Callback):
    """Records host reads from the end of the first step (warm-up: lazy initialisations may read the host)
    to the end of the last: the transfer hook, the view drawing, forward, backward, optimizer and momentum
    updates of every later step."""

    def __init__(self):
        self.mode = HostReads()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.mode.__enter__()

    def on_train_end(self, trainer, pl_module) -> None:
        self.mode.__exit__(None, None, None)


TINY = ["--data.init_args.batch_size=16", "--data.init_args.num_workers=0", "--data.init_args.knn_bank=false"]
CONFIGS = ["moco_digits", "sce_digits", "ressl_digits", "simclr_digits", "npid_digits", "jcl_digits", "supcon_digits",
           "tcl_digits", "tcl_ssl_digits", "paco_digits_lt", "paco_ride_digits_lt", "ce_digits_lt", "balanced_softmax_digits_lt",
           "barlow_twins_digits", "vicreg_digits", "swav_digits", "dino_digits"]
# The one host read by design: the non-finite loss guard reads whether the loss is finite before backward, so that it
# stops before the optimizer step (engine/non_finite.py)
BY_DESIGN = "engine/non_finite.py"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.slow
def test_training_steps_read_no_device_value_on_the_host(config, tmp_path, monkeypatch):
    # the branches an accelerator takes: the losses check values and the hue jitter selects rows on CPU tensors only
    monkeypatch.setattr(devices, "host_reads_are_free", lambda tensor: False)
    cli = ContrastlabCLI(MethodBase, args=[
        "--config", str(ROOT / f"configs/{config}.yaml"), *TINY, "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=test_host_sync.RecordSteps",
    ], run=False)  # fmt: skip
    (recorder,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RecordSteps)]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)  # with every callback of a real run (engine/)
    assert cli.trainer.global_step == 3
    found = sorted(set(recorder.mode.found))
    assert [read for read in found if not read.startswith(BY_DESIGN)] == []
    assert len([read for read in found if read.startswith(BY_DESIGN)]) == 1
