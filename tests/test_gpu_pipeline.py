"""`data.pipeline: gpu` with the training images resident on the device, and the compiled trunks (issue 11).

The device here is the CPU: the same code runs on CUDA tensors."""

from pathlib import Path

import lightning as L
import pytest
import torch

from datamodules import DigitsDataModule, DigitsLTDataModule
from datamodules.base import RawImageDataset
from helpers import cpu_trainer
from methods import MethodBase
from methods.cli import ContrastlabCLI

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
    images, labels = datamodule.images_on_device(batch)
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


def test_resident_is_only_for_the_gpu_pipeline_with_images_of_one_size():
    assert not DigitsDataModule(num_workers=0, views=VIEWS, pipeline="cpu").resident
    assert not DigitsDataModule(num_workers=0, views=VIEWS, pipeline="gpu", resident=False).resident


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
