"""One run of the peers benchmark (`benchmarks/peers.py`), inside one system's own environment.

    python benchmarks/peer_workloads.py train SYSTEM --data DIR --json FILE [--warmup 5] [--steps 30] [--batch 128] [--workers 2]
    python benchmarks/peer_workloads.py views SYSTEM --data DIR --json FILE [--images 2560] [--batch 128] [--workers 2]

The workload is MoCo v2 on the fake CIFAR-10 files under `--data` (`portable.write_fake_cifar10`, read by torchvision's
CIFAR10 class in every system): a ResNet-18 with the CIFAR stem (3x3 convolution of stride 1, no max-pool), a 2-layer
512-512-128 projector without BatchNorm, a queue of 4,096 keys, momentum 0.99, InfoNCE at temperature 0.2; batches of
128 images in two MoCo v2 views of 32 px (aug+: crop 0.2-1, colour jitter 0.4/0.4/0.4/0.1 with p 0.8, grayscale 0.2,
blur p 0.5, flip, CIFAR normalisation), with 2 DataLoader workers (contrastlab's config holds the images and draws the views per
batch in the training process, the workers serving indices); SGD lr 0.06 (momentum 0.9, weight decay 5e-4).
Each system is written the way its own documentation trains MoCo, at its own defaults otherwise:

- `contrastlab`: `main_pretrain.py fit --config configs/moco_cifar10.yaml` (its CLI, its W&B offline logger, its
  callbacks) with only the workload's data, batch, workers and steps set (lr 0.12 per 256 images: 0.06 at 128);
  precision, data pipeline and memory layout are the config's: what a user gets. `contrastlab-fp32-pil` adds
  `trainer.precision 32-true`, `data.pipeline cpu` (PIL views per image in the workers) and no channels-last: the
  peers' settings, so that the difference left is the framework;
- `lightly` (1.6): a LightningModule in the style of lightly's MoCo example: torchvision ResNet-18 without its
  classifier, `MoCoProjectionHead`, deep-copied momentum branches, `update_momentum` in every step, `NTXentLoss` with
  a memory bank, `MoCoV2Transform` in the dataset; Lightning's default Trainer (fp32);
- `stable-pretraining` (0.1): its MoCo v2 (`spt.methods.MoCov2`: momentum copies by `TeacherStudentWrapper`, which
  the Manager updates through its `TeacherStudentCallback`) on `spt.backbone.from_torchvision(..., low_resolution=True)`,
  called from the forward function of an `spt.Module`, views by `spt.data.transforms.MultiViewTransform` over
  `spt.data.FromTorchDataset`, run by `spt.Manager` (fp32). Its MoCo v2 also embeds the query view with the
  momentum trunk in every step, for its probes: one more forward pass than the others make.

`train` writes `{"first_step_at": <time.time() at the start of the first step>, "step_ends": [...], "settings": ...}`;
the launcher subtracts its own clock at the process start. `views` writes the images/s of producing the two views
of an image (`portable.one_process_rate`, `portable.loader_rate`, and for contrastlab its batched views on the CPU).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from portable import accept_fake_cifar10, loader_rate, one_process_rate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTRASTLAB_CONFIG = ROOT / "configs" / "moco_cifar10.yaml"
# contrastlab's CIFAR-10 statistics (datamodules/cifar.py), used by every system
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
TEMPERATURE, QUEUE, MOMENTUM, LR, SGD_MOMENTUM, WEIGHT_DECAY = 0.2, 4096, 0.99, 0.06, 0.9, 5e-4
# settings over the config that make contrastlab train as the peers do (precision, per-image PIL views, layout)
PEER_SETTINGS = ["--trainer.precision=32-true", "--data.init_args.pipeline=cpu", "--model.init_args.channels_last=false"]
TRAINED = ("contrastlab", "contrastlab-fp32-pil", "lightly", "stable-pretraining")
VIEWED = ("contrastlab", "lightly")


def step_clock(callback_base: type, record: dict):
    """A callback of the system's Lightning package that stamps the start of the first step and the end of each."""

    class StepClock(callback_base):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            record.setdefault("first_step_at", time.time())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["step_ends"].append(time.time())

    return StepClock()


