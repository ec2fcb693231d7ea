"""Tests of analysis/metrics.py against hand-computed values and the pairwise definitions."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import multiclass_stat_scores

from analysis.metrics import alignment, normalised_std, rankme, tolerance, uniformity


def unit(seed, *shape):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def test_uniformity_of_two_orthogonal_unit_vectors_is_minus_four():
    assert uniformity(torch.eye(2, dtype=torch.float64)).item() == pytest.approx(-4.0, abs=1e-12)


def test_uniformity_of_identical_points_is_zero():
    assert uniformity(unit(0, 1, 5).expand(6, 5)).item() == pytest.approx(0.0, abs=1e-12)


def test_uniformity_matches_mean_over_unordered_pairs():
    z, t = unit(1, 7, 4), 1.5
    pairs = [math.exp(-t * (z[i] - z[j]).pow(2).sum().item()) for i, j in itertools.combinations(range(7), 2)]
    assert uniformity(z, t).item() == pytest.approx(math.log(sum(pairs) / len(pairs)), abs=1e-12)


def test_uniformity_refuses_rows_that_are_not_unit_vectors():
    """Unnormalised rows would read as far more uniform: 3z gave -11.24 where z gives -2.45."""
    with pytest.raises(ValueError, match=r"^uniformity needs L2-normalised rows, got norms from 3 to 3$"):
        uniformity(3 * unit(1, 7, 4))


def test_tolerance_of_identical_same_class_features_is_one():
    z = torch.cat([unit(2, 1, 4).expand(3, 4), unit(3, 1, 4).expand(2, 4)])
    assert tolerance(z, torch.tensor([0, 0, 0, 1, 1])).item() == pytest.approx(1.0, abs=1e-12)


def test_tolerance_is_mean_over_same_class_pairs_without_self():
    z, labels = unit(4, 6, 3), torch.tensor([0, 1, 0, 0, 1, 2])
    pairs = [(z[i] @ z[j]).item() for i in range(6) for j in range(6) if i != j and labels[i] == labels[j]]
    assert tolerance(z, labels).item() == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)


def test_tolerance_is_invariant_to_the_order_of_classes():
    z, labels = unit(5, 8, 3), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    relabelled = torch.tensor([2, 0, 1])[labels]
    assert tolerance(z, relabelled).item() == pytest.approx(tolerance(z, labels).item(), abs=1e-12)


def test_alignment_is_the_mean_power_of_the_distance_of_positive_pairs():
    z, positives = unit(7, 5, 3), unit(8, 5, 3)
    distances = [(z[i] - positives[i]).norm().item() for i in range(5)]
    assert alignment(z, positives).item() == pytest.approx(sum(d**2 for d in distances) / 5, abs=1e-12)
    assert alignment(z, positives, alpha=1.0).item() == pytest.approx(sum(distances) / 5, abs=1e-12)
    assert alignment(z, z).item() == 0.0
    assert alignment(z, -z).item() == pytest.approx(4.0, abs=1e-12)  # antipodal unit vectors: 2^2


def gaussian(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("rank", [1, 3, 10, 32])
def test_rankme_of_a_matrix_of_rank_r_with_equal_singular_values_is_about_r(rank):
    left, _ = torch.linalg.qr(gaussian(9, 256, rank))
    right, _ = torch.linalg.qr(gaussian(10, 64, rank))
    z = 5.0 * left @ right.T  # 256 x 64, singular values: rank times 5, the rest 0
    assert rankme(z).item() == pytest.approx(rank, rel=1e-3)  # the epsilon adds about (64 - r) * 1e-7 * 16 nats


def test_rankme_of_a_collapsed_matrix_is_about_one_and_of_an_isotropic_one_near_full():
    collapsed = gaussian(11, 1, 64).expand(512, 64) + 1e-6 * gaussian(12, 512, 64)  # every row one point
    assert rankme(collapsed).item() == pytest.approx(1.0, abs=0.01)
    isotropic = rankme(gaussian(13, 4096, 64)).item()
    assert 0.95 * 64 < isotropic <= 64  # the singular values of a finite sample spread a little
    decaying = torch.diag(torch.tensor([2.0**-k for k in range(8)], dtype=torch.float64))
    p = torch.tensor([2.0**-k for k in range(8)], dtype=torch.float64) / sum(2.0**-k for k in range(8)) + 1e-7
    assert rankme(decaying).item() == pytest.approx(math.exp(-(p * p.log()).sum().item()), rel=1e-12)


def test_normalised_std_is_zero_when_collapsed_and_about_one_over_sqrt_d_when_isotropic():
    for dim in (16, 128):
        assert normalised_std(gaussian(14, 1, dim).expand(100, dim) * torch.arange(1.0, 101.0)[:, None]).item() == pytest.approx(0.0, abs=1e-12)
        assert normalised_std(gaussian(15, 20000, dim)).item() == pytest.approx(1 / math.sqrt(dim), rel=0.02)


def test_metrics_return_float32_for_low_precision_input():
    z = unit(6, 5, 4).to(torch.bfloat16)
    assert uniformity(z).dtype == torch.float32
    assert tolerance(z, torch.tensor([0, 0, 1, 1, 1])).dtype == torch.float32
    assert alignment(z, z).dtype == rankme(z).dtype == normalised_std(z).dtype == torch.float32


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: uniformity(torch.ones(1, 3)), r"z must have shape \(N, D\) with N >= 2"),
        (lambda: uniformity(torch.eye(2), t=0.0), "t must be > 0"),
        (lambda: tolerance(torch.eye(3), torch.tensor([0, 1])), r"labels must have shape \(3,\)"),
        (lambda: tolerance(torch.eye(3), torch.tensor([0, 1, 2])), "at least one class with two samples"),
        (lambda: alignment(torch.eye(3), torch.eye(2)), r"positives must have the shape of z \(3, 3\)"),
        (lambda: alignment(torch.eye(3), torch.eye(3), alpha=0.0), "alpha must be > 0"),
        (lambda: rankme(torch.ones(4)), r"z must have shape \(N, D\) with N >= 2"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_shot_accuracies_average_per_class_accuracy_within_many_medium_and_few_groups():
    from methods.evaluation import shot_accuracies

    train_counts = torch.tensor([500, 101, 100, 20, 19, 3])  # many: >100, medium: 20..100, few: <20
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 4, 4, 5])
    predictions = torch.tensor([0, 0, 0, 1, 1, 0, 2, 0, 3, 4, 0, 0, 1])
    result = shot_accuracies(multiclass_stat_scores(predictions, labels, num_classes=6, average=None), train_counts)
    # per class: 3/4, 1/2, 1/2, 1, 1/3, 0
    assert result["many_top1"] == pytest.approx((3 / 4 + 1 / 2) / 2)
    assert result["medium_top1"] == pytest.approx((1 / 2 + 1) / 2)
    assert result["few_top1"] == pytest.approx((1 / 3 + 0) / 2)
    assert result["top1"] == pytest.approx(7 / 13)  # over samples, not classes


def test_shot_accuracies_leave_out_empty_groups_and_unseen_classes():
    from methods.evaluation import shot_accuracies

    stats = multiclass_stat_scores(torch.tensor([0, 1]), torch.tensor([0, 1]), num_classes=3, average=None)
    result = shot_accuracies(stats, torch.tensor([500, 50, 5]))
    assert result == {"top1": 1.0, "many_top1": 1.0, "medium_top1": 1.0}  # class 2 (few) has no sample


def test_knn_votes_weigh_each_neighbour_by_exp_of_its_similarity_over_the_temperature():
    """NPID's weighted vote (Wu et al. 2018, Sec. 3.4): one class-1 neighbour at similarity 0.9 outvotes two class-0
    neighbours at 0.5 at temperature 0.07, and loses to them at temperature 10, where the vote is nearly a count."""
    from methods.evaluation import knn_predict

    angle = lambda similarity: torch.tensor([similarity, math.sqrt(1 - similarity**2)])  # noqa: E731 (unit vectors)
    bank = torch.stack([angle(0.9), angle(0.5), angle(0.5), angle(-0.9)])
    labels = torch.tensor([1, 0, 0, 2])  # the last, least similar, is not among the k = 3 neighbours
    query = torch.tensor([[1.0, 0.0]])
    for temperature in (0.07, 10.0):
        scores = knn_predict(query, bank, labels, num_classes=3, k=3, temperature=temperature)
        expected = torch.tensor([[2 * math.exp(0.5 / temperature), math.exp(0.9 / temperature), 0.0]])
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=0.0)
    assert knn_predict(query, bank, labels, 3, k=3, temperature=0.07).argmax().item() == 1
    assert knn_predict(query, bank, labels, 3, k=3, temperature=10.0).argmax().item() == 0


def test_knn_top_k_counts_only_classes_that_received_a_vote():
    """With k = 1 neighbour a query has one class with a vote: its top-5 is that class alone, not four zero-score
    classes in index order (DINO's eval_knn.py: the top min(5, k))."""
    from methods.evaluation import knn_predict, knn_topk_accuracy

    bank = F.normalize(torch.eye(8)[:6], dim=1)  # six bank images, one per class 0..5 (classes 6, 7 have none)
    queries = F.normalize(torch.eye(8)[[0, 1]] + 0.1, dim=1)
    scores = knn_predict(queries, bank, torch.arange(6), num_classes=8, k=1)
    assert (scores > 0).sum(dim=1).tolist() == [1, 1]
    for unvoted in range(2, 8):  # query 0 is right; query 1 (its neighbour: class 1) is labelled with a class without a vote
        labels = torch.tensor([0, unvoted])
        assert knn_topk_accuracy(scores, labels, 1).item() == 0.5
        assert knn_topk_accuracy(scores, labels, 5).item() == 0.5  # a plain top-5 takes 4 of the 7 zero-score classes: some hit
    assert knn_topk_accuracy(scores, torch.tensor([1, 1]), 5).item() == 0.5
    assert knn_topk_accuracy(scores, torch.tensor([0, -1]), 5).item() == 1.0  # an unlabelled query is not scored
    tied = torch.tensor([[3.0, 2.0, 3.0, 3.0, 3.0, 2.0, 3.0, 3.0, 2.0, 2.0, 1.0]] * 2)  # ties: the first index wins, as argmax
    assert knn_topk_accuracy(tied, torch.tensor([0, 0]), 1).item() == 1.0 and knn_topk_accuracy(tied, torch.tensor([4, 4]), 1).item() == 0.0
