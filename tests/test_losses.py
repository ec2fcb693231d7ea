"""Tests of methods/losses.py: hand-computed reference cases, cross-loss identities, gradients, numerics, validation.

The reference cases (S1, S2, H1, T1, T2, P1, ...) were computed for this project with an independent NumPy
re-implementation of each paper's formula and cross-checked by a second formulation or finite differences; the
identities are derived from the losses' definitions.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.memory import LargestTensor
from methods.losses import (
    check_hyperparameters,
    contrastive_loss,
    info_nce,
    jcl_loss,
    nt_xent,
    paco_loss,
    ressl_loss,
    sce_loss,
    supcon_loss,
    tcl_loss,
)

f64 = torch.float64


def unit(gen, *shape, dtype=f64):
    return F.normalize(torch.randn(*shape, generator=gen, dtype=dtype), dim=-1)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def assert_close(actual, expected, tol=1e-6):
    actual, expected = torch.as_tensor(actual, dtype=f64), torch.as_tensor(expected, dtype=f64)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=0)


# --- reference cases --------------------------------------------------------------------------------------

# reference case S1: B=4, V=2, d=3, labels (0, 1, 0, 1); features[b, v]
S1 = F.normalize(
    torch.tensor(
        [
            [[1, 0, 0], [0.8, 0.6, 0]],
            [[0, 1, 0], [0, 0.6, 0.8]],
            [[0.6, 0, 0.8], [1, 1, 0]],
            [[0, 0, 1], [1, 0, 1]],
        ],
        dtype=f64,
    ),
    dim=-1,
)
S1_LABELS = torch.tensor([0, 1, 0, 1])
# hand case H1: one view, z = (1,0), (1,0), (-1,0), (-1,0), labels (0, 0, 1, 1)
H1 = torch.tensor([[[1.0, 0]], [[1.0, 0]], [[-1.0, 0]], [[-1.0, 0]]], dtype=f64)
H1_LABELS = torch.tensor([0, 0, 1, 1])
# reference cases S2 / T2: every view of every sample is the same unit vector
S2 = F.normalize(torch.ones(4, 2, 3, dtype=f64), dim=-1)


def paco_p1():
    """Reference case P1: B=2, K=4, d=2, C=3."""
    s = 1 / math.sqrt(2)
    return dict(
        query=torch.tensor([[1.0, 0], [0.6, 0.8]], dtype=f64),
        key=torch.tensor([[0.8, 0.6], [0.0, 1]], dtype=f64),
        queue=torch.tensor([[s, s], [-1.0, 0], [0, -1.0], [s, -s]], dtype=f64),
        labels=torch.tensor([0, 1]),
        queue_labels=torch.tensor([0, 1, 2, 0]),
        center_logits=torch.tensor([[2.0, 0.5, -1.0], [0.1, 1.5, 0.3]], dtype=f64),
    )


P1_PRIOR = torch.tensor([100.0, 20, 5], dtype=f64) / 125


# --- SupCon -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature, base_temperature, contrast_mode, labels, expected",
    [
        (0.1, 0.07, "all", S1_LABELS, 5.2227964),
        (0.1, 0.1, "all", S1_LABELS, 3.6559575),
        (0.5, 0.5, "all", S1_LABELS, 1.9356808),
        (0.1, 0.1, "one", S1_LABELS, 4.0382162),
        (0.5, 0.5, "all", None, 1.7823475),
    ],
)
def test_supcon_reproduces_reference_case_s1(temperature, base_temperature, contrast_mode, labels, expected):
    assert_close(supcon_loss(S1, labels, temperature, base_temperature, contrast_mode), expected)


def test_supcon_reproduces_hand_cases_h1_and_s2():
    assert_close(supcon_loss(H1, H1_LABELS, 1.0, 1.0), math.log(1 + 2 * math.exp(-2)))
    assert_close(supcon_loss(S2, torch.tensor([0, 1, 0, 1]), 0.1, 0.07), 2.7798716)


def test_supcon_anchor_without_positive_contributes_zero_and_counts_in_mean():
    z = F.normalize(torch.tensor([[1.0, 0], [0, 1], [1, 1], [-1, 0.5]], dtype=f64), dim=-1)
    assert_close(supcon_loss(z[:, None], torch.tensor([0, 1, 1, 2]), 0.5, 0.5), 0.3410698)


def test_supcon_is_invariant_to_rotation_and_sample_permutation():
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, generator=gen(1), dtype=f64))
    perm = torch.tensor([2, 0, 3, 1])
    assert_close(supcon_loss(S1 @ rotation, S1_LABELS, 0.1, 0.07), 5.2227964)
    assert_close(supcon_loss(S1[perm], S1_LABELS[perm], 0.1, 0.07), 5.2227964)


def test_supcon_without_labels_and_two_views_equals_nt_xent():
    z1, z2 = unit(gen(2), 6, 5), unit(gen(3), 6, 5)
    assert_close(supcon_loss(torch.stack([z1, z2], 1), None, 0.3, 0.3), nt_xent(z1, z2, 0.3), tol=1e-12)


# --- SimCLR NT-Xent ---------------------------------------------------------------------------------------


def test_nt_xent_is_half_of_simclr_official_two_direction_sum():
    """google-research/simclr add_contrastive_loss: CE over [ab, aa - 1e9 I] plus CE over [ba, bb - 1e9 I]."""
    h1, h2, tau = unit(gen(4), 5, 8), unit(gen(5), 5, 8), 0.2
    eye, target = torch.eye(5, dtype=f64), torch.arange(5)
    aa, bb = h1 @ h1.T / tau - 1e9 * eye, h2 @ h2.T / tau - 1e9 * eye
    ab, ba = h1 @ h2.T / tau, h2 @ h1.T / tau
    official = F.cross_entropy(torch.cat([ab, aa], 1), target) + F.cross_entropy(torch.cat([ba, bb], 1), target)
    assert_close(2 * nt_xent(h1, h2, tau), official, tol=1e-12)


def test_nt_xent_reproduces_the_simclr_reference_case():
    assert_close(nt_xent(S1[:, 0], S1[:, 1], 0.5), 1.7823475)


# --- TCL --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k1, k2, expected",
    [(5000.0, 1.0, 4.4015279), (4000.0, 1.0, 4.3028799), (1.0, 1.5, 3.8471147), (0.0, 1.0, 3.6559575)],
)
def test_tcl_reproduces_reference_case_t1(k1, k2, expected):
    assert_close(tcl_loss(S1, S1_LABELS, 0.1, k1, k2), expected)


def test_tcl_reproduces_hand_cases_h1_and_t2():
    assert_close(tcl_loss(H1, H1_LABELS, 1.0, 5000.0, 1.0), 6.5190692)
    assert_close(tcl_loss(H1, H1_LABELS, 0.1, 5000.0, 1.0), 0.0802044)
    assert_close(tcl_loss(S2, torch.tensor([0, 1, 0, 1]), 0.1, 5000.0, 1.0), 1.9810740)


def test_tcl_with_k1_zero_equals_supcon_times_base_over_temperature():
    features, labels = unit(gen(6), 7, 3, 5), torch.tensor([0, 0, 0, 1, 1, 2, 3])  # unequal class sizes
    supcon = supcon_loss(features, labels, temperature=0.2, base_temperature=0.07)
    assert_close(tcl_loss(features, labels, 0.2, k1=0.0, k2=1.0), supcon * 0.07 / 0.2, tol=1e-12)


def lemma_2_coefficients(z, labels, tau, k1, k2):
    """G[i, j] = dL_i/ds_ij from Lemma 2 of TCL supplementary, Sec. 1, so that dL_i/dz_i = G[i] @ z."""
    s = z @ z.T
    same = labels[:, None] == labels[None, :]
    pos, neg = same & ~torch.eye(len(z), dtype=torch.bool), ~same
    e, e_neg = torch.exp(s / tau), torch.exp(-s)
    d1, d2, d3 = ((x * mask).sum(1, keepdim=True) for x, mask in [(e, pos), (e_neg, pos), (e, neg)])
    denominator = d1 + k1 * d2 + k2 * d3  # TCL supplementary, Eqs. (19)-(22)
    p_pos, y_pos, p_neg = e / denominator, tau * k1 * e_neg / denominator, k2 * e / denominator
    x = 1.0 / pos.sum(1, keepdim=True).to(z.dtype)
    return (pos * (p_pos - x - y_pos) + neg * p_neg) / tau


def test_tcl_gradient_equals_lemma_2():
    z = S1.transpose(0, 1).reshape(8, 3)
    labels = S1_LABELS.repeat(2)
    g = lemma_2_coefficients(z, labels, 0.1, 5000.0, 1.0)
    assert_close(g[0] @ z, [-4.164806, -2.604061, -1.956292])  # reference case T3 (TCL's Lemma 2 gradient, checked by finite differences)

    for features, sample_labels in [(S1, S1_LABELS), (unit(gen(7), 6, 2, 4), torch.tensor([0, 0, 0, 1, 1, 2]))]:
        features = features.clone().requires_grad_()
        tcl_loss(features, sample_labels, 0.1, 5000.0, 1.0).backward()
        batch, views, dim = features.shape
        z = features.detach().transpose(0, 1).reshape(-1, dim)
        g = lemma_2_coefficients(z, sample_labels.repeat(views), 0.1, 5000.0, 1.0)
        # s_ij = z_i.z_j, so the gradient of the mean is (G + G^T) z / N: anchor and contrast roles
        expected = (g + g.T) @ z / len(z)
        assert_close(features.grad.transpose(0, 1).reshape(-1, dim), expected, tol=1e-10)


def test_supcon_gradient_matches_supplement_formula():
    """With k1 = 0 and k2 = 1, Lemma 2 is SupCon's gradient (P_ip - X_ip on positives, P_in on negatives)."""
    z, labels = S1.transpose(0, 1).reshape(8, 3), S1_LABELS.repeat(2)
    g = lemma_2_coefficients(z, labels, 0.1, 0.0, 1.0)
    assert_close(g[0] @ z, [0.450673, 0.210438, -0.651595])  # reference case S1, anchor 0 (checked by finite differences)
    features = S1.clone().requires_grad_()
    supcon_loss(features, S1_LABELS, 0.1, 0.1).backward()
    assert_close(features.grad.transpose(0, 1).reshape(8, 3), (g + g.T) @ z / 8, tol=1e-10)


