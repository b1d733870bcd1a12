"""The accounting of a random-stopping search (``dpmp.accounting._tuning``).

References: the paper's closed-form numbers from its released MNIST sweep
(``tests/data/papernot_steinke_2022_mnist.toml``), the theorems' formulas
written out here from their statements, and the exact Renyi divergence of the
best of K runs of small discrete mechanisms (the distribution of a maximum:
``P[best <= y] = E[F(y)^K]``).
"""

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special, stats

from dpmp.accounting._tuning import (
    SEARCH_ORDERS,
    CandidatePlan,
    PoissonCount,
    TruncatedNegativeBinomialCount,
    calibrate_search_noise,
    search_epsilon,
    search_guarantee,
)

SWEEP = tomllib.loads(
    (Path(__file__).parent / "data" / "papernot_steinke_2022_mnist.toml").read_text()
)
# The paper gives its figures to 2 decimals: the exact value is within half a unit
# of the last digit (a percentage to 2 decimals: within 5e-5 as a fraction).
ROUNDING = 0.005


def test_the_sweep_data_is_the_papers():
    """400 learning rates with an accuracy each; the curve of one run, one value
    per order; the best accuracy is the non-private best the paper compares with."""
    assert len(SWEEP["learning_rates"]) == len(SWEEP["accuracies"]) == 400
    assert len(SWEEP["orders"]) == len(SWEEP["rdp"])
    assert max(SWEEP["accuracies"]) == SWEEP["non_private_best"] == 0.9594
    np.testing.assert_allclose(SWEEP["learning_rates"], np.logspace(-4, 0, 1000)[-400:], rtol=1e-15)


def test_one_run_of_the_sweep_is_epsilon_2_60():
    eps, _ = rdp_privacy_accountant.compute_epsilon(SWEEP["orders"], SWEEP["rdp"], 1e-5)
    assert abs(eps - 2.60) <= ROUNDING


def test_a_poisson_10_search_of_the_sweep_is_epsilon_5_75():
    eps = search_epsilon(PoissonCount(10), orders=SWEEP["orders"], rdp=SWEEP["rdp"], delta=1e-5)
    assert abs(eps - 5.75) <= ROUNDING


def _expected_best_by_sum(pmf, accuracies, k_max):
    """E[best of K uniform draws from the sweep], K = 0 scoring 0 (as the paper's
    figure counts it), summed over k: the best of k draws is at most a_(i) with
    probability (i/m)^k."""
    a = np.sort(accuracies)
    m = len(a)
    i = np.arange(1, m + 1)
    best_of = [0.0] + [
        float(np.sum(a * ((i / m) ** k - ((i - 1) / m) ** k))) for k in range(1, k_max)
    ]
    return sum(pmf(k) * best_of[k] for k in range(k_max))


def test_a_poisson_10_search_of_the_sweep_reaches_95_66_percent():
    """The expected best accuracy: summed over K here, from the PGF in the library;
    the paper's 95.66% to its rounding."""
    acc = SWEEP["accuracies"]
    # Poisson(10) beyond 60 has mass < 1e-20: the truncated sum is exact to 1e-20.
    summed = _expected_best_by_sum(lambda k: stats.poisson.pmf(k, 10), acc, 61)
    assert abs(summed - 0.9566) <= ROUNDING / 100
    assert PoissonCount(10).expected_best(acc) == pytest.approx(summed, abs=1e-12)


@pytest.mark.parametrize("eta", [-0.5, 0.0, 0.5, 1.0, 3.0])
def test_expected_best_of_the_negative_binomial_is_the_sum_over_k(eta):
    count = TruncatedNegativeBinomialCount.with_mean(5.0, eta)
    pmf = _tnb_pmf(count)
    # the tail beyond 5,000 has mass < 1e-13 at mean 5 (checked): a sum exact to that
    assert 1.0 - sum(pmf(k) for k in range(1, 5000)) < 1e-13
    summed = _expected_best_by_sum(pmf, SWEEP["accuracies"], 5000)
    assert count.expected_best(SWEEP["accuracies"]) == pytest.approx(summed, abs=1e-12)


def _tnb_pmf(count):
    """P[K = k] of D_{eta,gamma} from its definition, normalised numerically."""
    eta, gamma = count.eta, count.gamma
    ks = np.arange(1, 20_000)
    if eta == 0.0:
        w = (1 - gamma) ** ks / ks
    else:
        log_binom = special.gammaln(ks + eta) - special.gammaln(eta) - special.gammaln(ks + 1)
        sign = np.sign(special.poch(eta, ks))
        w = sign * np.exp(log_binom + ks * math.log1p(-gamma))
    w = w / w.sum()
    return lambda k: float(w[k - 1]) if k >= 1 else 0.0


