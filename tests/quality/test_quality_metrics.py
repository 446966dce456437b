"""The metric arithmetic of runtime/eval/metrics.py on hand-made distributions with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from s4kv.runtime.eval.metrics import (
    Greedy,
    TeacherForced,
    compare_teacher_forced,
    exact_kl,
    first_divergence,
    greedy_match,
    perplexity,
    perplexity_ratio_interval,
    ratio_interval,
    top1_agreement,
    topk_kl,
)


def record_from_logprobs(logprobs: np.ndarray, targets: np.ndarray, k: int) -> TeacherForced:
    """What an engine returns for full log-prob tensors [S, N, V]: top-k (best first) and target log-probs."""
    order = np.argsort(-logprobs, axis=-1)[..., :k]
    return TeacherForced(order, np.take_along_axis(logprobs, order, -1),
                         np.take_along_axis(logprobs, targets[..., None], -1)[..., 0], targets)


def random_logprobs(rng, shape, temperature=1.0) -> np.ndarray:
    logits = rng.normal(size=shape) * 4.0 / temperature
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_a_record_against_itself_is_exact(rng):
    lp = random_logprobs(rng, (3, 50, 64))
    rec = record_from_logprobs(lp, rng.integers(0, 64, (3, 50)), 10)
    metrics = compare_teacher_forced(rec, rec)
    assert metrics["top1_agreement"] == 1.0
    assert metrics["perplexity_delta"] == 0.0
    assert metrics["mean_kl"] == 0.0
    assert metrics["positions"] == 150


def test_perplexity_is_exp_of_mean_negative_log_likelihood():
    rec = TeacherForced(np.zeros((1, 2, 1), int), np.zeros((1, 2, 1)), np.log(np.array([[0.5, 0.125]])),
                        np.zeros((1, 2), int))
    assert perplexity(rec) == pytest.approx(4.0)  # exp(-(ln 1/2 + ln 1/8) / 2) = sqrt(16)


def test_top1_agreement_counts_positions_whose_best_token_matches(rng):
    lp = random_logprobs(rng, (1, 4, 8))
    ref = record_from_logprobs(lp, np.zeros((1, 4), int), 3)
    changed = lp.copy()
    best = lp[0, 1].argmax()
    changed[0, 1, best] = -50.0  # position 1 now prefers another token
    fmt = record_from_logprobs(changed, np.zeros((1, 4), int), 3)
    assert top1_agreement(ref, fmt) == 0.75


def test_topk_kl_is_a_lower_bound_that_tightens_with_k(rng):
    ref_lp = random_logprobs(rng, (2, 40, 200), temperature=0.7)
    fmt_lp = ref_lp + rng.normal(scale=0.3, size=ref_lp.shape)
    fmt_lp -= np.log(np.exp(fmt_lp).sum(-1, keepdims=True))
    targets = rng.integers(0, 200, (2, 40))
    exact = exact_kl(ref_lp, fmt_lp)
    previous = np.zeros_like(exact)
    for k in (1, 5, 20, 200):
        estimate = topk_kl(record_from_logprobs(ref_lp, targets, k), record_from_logprobs(fmt_lp, targets, k))
        assert np.all(estimate <= exact + 1e-9)
        assert estimate.mean() >= previous.mean() - 1e-9
        previous = estimate
    np.testing.assert_allclose(previous, exact, rtol=1e-6, atol=1e-10)  # k = V: nothing is merged


def test_topk_kl_sees_a_distribution_that_moved_its_mass(rng):
    ref_lp = random_logprobs(rng, (1, 30, 100))
    shuffled = ref_lp[..., rng.permutation(100)]
    targets = np.zeros((1, 30), int)
    kl = topk_kl(record_from_logprobs(ref_lp, targets, 20), record_from_logprobs(shuffled, targets, 20))
    assert kl.mean() > 0.5


def test_topk_kl_counts_the_target_when_the_top_k_lists_are_disjoint(rng):
    """A broken format that moves all its mass to other tokens: no token is in both top-K lists, yet the target's
    log-probability, known in both, keeps the bound from collapsing to 0 (the bucket alone would match)."""
    ref_lp = random_logprobs(rng, (1, 30, 1000), temperature=0.3)
    ref_lp[..., 900:] = -30.0  # the reference puts its mass on tokens 0..899
    ref_lp -= np.log(np.exp(ref_lp).sum(-1, keepdims=True))
    targets = ref_lp.argmax(-1)  # text the reference predicts well
    broken_lp = np.full_like(ref_lp, np.log(1e-6))  # almost nothing on those tokens...
    broken_lp[..., 900:] = np.log((1 - 900e-6) / 100)  # ...and the rest on tokens 900..999
    ref, broken = record_from_logprobs(ref_lp, targets, 20), record_from_logprobs(broken_lp, targets, 20)
    assert not (ref.top_ids[..., :, None] == broken.top_ids[..., None, :]).any()
    kl = topk_kl(ref, broken)
    exact = exact_kl(ref_lp, broken_lp)
    assert np.all(kl <= exact + 1e-9)
    assert kl.mean() > 0.5 * exact.mean()


def test_first_divergence_and_greedy_match():
    ref = Greedy(np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]))
    fmt = Greedy(np.array([[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]))
    assert first_divergence(ref.tokens[0], fmt.tokens[0]) is None
    assert first_divergence(ref.tokens[1], fmt.tokens[1]) == 1
    match = greedy_match(ref, fmt)
    assert match["exact_match"] == pytest.approx(1 / 3)
    assert match["first_divergence"] == [None, 1, 0]
    assert match["mean_first_divergence"] == 0.5
    assert match["mean_matched_prefix"] == pytest.approx((4 + 1 + 0) / 3 / 4)


def test_mismatched_records_are_rejected():
    a = TeacherForced(np.zeros((1, 3, 2), int), np.zeros((1, 3, 2)), np.zeros((1, 3)), np.zeros((1, 3), int))
    b = TeacherForced(np.zeros((1, 4, 2), int), np.zeros((1, 4, 2)), np.zeros((1, 4)), np.zeros((1, 4), int))
    with pytest.raises(ValueError, match="shape"):
        top1_agreement(a, b)
    with pytest.raises(ValueError, match="inconsistent"):
        TeacherForced(np.zeros((1, 3, 2), int), np.zeros((1, 3, 3)), np.zeros((1, 3)), np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="inconsistent"):
        TeacherForced(np.zeros((1, 3, 2), int), np.zeros((1, 3, 2)), np.zeros((1, 3)), np.zeros((1, 2), int))
    with pytest.raises(ValueError, match="different target tokens"):
        topk_kl(a, TeacherForced(a.top_ids, a.top_logprobs, a.target_logprobs, np.ones((1, 3), int)))


def test_window_kl_averages_to_mean_kl(rng):
    ref = record_from_logprobs(random_logprobs(rng, (5, 40, 64)), rng.integers(0, 64, (5, 40)), 10)
    noisy = record_from_logprobs(random_logprobs(rng, (5, 40, 64)), ref.target_ids, 10)
    metrics = compare_teacher_forced(ref, noisy)
    assert len(metrics["window_kl"]) == 5
    assert np.mean(metrics["window_kl"]) == pytest.approx(metrics["mean_kl"], rel=1e-4)
    assert np.exp(np.mean(metrics["window_nll"])) == pytest.approx(metrics["perplexity"], rel=1e-5)


def test_ratio_interval_covers_the_ratio_and_shrinks_with_more_windows(rng):
    def windows(n):
        hardness = rng.gamma(2.0, 1.0, n)  # text that is hard for one int4 format is hard for the other
        return hardness * 1.1 * rng.uniform(0.9, 1.1, n), hardness * rng.uniform(0.9, 1.1, n)

    few_low, few_high = ratio_interval(*windows(16))
    many_low, many_high = ratio_interval(*windows(1024))
    assert few_low < 1.1 < few_high and many_low < 1.1 < many_high
    assert many_high - many_low < (few_high - few_low) / 3
    assert ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == (1.0, 1.0)  # a format against itself


def test_ratio_interval_rejects_unpaired_windows():
    with pytest.raises(ValueError, match="two equal lists"):
        ratio_interval([1.0, 2.0], [1.0, 2.0, 3.0])


def test_perplexity_ratio_interval_covers_the_ratio_of_the_perplexities(rng):
    hardness = rng.uniform(2.0, 4.0, 32)  # per-window nll of the text, shared by both formats
    worse = hardness + 0.05 + rng.normal(0, 0.01, 32)  # 5% higher perplexity, give or take
    low, high = perplexity_ratio_interval(list(worse), list(hardness))
    measured = np.exp(worse.mean() - hardness.mean())
    assert low < measured < high and 1.0 < low and high < 1.07
    assert perplexity_ratio_interval([2.0, 3.0], [2.0, 3.0]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="two equal lists"):
        perplexity_ratio_interval([1.0], [1.0])