# --- PaCo -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alpha, gamma, temperature, prior, expected",
    [
        (0.05, 1.0, 0.2, P1_PRIOR, 4.539350),
        (1.0, 1.0, 0.07, P1_PRIOR, 8.691533),
        (0.05, 0.5, 0.2, P1_PRIOR, 3.868655),
        (0.05, 1.0, 0.2, None, 3.627559),
        (0.05, 1.0, 0.2, torch.full((3,), 1 / 3, dtype=f64), 4.577149),
        (0.0, 0.0, 0.2, P1_PRIOR, 0.4412716),
    ],
)
def test_paco_reproduces_reference_case_p1(alpha, gamma, temperature, prior, expected):
    loss = paco_loss(**paco_p1(), alpha=alpha, temperature=temperature, gamma=gamma, class_prior=prior)
    assert_close(loss, expected)


def test_paco_with_alpha_and_gamma_zero_equals_balanced_softmax_cross_entropy():
    g = gen(8)
    query, key, queue = unit(g, 6, 4), unit(g, 6, 4), unit(g, 10, 4)
    labels, queue_labels = torch.randint(0, 5, (6,), generator=g), torch.randint(0, 5, (10,), generator=g)
    center_logits = torch.randn(6, 5, generator=g, dtype=f64)
    prior = torch.rand(5, generator=g, dtype=f64)
    prior = prior / prior.sum()
    loss = paco_loss(query, key, queue, labels, queue_labels, center_logits, 0.0, 0.2, gamma=0.0, class_prior=prior)
    assert_close(loss, F.cross_entropy(center_logits + torch.log(prior + 1e-9), labels), tol=1e-12)


