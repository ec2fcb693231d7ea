"""Issue 10: one optimizer step of Lightning DDP on 2 CPU processes (gloo) with B images each equals one
step of 1 process with the 2B images: the same parameters, momentum encoder and queue (keys, labels,
pointer) or memory bank, for every trainable method: MoCo v2, SCE, ReSSL, JCL, NPID, SimCLR, SupCon, TCL, PaCo, PaCo on
RIDE and the multi-task baseline (with `in_batch: global`; the official per-GPU contrast, `local`, shares the queue but
not the gradient), cross-entropy, BYOL, SimSiam, MoCo v3, NNCLR, Barlow Twins, VICReg, SwAV and DINO.

What makes it hold: keys are gathered in rank order before they are enqueued (`MethodBase.gather`),
in-batch negatives are gathered with their gradients (`gather_with_grad`: SupCon / TCL, NNCLR's predictions),
MoCo v3's keys are gathered without gradient and its positives offset by the rank, and DDP
averages the processes' gradients of their mean losses, which is the gradient of the mean over the
2B images. Shuffle-BN and split-BN are off, as the comparison requires. BatchNorm statistics are per
process by design (the global batch's statistics are `trainer.sync_batchnorm`, whose torch kernel runs on
CUDA only), so the trunk normalises with GroupNorm and the heads have no BatchNorm: every operation of
the step is then the same function of the same 2B images in both runs. The official SimSiam, MoCo v3 and BYOL
runs synchronise BatchNorm (SyncBatchNorm), but torch's SyncBatchNorm refuses CPU tensors: their heads here have
no BatchNorm either, and their configs set trainer.sync_batchnorm for GPUs."""

import os
import signal
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from helpers import TINY_PROJECTOR, cpu_trainer, free_port, start_processes
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from test_reliability import SignalAtStep
from torch.utils.data import DataLoader, Dataset, Subset

from backbones import BackboneSpec, MLPSpec
from datamodules import DigitsDataModule
from engine.optim import OptimizerSpec
from engine.preemption import LastCheckpointOnSigterm, PreemptionSignals
import methods
from methods import BYOL, DINO, JCL, NNCLR, NPID, SCE, BarlowTwins, CrossEntropy, MoCoV2, MoCoV3, MultiTaskContrast, PaCo, PaCoRIDE, ReSSL, SimCLR, SimSiam, SupCon, SwAV, VICReg
from methods.checkpoints import trainable_classes
from methods.momentum import MomentumSpec

pytestmark = pytest.mark.slow  # two processes each: left out of the inner loop (`pytest -m "not slow"`)