# ---- the theorems against their statements and against exact divergences -------


def _theorem2(orders, rdp, eta, gamma):
    """Theorem 2's eps'(lambda), written from its statement, lambda_hat over the
    orders and 1."""
    if eta == 0:
        mean = (1 / gamma - 1) / math.log(1 / gamma)
    else:
        mean = eta * (1 - gamma) / (gamma * (1 - gamma**eta))
    out = []
    for lam, eps in zip(orders, rdp, strict=True):
        terms = [(1 + eta) * math.log(1 / gamma)]  # lambda_hat = 1
        for lam_hat, eps_hat in zip(orders, rdp, strict=True):
            terms.append(
                (1 + eta) * (1 - 1 / lam_hat) * eps_hat + (1 + eta) * math.log(1 / gamma) / lam_hat
            )
        out.append(eps + min(terms) + math.log(mean) / (lam - 1))
    return np.array(out)


@pytest.mark.parametrize("gamma", [0.5, 0.1, 0.01])
def test_geometric_search_is_theorem_2_at_eta_1(gamma):
    """eta = 1: eps' = eps + 2 (1 - 1/l^) eps^ + 2 log(1/gamma)/l^ + log(1/gamma)/(l - 1)."""
    orders, rdp = SWEEP["orders"], SWEEP["rdp"]
    count = TruncatedNegativeBinomialCount(1.0, gamma)
    assert count.mean == pytest.approx(1 / gamma, rel=1e-14)
    expect = _theorem2(orders, rdp, 1.0, gamma)
    np.testing.assert_allclose(count.search_rdp(orders, rdp), expect, rtol=1e-13)


@pytest.mark.parametrize("eta", [-0.5, 0.5, 3.0])
def test_negative_binomial_search_is_theorem_2(eta):
    orders, rdp = SWEEP["orders"], SWEEP["rdp"]
    count = TruncatedNegativeBinomialCount(eta, 0.05)
    expect = _theorem2(orders, rdp, eta, 0.05)
    np.testing.assert_allclose(count.search_rdp(orders, rdp), expect, rtol=1e-13)


def test_logarithmic_search_is_the_limit_eta_to_0():
    """eta = 0 (the logarithmic distribution) is the theorem at eta = 0 and the
    limit of eta > 0: eps' is affine in (1 + eta) plus log E[K], smooth in eta,
    so at eta = 1e-9 it moves by at most ~1e-9 times its terms (< 1e-6 here)."""
    orders, rdp = SWEEP["orders"], SWEEP["rdp"]
    log_count = TruncatedNegativeBinomialCount(0.0, 0.05)
    np.testing.assert_allclose(
        log_count.search_rdp(orders, rdp), _theorem2(orders, rdp, 0.0, 0.05), rtol=1e-13
    )
    near = TruncatedNegativeBinomialCount(1e-9, 0.05)
    np.testing.assert_allclose(
        near.search_rdp(orders, rdp), log_count.search_rdp(orders, rdp), rtol=0, atol=1e-6
    )


def test_poisson_search_is_theorem_6():
    """eps' = eps + mu delta_hat + log(mu)/(lambda - 1), delta_hat the one run's
    delta at eps_hat = log(1 + 1/(lambda - 1)), from its curve (the reference's
    get_privacy_spent, written here: the bound of Canonne, Kamath & Steinke
    2020, Proposition 12, with the KL bound)."""
    orders, rdp = np.array(SWEEP["orders"]), np.array(SWEEP["rdp"])

    def delta_at(eps):
        logs = [0.5 * math.log1p(-math.exp(-r)) for r in rdp]
        logs = [
            min(d, (a - 1) * (r - eps + math.log1p(-1 / a)) - math.log(a)) if a > 1.01 else d
            for d, a, r in zip(logs, orders, rdp, strict=True)
        ]
        return min(1.0, math.exp(min(logs)))

    mu = 10.0
    expect = [
        eps + mu * delta_at(math.log1p(1 / (lam - 1))) + math.log(mu) / (lam - 1)
        for lam, eps in zip(orders, rdp, strict=True)
    ]
    np.testing.assert_allclose(PoissonCount(mu).search_rdp(orders, rdp), expect, rtol=1e-12)


def _renyi(p, q, lam):
    return float(special.logsumexp(lam * np.log(p) + (1 - lam) * np.log(q)) / (lam - 1))


