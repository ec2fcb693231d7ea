"""The losses of BYOL, SimSiam, MoCo v3 and NNCLR (methods/losses/predictive.py, contrastive.py): hand-computed values,
the official formulas written out as their repositories compute them, and the identities of issue 33."""

import math

import pytest
import torch
import torch.nn.functional as F

from methods.losses import byol_loss, mocov3_loss, nnclr_loss, simsiam_loss

f64 = torch.float64


def unit(generator, *shape, dtype=f64):
    return F.normalize(torch.randn(*shape, generator=generator, dtype=dtype), dim=-1)


def official_byol(p1, p2, z1, z2):
    """deepmind-research byol/utils/helpers.py `regression_loss` (l2-normalise with rsqrt(max(sum x^2, 1e-12)), squared
    distance summed over features), both view orders added, mean over the batch (byol/byol_experiment.py)."""
    normalise = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True).clamp(min=1e-12))  # noqa: E731
    regression = lambda x, y: ((normalise(x) - normalise(y)) ** 2).sum(-1)  # noqa: E731
    return (regression(p1, z2.detach()) + regression(p2, z1.detach())).mean()


def official_simsiam(p1, p2, z1, z2):
    """facebookresearch/simsiam main_simsiam.py: -(cos(p1, z2).mean() + cos(p2, z1).mean()) * 0.5, z detached by the model."""
    cosine = torch.nn.CosineSimilarity(dim=1)
    return -(cosine(p1, z2.detach()).mean() + cosine(p2, z1.detach()).mean()) * 0.5


def official_mocov3(q, k, temperature, rank=0):
    """facebookresearch/moco-v3 moco/builder.py `contrastive_loss`, with the gathered keys `k` given."""
    q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
    logits = torch.einsum("nc,mc->nm", q, k) / temperature
    labels = torch.arange(len(q)) + len(q) * rank
    return F.cross_entropy(logits, labels) * (2 * temperature)


def test_byol_hand_computed_value_and_zero_when_prediction_and_target_agree():
    p1 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    p2 = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    t1 = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    t2 = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    # image 0: both predictions equal their targets -> 0; image 1: (2 - 2 * 0.6) + (2 + 2) = 4.8
    assert byol_loss(p1, p2, t1, t2).item() == pytest.approx(2.4)
    assert byol_loss(p1[:1], p2[:1], t1[:1], t2[:1]).item() == 0.0
    assert byol_loss(p1, p1, -p1, -p1).item() == pytest.approx(8.0)  # the maximum: opposite directions


def test_byol_equals_the_official_regression_loss_on_unnormalised_outputs():
    g = torch.Generator().manual_seed(0)
    p1, p2, z1, z2 = (torch.randn(6, 5, generator=g, dtype=f64) * 3 for _ in range(4))
    ours = byol_loss(*(F.normalize(x, dim=1) for x in (p1, p2, z1, z2)))
    torch.testing.assert_close(ours, official_byol(p1, p2, z1, z2), rtol=1e-12, atol=1e-12)


def test_simsiam_is_minus_one_at_perfect_alignment_and_equals_the_official_criterion():
    g = torch.Generator().manual_seed(1)
    z1, z2 = unit(g, 5, 7), unit(g, 5, 7)
    assert simsiam_loss(z2, z1, z1, z2).item() == pytest.approx(-1.0, abs=1e-12)
    assert simsiam_loss(z2, z1, -z1, -z2).item() == pytest.approx(1.0, abs=1e-12)
    p1, p2, y1, y2 = (torch.randn(5, 7, generator=g, dtype=f64) * 2 for _ in range(4))
    ours = simsiam_loss(*(F.normalize(x, dim=1) for x in (p1, p2, y1, y2)))
    torch.testing.assert_close(ours, official_simsiam(p1, p2, y1, y2), rtol=1e-12, atol=1e-12)


def test_byol_is_four_plus_four_times_simsiam_on_the_same_pairs():
    g = torch.Generator().manual_seed(2)
    p1, p2, z1, z2 = (unit(g, 4, 3) for _ in range(4))
    torch.testing.assert_close(byol_loss(p1, p2, z1, z2), 4 + 4 * simsiam_loss(p1, p2, z1, z2))


@pytest.mark.parametrize("loss", [byol_loss, simsiam_loss])
def test_the_targets_of_byol_and_simsiam_get_no_gradient_and_the_predictions_do(loss):
    g = torch.Generator().manual_seed(3)
    p1, p2, z1, z2 = (unit(g, 4, 3).requires_grad_() for _ in range(4))
    loss(p1, p2, z1, z2).backward()
    assert z1.grad is None and z2.grad is None
    assert p1.grad.abs().sum() > 0 and p2.grad.abs().sum() > 0


def test_mocov3_hand_computed_value_keeps_the_factor_two_tau():
    q = k = torch.eye(2, dtype=torch.float64)
    # logits [[4, 0], [0, 4]] at tau 0.25: CE per row log(1 + e^-4), times 2 tau = 0.5
    assert mocov3_loss(q, k, 0.25).item() == pytest.approx(0.5 * math.log(1 + math.exp(-4)))


