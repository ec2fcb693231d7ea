"""The online linear probe: by default it learns from the first view's detached trunk features with its own plain,
unscaled learning rate; `probe_views: global` and `probe_like_trunk: true` make it solo-learn's online classifier
(solo/methods/base.py: the cross-entropy's mean over the num_large_crops crops; the classifier a group of the LARS
optimizer, solo/utils/lars.py, its lr scaled with the batch in solo/args/pretrain.py)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import digits, first_batch
from test_barlow_twins_vicreg import LOCAL, VIEWS, tiny
from test_byol import BYOL_VIEWS, tiny_byol
from test_dino import tiny_dino
from test_moco import MOCO_VIEWS, tiny_moco
from test_supcon import CROPS, tiny_supcon

from engine.optim import OptimizerSpec, build_optimizer, with_group_lrs
from methods import BarlowTwins

CASES = {  # a method, its views: which crops are global
    "byol: a forward per view": (tiny_byol, BYOL_VIEWS, ["first", "second"]),
    "supcon: the crops of one view in one forward": (tiny_supcon, {"crops": CROPS["crops"] | {"count": 3}}, None),
    "barlow twins: per crop, local crops left out": (lambda **kwargs: tiny(BarlowTwins, local_crops=["local"], **kwargs), VIEWS | LOCAL, ["global1", "global2"]),
    "dino: by resolution, local crops left out": (lambda **kwargs: tiny_dino(local_crops=["local"], **kwargs), VIEWS | LOCAL, ["global1", "global2"]),
    "byol: local crops left out": (lambda **kwargs: tiny_byol(local_crops=["local"], **kwargs), BYOL_VIEWS | LOCAL, ["first", "second"]),
    "supcon: local crops left out": (lambda **kwargs: tiny_supcon(local_crops=["local"], **kwargs), {"crops": CROPS["crops"] | {"count": 3}} | LOCAL, None),
}


@pytest.mark.parametrize("case", CASES)
def test_a_method_returns_the_trunk_features_of_each_global_view_in_view_order(case):
    make, views, global_views = CASES[case]
    model = make(probe_views="global").eval()  # BatchNorm on running statistics: a crop's features do not depend on its batch
    batch = first_batch(digits(views, batch_size=6))
    crops = [batch["views"][name] for name in global_views] if global_views else list(batch["views"]["crops"].unbind(1))
    with torch.no_grad():
        _, features = model.step(batch)
        expected = torch.cat([model.backbone(crop) for crop in crops])
    torch.testing.assert_close(features, expected)


def test_the_global_probe_loss_is_the_mean_over_the_views_and_the_first_view_probe_reads_the_first_rows_only():
    labels = torch.tensor([3, -1, 5, 0])
    features = torch.randn(3 * len(labels), 512)
    global_probe, first_probe = tiny_moco(probe_views="global"), tiny_moco()
    first_probe.probe.load_state_dict(global_probe.probe.state_dict())
    labelled = labels >= 0
    per_view = [F.cross_entropy(global_probe.probe(view[labelled]), labels[labelled]) for view in features.chunk(3)]
    torch.testing.assert_close(global_probe.probe_loss(features, labels), torch.stack(per_view).mean())
    torch.testing.assert_close(first_probe.probe_loss(features, labels), per_view[0], rtol=0, atol=0)


def solo_learn_lars_step(param: torch.Tensor, grad: torch.Tensor, lr: float, eta: float, adapted: bool) -> torch.Tensor:
    """solo/utils/lars.py LARS.step for one parameter of a group without weight decay, its first step (the momentum
    buffer starts as the update), with clip_lr."""
    update = grad.clone()
    param_norm, grad_norm = torch.norm(param), torch.norm(grad)
    if adapted and param_norm != 0 and grad_norm != 0:
        update *= min(eta * param_norm / (grad_norm + 0.0 * param_norm + 1e-8) / lr, 1)
    return param - lr * update


@pytest.mark.parametrize("like_trunk", [False, True])
def test_a_probe_like_the_trunk_has_its_lr_scaled_with_the_batch_and_its_weight_lars_adapted(like_trunk):
    # solo-learn's CIFAR BYOL, with weight decay 1e-2 for its 1e-5: the probe's group has none, and decay at 1e-5 would
    # move its weight by 7.5e-9, under the tolerance
    spec = OptimizerSpec(name="lars", lr=1.0, lr_scaling="linear", weight_decay=1e-2, trust_coefficient=0.02,
                         lars_trust_denominator="norm_sum", lars_clip_lr=True, exclude_bias_and_norm=True)
    model = tiny_moco(optimizer=spec, probe_lr=0.1, probe_like_trunk=like_trunk)
    batch = first_batch(digits(MOCO_VIEWS, batch_size=16))
    scale = spec.batch_scale(16)  # 16 / 256
    optimizer = build_optimizer(with_group_lrs(model.optimizer_groups(), spec.effective_lr(16), scale), spec, spec.effective_lr(16))
    before = {name: param.detach().clone() for name, param in model.probe.named_parameters()}
    model.training_step(batch, 0).backward()
    grads = {name: param.grad.clone() for name, param in model.probe.named_parameters()}
    optimizer.step()
    lr = 0.1 * scale if like_trunk else 0.1
    for name, adapted in (("weight", like_trunk), ("bias", False)):  # the bias: exclude_bias_and_norm
        expected = solo_learn_lars_step(before[name], grads[name], lr, 0.02, adapted)
        torch.testing.assert_close(getattr(model.probe, name).detach(), expected, rtol=1e-6, atol=1e-7)
    if like_trunk:  # the adaptation changed the step (else the test could not tell the two apart)
        assert not torch.allclose(model.probe.weight.detach(), before["weight"] - lr * grads["weight"])


def test_an_unknown_probe_views_value_is_refused_naming_it():
    with pytest.raises(ValueError, match="model.probe_views must be 'first' or 'global', got 'both'"):
        tiny_moco(probe_views="both")
