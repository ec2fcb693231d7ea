"""Prediction of a target embedding, without negatives: BYOL's normalised regression against the momentum
target and SimSiam's negative cosine against the stop-gradient of the other view's projection."""

from torch import Tensor

from methods.losses.common import check_shape, float32_math


def check_pairs(prediction1: Tensor, prediction2: Tensor, target1: Tensor, target2: Tensor) -> None:
    check_shape("prediction1", prediction1, None, None)
    for name, tensor in (("prediction2", prediction2), ("target1", target1), ("target2", target2)):
        check_shape(name, tensor, *prediction1.shape)


@float32_math
def byol_loss(prediction1: Tensor, prediction2: Tensor, target1: Tensor, target2: Tensor) -> Tensor:
    """BYOL (Grill et al., NeurIPS 2020, Eq. 2 and its symmetrisation): per image
    ``||p1 - t2||^2 + ||p2 - t1||^2 = (2 - 2 p1.t2) + (2 - 2 p2.t1)`` of the normalised predictions p_v of view v and
    the normalised targets t_v, mean over the batch, in [0, 8] (deepmind-research byol/utils/helpers.py
    `regression_loss`, byol/byol_experiment.py `_loss_fn`). The targets are detached (`jax.lax.stop_gradient`)."""
    check_pairs(prediction1, prediction2, target1, target2)
    return (4 - 2 * (prediction1 * target2.detach()).sum(dim=1) - 2 * (prediction2 * target1.detach()).sum(dim=1)).mean()


@float32_math
def simsiam_loss(prediction1: Tensor, prediction2: Tensor, projection1: Tensor, projection2: Tensor) -> Tensor:
    """SimSiam (Chen & He, CVPR 2021, Eq. 3-4): ``-(mean p1.sg(z2) + mean p2.sg(z1)) / 2`` of the normalised
    predictions p_v and projections z_v, -1 at perfect alignment (facebookresearch/simsiam main_simsiam.py: the
    cosine criterion; simsiam/builder.py detaches z)."""
    check_pairs(prediction1, prediction2, projection1, projection2)
    return -((prediction1 * projection2.detach()).sum(dim=1).mean() + (prediction2 * projection1.detach()).sum(dim=1).mean()) / 2