def test_mocov3_with_one_positive_per_row_is_two_tau_times_cross_entropy_on_the_logits_as_the_official_function():
    g = torch.Generator().manual_seed(4)
    q, k = unit(g, 6, 8), unit(g, 6, 8)
    expected = 2 * 0.2 * F.cross_entropy(q @ k.T / 0.2, torch.arange(6))
    torch.testing.assert_close(mocov3_loss(q, k, 0.2), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mocov3_loss(q, k, 0.2), official_mocov3(q, k, 0.2), rtol=1e-12, atol=1e-12)


def test_mocov3_per_process_terms_against_the_gathered_keys_average_to_the_global_batch_loss():
    g = torch.Generator().manual_seed(5)
    q, k = unit(g, 6, 8), unit(g, 6, 8)
    per_process = [mocov3_loss(q[3 * rank : 3 * rank + 3], k, 1.0, positive_offset=3 * rank) for rank in (0, 1)]
    torch.testing.assert_close(sum(per_process) / 2, mocov3_loss(q, k, 1.0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per_process[1], official_mocov3(q[3:], k, 1.0, rank=1), rtol=1e-12, atol=1e-12)


def test_nnclr_hand_computed_value_with_the_nearest_neighbour_as_the_anchor():
    support = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    projection = torch.tensor([[0.8, 0.6], [0.28, -0.96]])  # both nearest to (1, 0)
    predictions = torch.eye(2)
    # row 0: logits [1, 0], positive 0 -> log(1 + e^-1); row 1: logits [1, 0], positive 1 -> log(1 + e)
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2
    assert nnclr_loss(projection, predictions, support, 1.0).item() == pytest.approx(expected)


def test_nnclr_with_each_projection_in_the_support_set_is_infonce_of_the_projection_against_the_predictions():
    g = torch.Generator().manual_seed(6)
    z, p, others = unit(g, 5, 8), unit(g, 5, 8), unit(g, 7, 8)
    support = torch.cat([others, z])  # every z_i is its own nearest neighbour
    torch.testing.assert_close(nnclr_loss(z, p, support, 0.1), F.cross_entropy(z @ p.T / 0.1, torch.arange(5)), rtol=1e-12, atol=1e-12)


def test_nnclr_trains_the_predictions_only_and_per_process_terms_average_to_the_global_batch_loss():
    g = torch.Generator().manual_seed(7)
    z, p, support = unit(g, 6, 8).requires_grad_(), unit(g, 6, 8).requires_grad_(), unit(g, 16, 8).requires_grad_()
    nnclr_loss(z, p, support, 0.2).backward()
    assert z.grad is None and support.grad is None and p.grad.abs().sum() > 0
    with torch.no_grad():
        per_process = [nnclr_loss(z[3 * rank : 3 * rank + 3], p, support, 0.2, positive_offset=3 * rank) for rank in (0, 1)]
        torch.testing.assert_close(sum(per_process) / 2, nnclr_loss(z, p, support, 0.2), rtol=1e-12, atol=1e-12)


def differentiable_cases(dtype):
    """name: (the loss of its differentiable inputs, those inputs), the fixed inputs in `dtype`."""
    g = torch.Generator().manual_seed(8)
    z1, z2, p1, p2, support = (unit(g, rows, 4, dtype=dtype) for rows in (3, 3, 3, 3, 5))
    return {
        "byol": (lambda p1, p2: byol_loss(p1, p2, z1, z2), (p1, p2)),
        "simsiam": (lambda p1, p2: simsiam_loss(p1, p2, z1, z2), (p1, p2)),
        "mocov3": (lambda q, k: mocov3_loss(q, k, 0.2), (p1, z2)),
        "nnclr": (lambda p: nnclr_loss(z1, p, support, 0.2), (p2,)),
    }


@pytest.mark.parametrize("name", ["byol", "simsiam", "mocov3", "nnclr"])
def test_gradcheck_in_float64_and_bf16_autocast_gives_a_finite_float32_value(name):
    loss, inputs = differentiable_cases(f64)[name]
    assert torch.autograd.gradcheck(loss, tuple(x.requires_grad_() for x in inputs))
    loss, inputs = differentiable_cases(torch.float32)[name]
    leaves = [x.requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(*(x.to(torch.bfloat16) for x in leaves))
    assert value.dtype == torch.float32 and torch.isfinite(value)


Z = F.normalize(torch.randn(4, 8, generator=torch.Generator().manual_seed(9)), dim=1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: byol_loss(Z, Z, Z, Z[:3]), r"target2 must have shape \(4, 8\), got \(3, 8\)"),
        (lambda: simsiam_loss(Z, Z[:, :5], Z, Z), r"prediction2 must have shape \(4, 8\), got \(4, 5\)"),
        (lambda: mocov3_loss(Z, Z[:, :5], 0.2), r"keys must have shape \(\*, 8\), got \(4, 5\)"),
        (lambda: mocov3_loss(Z, Z, 0.0), "temperature must be > 0, got 0.0"),
        (lambda: mocov3_loss(Z[:2], Z, 0.2, positive_offset=3), r"positive_offset must lie in \[0, 2\] \(2 rows, 4 columns\), got 3"),
        (lambda: nnclr_loss(Z, Z, Z[:, :5], 0.2), r"support must have shape \(\*, 8\), got \(4, 5\)"),
        (lambda: nnclr_loss(Z, Z, Z, -0.1), "temperature must be > 0, got -0.1"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()