def contrastlab_overrides(data: Path, batch: int, workers: int) -> list[str]:
    return [f"--data.init_args.root={data}", f"--data.init_args.batch_size={batch}", f"--data.init_args.num_workers={workers}",
            f"--model.init_args.optimizer.lr={LR * 256 / batch}"]


def train_contrastlab(options, record: dict, peer_settings: bool) -> None:
    sys.path.insert(0, str(ROOT))
    from lightning.pytorch.callbacks import Callback

    from engine.cli import ContrastlabCLI
    from methods import MethodBase

    clock = step_clock(Callback, record)

    class TimedCLI(ContrastlabCLI):  # main_pretrain.py's CLI, with the clock among the trainer's callbacks
        def before_fit(self) -> None:
            super().before_fit()
            self.trainer.callbacks.append(clock)

    args = ["fit", "--config", str(CONTRASTLAB_CONFIG), *contrastlab_overrides(options.data, options.batch, options.workers),
            f"--trainer.max_steps={options.warmup + options.steps}", "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={options.workdir}", *(PEER_SETTINGS if peer_settings else [])]
    cli = TimedCLI(MethodBase, args=args)
    record["settings"] = {"precision": cli.trainer.precision, "pipeline": cli.datamodule.pipeline, "channels_last": cli.model.channels_last}