WORLD, GLOBAL_BATCH, NUM_CLASSES = 2, 8, 3
GLOBAL_VIEWS = ("global1", "global2")
STEP = dict(lr=0.5, momentum=0.9)  # a step large enough that a gradient off by the world size shows in the weights
TRUNK = BackboneSpec(name="timm:test_resnet", kwargs={"norm_layer": "groupnorm1"})  # no batch statistics
NO_SHUFFLE = MomentumSpec(base=0.9, shuffle_bn=False, split_bn=1)
COMMON = dict(backbone=TRUNK, projector=TINY_PROJECTOR)
PRETRAIN = COMMON | dict(knn_k=0, num_classes=NUM_CLASSES)
PREDICTOR = MLPSpec(hidden_dim=16, output_dim=TINY_PROJECTOR.output_dim, batch_norm=False)
TWO_VIEWS = ("first", "second")
METHODS = {  # name: (model, the views it reads)
    "moco": (lambda: MoCoV2(queue_size=32, momentum=NO_SHUFFLE, **PRETRAIN), ("query", "key")),
    "sce": (lambda: SCE(queue_size=32, momentum=NO_SHUFFLE, **PRETRAIN), ("weak", "strong")),
    "ressl": (lambda: ReSSL(queue_size=32, momentum=NO_SHUFFLE, **PRETRAIN), ("weak", "strong")),
    "jcl": (lambda: JCL(queue_size=32, momentum=NO_SHUFFLE, **PRETRAIN), ("query", "keys")),
    "npid": (lambda: NPID(**PRETRAIN), ("image",)),  # a bank of the 2B images, updated with the gathered batch
    "simclr": (lambda: SimCLR(temperature=0.2, **PRETRAIN), TWO_VIEWS),
    "cross_entropy": (lambda: CrossEntropy(loss="balanced_softmax", num_classes=NUM_CLASSES, backbone=TRUNK), ("image",)),
    "paco_ride": (lambda: PaCoRIDE(queue_size=32, momentum=NO_SHUFFLE, in_batch="global", num_classes=NUM_CLASSES, **COMMON), ("query", "key")),
    "supcon": (lambda: SupCon(loss="supcon", temperature=0.1, **PRETRAIN), ("crops",)),
    "tcl": (lambda: SupCon(loss="tcl", temperature=0.1, k1=2.0, k2=1.5, **PRETRAIN), ("crops",)),
    "paco": (lambda: PaCo(queue_size=32, momentum=NO_SHUFFLE, in_batch="global", num_classes=NUM_CLASSES, **COMMON), ("query", "key")),
    "multitask": (lambda: MultiTaskContrast(queue_size=32, momentum=NO_SHUFFLE, in_batch="global", num_classes=NUM_CLASSES, **COMMON), ("query", "key")),
    "paco_local": (lambda: PaCo(queue_size=32, momentum=NO_SHUFFLE, num_classes=NUM_CLASSES, **COMMON), ("query", "key")),
    "byol": (lambda: BYOL(predictor=PREDICTOR, momentum=MomentumSpec(base=0.9, schedule="cosine_byol", shuffle_bn=False), **PRETRAIN), TWO_VIEWS),
    "simsiam": (lambda: SimSiam(predictor=PREDICTOR, **PRETRAIN), TWO_VIEWS),
    "mocov3": (lambda: MoCoV3(temperature=0.2, predictor=PREDICTOR, momentum=NO_SHUFFLE, **PRETRAIN), TWO_VIEWS),
    "nnclr": (lambda: NNCLR(queue_size=32, predictor=PREDICTOR, **PRETRAIN), TWO_VIEWS),
    # the losses over the whole batch: gathered with gradients (Barlow Twins, VICReg), codes over the global batch and
    # a queue that receives it (SwAV, from its first step), a centre over the global batch (DINO, clipping per tensor)
    "barlow_twins": (lambda: BarlowTwins(optimizer=STEP | {"lr": 0.001}, **PRETRAIN), GLOBAL_VIEWS),  # gradients ~50x the others'
    "vicreg": (lambda: VICReg(optimizer=STEP, **PRETRAIN), GLOBAL_VIEWS),
    "swav": (lambda: SwAV(num_prototypes=5, queue_size=GLOBAL_BATCH, queue_start_epoch=0, freeze_prototypes_steps=0, optimizer=STEP, **PRETRAIN), GLOBAL_VIEWS),
    "dino": (lambda: DINO(out_dim=6, freeze_last_layer_epochs=0, momentum=NO_SHUFFLE, optimizer=STEP | {"clip_grad_per_parameter": 0.5}, **PRETRAIN), GLOBAL_VIEWS),
    # multi-crop: local crops contrasted across processes (gathered with their gradients, or against gathered keys)
    "simclr_local": (lambda: SimCLR(temperature=0.2, local_crops=["local"], **PRETRAIN), (*TWO_VIEWS, "local")),
    "nnclr_local": (lambda: NNCLR(queue_size=32, predictor=PREDICTOR, local_crops=["local"], **PRETRAIN), (*TWO_VIEWS, "local")),
    "supcon_local": (lambda: SupCon(loss="supcon", temperature=0.1, local_crops=["local"], **PRETRAIN), ("crops", "local")),
    "mocov3_local": (lambda: MoCoV3(temperature=0.2, predictor=PREDICTOR, momentum=NO_SHUFFLE, local_crops=["local"], **PRETRAIN), (*TWO_VIEWS, "local")),
}
CROPS = {"crops": (2, 3, 16, 16), "local": (2, 3, 8, 8), "keys": (2, 3, 16, 16)}  # views of several crops: SupCon's 2, 2 local, JCL's 2 keys
GRADIENTS_KEPT = ("barlow_twins", "vicreg", "swav", "dino")  # their gradients are compared too (`grad:` entries)
EQUIVALENT = sorted(set(METHODS) - {"paco_local"})


