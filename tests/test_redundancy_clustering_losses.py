"""Barlow Twins, VICReg, Sinkhorn-Knopp, SwAV and DINO (methods/losses/redundancy.py, clustering.py): hand-computed
values, each official formula written out term by term, the identities of issue 34, gradients and validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from methods.losses import barlow_twins_loss, dino_loss, sinkhorn_knopp, swav_loss, vicreg_loss

f64 = torch.float64
EPS_BN = 1e-5  # BatchNorm1d's eps in Barlow Twins' standardisation
# four samples, two centred orthogonal dimensions of unit (biased) variance: standardized(H)^T standardized(H) / 4 = I
H = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]], dtype=f64)


def randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


# --- Barlow Twins ----------------------------------------------------------------------------------------------

def official_barlow_twins(z1, z2, lambd):
    """facebookresearch/barlowtwins main.py, term by term: BatchNorm1d(affine=False) in training mode, c / N."""
    norm = torch.nn.BatchNorm1d(z1.shape[1], affine=False).double().train()
    c = norm(z1).T @ norm(z2) / z1.shape[0]
    on_diag = (torch.diagonal(c) - 1).pow(2).sum()
    off_diag = sum(c[i, j] ** 2 for i in range(c.shape[0]) for j in range(c.shape[1]) if i != j)
    return on_diag + lambd * off_diag


def test_barlow_twins_is_zero_when_the_cross_correlation_is_the_identity():
    scaled = 1000 * H  # BatchNorm's eps is then negligible: C = I to 1e-11
    assert barlow_twins_loss(scaled, scaled + 3.0).item() < 1e-20


def test_barlow_twins_reproduces_hand_computed_values():
    diagonal = 1 / (1 + EPS_BN)  # C_ii of H against itself: 1 / (1 + eps)
    flipped = H * torch.tensor([1.0, -1.0], dtype=f64)  # C = diag(d, -d)
    assert math.isclose(barlow_twins_loss(H, flipped, 0.5).item(), (1 - diagonal) ** 2 + (1 + diagonal) ** 2, rel_tol=1e-12)
    swapped = H.flip(1)  # C = [[0, d], [d, 0]]: invariance 2, redundancy 2 d^2
    assert math.isclose(barlow_twins_loss(H, swapped, 0.5).item(), 2 + 0.5 * 2 * diagonal**2, rel_tol=1e-12)
    assert math.isclose(barlow_twins_loss(H, swapped, 0.5, loss_scale=0.1).item(), 0.1 * (2 + diagonal**2), rel_tol=1e-12)


def test_barlow_twins_equals_its_official_formula_and_ignores_per_dimension_affine_maps():
    z1, z2 = randn(0, 16, 6), randn(1, 16, 6)
    expected = official_barlow_twins(z1, z2, 0.0051)
    torch.testing.assert_close(barlow_twins_loss(z1, z2), expected, rtol=1e-12, atol=0)
    shift, scale = randn(2, 6), randn(3, 6).abs() + 0.5  # standardisation removes them (up to BatchNorm's eps)
    torch.testing.assert_close(barlow_twins_loss(z1 * scale + shift, z2), expected, rtol=1e-4, atol=0)


# --- VICReg ----------------------------------------------------------------------------------------------------

def official_vicreg(x, y, sim=25.0, std=25.0, cov=1.0):
    """facebookresearch/vicreg main_vicreg.py, term by term (one process: the gathered batch is the batch)."""
    repr_loss = F.mse_loss(x, y)
    x, y = x - x.mean(dim=0), y - y.mean(dim=0)
    std_x, std_y = torch.sqrt(x.var(dim=0) + 0.0001), torch.sqrt(y.var(dim=0) + 0.0001)
    std_loss = torch.mean(F.relu(1 - std_x)) / 2 + torch.mean(F.relu(1 - std_y)) / 2
    n, d = x.shape
    cov_x, cov_y = x.T @ x / (n - 1), y.T @ y / (n - 1)
    off = ~torch.eye(d, dtype=torch.bool)
    cov_loss = cov_x[off].pow(2).sum() / d + cov_y[off].pow(2).sum() / d
    return sim * repr_loss + std * std_loss + cov * cov_loss


def test_vicreg_equals_its_official_formula():
    z1, z2 = randn(4, 12, 5), 0.3 * randn(5, 12, 5)  # z2's std is below 1: the hinge is active
    torch.testing.assert_close(vicreg_loss(z1, z2), official_vicreg(z1, z2), rtol=1e-12, atol=0)


def test_vicreg_variance_term_is_zero_when_every_dimension_has_std_at_least_gamma():
    wide = 2 * randn(6, 32, 4) / randn(6, 32, 4).std(dim=0)  # std exactly 2 per dimension
    assert vicreg_loss(wide, wide + 1, invariance_weight=0, variance_weight=1, covariance_weight=0).item() == 0.0
    assert vicreg_loss(wide, wide, 0, 1, 0, gamma=3.0).item() > 0  # std 2 < gamma 3: the hinge is active


def test_vicreg_reproduces_hand_computed_values():
    # H: unbiased variance 4/3 per dimension, centred orthogonal columns: no covariance
    std = math.sqrt(4 / 3 + 1e-4)
    assert vicreg_loss(H, H).item() == pytest.approx(0.0, abs=1e-15)  # std > 1, no covariance, no difference
    half = H / 2  # std sqrt(1/3 + 1e-4) < 1: variance term relu(1 - std) per dimension, halved per branch
    expected_variance = 1 - math.sqrt(1 / 3 + 1e-4)
    assert vicreg_loss(half, half, 0, 1, 0).item() == pytest.approx(expected_variance, rel=1e-12)
    assert vicreg_loss(H, H + 1, 1, 0, 0).item() == pytest.approx(1.0, rel=1e-12)  # mean squared difference 1
    correlated = torch.stack([H[:, 0], H[:, 0]], dim=1)  # both dimensions equal: Cov = [[4/3, 4/3], [4/3, 4/3]]
    assert vicreg_loss(correlated, correlated, 0, 0, 1).item() == pytest.approx(2 * (2 * (4 / 3) ** 2) / 2, rel=1e-12)
    assert std > 1


# --- Sinkhorn-Knopp --------------------------------------------------------------------------------------------

def official_sinkhorn(out, epsilon=0.05, iterations=3):
    """facebookresearch/swav main_swav.py `distributed_sinkhorn` on one process, term by term (no max subtraction)."""
    q = torch.exp(out / epsilon).t()
    b, k = q.shape[1], q.shape[0]
    q /= torch.sum(q)
    for _ in range(iterations):
        q /= torch.sum(q, dim=1, keepdim=True)
        q /= k
        q /= torch.sum(q, dim=0, keepdim=True)
        q /= b
    q *= b
    return q.t()


def test_sinkhorn_codes_sum_to_one_per_sample_and_to_uniform_prototype_masses_up_to_three_iterations():
    scores = F.normalize(randn(7, 64, 128), dim=1) @ F.normalize(randn(8, 16, 128), dim=1).T  # cosine scores, B=64, K=16
    codes = sinkhorn_knopp(scores)
    torch.testing.assert_close(codes.sum(dim=1), torch.ones(64, dtype=f64), rtol=0, atol=1e-12)
    masses = codes.sum(dim=0) / (64 / 16)  # 1 for a uniform marginal
    assert (masses - 1).abs().max() < 0.05
    assert (sinkhorn_knopp(scores, iterations=30).sum(dim=0) / 4 - 1).abs().max() < (masses - 1).abs().max() / 10


def test_sinkhorn_equals_the_official_iterations_and_ignores_a_constant_shift():
    scores = F.normalize(randn(9, 24, 32), dim=1) @ F.normalize(randn(10, 10, 32), dim=1).T
    expected = official_sinkhorn(scores.clone())
    torch.testing.assert_close(sinkhorn_knopp(scores), expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(sinkhorn_knopp(scores + 0.7), expected, rtol=1e-12, atol=1e-15)
    assert torch.equal(sinkhorn_knopp(torch.zeros(4, 5, dtype=f64)), torch.full((4, 5), 0.2, dtype=f64))


def test_sinkhorn_stays_finite_where_the_plain_exponential_overflows():
    scores = torch.tensor([[1.0, -1.0], [-1.0, 1.0]]) * 10  # exp(10 / 0.05) overflows float32
    assert not torch.isfinite(official_sinkhorn(scores.clone())).all()
    torch.testing.assert_close(sinkhorn_knopp(scores), torch.eye(2), rtol=0, atol=1e-6)


# --- SwAV and DINO ---------------------------------------------------------------------------------------------

def official_swav(scores, codes, temperature):
    """facebookresearch/swav main_swav.py's loop over crops_for_assign and the other crops."""
    loss = 0
    for i in range(codes.shape[0]):
        subloss = 0
        for v in [v for v in range(scores.shape[0]) if v != i]:
            subloss -= torch.mean(torch.sum(codes[i] * F.log_softmax(scores[v] / temperature, dim=1), dim=1))
        loss += subloss / (scores.shape[0] - 1)
    return loss / codes.shape[0]