def cifar_stem_resnet18() -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem and no classifier: (N, 3, 32, 32) -> (N, 512)."""
    resnet = torchvision.models.resnet18()
    resnet.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    resnet.maxpool = nn.Identity()
    resnet.fc = nn.Identity()
    return resnet


def train_lightly(options, record: dict) -> None:
    import copy

    import pytorch_lightning as pl
    from lightly.loss import NTXentLoss
    from lightly.models.modules import MoCoProjectionHead
    from lightly.models.utils import deactivate_requires_grad, update_momentum
    from lightly.transforms import MoCoV2Transform

    class MoCo(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = cifar_stem_resnet18()
            self.projection_head = MoCoProjectionHead(512, 512, 128)
            self.backbone_momentum = copy.deepcopy(self.backbone)
            self.projection_head_momentum = copy.deepcopy(self.projection_head)
            deactivate_requires_grad(self.backbone_momentum)
            deactivate_requires_grad(self.projection_head_momentum)
            self.criterion = NTXentLoss(temperature=TEMPERATURE, memory_bank_size=(QUEUE, 128))

        def training_step(self, batch, batch_idx):
            update_momentum(self.backbone, self.backbone_momentum, m=MOMENTUM)
            update_momentum(self.projection_head, self.projection_head_momentum, m=MOMENTUM)
            (query_view, key_view), _ = batch
            query = self.projection_head(self.backbone(query_view))
            key = self.projection_head_momentum(self.backbone_momentum(key_view)).detach()
            return self.criterion(query, key)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=SGD_MOMENTUM, weight_decay=WEIGHT_DECAY)

    pl.seed_everything(0)
    transform = MoCoV2Transform(input_size=32, normalize={"mean": CIFAR10_MEAN, "std": CIFAR10_STD})
    dataset = torchvision.datasets.CIFAR10(str(options.data), train=True, transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=options.batch, shuffle=True, drop_last=True, num_workers=options.workers)
    trainer = pl.Trainer(max_steps=options.warmup + options.steps, accelerator="cpu", devices=1, default_root_dir=options.workdir,
                         callbacks=[step_clock(pl.Callback, record)])
    trainer.fit(MoCo(), loader)
    record["settings"] = {"precision": trainer.precision, "pipeline": "cpu", "channels_last": False}


def stable_pretraining_view(transforms):
    """MoCo v2's aug+ at 32 px in stable-pretraining's per-sample transforms."""
    return transforms.Compose(
        transforms.RGB(),
        transforms.RandomResizedCrop((32, 32), scale=(0.2, 1.0)),
        transforms.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.1, p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.PILGaussianBlur(sigma=[0.1, 2.0], p=0.5),
        transforms.RandomHorizontalFlip(p=0.5),
        transforms.ToImage(mean=CIFAR10_MEAN, std=CIFAR10_STD),
    )


def train_stable_pretraining(options, record: dict) -> None:
    import lightning as pl
    import stable_pretraining as spt
    from stable_pretraining.data import transforms

    def moco_forward(self, batch, stage):
        query_view, key_view = batch["views"]
        output = self.moco(query_view["image"], key_view["image"])
        return {"loss": output.loss, "embedding": output.embedding}

    views = transforms.MultiViewTransform([stable_pretraining_view(transforms), stable_pretraining_view(transforms)])
    dataset = spt.data.FromTorchDataset(torchvision.datasets.CIFAR10(str(options.data), train=True), names=["image", "label"], transform=views)
    loader = torch.utils.data.DataLoader(dataset, batch_size=options.batch, shuffle=True, drop_last=True, num_workers=options.workers)
    moco = spt.methods.MoCov2(spt.backbone.from_torchvision("resnet18", low_resolution=True), projector_dims=(512, 128),
                              queue_length=QUEUE, temperature=TEMPERATURE, ema_decay_start=MOMENTUM, ema_decay_end=MOMENTUM)
    module = spt.Module(moco=moco, forward=moco_forward,
                        optim={"optimizer": {"type": "SGD", "lr": LR, "momentum": SGD_MOMENTUM, "weight_decay": WEIGHT_DECAY}})
    trainer = pl.Trainer(max_steps=options.warmup + options.steps, accelerator="cpu", devices=1, default_root_dir=options.workdir,
                         callbacks=[step_clock(pl.Callback, record)], enable_checkpointing=False)
    spt.set(cache_dir=options.workdir)  # its runs and their last checkpoint (134 MiB) go with the run's scratch folder
    spt.Manager(trainer=trainer, module=module, data=spt.data.DataModule(train=loader), seed=0)()
    record["settings"] = {"precision": trainer.precision, "pipeline": "cpu", "channels_last": False}


def views_contrastlab(options) -> dict:
    sys.path.insert(0, str(ROOT))
    import throughput

    overrides = contrastlab_overrides(options.data, options.batch, options.workers)
    rows = throughput.view_rates(str(CONTRASTLAB_CONFIG), options.images, overrides)
    both = rows[-1]  # the views of one training image together
    return {"views": both["views"], "one_process": both["one_process"], "loader": both["loader"], "batched": both["batched"],
            "threads": both["threads"]}


def views_lightly(options) -> dict:
    from lightly.transforms import MoCoV2Transform

    transform = MoCoV2Transform(input_size=32, normalize={"mean": CIFAR10_MEAN, "std": CIFAR10_STD})
    images = torchvision.datasets.CIFAR10(str(options.data), train=True)
    count = min(options.images, len(images))
    pil_images = [images[index][0] for index in range(count)]
    served = torch.utils.data.Subset(torchvision.datasets.CIFAR10(str(options.data), train=True, transform=transform), range(count))
    return {"views": "MoCoV2Transform (two views)", "one_process": one_process_rate(pil_images, transform),
            "loader": loader_rate(served, options.batch, options.workers), "batched": None, "threads": torch.get_num_threads()}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("train", "views"))
    parser.add_argument("system", choices=TRAINED)
    parser.add_argument("--data", type=Path, required=True, help="the folder holding cifar-10-batches-py/")
    parser.add_argument("--json", type=Path, required=True, help="where the measurement is written")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--images", type=int, default=2560, help="images per views measurement")
    options = parser.parse_args(argv)
    if options.mode == "views" and options.system not in VIEWED:
        parser.error(f"views are measured for {', '.join(VIEWED)}, not {options.system}")
    return options


def main(argv: list[str]) -> int:
    options = parse(argv)
    accept_fake_cifar10(options.data)
    if options.mode == "views":
        result = views_contrastlab(options) if options.system == "contrastlab" else views_lightly(options)
    else:
        result = {"step_ends": []}
        with tempfile.TemporaryDirectory() as workdir:
            options.workdir = workdir
            if options.system.startswith("contrastlab"):
                train_contrastlab(options, result, peer_settings=options.system == "contrastlab-fp32-pil")
            elif options.system == "lightly":
                train_lightly(options, result)
            else:
                train_stable_pretraining(options, result)
    options.json.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
