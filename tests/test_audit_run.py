"""The one-run audit of a whole run: its statistics against independent references,
its end-to-end verdicts (slow), and the command's usage errors."""

import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
from jax_privacy import auditing as jp_auditing

from dpmp._src.audit_one_run import auc, epsilon_lower_bound, exact_gaussian_game, guess


def _p_value(m, k, c, eps, delta):
    """P[W >= c] bound of Steinke, Nasr & Jagielski (2023), written out from the
    paper with scipy: beta + 2 m delta max_i (P[B >= c - i] - beta) / i."""
    p = scipy.special.expit(eps)
    beta = scipy.stats.binom.sf(c - 1, k, p)
    i = np.arange(1, c + 1)
    alpha = np.max((scipy.stats.binom.sf(c - i - 1, k, p) - beta) / i)
    return min(beta + 2 * m * delta * alpha, 1.0)


def _bound_delta_zero(k, c, significance=0.05):
    """delta = 0: the epsilon where P[Binomial(k, e^eps / (1 + e^eps)) >= c] = significance."""

    def excess(eps):
        return scipy.stats.binom.sf(c - 1, k, scipy.special.expit(eps)) - significance

    return 0.0 if excess(0.0) > 0 else scipy.optimize.brentq(excess, 0.0, 50.0, xtol=1e-12)


# ---- the bound from counts ---------------------------------------------------------


@pytest.mark.parametrize("k, c", [(200, 140), (200, 180), (100, 100), (50, 36), (1000, 560)])
def test_bound_is_the_binomial_tail_at_delta_zero(k, c):
    expected = _bound_delta_zero(k, c)
    assert expected > 0
    assert epsilon_lower_bound(1000, k, c, delta=0.0) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("k, c", [(200, 150), (200, 190), (100, 100)])
def test_bound_with_delta_is_where_the_papers_p_value_meets_the_significance(k, c):
    m, delta = 1000, 1e-5
    eps = epsilon_lower_bound(m, k, c, delta=delta)
    assert 0 < eps < _bound_delta_zero(k, c)
    assert _p_value(m, k, c, eps, delta) == pytest.approx(0.05, abs=1e-4)
    assert _p_value(m, k, c, 0.98 * eps, delta) < 0.05 < _p_value(m, k, c, 1.02 * eps, delta)


def test_bound_grows_with_correct_guesses_and_shrinks_with_delta():
    bounds = [epsilon_lower_bound(1000, 200, c, delta=1e-5) for c in range(90, 201)]
    assert bounds[0] == 0.0 and bounds[-1] > 4
    assert all(b <= a for b, a in zip(bounds, bounds[1:]))
    by_delta = [epsilon_lower_bound(1000, 200, 180, delta=d) for d in (0.0, 1e-6, 1e-5, 1e-4)]
    assert all(b >= a for b, a in zip(by_delta, by_delta[1:]))


def test_bound_agrees_with_jax_privacy_public_one_run_audit():
    """One-sided guesses above a threshold: the count-based bound is what
    ``CanaryScoreAuditor.epsilon_one_run`` gives for the same threshold."""
    rng = np.random.default_rng(0)
    member = rng.random(1000) < 0.5
    scores = rng.normal(size=1000) + 1.5 * member
    threshold = np.quantile(scores, 0.9)
    auditor = jp_auditing.CanaryScoreAuditor(scores[member], scores[~member])
    theirs = auditor.epsilon_one_run(
        0.05, 1e-5, threshold_strategy=jp_auditing.Explicit(threshold=threshold)
    )
    above = scores >= threshold
    ours = epsilon_lower_bound(1000, int(above.sum()), int((above & member).sum()), delta=1e-5)
    assert ours > 0.5 and ours == pytest.approx(theirs, abs=1e-9)


def test_chance_guesses_give_no_bound_and_perfect_guesses_a_large_one():
    rng = np.random.default_rng(1)
    chance = []
    for _ in range(50):
        member = rng.random(1000) < 0.5
        chance.append(
            epsilon_lower_bound(1000, 200, guess(rng.normal(size=1000), member, 200), delta=1e-5)
        )
    assert np.median(chance) == 0.0 and sum(b > 0 for b in chance) <= 8
    member = rng.random(1000) < 0.5  # no noise: the score is the membership
    perfect = guess(member + 1e-3 * rng.normal(size=1000), member, 200)
    assert perfect == 200
    assert epsilon_lower_bound(1000, 200, perfect, delta=1e-5) > 4


@pytest.mark.parametrize(
    "args, needle",
    [
        ((1000, 0, 0), "num_guesses"),
        ((1000, 1001, 10), "num_guesses"),
        ((1000, 200, 201), "num_correct"),
    ],
)
def test_bound_refuses_impossible_counts(args, needle):
    with pytest.raises(ValueError, match=needle):
        epsilon_lower_bound(*args, delta=1e-5)


# ---- guesses and AUC ----------------------------------------------------------------


def test_guesses_take_the_highest_as_in_and_the_lowest_as_out():
    scores = np.array([0.1, 0.9, 0.5, 0.3])
    member = np.array([False, True, True, False])
    assert guess(scores, member, 2) == 2  # in: 0.9 (right); out: 0.1 (right)
    assert guess(scores, member, 3) == 3  # in: 0.9; out: 0.1, 0.3
    assert guess(scores, member, 4) == 4
    assert guess(scores, ~member, 4) == 0
    with pytest.raises(ValueError, match="num_guesses"):
        guess(scores, member, 5)


def test_auc_is_the_probability_that_in_outscores_out():
    assert auc([2.0, 3.0], [1.0, 2.0]) == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    rng = np.random.default_rng(2)
    assert abs(auc(rng.normal(size=5000), rng.normal(size=5000)) - 0.5) < 0.015
    shifted = auc(rng.normal(size=20000) + 1.0, rng.normal(size=20000))
    assert shifted == pytest.approx(scipy.stats.norm.cdf(1 / np.sqrt(2)), abs=0.006)


# ---- the exact Gaussian game ---------------------------------------------------------


def test_exact_game_auc_is_the_gaussian_shift_of_the_composed_mechanism():
    """q = 1: each canary's log-likelihood ratio is Gaussian with means +-mu^2/2 and
    variance mu^2, mu = sqrt(steps) / sigma, so the optimal test's AUC is
    Phi(mu / sqrt(2))."""
    game = exact_gaussian_game(
        noise_multiplier=10.0,
        sampling_prob=1.0,
        steps=100,
        num_canaries=1000,
        num_guesses=200,
        delta=1e-5,
        games=20,
    )
    assert game.auc == pytest.approx(scipy.stats.norm.cdf(1 / np.sqrt(2)), abs=0.01)
    assert game.epsilon_low <= game.epsilon_median <= game.epsilon_high
    assert 1.0 < game.epsilon_median < 2.5


def test_exact_game_without_privacy_and_with_pure_noise():
    common = dict(num_canaries=1000, num_guesses=200, delta=1e-5, games=20)
    loud = exact_gaussian_game(noise_multiplier=0.05, sampling_prob=0.5, steps=10, **common)
    assert loud.auc > 0.999 and loud.epsilon_median > 4
    quiet = exact_gaussian_game(noise_multiplier=1e3, sampling_prob=0.5, steps=10, **common)
    assert abs(quiet.auc - 0.5) < 0.02 and quiet.epsilon_median == 0.0
