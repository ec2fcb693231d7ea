"""`data.pipeline: gpu` with the training images resident on the device, and the compiled trunks (issue 11).

The device here is the CPU: the same code runs on CUDA tensors."""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import cpu_trainer, free_port, start_processes
from torch.utils.data import Subset

from datamodules import DigitsDataModule, DigitsLTDataModule
from datamodules.base import RawImageDataset
from datamodules.batched import BatchedAugment
from datamodules.view_spec import CONTRASTIVE_PRESETS, ViewSpec
from datamodules.pipeline import Pipeline, pipeline_mode
from engine.cli import ContrastlabCLI
from methods import MethodBase

ROOT = Path(__file__).parents[1]
VIEWS = {"query": {"preset": "mocov2"}, "key": {"preset": "mocov2"}}
TINY = ["--data.init_args.batch_size=16", "--data.init_args.num_workers=0", "--data.init_args.knn_bank=false"]


@pytest.mark.parametrize("datamodule_class", [DigitsDataModule, DigitsLTDataModule])
@pytest.mark.slow
def test_resident_images_are_the_decoded_training_split_in_dataset_order(datamodule_class):
    datamodule = datamodule_class(batch_size=8, num_workers=0, views=VIEWS, pipeline="gpu")
    loader = datamodule.train_dataloader()
    train = datamodule.splits["train"]  # the long-tailed subset for DigitsLT: indices map through it
    assert datamodule.resident_images.shape == (len(train), 3, 32, 32) and datamodule.resident_images.dtype == torch.uint8
    batch = next(iter(loader))
    assert loader.num_workers == 0 and set(batch) == {"label", "index"}  # indices and labels only
    images, labels, _ = datamodule.images_on_device(batch)
    for row, index in enumerate(batch["index"].tolist()):
        expected = RawImageDataset(train)[index]
        assert torch.equal(images[row], expected["image"]) and labels[row] == expected["label"]


@pytest.mark.slow
def test_resident_and_streamed_raw_batches_come_in_the_same_order_and_train_to_the_same_parameters(tmp_path):
    def train(resident: bool):
        L.seed_everything(0, verbose=False)
        cli = ContrastlabCLI(MethodBase, args=["--config", str(ROOT / "configs/moco_digits.yaml"), *TINY, f"--data.init_args.resident={resident}"], run=False)
        assert cli.datamodule.resident == resident
        cpu_trainer(tmp_path / str(resident), max_steps=3, limit_val_batches=0).fit(cli.model, datamodule=cli.datamodule)
        return cli.model.state_dict()

    resident, streamed = train(True), train(False)
    assert resident.keys() == streamed.keys()
    for key in resident:
        assert torch.equal(resident[key], streamed[key]), key


def test_the_pipeline_mode_follows_the_pipeline_resident_and_whether_the_images_have_one_size():
    assert DigitsDataModule(num_workers=0, views=VIEWS, pipeline="cpu").mode is Pipeline.CPU
    assert DigitsDataModule(num_workers=0, views=VIEWS, pipeline="gpu").mode is Pipeline.RESIDENT
    assert DigitsDataModule(num_workers=0, views=VIEWS, pipeline="gpu", resident=False).mode is Pipeline.STREAMED
    assert pipeline_mode("gpu", resident=True, uniform_image_size=False) is Pipeline.ENCODED  # files of any size
    assert pipeline_mode("cpu", resident=True, uniform_image_size=True) is Pipeline.CPU
    with pytest.raises(ValueError, match=r"data.pipeline must be one of \['cpu', 'gpu'\], got 'tpu'"):
        DigitsDataModule(num_workers=0, views=VIEWS, pipeline="tpu")


def test_an_analysed_subset_draws_its_views_from_its_own_raw_images_whether_or_not_training_is_resident():
    def views(resident: bool) -> torch.Tensor:
        datamodule = DigitsDataModule(num_workers=0, batch_size=8, views=VIEWS, pipeline="gpu", resident=resident)
        datamodule.setup()
        torch.manual_seed(0)
        return torch.cat(list(datamodule.view_batches(Subset(datamodule.splits["val"], range(12)), "query", torch.device("cpu"))))

    resident, streamed = views(True), views(False)
    assert resident.shape == (12, 3, 32, 32) and torch.equal(resident, streamed)


@pytest.mark.slow
def test_compiled_trunks_train_like_the_eager_ones_and_keep_the_checkpoint_keys(tmp_path):
    def train(*compile_args: str):
        L.seed_everything(0, verbose=False)
        cli = ContrastlabCLI(MethodBase, args=["--config", str(ROOT / "configs/moco_digits.yaml"), *TINY, *compile_args], run=False)
        cpu_trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(cli.model, datamodule=cli.datamodule)
        return cli.model

    # aot_eager: traced by dynamo and AOTAutograd like inductor, without needing a C++ compiler on the test machine
    compiled = train("--model.init_args.compile.backend=aot_eager")
    eager = train()
    assert compiled.backbone._compiled_call_impl is not None and compiled.target_backbone._compiled_call_impl is not None
    assert eager.backbone._compiled_call_impl is None
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)


# every random operation of the batched views, each at its preset's rate: crop, jitter in a random order, grayscale,
# blur, solarisation, flip
AUGMENT_ALL = ViewSpec(16, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), **(CONTRASTIVE_PRESETS["byol2"] | {"blur_prob": 0.5}))


def process_batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (6, 3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(10 + rank))


def _views_worker(rank: int, world: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # as seed_everything seeds every rank
    results[rank] = (BatchedAugment(AUGMENT_ALL)(process_batch(rank)), torch.get_rng_state())
    dist.destroy_process_group()


@pytest.mark.slow
def test_each_process_draws_its_own_samples_views_from_one_random_state_as_one_process_of_the_global_batch():
    """seed_everything seeds every rank alike: drawing its batch alone, each rank repeated rank 0's crops, jitters and
    flips. Each rank's views are the one-process views of the concatenated batch, its own rows, and the ranks end
    with one random state (a resumed run restores rank 0's on every rank)."""
    with mp.Manager() as manager:
        results = manager.dict()
        start_processes(_views_worker, (2, free_port(), results))
        results = dict(results)
    torch.manual_seed(0)
    together = BatchedAugment(AUGMENT_ALL)(torch.cat([process_batch(0), process_batch(1)]))
    for rank in (0, 1):
        torch.testing.assert_close(results[rank][0], together[6 * rank : 6 * (rank + 1)], rtol=0, atol=1e-5)
    assert torch.equal(results[0][1], results[1][1])
    torch.manual_seed(0)
    alone = BatchedAugment(AUGMENT_ALL)(process_batch(1))  # rank 1's images with rank 0's draws: other views
    assert (alone - results[1][0]).abs().amax(dim=(1, 2, 3)).min() > 0.1