def _best_of(p, pgf):
    """The distribution of the best of K draws of p (outcomes in increasing order),
    and of nothing (K = 0) first: P[best <= y] = pgf(F(y))."""
    cdf = np.concatenate([[0.0], np.cumsum(p)])
    cdf[-1] = 1.0
    at = np.array([pgf(c) for c in cdf])
    return np.concatenate([[at[0]], np.diff(at)]) if at[0] > 0 else np.diff(at)


TOY_ORDERS = [1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]


def _toy_pairs(seed, n=40):
    """Random neighbouring output distributions of a 4-outcome mechanism and their
    exact RDP curve (both directions) at ``TOY_ORDERS``."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        p = rng.dirichlet(np.ones(4))
        q = p * np.exp(rng.normal(0.0, 0.3, 4))
        q /= q.sum()
        curve = [max(_renyi(p, q, a), _renyi(q, p, a)) for a in TOY_ORDERS]
        yield p, q, np.array(curve)


@pytest.mark.parametrize(
    "count",
    [
        TruncatedNegativeBinomialCount(-0.5, 0.1),
        TruncatedNegativeBinomialCount(0.0, 0.01),
        TruncatedNegativeBinomialCount(1.0, 0.1),
        TruncatedNegativeBinomialCount(3.0, 0.01),
        PoissonCount(1.0),
        PoissonCount(10.0),
    ],
    ids=repr,
)
def test_search_rdp_bounds_the_exact_divergence_of_the_best(count):
    """Each bound holds on small mechanisms whose best-of-K divergence is exact."""
    for p, q, curve in _toy_pairs(0):
        bound = count.search_rdp(TOY_ORDERS, curve)
        best_p, best_q = _best_of(p, count.pgf), _best_of(q, count.pgf)
        exact = [max(_renyi(best_p, best_q, a), _renyi(best_q, best_p, a)) for a in TOY_ORDERS]
        assert np.all(np.array(exact) <= bound + 1e-9), (exact, bound)


def test_poisson_below_mean_1_is_refused_as_its_bound_fails():
    """The stated bound is negative, below the true divergence, for mu < 1: refused."""
    p, q = np.array([0.7, 0.3]), np.array([0.7 - 0.3 * 0.05, 0.3 * 1.05])
    pgf = lambda x: math.exp(0.9 * (x - 1))  # noqa: E731
    exact = _renyi(_best_of(p, pgf), _best_of(q, pgf), 2.0)
    curve_at_2 = max(_renyi(p, q, 2.0), _renyi(q, p, 2.0))
    assert curve_at_2 + math.log(0.9) < 0 < exact  # the formula's value, without delta_hat >= 0
    with pytest.raises(ValueError, match="PoissonCount.mean: must be >= 1"):
        PoissonCount(0.9)


@pytest.mark.parametrize(
    "make", [PoissonCount, lambda m: TruncatedNegativeBinomialCount.with_mean(m, 1.0)]
)
def test_search_epsilon_falls_with_the_mean(make):
    means = [20.0, 10.0, 5.0, 2.0, 1.5]
    eps = [
        search_epsilon(make(m), orders=SWEEP["orders"], rdp=SWEEP["rdp"], delta=1e-5) for m in means
    ]
    assert all(a > b for a, b in zip(eps, eps[1:], strict=False)), eps


@pytest.mark.parametrize("eta", [-0.5, 0.0, 1.0, 2.5])
def test_with_mean_gives_the_mean(eta):
    for mean in (1.5, 10.0, 200.0):
        count = TruncatedNegativeBinomialCount.with_mean(mean, eta)
        # gamma is bisected to a relative 1e-13; E[K] is smooth in gamma
        assert count.mean == pytest.approx(mean, rel=1e-9)


@pytest.mark.parametrize(
    "count",
    [
        PoissonCount(4.0),
        TruncatedNegativeBinomialCount(1.0, 0.25),
        TruncatedNegativeBinomialCount(0.0, 0.1),
        TruncatedNegativeBinomialCount(-0.5, 0.1),
        TruncatedNegativeBinomialCount(2.0, 0.3),
    ],
    ids=repr,
)
def test_draws_follow_the_distribution(count):
    """A chi-square test of 20,000 draws against the pmf accepts the distribution
    (p > 0.001) and rejects the same draws against a neighbour of it."""
    rng = np.random.default_rng(1234)
    draws = np.array([count.draw(rng) for _ in range(20_000)])
    pmf = (
        (lambda k: stats.poisson.pmf(k, count.mean))
        if isinstance(count, PoissonCount)
        else _tnb_pmf(count)
    )
    assert stats.chisquare(*_binned(draws, pmf)).pvalue > 1e-3
    if isinstance(count, PoissonCount):
        wrong = lambda k: stats.poisson.pmf(k, count.mean * 1.05)  # noqa: E731
    else:
        wrong = _tnb_pmf(TruncatedNegativeBinomialCount(count.eta, count.gamma * 1.3))
    assert stats.chisquare(*_binned(draws, wrong)).pvalue < 1e-6


def _binned(draws, pmf):
    """Observed and expected counts over bins of at least 5 expected draws; the
    last bin takes the rest of the draws and of the mass (the tail)."""
    n = len(draws)
    observed, expected, o, e = [], [], 0, 0.0
    for k in range(int(draws.max()) + 1):
        o += int(np.sum(draws == k))
        e += n * pmf(k)
        if e >= 5:
            observed.append(o)
            expected.append(e)
            o, e = 0, 0.0
    observed[-1] += o
    expected[-1] = n - sum(expected[:-1])
    return np.array(observed), np.array(expected)


# ---- a dpmp candidate: its drawn noise, its truncation, calibration --------------

PLAN = CandidatePlan(
    noise_multiplier=None,
    sampling_prob=512 / 1437,
    steps=50,
    noised_coordinates=19_210,
    truncation_tv=50 * 1e-12,
)


def test_an_exact_candidate_is_the_theorem_alone():
    """Exact noise and no truncation: the guarantee is search_epsilon of the
    candidate's own RDP curve (dp-accounting's), with all of delta."""
    plan = PLAN.replace(noise_multiplier=3.0, noise_sampler=None, truncation_tv=0.0)
    count = PoissonCount(5)
    g = search_guarantee(plan, count, delta=1e-5)
    rdp = plan.rdp(SEARCH_ORDERS)
    assert g.epsilon == pytest.approx(
        search_epsilon(count, orders=SEARCH_ORDERS, rdp=rdp, delta=1e-5), rel=1e-12
    )
    assert g.delta_tv == 0.0 and g.delta_rdp == 1e-5 and g.residual_log_ratio == 0.0


def test_the_drawn_noise_and_truncation_cost_their_share():
    """With the snapped noise's residual and a truncation bound the search costs
    more; its delta is the conversion's plus E[K] (b + T p)(1 + e^eps)."""
    plan = PLAN.replace(noise_multiplier=3.0)
    count = PoissonCount(5)
    exact = search_guarantee(plan.replace(noise_sampler=None, truncation_tv=0.0), count, delta=1e-5)
    drawn = search_guarantee(plan, count, delta=1e-5)
    assert drawn.epsilon > exact.epsilon
    tail = plan.residual(1e-5).delta_tail
    share = count.mean * (tail + plan.truncation_tv) * (1 + math.exp(drawn.epsilon))
    assert drawn.delta_tv <= share * (1 + 1e-9)
    assert drawn.delta_rdp + drawn.delta_tv == pytest.approx(1e-5, rel=1e-12)


