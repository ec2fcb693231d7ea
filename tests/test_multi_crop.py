"""Multi-crop as one mechanism: the DataModule draws the global and local views at their own sizes, a method with
`multi_crop` names its local crops (`local_crops`) and the base passes a branch's crops through trunk and head one
crop at a time or batched by resolution, as the official `MultiCropWrapper` (facebookresearch/dino utils.py)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import TINY_BACKBONE, TINY_PROJECTOR, digits

from backbones import MLPSpec
from methods import BYOL, DINO, JCL, NNCLR, NPID, SCE, MoCoV2, MoCoV3, SimCLR, SimSiam, SupCon
from methods.losses import contrastive_loss, info_nce, jcl_loss, mocov3_loss, nnclr_loss, nt_xent, nt_xent_multi_crop, supcon_loss
from methods.momentum import MomentumSpec
from methods.pretrain import PretrainMethod

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


def test_by_resolution_batching_splits_every_output_of_a_head_that_returns_several():
    """SimSiam's and NNCLR's head returns the projection and the prediction (`project_and_predict`)."""
    model = sce()
    model.crop_batching = "by_resolution"
    crops = [torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8), torch.randn(4, 3, 4, 4)]
    outputs, _ = model.encode_crops(crops, CountingTrunk(), lambda features: (2 * features, features + 1))
    features = torch.cat([CountingTrunk()(torch.cat(crops[:2])), CountingTrunk()(crops[2])])
    assert [len(output) for output in outputs] == [2, 2, 2]
    for index, (doubled, shifted) in enumerate(outputs):
        torch.testing.assert_close(doubled, 2 * features[4 * index : 4 * index + 4])
        torch.testing.assert_close(shifted, features[4 * index : 4 * index + 4] + 1)


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
    """A new method must say that its `step` reads `local_crops` (every shipped pretraining method does)."""

    class TwoViewsOnly(PretrainMethod):
        views = ("first", "second")

    with pytest.raises(ValueError, match=r"model.local_crops \['local'\]: TwoViewsOnly has no branch for local crops"):
        TwoViewsOnly(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0, local_crops=["local"])


# Every pretraining method with 2 local crops of 16 px: its step's loss against the loop of the reference it follows,
# written out here over separately computed embeddings (BatchNorm in training mode: each crop its own forward, as the
# methods' per-crop batching), so that a pair left out, a sum taken for a mean or a local crop sent to the target fails.
BATCH, LOCAL = 8, 2
PREDICTOR = MLPSpec(hidden_dim=32, output_dim=TINY_PROJECTOR.output_dim)
NO_SHUFFLE = MomentumSpec(base=0.99, shuffle_bn=False)


def views_and_local_crops(*names: str, **shaped: tuple) -> dict:
    generator = torch.Generator().manual_seed(0)
    views = {name: torch.randn(BATCH, 3, 32, 32, generator=generator) for name in names}
    views |= {name: torch.randn(BATCH, *shape, generator=generator) for name, shape in shaped.items()}
    return views | {"local": torch.randn(BATCH, LOCAL, 3, 16, 16, generator=generator)}


def local_crops(views: dict) -> list:
    return list(views["local"].unbind(1))


def online(model, images):
    return model.embed(images)[1]


def step_loss(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.step(batch)[0]


@torch.no_grad()
def test_moco_v2_contrasts_each_local_crop_with_the_key_and_the_queue_and_averages_as_eztorch():
    model = MoCoV2(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=NO_SHUFFLE, knn_k=0, local_crops=["local"])
    views = views_and_local_crops("query", "key")
    queue, key = model.queue.read().clone(), model.target_embed(views["key"])
    queries = [online(model, views["query"])] + [online(model, crop) for crop in local_crops(views)]
    expected = sum(info_nce(query, key, queue, model.temperature) for query in queries) / len(queries)  # tot_loss /= num_crops - 1
    torch.testing.assert_close(step_loss(model, {"views": views}), expected)
    torch.testing.assert_close(model.queue.read()[:BATCH], key)  # the key alone entered the queue


@torch.no_grad()
def test_moco_v3_sums_every_pair_of_a_global_key_and_another_crop_as_eztorch():
    model = MoCoV3(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, predictor=PREDICTOR, temperature=0.2, knn_k=0, local_crops=["local"])
    views = views_and_local_crops("first", "second")
    keys = [model.target_embed(views[name]) for name in ("first", "second")]
    queries = [online(model, views[name]) for name in ("first", "second")] + [online(model, crop) for crop in local_crops(views)]
    expected = sum(mocov3_loss(queries[j], keys[i], 0.2) for i in range(2) for j in range(len(queries)) if j != i)
    torch.testing.assert_close(step_loss(model, {"views": views}), expected)


@torch.no_grad()
def test_byol_sums_the_regression_of_every_other_crop_on_each_global_target_as_solo_learn():
    model = BYOL(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, predictor=PREDICTOR, knn_k=0, local_crops=["local"])
    views = views_and_local_crops("first", "second")
    targets = [model.target_embed(views[name]) for name in ("first", "second")]
    predictions = [online(model, views[name]) for name in ("first", "second")] + [online(model, crop) for crop in local_crops(views)]
    # solo/losses/byol.py byol_loss_func: 2 - 2 cos, mean over the batch; solo/methods/byol.py sums the pairs
    expected = sum((2 - 2 * (predictions[j] * targets[i]).sum(dim=1)).mean() for i in range(2) for j in range(len(predictions)) if j != i)
    torch.testing.assert_close(step_loss(model, {"views": views}), expected)


@torch.no_grad()
@pytest.mark.parametrize("method", ["SimSiam", "NNCLR"])
def test_simsiam_and_nnclr_average_over_every_pair_of_a_global_target_and_another_crop(method):
    model = (SimSiam(predictor=PREDICTOR, backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0, local_crops=["local"]) if method == "SimSiam"
             else NNCLR(queue_size=32, predictor=PREDICTOR, backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, knn_k=0, local_crops=["local"]))
    if method == "NNCLR":
        model.support_set.push(F.normalize(torch.randn(32, TINY_PROJECTOR.output_dim, generator=torch.Generator().manual_seed(1)), dim=1))
    views = views_and_local_crops("first", "second")
    embedded = [model.project_and_predict(model.backbone(crop)) for crop in [views["first"], views["second"], *local_crops(views)]]
    support = model.support_set.read().clone() if method == "NNCLR" else None

    def pair(target: int, crop: int) -> torch.Tensor:
        projection, prediction = embedded[target][0], embedded[crop][1]
        if method == "SimSiam":
            return -(prediction * projection).sum(dim=1).mean()  # D(p, sg(z)), main_simsiam.py's criterion
        return nnclr_loss(projection, prediction, support, model.temperature)

    pairs = [pair(i, j) for i in range(2) for j in range(len(embedded)) if j != i]
    torch.testing.assert_close(step_loss(model, {"views": views}), sum(pairs) / len(pairs))
    if method == "NNCLR":  # the first view's projections alone entered the support set
        torch.testing.assert_close(model.support_set.read()[:BATCH], embedded[0][0])


@torch.no_grad()
def test_simclr_contrasts_every_crop_with_the_other_crops_of_its_image_as_solo_learn():
    model = SimCLR(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, temperature=0.2, knn_k=0, local_crops=["local"])
    views = views_and_local_crops("first", "second")
    z = torch.cat([online(model, torch.cat([views["first"], views["second"]]))] + [online(model, crop) for crop in local_crops(views)])
    # solo/losses/simclr.py simclr_loss_func, one process: the positives summed inside the log
    indexes = torch.arange(BATCH).repeat(2 + LOCAL)
    similarity = torch.exp(z @ z.T / 0.2)
    positive = (indexes[:, None] == indexes[None, :]).fill_diagonal_(False)
    negative = indexes[:, None] != indexes[None, :]
    pos, neg = (similarity * positive).sum(dim=1), (similarity * negative).sum(dim=1)
    torch.testing.assert_close(step_loss(model, {"views": views}), -torch.log(pos / (pos + neg)).mean())
    with pytest.raises(ValueError, match=r"model.num_hard 4 with model.local_crops \['local'\]: the hard loss is for two views only"):
        SimCLR(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, num_hard=4, knn_k=0, local_crops=["local"])


def test_simclrs_multi_crop_loss_with_two_crops_is_nt_xent():
    generator = torch.Generator().manual_seed(0)
    z1, z2 = (F.normalize(torch.randn(6, 5, generator=generator), dim=1) for _ in range(2))
    torch.testing.assert_close(nt_xent_multi_crop(torch.stack([z1, z2], dim=1), 0.3), nt_xent(z1, z2, 0.3))


@torch.no_grad()
def test_supcon_takes_the_local_crops_as_further_views_of_its_loss():
    model = SupCon(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, temperature=0.1, knn_k=0, local_crops=["local"])
    views = views_and_local_crops(crops=(2, 3, 32, 32))
    labels = torch.tensor([0, 1, 0, 1, 2, 2, 3, 0])
    crops = online(model, views["crops"].flatten(0, 1)).view(BATCH, 2, -1)
    features = torch.cat([crops, torch.stack([online(model, crop) for crop in local_crops(views)], dim=1)], dim=1)
    torch.testing.assert_close(step_loss(model, {"views": views, "label": labels}), supcon_loss(features, labels, 0.1, 0.1))


@torch.no_grad()
def test_jcl_and_npid_average_their_loss_over_the_view_and_the_local_crops_against_the_same_positives():
    jcl = JCL(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, queue_size=64, momentum=NO_SHUFFLE, knn_k=0, local_crops=["local"])
    views = views_and_local_crops("query", keys=(3, 3, 32, 32))
    keys, queue = jcl.embed_keys(views["keys"]), jcl.queue.read().clone()
    queries = [online(jcl, views["query"])] + [online(jcl, crop) for crop in local_crops(views)]
    expected = sum(jcl_loss(query, keys, queue, jcl.temperature, jcl.jcl_lambda) for query in queries) / len(queries)
    torch.testing.assert_close(step_loss(jcl, {"views": views}), expected)

    npid = NPID(backbone=TINY_BACKBONE, projector=TINY_PROJECTOR, temperature=0.2, knn_k=0, local_crops=["local"])
    npid.build_bank(20)
    views, index = views_and_local_crops("image"), torch.arange(3, 3 + BATCH)
    bank, view = npid.bank.read().clone(), online(npid, views["image"])
    anchors = [view] + [online(npid, crop) for crop in local_crops(views)]
    expected = sum(contrastive_loss(anchor, bank[index], bank, 0.2, exclude=index) for anchor in anchors) / len(anchors)
    torch.testing.assert_close(step_loss(npid, {"views": views, "index": index}), expected)
    torch.testing.assert_close(npid.bank.read()[index], F.normalize(0.5 * bank[index] + 0.5 * view, dim=1))  # the view alone moved the bank