def test_paco_without_centres_is_the_mean_log_probability_of_the_positives_against_the_contrast_set():
    g = gen(9)
    query, key, queue = unit(g, 5, 4), unit(g, 5, 4), unit(g, 7, 4)
    labels, queue_labels = torch.randint(0, 3, (5,), generator=g), torch.randint(0, 3, (7,), generator=g)
    weights = torch.rand(5, generator=g, dtype=f64)
    loss = paco_loss(query, key, queue, labels, queue_labels, None, 1.0, 0.2, anchor_weights=weights)
    contrast, contrast_labels = torch.cat([query, key, queue]), torch.cat([labels, labels, queue_labels])
    expected = 0.0
    for i in range(5):
        others = [j for j in range(len(contrast)) if j != i]  # the anchor is never its own contrast
        log_prob = torch.log_softmax(query[i] @ contrast[others].T / 0.2, dim=0)
        positives = [n for n, j in enumerate(others) if contrast_labels[j] == labels[i]]
        expected += weights[i] * -log_prob[positives].mean() / 5
    assert_close(loss, expected, tol=1e-12)


def test_paco_class_prior_needs_centre_logits():
    inputs = paco_p1() | {"center_logits": None}
    with pytest.raises(ValueError, match="class_prior adjusts centre logits"):
        paco_loss(**inputs, alpha=0.05, temperature=0.2, class_prior=P1_PRIOR)


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_paco_center_gradient_is_p_minus_t_times_h(beta):
    inputs, alpha, tau = paco_p1(), 0.05, 0.2
    h = torch.tensor([[0.5, -0.2, 1.0], [1.2, 0.3, -0.4]], dtype=f64)
    weight = torch.tensor([[0.3, -0.1, 0.2], [-0.2, 0.4, 0.1], [0.05, 0.05, -0.3]], dtype=f64, requires_grad=True)
    bias = torch.tensor([0.1, -0.1, 0.0], dtype=f64)
    inputs["center_logits"] = (h @ weight.T + bias).detach().requires_grad_()
    paco_loss(**inputs, alpha=alpha, temperature=tau, beta=beta, class_prior=P1_PRIOR).backward()

    # p: softmax over [centre logits + log prior, contrast logits without self]; t: beta on own centre / (beta + alpha|P|)
    contrast = torch.cat([inputs["query"], inputs["key"], inputs["queue"]])
    contrast_labels = torch.cat([inputs["labels"], inputs["labels"], inputs["queue_labels"]])
    center = inputs["center_logits"].detach() + torch.log(P1_PRIOR + 1e-9)
    p = torch.empty_like(center)
    targets = torch.zeros_like(center)
    for i, y in enumerate(inputs["labels"]):
        others = torch.arange(len(contrast)) != i
        row = torch.cat([center[i], inputs["query"][i] @ contrast[others].T / tau])
        p[i] = row.softmax(0)[:3]
        targets[i, y] = beta / (beta + alpha * (contrast_labels[others] == y).sum().item())
    assert_close(inputs["center_logits"].grad, (p - targets) / 2, tol=1e-12)
    if beta == 1.0:
            assert_close(inputs["center_logits"].grad.T @ h, [[-0.213203, 0.086586, -0.431091],
                                                          [-0.545009, -0.136400, 0.182201],
                                                          [0.000137, 0.000001, 0.000074]])  # reference case P4: dL/dW (matches finite differences)