def global_batch(views: tuple[str, ...]) -> list[dict]:
    """The 2B samples of the step: fixed images per view (SupCon's `crops` and the local crops hold 2 crops per image)."""
    generator = torch.Generator().manual_seed(1)
    images = {name: torch.rand(GLOBAL_BATCH, *CROPS.get(name, (3, 16, 16)), generator=generator) for name in views}
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])  # every class on both processes' halves
    return [{"views": {name: images[name][i] for name in views}, "label": labels[i], "index": i} for i in range(GLOBAL_BATCH)]


class FixedBatch(L.LightningDataModule):
    """One training batch of fixed views; process r of W trains on the r-th contiguous block of it, so the
    keys gathered in rank order are the 1-process batch in its order."""

    def __init__(self, views: tuple[str, ...], world_size: int):
        super().__init__()
        self.view_names, self.samples = views, global_batch(views)
        self.views = {name: SimpleNamespace(count=CROPS[name][0] if name in CROPS else 1) for name in views}  # as data.views
        self.batch_size = GLOBAL_BATCH // world_size  # per process, as data.batch_size
        self.num_classes = NUM_CLASSES
        self.splits = {"train": self.samples}  # NPID's bank: one entry per image of the global batch

    def train_class_counts(self) -> list[int]:
        return torch.bincount(torch.stack([s["label"] for s in self.samples]), minlength=NUM_CLASSES).tolist()

    def augment_on_device(self, batch: dict) -> dict:
        return batch

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        block = self.samples[rank * self.batch_size : (rank + 1) * self.batch_size]
        return DataLoader(ListDataset(block), batch_size=self.batch_size)


class ListDataset(Dataset):
    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def initial_model(method: str) -> L.LightningModule:
    torch.manual_seed(0)  # the same initial weights and queue on every process and in the reference
    return METHODS[method][0]()


def one_step(method: str, trainer: L.Trainer, world_size: int) -> dict[str, torch.Tensor]:
    model, views = initial_model(method), METHODS[method][1]
    trainer.fit(model, FixedBatch(views, world_size))
    assert trainer.global_step == 1
    gradients = {f"grad:{name}": p.grad.clone() for name, p in model.named_parameters() if p.grad is not None} if method in GRADIENTS_KEPT else {}
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()} | gradients


def trainer_options(directory) -> dict:
    return dict(max_steps=1, limit_val_batches=0, precision="32-true", use_distributed_sampler=False, default_root_dir=directory)


def _ddp_worker(rank: int, port: int, directory: str, results) -> None:
    # the processes exist already: Lightning's default environment joins them from these variables
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    # Lightning's DDP setup re-seeds from PL_GLOBAL_SEED (lightning.fabric.utilities.seed.reset_seed) when an earlier
    # seed_everything of the test process left it set: NPID, which draws its bank at setup, would draw another one
    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.use_deterministic_algorithms(True)
    for method in METHODS:
        trainer = cpu_trainer(directory, devices=WORLD, strategy=DDPStrategy(process_group_backend="gloo"), **trainer_options(directory))
        results[method, rank] = one_step(method, trainer, WORLD)
        results[method, rank, "loss"] = trainer.callback_metrics["train/loss"].item()  # of this process's half


@pytest.fixture(scope="module")
def two_process_states(tmp_path_factory) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        start_processes(_ddp_worker, (free_port(), str(tmp_path_factory.mktemp("ddp")), results), nprocs=WORLD)
        return dict(results)


@pytest.mark.parametrize("method", EQUIVALENT)
def test_one_ddp_step_on_two_processes_equals_one_step_on_the_concatenated_batch(method, two_process_states, tmp_path):
    trainer = cpu_trainer(tmp_path, **trainer_options(tmp_path))
    expected = one_step(method, trainer, world_size=1)
    # every loss is a mean over the anchors, and each process has half of them
    mean_loss = (two_process_states[method, 0, "loss"] + two_process_states[method, 1, "loss"]) / 2
    assert mean_loss == pytest.approx(trainer.callback_metrics["train/loss"].item(), rel=1e-5)
    before = initial_model(method).state_dict()
    assert not torch.equal(before["backbone.conv1.0.weight"], expected["backbone.conv1.0.weight"])  # the step trained
    queues = [name for name in expected if name.startswith("queue.")]
    assert bool(queues) == (method in ("moco", "sce", "ressl", "jcl", "paco", "multitask", "paco_ride"))
    assert any(name.startswith("grad:") for name in expected) == (method in GRADIENTS_KEPT)
    for rank in range(WORLD):
        state = two_process_states[method, rank]
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():  # parameters, momentum encoder, queue keys / labels / pointer
            if name.startswith("grad:"):  # compared at their own scale below
                continue
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{method}: {name} on rank {rank}")
    if queues:  # the step enqueued all 2B keys, in the 1-process order
        assert int(expected["queue.pointer"]) == GLOBAL_BATCH


