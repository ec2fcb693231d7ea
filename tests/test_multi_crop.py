"""Multi-crop as one mechanism: the DataModule draws the global and local views at their own sizes, a method with
`multi_crop` names its local crops (`local_crops`) and the base passes a branch's crops through trunk and head one
crop at a time or batched by resolution, as the official `MultiCropWrapper` (facebookresearch/dino utils.py)."""

import pytest
import torch
import torch.nn as nn
from helpers import TINY_BACKBONE, TINY_PROJECTOR, digits

from methods import DINO, SCE, MoCoV2
from methods.momentum import MomentumSpec

GLOBAL_LOCAL = {
    "weak": {"preset": "crop_flip"},
    "strong": {"preset": "mocov2"},
    "local": {"preset": "mocov2", "size": 16, "scale": [0.05, 0.4], "count": 3},
}


class CountingTrunk(nn.Module):
    """A trunk with BatchNorm (its output depends on the whole batch it sees) that records each batch's size."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm2d(3)
        self.batches: list[tuple[int, ...]] = []

    def forward(self, images):
        self.batches.append(tuple(images.shape))
        return self.norm(images).mean(dim=(2, 3))


def sce(**kwargs):
    return SCE(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=256, knn_k=0, momentum=MomentumSpec(shuffle_bn=False), **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["cpu", "gpu"])
def test_the_datamodule_draws_global_views_at_the_image_size_and_local_crops_at_theirs(pipeline):
    datamodule = digits(GLOBAL_LOCAL, batch_size=4, pipeline=pipeline)
    datamodule.setup()
    batch = datamodule.augment_on_device(next(iter(datamodule.train_dataloader())))
    assert batch["views"]["strong"].shape == (4, 3, 32, 32)
    assert batch["views"]["local"].shape == (4, 3, 3, 16, 16)


def test_crops_unbinds_counted_views_in_order():
    model = sce(local_crops=["local"])
    views = {"strong": torch.zeros(2, 3, 8, 8), "local": torch.arange(3.0).view(1, 3, 1, 1, 1).expand(2, 3, 3, 4, 4)}
    crops = model.crops(views, model.online_views)
    assert [tuple(crop.shape) for crop in crops] == [(2, 3, 8, 8)] + [(2, 3, 4, 4)] * 3
    assert [crop[0, 0, 0, 0].item() for crop in crops[1:]] == [0.0, 1.0, 2.0]


def test_per_crop_batching_runs_trunk_and_head_once_per_crop():
    model = sce()
    trunk, head = CountingTrunk(), nn.BatchNorm1d(3)
    crops = [torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.randn(4, 3, 4, 4)]
    outputs, features = model.encode_crops(crops, trunk, head)
    assert trunk.batches == [(4, 3, 8, 8), (4, 3, 8, 8), (4, 3, 4, 4)]
    for crop, output in zip(crops, outputs):
        torch.testing.assert_close(output, head(trunk(crop)))
    torch.testing.assert_close(features, trunk(crops[0]))


def test_by_resolution_batching_concatenates_runs_of_one_resolution_and_runs_the_head_on_all_crops():
    model = sce()
    model.crop_batching = "by_resolution"
    trunk, head = CountingTrunk(), nn.BatchNorm1d(3)
    crops = [torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.randn(4, 3, 4, 4), torch.randn(4, 3, 4, 4), torch.randn(4, 3, 8, 8)]
    outputs, features = model.encode_crops(crops, trunk, head)
    assert trunk.batches == [(8, 3, 8, 8), (8, 3, 4, 4), (4, 3, 8, 8)]  # consecutive runs only, as MultiCropWrapper
    expected = head(torch.cat([trunk(torch.cat(crops[:2])), trunk(torch.cat(crops[2:4])), trunk(crops[4])]))
    torch.testing.assert_close(torch.cat(outputs), expected)  # the head's BatchNorm saw all 20 rows at once
    assert [output.shape[0] for output in outputs] == [4] * 5
    torch.testing.assert_close(features, trunk(torch.cat(crops[:2]))[:4])


def test_a_config_may_choose_the_crop_batching_of_a_method_whose_official_code_batches_by_resolution():
    """solo-learn forwards every crop on its own, also for DINO and SwAV (solo/methods/base.py training_step)."""
    options = dict(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, out_dim=16, knn_k=0)
    assert DINO(**options).crop_batching == "by_resolution"  # facebookresearch/dino's MultiCropWrapper
    model = DINO(crop_batching="per_crop", **options)
    trunk = CountingTrunk()
    model.encode_crops([torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)], trunk, nn.Identity(), global_crops=2)
    assert trunk.batches == [(4, 3, 8, 8), (4, 3, 8, 8)]
    with pytest.raises(ValueError, match="model.crop_batching must be 'per_crop' or 'by_resolution' \\(or null: the method's own\\), got 'all'"):
        DINO(crop_batching="all", **options)


def test_local_crops_are_consumed_views_that_the_data_must_provide():
    model = sce(local_crops=["local"])
    model.check_data(digits(GLOBAL_LOCAL), world_size=1)
    with pytest.raises(ValueError, match=r"consumes the views \['weak', 'strong', 'local'\] but data.views provides \['weak', 'strong'\]"):
        model.check_data(digits({name: GLOBAL_LOCAL[name] for name in ("weak", "strong")}), world_size=1)


def test_a_method_without_a_branch_for_local_crops_refuses_them():
    with pytest.raises(ValueError, match=r"model.local_crops \['local'\]: MoCoV2 has no branch for local crops"):
        MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=256, knn_k=0, local_crops=["local"])