# --- SCE, ReSSL, MoCo InfoNCE -------------------------------------------------------------------------------


def moco_inputs(seed, batch=5, dim=8, queue_size=20):
    g = gen(seed)
    return unit(g, batch, dim), unit(g, batch, dim), unit(g, queue_size, dim)


def test_info_nce_is_cross_entropy_with_positive_in_column_zero():
    q, k, queue = moco_inputs(9)
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1) / 0.2
    assert_close(info_nce(q, k, queue, 0.2), F.cross_entropy(logits, torch.zeros(5, dtype=torch.long)), tol=1e-12)


@pytest.mark.parametrize("coeff", [0.0, 0.3, 1.0])
def test_sce_with_masked_target_satisfies_proposition_1(coeff):
    q, k, queue = moco_inputs(10)
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1) / 0.1
    ceil = -(logits[:, 1:].logsumexp(1) - logits.logsumexp(1)).mean()
    expected = coeff * info_nce(q, k, queue, 0.1) + (1 - coeff) * (ressl_loss(q, k, queue, 0.1, 0.05) + ceil)
    assert_close(sce_loss(q, k, queue, 0.1, 0.05, coeff, mask_positive_target=True), expected, tol=1e-12)


def test_sce_official_target_satisfies_generalised_identity():
    """With target mass s0 on the positive slot, the unmasked loss splits exactly."""
    q, k, queue = moco_inputs(11)
    coeff, tau, tau_m = 0.4, 0.1, 0.5  # a large tau_m makes s0 far from 0
    logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1) / tau
    log_p = logits.log_softmax(1)
    s0 = 1 / (1 + torch.exp(k @ queue.T / tau_m).sum(1))
    ressl = -((k @ queue.T / tau_m).softmax(1) * (q @ queue.T / tau).log_softmax(1)).sum(1)
    ceil = -(logits[:, 1:].logsumexp(1) - logits.logsumexp(1))
    expected = (-(coeff + (1 - coeff) * s0) * log_p[:, 0] + (1 - coeff) * (1 - s0) * (ressl + ceil)).mean()
    assert_close(sce_loss(q, k, queue, tau, tau_m, coeff), expected, tol=1e-12)


@pytest.mark.parametrize("mask_positive_target", [False, True])
def test_sce_with_coeff_one_equals_info_nce(mask_positive_target):
    q, k, queue = moco_inputs(12)
    assert_close(sce_loss(q, k, queue, 0.1, 0.05, 1.0, mask_positive_target), info_nce(q, k, queue, 0.1), tol=1e-12)


def test_sce_gradient_is_softmax_minus_target_and_target_gets_none():
    q, k, queue = (t.requires_grad_() for t in moco_inputs(13))
    coeff, tau, tau_m = 0.5, 0.1, 0.05
    sce_loss(q, k, queue, tau, tau_m, coeff).backward()
    with torch.no_grad():
        p = (torch.cat([(q * k).sum(1, keepdim=True), q @ queue.T], 1) / tau).softmax(1)
        w = (1 - coeff) * torch.cat([torch.zeros(5, 1, dtype=f64), k @ queue.T / tau_m], 1).softmax(1)
        w[:, 0] += coeff
        dlogit = (p - w) / tau / len(q)  # gradient w.r.t. the pre-temperature similarities
    assert_close(q.grad, dlogit[:, :1] * k + dlogit[:, 1:] @ queue, tol=1e-12)
    # k reaches the loss through q.k only: the target contributes no gradient
    assert_close(k.grad, dlogit[:, :1] * q, tol=1e-12)
    assert_close(queue.grad, dlogit[:, 1:].T @ q, tol=1e-12)