def official_dino(student, teacher, center, student_temp, teacher_temp):
    """facebookresearch/dino main_dino.py `DINOLoss.forward`, term by term."""
    student_out = (student / student_temp).unbind(0)
    teacher_out = F.softmax((teacher - center) / teacher_temp, dim=-1).unbind(0)
    total, terms = 0, 0
    for iq, q in enumerate(teacher_out):
        for v in range(len(student_out)):
            if v != iq:
                total += torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1).mean()
                terms += 1
    return total / terms


def test_swav_loss_equals_its_official_loop_and_trains_only_the_scores():
    scores = torch.tanh(randn(11, 5, 8, 6)).requires_grad_()  # 2 global + 3 local crops, B=8, K=6
    codes = torch.stack([sinkhorn_knopp(scores[i].detach()) for i in range(2)]).requires_grad_()
    loss = swav_loss(scores, codes, 0.1)
    torch.testing.assert_close(loss, official_swav(scores, codes, 0.1), rtol=1e-12, atol=0)
    loss.backward()
    assert codes.grad is None and scores.grad.abs().sum() > 0


def test_swav_loss_of_two_crops_is_the_cross_entropy_of_each_code_under_the_other_crop():
    scores = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=f64)  # one image, two crops, two prototypes
    codes = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=f64)  # crop 0 codes prototype 0, crop 1 prototype 1
    # crop 1 predicts prototype 0 with softmax([0, 10])_0 and crop 0 prototype 1 with softmax([10, 0])_1: both log(1 + e^10)
    assert swav_loss(scores, codes, 0.1).item() == pytest.approx(math.log1p(math.exp(10)), rel=1e-12)