def test_paco_with_the_official_per_process_contrast_enqueues_the_same_keys_but_trains_differently(two_process_states, tmp_path):
    expected = one_step("paco_local", cpu_trainer(tmp_path, **trainer_options(tmp_path)), world_size=1)  # 1 process: local = global
    local = two_process_states["paco_local", 0]
    for name in ("queue.keys", "queue.labels", "queue.pointer"):  # keys come from the momentum encoder before the step
        torch.testing.assert_close(local[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(local["backbone.conv1.0.weight"], expected["backbone.conv1.0.weight"], rtol=1e-5, atol=1e-6)


def _sigterm_worker(rank: int, port: int, directory: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    callbacks = [LastCheckpointOnSigterm(), PreemptionSignals(), ModelCheckpoint(directory, save_last=True),
                 SignalAtStep(signal.SIGTERM, step=1 + rank)]  # the processes receive it at different steps
    trainer = cpu_trainer(directory, devices=WORLD, strategy=DDPStrategy(process_group_backend="gloo"), enable_checkpointing=True,
                          callbacks=callbacks, **(trainer_options(directory) | dict(max_steps=6)))
    try:
        trainer.fit(initial_model("moco"), FixedBatch(METHODS["moco"][1], WORLD))
    except SIGTERMException:
        results[rank] = trainer.global_step


def join_or_fail(context, seconds: float, message: str) -> None:
    """Waits for the processes; a hang (processes waiting on each other) kills them and fails instead of blocking CI."""
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(message)


def test_sigterm_at_different_steps_stops_every_process_at_the_same_step_with_a_last_ckpt(tmp_path):
    context = start_processes(_sigterm_worker, (free_port(), str(tmp_path), results := mp.Manager().dict()), nprocs=WORLD, join=False)
    join_or_fail(context, 600, "the processes did not stop after SIGTERM: they wait on each other")
    assert dict(results) == {0: 2, 1: 2}  # rank 0's signal before step 1 stops both after it
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.parametrize("method", ["barlow_twins", "vicreg"])
def test_barlow_twins_and_vicreg_gradients_on_two_processes_are_the_global_batch_gradients_not_a_world_size_fraction(method, two_process_states, tmp_path):
    """The bugs of lightly's losses (lightly issue #1977, PR #979's review): a cross-correlation all-reduced without
    autograd gives each process 1/W of the gradient; embeddings summed where they should be gathered give another
    loss. Both would fail here, where the gradient of every parameter is compared with the 1-process one."""
    expected = one_step(method, cpu_trainer(tmp_path, **trainer_options(tmp_path)), world_size=1)
    gradients = {name: tensor for name, tensor in expected.items() if name.startswith("grad:backbone.") or name.startswith("grad:projector.")}
    large = [name for name, tensor in gradients.items() if tensor.abs().max() > 1e-3]
    scale = max(tensor.abs().max().item() for tensor in gradients.values())
    assert "grad:backbone.conv1.0.weight" in large and "grad:projector.0.weight" in large
    for rank in range(WORLD):
        for name, tensor in gradients.items():
            found = two_process_states[method, rank][name]
            # float32 sums in another order: differences to 1e-5 of the largest gradient (the last layer's bias, which
            # the standardisation or centring cancels, has only rounding noise)
            difference = (found - tensor).abs().max().item()
            assert difference <= 1e-5 * scale + 1e-5 * tensor.abs().max().item(), f"{method}: {name} on rank {rank} differs by {difference:.3g}"
            if name in large:  # a gradient off by the world size would be half of it
                assert not torch.allclose(found, tensor / WORLD, rtol=1e-3, atol=1e-7)


def test_swav_queue_and_dino_centre_on_two_processes_hold_the_global_batch(two_process_states, tmp_path):
    swav = one_step("swav", cpu_trainer(tmp_path / "swav", **trainer_options(tmp_path / "swav")), world_size=1)
    dino = one_step("dino", cpu_trainer(tmp_path / "dino", **trainer_options(tmp_path / "dino")), world_size=1)
    assert torch.count_nonzero(swav["queues.0.embeddings"].norm(dim=1)) == GLOBAL_BATCH  # every row of both processes
    assert dino["center"].abs().max() > 0
    for rank in range(WORLD):
        torch.testing.assert_close(two_process_states["swav", rank]["queues.0.embeddings"], swav["queues.0.embeddings"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(two_process_states["dino", rank]["center"], dino["center"], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------- evaluation on 2 processes
# odd sizes: in batches of 32, unpadded halves of 65 would take 2 and 1 batches, and DDP's forward (buffers) and the
# preemption agreement run a collective per batch
VAL_IMAGES, BANK_IMAGES, EVAL_BATCH = 65, 97, 32


class OddSplits(DigitsDataModule):
    """Digits-M with a validation split and a kNN bank of odd sizes."""

    def build_splits(self) -> dict[str, Dataset]:
        splits = super().build_splits()
        return splits | {"val": Subset(splits["val"], range(VAL_IMAGES)), "bank": Subset(splits["train"], range(BANK_IMAGES))}


def validation_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The validation of a random trunk and probe; inside a fit of one step that changes neither (the trunk's learning
    rate 0, the probe's far too small to change a prediction: it must be > 0)."""
    torch.manual_seed(0)  # the same random trunk and probe on every process and in the reference
    model = MoCoV2(queue_size=128, momentum=NO_SHUFFLE, backbone=TRUNK, projector=TINY_PROJECTOR, knn_k=20, num_classes=10,
                   optimizer=OptimizerSpec(lr=0.0), probe_lr=1e-12)
    data = OddSplits(batch_size=EVAL_BATCH, num_workers=0, train_variants=1, eval_variants=1,
                     views={"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}})
    if trainer.world_size > 1:
        trainer.fit(model, data)
    else:
        trainer.validate(model, data, verbose=False)
    return {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("val/")}


def _validation_worker(rank: int, port: int, directory: str, cache: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", CONTRASTLAB_CACHE=cache)
    trainer = cpu_trainer(directory, devices=WORLD, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=1,
                          limit_train_batches=1, callbacks=[PreemptionSignals()])
    results[rank] = validation_metrics(trainer)


def test_two_processes_score_each_validation_and_bank_image_once_and_report_the_metrics_of_one_process(tmp_path):
    """Inside a fit, each process validates its shard of the 65 images and votes with the whole bank of 97, in as
    many batches as the other (the shards are padded with images labelled -1): the probe's and the kNN monitor's
    top-1 and top-5 are those of one process on all images. (torch's DistributedSampler would score one image twice
    and put one bank image in twice; unpadded shards would wait on each other.)"""
    context = start_processes(_validation_worker, (free_port(), str(tmp_path / "ddp"), os.environ["CONTRASTLAB_CACHE"], results := mp.Manager().dict()),
                              nprocs=WORLD, join=False)
    join_or_fail(context, 300, "the processes wait on each other during validation")
    expected = validation_metrics(cpu_trainer(tmp_path / "one"))
    assert expected.keys() == {"val/probe_top1", "val/probe_top5", "val/knn_top1", "val/knn_top5"}
    assert 0 < expected["val/probe_top1"] < 1 and 0 < expected["val/knn_top1"] < 1  # a count of 65 that one image more would change
    for rank in range(WORLD):
        assert results[rank] == pytest.approx(expected, abs=1e-12), rank


def test_every_trainable_method_class_has_a_two_process_case():
    """A method added without a case above could contrast each process's batch alone (a missing `gather_with_grad`)
    and pass every other test."""
    covered = {type(initial_model(name)) for name in METHODS}
    trainable = {getattr(methods, name) for base in (methods.PretrainMethod, methods.LongTailClassifier) for name in trainable_classes(base)}
    assert sorted(cls.__name__ for cls in trainable - covered) == []