def test_ressl_with_uniform_target_is_logsumexp_minus_mean_logit():
    g = gen(14)
    q, queue = unit(g, 4, 4), F.pad(unit(g, 6, 3), (0, 1))  # queue orthogonal to e_4
    k = torch.tensor([[0, 0, 0, 1.0]], dtype=f64).expand(4, 4)
    logits = q @ queue.T / 0.1
    assert_close(ressl_loss(q, k, queue, 0.1, 0.04), (logits.logsumexp(1) - logits.mean(1)).mean(), tol=1e-12)


# --- JCL --------------------------------------------------------------------------------------------------


def jcl_inputs(seed, batch=3, positives=4, dim=6, queue_size=12):
    g = gen(seed)
    return unit(g, batch, dim), unit(g, batch, positives, dim), unit(g, queue_size, dim)


def test_jcl_equals_official_code_form_with_biased_full_covariance():
    q, keys, queue = jcl_inputs(15)
    lam, tau = 2.0, 0.2
    mu = keys.mean(1)
    sigma = torch.stack([torch.from_numpy(np.cov(k.numpy().T, bias=True)) for k in keys])
    sigma_prime = sigma * lam / tau  # moco_unlimit_key_default.py after the JCL issue #1 update
    quad = torch.einsum("bi,bij,bj->b", q, sigma_prime, q)
    l_pos = (q * mu).sum(1) + 0.5 * quad
    logits = torch.cat([l_pos[:, None], q @ queue.T], 1) / tau
    expected = F.cross_entropy(logits, torch.zeros(3, dtype=torch.long)) + 0.5 * quad.mean() / tau
    assert_close(jcl_loss(q, keys, queue, tau, lam), expected, tol=1e-12)


def test_jcl_without_spread_equals_info_nce_with_mean_key():
    q, keys, queue = jcl_inputs(16)
    identical = keys[:, :1].expand_as(keys)
    assert_close(jcl_loss(q, identical, queue, 0.2, 4.0), info_nce(q, keys[:, 0], queue, 0.2), tol=1e-12)
    assert_close(jcl_loss(q, keys[:, :1], queue, 0.2, 4.0), info_nce(q, keys[:, 0], queue, 0.2), tol=1e-12)
    assert_close(jcl_loss(q, keys, queue, 0.2, 0.0), info_nce(q, keys.mean(1), queue, 0.2), tol=1e-12)


def test_jcl_closed_form_agrees_with_monte_carlo_over_gaussian_keys():
    q, keys, queue = jcl_inputs(17, batch=2, positives=4, dim=8, queue_size=16)
    tau, samples = 0.5, 400_000
    g = gen(18)
    estimates, errors, vanilla = [], [], []
    for qi, ki in zip(q, keys):
        mu, centred = ki.mean(0), ki - ki.mean(0)
        # k = mu + centred^T eps / sqrt(M) has covariance centred^T centred / M: the biased covariance
        sampled = mu + torch.randn(samples, len(ki), generator=g, dtype=f64) @ centred / math.sqrt(len(ki))
        pos = torch.exp(sampled @ qi / tau)
        neg = torch.exp(queue @ qi / tau).sum()
        estimates.append(torch.log(pos.mean() + neg) - mu @ qi / tau)
        errors.append(pos.std() / math.sqrt(samples) / (pos.mean() + neg))  # delta method
        vanilla.append((torch.log(pos + neg) - torch.log(pos)).mean())
    closed_form = jcl_loss(q, keys, queue, tau, lam=1.0)
    assert abs(closed_form - torch.stack(estimates).mean()) < 4 * torch.stack(errors).mean()
    assert torch.stack(vanilla).mean() <= closed_form  # Jensen: E log <= log E


# --- Wang & Liu ordinary / hard contrastive loss -----------------------------------------------------------


@pytest.mark.parametrize("num_hard", [None, 1, 4])
@pytest.mark.parametrize("excluded_per_anchor", [0, 1, 2])
def test_contrastive_loss_keeps_positive_and_n_hardest_negatives(num_hard, excluded_per_anchor):
    g = gen(19)
    q, pos, bank = unit(g, 5, 6), unit(g, 5, 6), unit(g, 9, 6)
    exclude = torch.randint(0, 9, (5, excluded_per_anchor), generator=g) if excluded_per_anchor else None
    expected = []
    for i in range(5):
        keep = torch.ones(9, dtype=torch.bool)
        if exclude is not None:
            keep[exclude[i]] = False
        negatives = (bank[keep] @ q[i] / 0.3).sort(descending=True).values[:num_hard]
        positive = pos[i] @ q[i] / 0.3
        expected.append(torch.cat([positive[None], negatives]).logsumexp(0) - positive)
    if excluded_per_anchor == 1:
        exclude = exclude[:, 0]  # one row per anchor may also be given as a (B,) vector
    assert_close(contrastive_loss(q, pos, bank, 0.3, num_hard, exclude), torch.stack(expected).mean(), tol=1e-12)