def test_dino_loss_with_the_teacher_equal_to_the_student_and_no_centre_is_the_students_entropy():
    logits = randn(12, 4, 10)
    student = torch.stack([logits, logits])  # two global crops of identical logits
    probs = (logits / 0.1).softmax(dim=-1)
    entropy = -(probs * probs.log()).sum(dim=-1).mean()
    loss = dino_loss(student, student.clone(), torch.zeros(1, 10, dtype=f64), 0.1, 0.1)
    torch.testing.assert_close(loss, entropy, rtol=1e-12, atol=0)


def test_dino_loss_equals_its_official_loop_with_a_centre_and_trains_only_the_student():
    student = randn(13, 6, 4, 10).requires_grad_()  # 2 global + 4 local crops
    teacher = randn(14, 2, 4, 10).requires_grad_()
    center = randn(15, 1, 10)
    loss = dino_loss(student, teacher, center, 0.1, 0.04)
    torch.testing.assert_close(loss, official_dino(student, teacher, center, 0.1, 0.04), rtol=1e-12, atol=0)
    shift = randn(16, 1, 10)  # centring: moving teacher and centre together changes nothing
    torch.testing.assert_close(dino_loss(student, teacher + shift, center + shift, 0.1, 0.04), loss, rtol=1e-12, atol=0)
    loss.backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "loss, inputs",
    [
        (lambda z1, z2: barlow_twins_loss(z1, z2, 0.3), (randn(17, 6, 3), randn(18, 6, 3))),
        (lambda z1, z2: vicreg_loss(z1, z2), (randn(19, 6, 3), 0.5 * randn(20, 6, 3))),
        (lambda scores: swav_loss(scores, sinkhorn_knopp(randn(21, 4, 3)).view(2, 2, 3), 0.5), (randn(21, 3, 2, 3),)),
        (lambda student: dino_loss(student, randn(22, 2, 2, 3), randn(23, 1, 3), 0.5, 0.3), (randn(24, 3, 2, 3),)),
    ],
    ids=["barlow_twins", "vicreg", "swav", "dino"],
)
def test_gradcheck_in_float64(loss, inputs):
    assert torch.autograd.gradcheck(loss, tuple(x.requires_grad_() for x in inputs))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: barlow_twins_loss(H, H[:3]), r"^z2 must have shape \(4, 2\), got \(3, 2\)"),
        (lambda: vicreg_loss(H[:1], H[:1]), "^z1 must hold at least 2 embeddings"),
        (lambda: barlow_twins_loss(H, H, off_diagonal_weight=-1.0), "^off_diagonal_weight must be >= 0, got -1.0"),
        (lambda: vicreg_loss(H, H, epsilon=0.0), "^epsilon must be > 0, got 0.0"),
        (lambda: sinkhorn_knopp(H, iterations=0), "^sinkhorn_iterations must be >= 1, got 0"),
        (lambda: swav_loss(randn(0, 2, 4, 3), randn(1, 3, 4, 3)), "^scores must hold at least 2 crops and codes 1 to as many, got 2 and 3"),
        (lambda: swav_loss(randn(0, 3, 4, 3), randn(1, 2, 4, 2)), r"^codes must have shape \(\*, 4, 3\)"),
        (lambda: dino_loss(randn(0, 3, 4, 3), randn(1, 2, 4, 3), torch.zeros(3, dtype=f64)), r"^center must have shape \(1, 3\)"),
        (lambda: dino_loss(randn(0, 3, 4, 3), randn(1, 2, 4, 3), torch.zeros(1, 3, dtype=f64), teacher_temperature=0.0), "^teacher_temperature must be > 0"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bf16_autocast_gives_finite_float32_values():
    z = torch.randn(8, 4)
    scores = torch.tanh(torch.randn(3, 8, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = [barlow_twins_loss(z.bfloat16(), z.bfloat16() + 0.1), vicreg_loss(z.bfloat16(), z.bfloat16()),
                  swav_loss(scores.bfloat16(), sinkhorn_knopp(scores[:2].flatten(0, 1).bfloat16()).view(2, 8, 6), 0.1),
                  dino_loss(scores.bfloat16(), scores[:2].bfloat16(), torch.zeros(1, 6), 0.1, 0.04)]  # fmt: skip
    assert all(value.dtype == torch.float32 and torch.isfinite(value) for value in values)