@pytest.mark.parametrize(
    "count", [PoissonCount(10), TruncatedNegativeBinomialCount.with_mean(10, 1.0)], ids=repr
)
def test_calibration_meets_the_target(count):
    """The calibrated sigma's search is within the target; 0.1% less noise is not
    (the bisection's tolerance): the smallest such sigma."""
    sigma = calibrate_search_noise(PLAN, count, target_epsilon=4.0, delta=1e-5, rtol=1e-3)
    assert search_guarantee(PLAN.replace(noise_multiplier=sigma), count, delta=1e-5).epsilon <= 4.0
    less = PLAN.replace(noise_multiplier=sigma / (1 + 1e-3))
    assert search_guarantee(less, count, delta=1e-5).epsilon > 4.0


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: PoissonCount(0.5), "must be >= 1"),
        (lambda: TruncatedNegativeBinomialCount(-1.0, 0.5), "eta: must be a real number > -1"),
        (
            lambda: TruncatedNegativeBinomialCount(1.0, 1.0),
            "gamma: must be a real number in (0, 1)",
        ),
        (lambda: TruncatedNegativeBinomialCount.with_mean(1.0), "mean: must be a real number > 1"),
        (lambda: PLAN.replace(noised_coordinates=None), "noised_coordinates: required"),
        (
            lambda: calibrate_search_noise(PLAN, PoissonCount(10), target_epsilon=1e-3, delta=1e-5),
            "out of reach",
        ),
    ],
)
def test_bad_inputs_name_the_field(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)