def test_hard_loss_with_num_hard_at_least_bank_size_equals_ordinary_loss():
    q, pos, bank = moco_inputs(20)
    ordinary = contrastive_loss(q, pos, bank, 0.5)
    assert_close(contrastive_loss(q, pos, bank, 0.5, num_hard=len(bank)), ordinary, tol=1e-12)
    assert_close(contrastive_loss(q, pos, bank, 0.5, num_hard=len(bank) + 3), ordinary, tol=1e-12)


def test_guarded_contrastive_loss_scales_the_gradient_by_p_over_p_plus_eps():
    q, pos, bank = moco_inputs(21)
    q.requires_grad_(True)
    plain = contrastive_loss(q, pos, bank, 0.05)
    (plain_grad,) = torch.autograd.grad(plain, q)
    guarded = contrastive_loss(q, pos, bank, 0.05, log_eps=0.01)
    (guarded_grad,) = torch.autograd.grad(guarded, q)
    positive = (q * pos).sum(1) / 0.05
    p = torch.exp(positive - torch.cat([positive[:, None], q @ bank.T / 0.05], 1).logsumexp(1))
    assert_close(guarded, -(p + 0.01).log().mean(), tol=1e-12)
    assert_close(guarded_grad, plain_grad * (p / (p + 0.01))[:, None], tol=1e-12)
    assert not torch.allclose(guarded_grad, plain_grad)


def negative_penalty(query, positive, bank, tau):
    """Wang & Liu's r_i: the share of each negative in the gradient (|dL/ds_ij| is proportional to ||dL/dn_j||)."""
    bank = bank.clone().requires_grad_()
    positive = positive.clone().requires_grad_()
    contrastive_loss(query, positive, bank, tau).backward()
    return bank.grad.norm(dim=1), positive.grad.norm(dim=1)


def test_negative_penalty_entropy_increases_with_temperature():
    g = gen(21)
    q, pos, bank = unit(g, 1, 6), unit(g, 1, 6), unit(g, 12, 6)
    entropies = []
    for tau in [0.05, 0.1, 0.2, 0.5, 1.0, 2.0]:
        penalty, _ = negative_penalty(q, pos, bank, tau)
        r = penalty / penalty.sum()
        entropies.append(-(r * r.log()).sum().item())
    assert all(a < b for a, b in zip(entropies, entropies[1:])), entropies


def test_positive_gradient_balances_sum_of_negative_gradients():
    g = gen(22)
    q, pos, bank = unit(g, 1, 6), unit(g, 1, 6), unit(g, 12, 6)
    negative, positive = negative_penalty(q, pos, bank, 0.2)
    assert_close(negative.sum(), positive.sum(), tol=1e-12)


def test_contrastive_loss_tends_to_zero_margin_triplet_as_temperature_vanishes():
    q, pos, bank = moco_inputs(23)
    tau = 1e-3
    triplet = ((q @ bank.T).max(1).values - (q * pos).sum(1)).clamp_min(0).mean()
    assert abs(tau * contrastive_loss(q, pos, bank, tau) - triplet) < tau * math.log(len(bank) + 1)


# --- gradients, autocast and memory for every loss ----------------------------------------------------------


def loss_case(name, dtype=f64, batch=3, dim=4, queue_size=5, num_classes=3):
    """(loss of the differentiable inputs, differentiable inputs) for a small random problem."""
    g = gen(24)
    q, k = unit(g, batch, dim, dtype=dtype), unit(g, batch, dim, dtype=dtype)
    queue = unit(g, queue_size, dim, dtype=dtype)
    labels = torch.arange(batch) % num_classes
    if name == "info_nce":
        return lambda q, k, queue: info_nce(q, k, queue, 0.2), (q, k, queue)
    if name == "nt_xent":
        return lambda z1, z2: nt_xent(z1, z2, 0.5), (q, k)
    if name == "ressl":  # only the online side gets a gradient: the target is detached by design
        return lambda q: ressl_loss(q, k, queue, 0.1, 0.04), (q,)
    if name == "sce":
        return lambda q: sce_loss(q, k, queue, 0.1, 0.05, 0.5), (q,)
    if name == "supcon":
        return lambda f: supcon_loss(f, labels % 2, 0.1, 0.07), (unit(g, batch, 2, dim, dtype=dtype),)
    if name == "supcon_one":
        return lambda f: supcon_loss(f, None, 0.5, 0.5, "one"), (unit(g, batch, 2, dim, dtype=dtype),)
    if name == "tcl":
        return lambda f: tcl_loss(f, labels % 2, 0.05, 1e4, 1.2), (unit(g, batch, 2, dim, dtype=dtype),)
    if name == "paco":
        queue_labels = torch.arange(queue_size) % num_classes
        prior = torch.full((num_classes,), 1 / num_classes, dtype=dtype)
        centers = torch.randn(batch, num_classes, generator=g, dtype=dtype)

        def paco(q, k, queue, centers):
            return paco_loss(q, k, queue, labels, queue_labels, centers, 0.05, 0.2, class_prior=prior)

        return paco, (q, k, queue, centers)
    if name == "jcl":
        keys = unit(g, batch, 4, dim, dtype=dtype)
        return lambda q, keys, queue: jcl_loss(q, keys, queue, 0.2, 2.0), (q, keys, queue)
    if name == "contrastive_hard":
        exclude = torch.arange(batch) % queue_size
        return lambda q, p, bank: contrastive_loss(q, p, bank, 0.3, num_hard=2, exclude=exclude), (q, k, queue)
    raise KeyError(name)


LOSSES = ["info_nce", "nt_xent", "ressl", "sce", "supcon", "supcon_one", "tcl", "paco", "jcl", "contrastive_hard"]


@pytest.mark.parametrize("name", LOSSES)
def test_gradcheck_in_float64(name):
    loss, inputs = loss_case(name)
    assert torch.autograd.gradcheck(loss, tuple(x.requires_grad_() for x in inputs))


@pytest.mark.parametrize("name", LOSSES)
def test_bf16_autocast_gives_finite_float32_value_and_gradient(name):
    loss, inputs = loss_case(name, dtype=torch.float32, batch=8, dim=16, queue_size=64)
    leaves = [x.requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = loss(*(x.to(torch.bfloat16) for x in leaves))
    assert value.dtype == torch.float32 and value.ndim == 0 and torch.isfinite(value)
    value.backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


@pytest.mark.parametrize("name", LOSSES)
def test_no_loss_builds_a_tensor_beyond_its_inputs_or_logits(name):
    batch, queue_size, num_classes, dim = 4, 32, 3, 16
    loss, inputs = loss_case(name, torch.float32, batch, dim, queue_size, num_classes)
    leaves = [x.requires_grad_() for x in inputs]
    # the contrast set is at most (K + 2B) x D and the logits (2B anchors) x (C + 2B + K + 1);
    # a (B, K, D) or (B, D, D) tensor would exceed both
    bound = max((queue_size + 2 * batch) * dim, 2 * batch * (num_classes + 2 * batch + queue_size + 1))
    with LargestTensor() as tracker:
        loss(*leaves).backward()
    assert tracker.numel <= bound


# --- validation ---------------------------------------------------------------------------------------------

Q, K_, QUEUE = moco_inputs(25, batch=4, dim=8, queue_size=6)
P1 = paco_p1()


def paco(**overrides):
    """paco_loss on the P1 inputs with some arguments replaced."""
    return paco_loss(**{**P1, "alpha": 0.05, "temperature": 0.2, **overrides})


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: info_nce(Q, K_[:3], QUEUE, 0.2), "key"),
        (lambda: nt_xent(Q, K_[:, :5], 0.2), "z2"),
        (lambda: supcon_loss(Q, None), "features"),
        (lambda: supcon_loss(Q[:, None], torch.tensor([0, 1])), "labels"),
        (lambda: tcl_loss(Q[:, None], torch.tensor([0, 1, 0])), "labels"),
        (lambda: jcl_loss(Q, K_[:3, None], QUEUE, 0.2, 1.0), "keys"),
        (lambda: paco(center_logits=P1["center_logits"][:1]), "center_logits"),
        (lambda: contrastive_loss(Q, K_[:2], QUEUE, 0.2), "positive"),
    ],
)
def test_mismatched_shapes_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must have shape"):
        call()


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda bank: info_nce(Q, K_, bank, 0.2), "queue"),
        (lambda bank: ressl_loss(Q, K_, bank, 0.1, 0.04), "queue"),
        (lambda bank: sce_loss(Q, K_, bank, 0.1, 0.05, 0.5), "queue"),
        (lambda bank: jcl_loss(Q, K_[:, None], bank, 0.2, 1.0), "queue"),
        (lambda bank: contrastive_loss(Q, K_, bank, 0.2), "negatives"),
    ],
)
def test_queue_with_different_dimension_raises_value_error(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must have shape \(\*, 8\), got \(6, 4\)"):
        call(QUEUE[:, :4])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: paco(labels=torch.tensor([0, 3])), r"labels must lie in \[0, 3\), got 3"),
        (lambda: paco(queue_labels=torch.tensor([0, -1, 2, 0])), r"queue_labels must lie in \[0, 3\), got -1"),
        (
            lambda: contrastive_loss(Q, K_, QUEUE, 0.2, exclude=torch.tensor([0, 1, 6, 2])),
            r"exclude must lie in \[0, 6\), got 6",
        ),
        (lambda: supcon_loss(S1, S1_LABELS.double()), "labels must be an integer tensor"),
    ],
)
def test_labels_outside_range_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("bad", [0.0, -0.1])
@pytest.mark.parametrize(
    "call, name",
    [
        (lambda t: info_nce(Q, K_, QUEUE, t), "temperature"),
        (lambda t: nt_xent(Q, K_, t), "temperature"),
        (lambda t: ressl_loss(Q, K_, QUEUE, t, 0.04), "temperature"),
        (lambda t: ressl_loss(Q, K_, QUEUE, 0.1, t), "temperature_momentum"),
        (lambda t: sce_loss(Q, K_, QUEUE, 0.1, t, 0.5), "temperature_momentum"),
        (lambda t: supcon_loss(S1, S1_LABELS, t), "temperature"),
        (lambda t: supcon_loss(S1, S1_LABELS, 0.1, t), "base_temperature"),
        (lambda t: tcl_loss(S1, S1_LABELS, t), "temperature"),
        (lambda t: paco(temperature=t), "temperature"),
        (lambda t: jcl_loss(Q, K_[:, None], QUEUE, t, 1.0), "temperature"),
        (lambda t: contrastive_loss(Q, K_, QUEUE, t), "temperature"),
    ],
)
def test_non_positive_temperature_raises_value_error(call, name, bad):
    with pytest.raises(ValueError, match=rf"^{name} must be > 0, got {bad}"):
        call(bad)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sce_loss(Q, K_, QUEUE, 0.1, 0.05, 1.5), r"coeff must lie in \[0, 1\]"),
        (lambda: supcon_loss(S1, S1_LABELS, contrast_mode="two"), "contrast_mode must be 'all' or 'one'"),
        (lambda: tcl_loss(S1, S1_LABELS, k1=-1.0), "k1 must be >= 0"),
        (lambda: paco(alpha=-0.1), "alpha must be >= 0"),
        (lambda: paco(class_prior=torch.tensor([100.0, 20, 5], dtype=f64)), "class_prior must sum to 1"),
        (lambda: jcl_loss(Q, K_[:, None], QUEUE, 0.2, -1.0), "lam must be >= 0"),
        (lambda: contrastive_loss(Q, K_, QUEUE, 0.2, num_hard=0), "num_hard must be >= 1"),
    ],
)
def test_invalid_hyperparameters_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "method, name, bad, loss_call",
    [
        ("MoCoV2", "temperature", 0.0, lambda v: info_nce(Q, K_, QUEUE, v)),
        ("ReSSL", "temperature_momentum", -0.1, lambda v: ressl_loss(Q, K_, QUEUE, 0.1, v)),
        ("SCE", "coeff", 1.5, lambda v: sce_loss(Q, K_, QUEUE, 0.1, 0.05, v)),
        ("SupCon", "k1", -1.0, lambda v: tcl_loss(S1, S1_LABELS, k1=v)),
        ("SupCon", "base_temperature", 0.0, lambda v: supcon_loss(S1, S1_LABELS, 0.1, v)),
        ("SimCLR", "num_hard", 0, lambda v: contrastive_loss(Q, K_, QUEUE, 0.2, num_hard=v)),
        ("NPID", "log_eps", -1.0, lambda v: contrastive_loss(Q, K_, QUEUE, 0.2, log_eps=v)),
        ("PaCo", "alpha", -0.1, lambda v: paco(alpha=v)),
        ("MultiTaskContrast", "temperature", -0.2, lambda v: paco(temperature=v)),
    ],
)
def test_a_method_refuses_a_bad_hyperparameter_with_its_losss_rule_before_building_anything(method, name, bad, loss_call, monkeypatch):
    import methods
    from backbones import BackboneSpec

    with pytest.raises(ValueError) as from_loss:
        loss_call(bad)
    monkeypatch.setattr(BackboneSpec, "build", lambda spec: pytest.fail(f"{method} built its trunk before checking {name}"))
    with pytest.raises(ValueError) as from_method:
        getattr(methods, method)(**{name: bad})
    assert str(from_method.value) == f"model.{from_loss.value}"


def test_check_hyperparameters_names_where_the_value_came_from_and_skips_unset_values():
    check_hyperparameters(temperature=0.1, num_hard=None, coeff=1.0)
    with pytest.raises(ValueError, match=r"^model.coeff must lie in \[0, 1\], got 1.5$"):
        check_hyperparameters("model.", temperature=0.1, coeff=1.5)
    with pytest.raises(ValueError, match=r"^temperature must be > 0, got -0.5$"):
        check_hyperparameters(temperature=torch.tensor(-0.5))
    # a new method's own hyper-parameter: one line saying what to do (it was a bare KeyError, "error: 'sharpness'")
    with pytest.raises(ValueError, match=r"^model.sharpness has no domain in HYPERPARAMETER_DOMAINS \(methods/losses/common.py\): add one, or check it in __init__$"):
        check_hyperparameters("model.", sharpness=2.0)
