"""Tests for dpmp.accounting, against dp-accounting events built by hand."""

import dataclasses
import json
import math
import re
import time

import dp_accounting
import jax
import numpy as np
import pytest

import dpmp
import dpmp.accounting as acc

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


# ---------------------------------------------------------------------------
# Independent reference: dp-accounting, events and accountants built by hand.
# ---------------------------------------------------------------------------


def _accountant(name, interval=1e-4, relation=ADD_REMOVE):
    if name == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return dp_accounting.pld.PLDAccountant(
        neighboring_relation=relation, value_discretization_interval=interval
    )


def _configured(name, interval):
    """dpmp's accountant ``name`` at the PLD ``interval`` (RDP has none)."""
    if name == "pld":
        return acc.PldAccountant(value_discretization_interval=interval)
    return name


def _sampled_gaussian(q, sigma):
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def _reference_epsilon(name, q, sigma, steps, delta, interval=1e-4, relation=ADD_REMOVE):
    event = dp_accounting.SelfComposedDpEvent(_sampled_gaussian(q, sigma), steps)
    return _accountant(name, interval, relation).compose(event).get_epsilon(delta)


def _reference_with_counts(name, q, sigma, sigma_c, steps, count_every, delta, interval=1e-4):
    """Steps k, 2k, ... release the gradient and a count of the same sample."""
    with_count = steps // count_every
    plain = steps - with_count
    if name == "rdp":
        # dp-accounting itself reduces a Poisson-sampled composition of
        # Gaussians on one sample to a single Gaussian.
        joint = dp_accounting.PoissonSampledDpEvent(
            q,
            dp_accounting.ComposedDpEvent(
                [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(sigma_c)]
            ),
        )
    else:
        # The PLD accountant only takes a Gaussian under a Poisson event: the
        # joint mechanism on (sum / sigma, count / sigma_c) has whitened L2
        # sensitivity sqrt(sigma**-2 + sigma_c**-2).
        joint = _sampled_gaussian(q, 1 / math.sqrt(sigma**-2 + sigma_c**-2))
    parts = [(_sampled_gaussian(q, sigma), plain), (joint, with_count)]
    event = dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(e, n) for e, n in parts if n > 0]
    )
    return _accountant(name, interval).compose(event).get_epsilon(delta)


# (sampling_prob, noise_multiplier, steps, delta, PLD value_discretization_interval):
# dp-accounting's default 1e-4 where it is fast, the tracking 1e-3 elsewhere.
PLANS = [
    (0.01, 1.0, 1000, 1e-5, 1e-4),
    (4096 / 50000, 10.0, 875, 1e-5, 1e-4),
    (256 / 1437, 2.0, 224, 1e-5, 1e-3),
    (0.05, 0.9, 100, 1e-6, 1e-3),
    (0.001, 1.5, 10000, 1e-5, 1e-4),
    (1.0, 5.0, 10, 1e-5, 1e-3),
    (0.2, 3.0, 50, 1e-3, 1e-3),
    (0.02, 1.2, 3000, 1e-7, 1e-4),
    (0.5, 4.0, 20, 1e-5, 1e-3),
    (0.1, 2.0, 1, 1e-5, 1e-3),
    (0.003, 0.8, 500, 1e-5, 1e-3),
]


# ---------------------------------------------------------------------------
# epsilon
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("q,sigma,steps,delta,interval", PLANS)
def test_epsilon_matches_dp_accounting(accountant, q, sigma, steps, delta, interval):
    got = acc.epsilon(
        noised_coordinates=None,
        noise_multiplier=sigma,
        sampling_prob=q,
        steps=steps,
        delta=delta,
        accountant=_configured(accountant, interval),
    )
    want = _reference_epsilon(accountant, q, sigma, steps, delta, interval)
    assert got == pytest.approx(want, rel=1e-6)


def test_zero_steps_cost_nothing():
    for accountant in acc.ACCOUNTANTS:
        eps = acc.epsilon(
            noised_coordinates=None,
            noise_multiplier=1.0,
            sampling_prob=0.1,
            steps=0,
            delta=1e-5,
            accountant=accountant,
        )
        assert eps == 0.0


def test_de_et_al_2022_cifar10_plan():
    # De et al. 2022: CIFAR-10, batch 4096 of 50,000, sigma 10, 875 steps,
    # delta 1e-5 -> epsilon 1. Measured: RDP 0.98771, PLD 0.90277.
    plan = dict(noise_multiplier=10.0, sampling_prob=4096 / 50000, steps=875, delta=1e-5)
    rdp = acc.epsilon(noised_coordinates=None, **plan, accountant="rdp")
    pld = acc.epsilon(noised_coordinates=None, **plan, accountant="pld")
    assert 0.9 <= rdp <= 1.1
    # PLD is tighter than RDP, and both are upper bounds of the same quantity.
    assert 0.8 <= pld <= rdp


@pytest.mark.parametrize("q,sigma,steps", [(0.05, 1.5, 200), (0.2, 3.0, 40), (1.0, 8.0, 5)])
def test_replace_one_matches_dp_accounting(q, sigma, steps):
    got = acc.epsilon(
        noised_coordinates=None,
        noise_multiplier=sigma,
        sampling_prob=q,
        steps=steps,
        delta=1e-5,
        neighboring="replace_one",
        accountant=_configured("pld", 1e-3),
    )
    want = _reference_epsilon("pld", q, sigma, steps, 1e-5, 1e-3, REPLACE_ONE)
    assert got == pytest.approx(want, rel=1e-6)
    add_remove = _reference_epsilon("pld", q, sigma, steps, 1e-5, 1e-3, ADD_REMOVE)
    assert got >= add_remove


def test_replace_one_with_rdp_is_refused():
    with pytest.raises(ValueError, match='accountant="pld"'):
        acc.epsilon(
            noised_coordinates=None,
            noise_multiplier=1.0,
            sampling_prob=0.1,
            steps=10,
            delta=1e-5,
            accountant="rdp",
            neighboring="replace_one",
        )


# ---------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize(
    "target,q,steps",
    [(1.0, 256 / 1437, 224), (2.0, 0.01, 1000), (8.0, 0.05, 100)],
)
def test_calibrated_noise_hits_target(accountant, target, q, steps):
    sigma = acc.calibrate_noise_multiplier(
        noised_coordinates=None,
        target_epsilon=target,
        sampling_prob=q,
        steps=steps,
        delta=1e-5,
        accountant=_configured(accountant, 1e-3),
    )
    eps = _reference_epsilon(accountant, q, sigma, steps, 1e-5, 1e-3)
    assert eps <= target
    assert eps == pytest.approx(target, rel=1e-2)


@pytest.mark.slow  # ~8 s on 2 cores
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibrated_noise_with_counts_hits_target(accountant):
    q, steps, sigma_c, every = 0.05, 100, 8.0, 4
    sigma = acc.calibrate_noise_multiplier(
        noised_coordinates=None,
        target_epsilon=3.0,
        sampling_prob=q,
        steps=steps,
        delta=1e-5,
        accountant=_configured(accountant, 1e-3),
        count_noise_stddev=sigma_c,
        count_every=every,
    )
    eps = _reference_with_counts(accountant, q, sigma, sigma_c, steps, every, 1e-5, 1e-3)
    assert eps <= 3.0
    assert eps == pytest.approx(3.0, rel=1e-2)


def test_calibration_refuses_counts_that_exceed_the_target_alone():
    with pytest.raises(ValueError, match="count_noise_stddev"):
        acc.calibrate_noise_multiplier(
            noised_coordinates=None,
            target_epsilon=0.5,
            sampling_prob=0.5,
            steps=100,
            delta=1e-5,
            accountant="rdp",
            count_noise_stddev=0.5,
        )


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("target,q,sigma", [(1.0, 0.05, 1.5), (4.0, 256 / 1437, 2.5)])
def test_calibrate_steps_is_the_most_steps_within_target(accountant, target, q, sigma):
    n = acc.calibrate_steps(
        noised_coordinates=None,
        target_epsilon=target,
        noise_multiplier=sigma,
        sampling_prob=q,
        delta=1e-5,
        accountant=_configured(accountant, 1e-3),
    )
    assert n >= 1
    assert _reference_epsilon(accountant, q, sigma, n, 1e-5, 1e-3) <= target
    assert _reference_epsilon(accountant, q, sigma, n + 1, 1e-5, 1e-3) > target


# ---------------------------------------------------------------------------
# Composition with the loss scale's count releases
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("sigma_c,every,steps", [(5.0, 1, 100), (2.0, 7, 150), (20.0, 3, 301)])
def test_counts_match_hand_built_composed_event(accountant, sigma_c, every, steps):
    q, sigma, delta = 0.05, 1.2, 1e-5
    got = acc.epsilon(
        noised_coordinates=None,
        noise_multiplier=sigma,
        sampling_prob=q,
        steps=steps,
        delta=delta,
        accountant=_configured(accountant, 1e-3),
        count_noise_stddev=sigma_c,
        count_every=every,
    )
    want = _reference_with_counts(accountant, q, sigma, sigma_c, steps, every, delta, 1e-3)
    assert got == pytest.approx(want, rel=1e-6)
    alone = _reference_epsilon(accountant, q, sigma, steps, delta, 1e-3)
    assert got >= alone


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_counts_cost_tends_to_zero_with_infinite_noise(accountant):
    plan = dict(
        noise_multiplier=1.5,
        sampling_prob=0.05,
        steps=200,
        delta=1e-5,
        accountant=_configured(accountant, 1e-3),
    )
    dpsgd = _reference_epsilon(accountant, 0.05, 1.5, 200, 1e-5, 1e-3)
    extras = []
    for sigma_c in [1.0, 4.0, 16.0, 1e3, 1e6]:
        eps = acc.epsilon(noised_coordinates=None, **plan, count_noise_stddev=sigma_c)
        extras.append(eps - dpsgd)
    assert all(e >= -1e-9 for e in extras)
    assert extras == sorted(extras, reverse=True)  # more count noise, less cost
    assert extras[-1] == pytest.approx(0.0, abs=1e-4 * dpsgd)
    assert acc.epsilon(
        noised_coordinates=None, **plan, count_noise_stddev=math.inf
    ) == pytest.approx(dpsgd, rel=1e-9)


def test_epsilon_breakdown_reports_the_cost_of_the_counts():
    plan = dict(noise_multiplier=1.0, sampling_prob=0.02, steps=300, delta=1e-5)
    b = acc.epsilon_breakdown(
        noised_coordinates=None, **plan, count_noise_stddev=3.0, count_every=2, accountant="rdp"
    )
    want_total = _reference_with_counts("rdp", 0.02, 1.0, 3.0, 300, 2, 1e-5)
    want_dpsgd = _reference_epsilon("rdp", 0.02, 1.0, 300, 1e-5)
    assert b.total == pytest.approx(want_total, rel=1e-6)
    assert b.dpsgd == pytest.approx(want_dpsgd, rel=1e-6)
    assert b.counts == pytest.approx(want_total - want_dpsgd, rel=1e-6, abs=1e-9)
    assert b.counts > 0


def _reference_with_preprocessing(name, q, sigma, steps, sigma_p, delta, interval=1e-4):
    """A one-off Gaussian release of the whole dataset, composed with the steps."""
    parts = [dp_accounting.GaussianDpEvent(sigma_p)]
    if steps:
        parts.append(dp_accounting.SelfComposedDpEvent(_sampled_gaussian(q, sigma), steps))
    event = dp_accounting.ComposedDpEvent(parts)
    return _accountant(name, interval).compose(event).get_epsilon(delta)


@pytest.mark.fast_cases("0-rdp", "0-pld", "1-rdp", "40-rdp")  # all cases: ~7 s on 2 cores
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("steps", [0, 1, 40])
def test_preprocessing_release_matches_hand_built_composed_event(accountant, steps):
    plan = dict(noise_multiplier=1.1, sampling_prob=0.05, steps=steps, delta=1e-5)
    got = acc.epsilon(
        noised_coordinates=None, **plan, accountant=accountant, preprocessing_noise_multiplier=20.0
    )
    want = _reference_with_preprocessing(accountant, 0.05, 1.1, steps, 20.0, 1e-5)
    assert got == pytest.approx(want, rel=1e-6)
    assert got > acc.epsilon(noised_coordinates=None, **plan, accountant=accountant)
    # the tracker composes it too: its first value already includes it
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=1.1,
        sampling_prob=0.05,
        delta=1e-5,
        target_epsilon=50.0,
        accountant=accountant,
        preprocessing_noise_multiplier=20.0,
    )
    tracker = acc.BudgetTracker(budget)
    for _ in range(steps):
        tracker.step()
    want_tracked = _reference_with_preprocessing(accountant, 0.05, 1.1, steps, 20.0, 1e-5, 1e-3)
    assert tracker.spent() == pytest.approx(want_tracked, rel=1e-6)


def test_breakdown_of_a_run_with_counts_and_preprocessing():
    plan = dict(noise_multiplier=1.0, sampling_prob=0.02, steps=300, delta=1e-5, accountant="rdp")
    b = acc.epsilon_breakdown(
        noised_coordinates=None,
        **plan,
        count_noise_stddev=3.0,
        count_every=2,
        preprocessing_noise_multiplier=10.0,
    )
    with_counts = _reference_with_counts("rdp", 0.02, 1.0, 3.0, 300, 2, 1e-5)
    assert b.dpsgd == pytest.approx(_reference_epsilon("rdp", 0.02, 1.0, 300, 1e-5), rel=1e-6)
    assert b.dpsgd + b.counts == pytest.approx(with_counts, rel=1e-6)
    assert b.total == pytest.approx(b.dpsgd + b.counts + b.preprocessing, rel=1e-12)
    assert b.counts > 0 and b.preprocessing > 0
    tracker = acc.BudgetTracker(
        acc.PrivacyBudget(
            noised_coordinates=None,
            noise_multiplier=1.0,
            sampling_prob=0.02,
            delta=1e-5,
            target_epsilon=50.0,
            accountant="rdp",
            count_noise_stddev=3.0,
            count_every=2,
            preprocessing_noise_multiplier=10.0,
        ),
        steps=300,
        count_releases=150,
    )
    tb = tracker.breakdown()
    assert tb.total == pytest.approx(b.total, rel=1e-6)
    assert tb.preprocessing == pytest.approx(b.preprocessing, rel=1e-5)


def test_calibration_accounts_for_the_preprocessing_release():
    common = dict(target_epsilon=2.0, sampling_prob=0.1, steps=100, delta=1e-5, accountant="rdp")
    plain = acc.calibrate_noise_multiplier(noised_coordinates=None, **common)
    sigma = acc.calibrate_noise_multiplier(
        noised_coordinates=None, **common, preprocessing_noise_multiplier=20.0
    )
    assert sigma > plain  # less budget is left for the steps
    got = _reference_with_preprocessing("rdp", 0.1, sigma, 100, 20.0, 1e-5)
    assert got <= 2.0 + 1e-9 and got == pytest.approx(2.0, rel=2e-3)
    with pytest.raises(ValueError, match="preprocessing_noise_multiplier=0.5"):
        acc.calibrate_noise_multiplier(
            noised_coordinates=None, **common, preprocessing_noise_multiplier=0.5
        )


def test_effective_noise_multiplier_matches_dp_accounting_rdp_reduction():
    # dp-accounting's RDP accountant reduces Poisson(q, Composed(G(a), G(b)))
    # itself; the closed form must give the same epsilon.
    q, a, b = 0.1, 1.3, 2.1
    joint = dp_accounting.PoissonSampledDpEvent(
        q,
        dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(a), dp_accounting.GaussianDpEvent(b)]
        ),
    )
    want = _accountant("rdp").compose(dp_accounting.SelfComposedDpEvent(joint, 50))
    got = _reference_epsilon("rdp", q, acc.effective_noise_multiplier(a, b), 50, 1e-5)
    assert got == pytest.approx(want.get_epsilon(1e-5), rel=1e-9)


# ---------------------------------------------------------------------------
# Budget tracker
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("counts", [None, (6.0, 3)])
def test_tracker_refuses_the_step_that_would_exceed_the_target(accountant, counts):
    q, sigma, delta, target = 0.1, 1.5, 1e-5, 1.5
    sigma_c, every = counts if counts else (None, 1)
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=sigma,
        sampling_prob=q,
        delta=delta,
        target_epsilon=target,
        accountant=accountant,
        count_noise_stddev=sigma_c,
        count_every=every,
    )
    tracker = acc.BudgetTracker(budget)
    while tracker.can_step():
        tracker.step()
    n = tracker.steps
    assert n >= 5

    def reference(steps):
        if sigma_c is None:
            return _reference_epsilon(accountant, q, sigma, steps, delta, 1e-3)
        return _reference_with_counts(accountant, q, sigma, sigma_c, steps, every, delta, 1e-3)

    assert reference(n) <= target < reference(n + 1)
    assert tracker.spent() == pytest.approx(reference(n), rel=1e-6)
    assert tracker.count_releases == (n // every if sigma_c else 0)
    spent = tracker.spent()
    with pytest.raises(acc.BudgetExceededError, match="target_epsilon"):
        tracker.step()
    assert tracker.steps == n and tracker.spent() == spent  # unchanged
    assert tracker.remaining_steps() == 0


def test_tracker_remaining_steps_agrees_with_calibrate_steps():
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=2.0,
        sampling_prob=0.05,
        delta=1e-5,
        target_epsilon=2.0,
    )
    total = acc.calibrate_steps(
        noised_coordinates=None,
        target_epsilon=2.0,
        noise_multiplier=2.0,
        sampling_prob=0.05,
        delta=1e-5,
        accountant=acc.get_accountant("pld").for_tracking(),
    )
    tracker = acc.BudgetTracker(budget, steps=100)
    assert tracker.remaining_steps() == total - 100


def test_tracker_explicit_count_releases():
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=1.0,
        sampling_prob=0.02,
        delta=1e-5,
        target_epsilon=10.0,
        accountant="rdp",
        count_noise_stddev=4.0,
        count_every=1000,  # the schedule would release nothing in 30 steps
    )
    tracker = acc.BudgetTracker(budget)
    for i in range(30):
        tracker.step(count_released=(i % 2 == 0))
    assert (tracker.steps, tracker.count_releases) == (30, 15)
    want = _reference_with_counts("rdp", 0.02, 1.0, 4.0, 30, 2, 1e-5)
    assert tracker.spent() == pytest.approx(want, rel=1e-6)
    b = tracker.breakdown()
    assert b.dpsgd == pytest.approx(_reference_epsilon("rdp", 0.02, 1.0, 30, 1e-5), rel=1e-6)
    assert b.total == tracker.spent() and b.counts > 0
    no_counts = acc.BudgetTracker(dataclasses.replace(budget, count_noise_stddev=None))
    with pytest.raises(ValueError, match="count_noise_stddev"):
        no_counts.step(count_released=True)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_tracker_state_round_trips_through_json(accountant):
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=1.2,
        sampling_prob=0.05,
        delta=1e-5,
        target_epsilon=5.0,
        accountant=accountant,
        count_noise_stddev=10.0,
        count_every=4,
    )
    run = acc.BudgetTracker(budget)
    for _ in range(37):
        run.step()
    text = run.to_json()
    json.loads(text)  # plain JSON
    resumed = acc.BudgetTracker.from_json(text)
    assert resumed.budget == budget
    assert (resumed.steps, resumed.count_releases) == (run.steps, run.count_releases)
    assert resumed.spent() == run.spent()
    for _ in range(20):
        assert resumed.step() == pytest.approx(run.step(), rel=1e-9)
    want = _reference_with_counts(accountant, 0.05, 1.2, 10.0, 57, 4, 1e-5, 1e-3)
    assert resumed.spent() == pytest.approx(want, rel=1e-6)


def test_tracker_restore_rejects_a_state_from_another_plan():
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=1.2,
        sampling_prob=0.05,
        delta=1e-5,
        target_epsilon=5.0,
    )
    state = acc.BudgetTracker(budget, steps=10).state_dict()
    state["epsilon"] *= 0.5
    with pytest.raises(ValueError, match="does not match"):
        acc.BudgetTracker.from_state_dict(state)
    state = acc.BudgetTracker(budget, steps=10).state_dict()
    state["budget"]["noise_multipler"] = 1.0
    with pytest.raises(ValueError, match="unknown PrivacyBudget fields"):
        acc.BudgetTracker.from_state_dict(state)


def test_tracker_queries_are_cheap_with_pld():
    # A trainer asks can_step() and spent() every step of a 224-step run.
    budget = acc.PrivacyBudget(
        noised_coordinates=None,
        noise_multiplier=1.9,
        sampling_prob=256 / 1437,
        delta=1e-5,
        target_epsilon=8.0,
        count_noise_stddev=25.0,
    )
    tracker = acc.BudgetTracker(budget)
    start = time.perf_counter()
    for _ in range(224):
        assert tracker.can_step()
        tracker.step()
        tracker.spent()
    elapsed = time.perf_counter() - start
    assert elapsed < 15.0, elapsed  # measured ~0.5 s on 2 shared CPU cores
    want = _reference_with_counts("pld", 256 / 1437, 1.9, 25.0, 224, 1, 1e-5, 1e-3)
    assert tracker.spent() == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------------------
# Validation: errors name the field and its allowed range.
# ---------------------------------------------------------------------------

GOOD = dict(noise_multiplier=1.0, sampling_prob=0.1, steps=10, delta=1e-5)


@pytest.mark.parametrize(
    "field,value,error,message",
    [
        ("sampling_prob", 0.0, ValueError, r"sampling_prob must be in \(0, 1\]"),
        ("sampling_prob", 1.5, ValueError, r"sampling_prob must be in \(0, 1\]"),
        ("delta", 0.0, ValueError, r"delta must be in \(0, 1\)"),
        ("delta", 1.0, ValueError, r"delta must be in \(0, 1\)"),
        ("steps", -1, ValueError, r"steps must be an integer >= 0"),
        ("steps", 2.5, TypeError, r"steps must be an integer >= 0"),
        ("steps", True, TypeError, r"steps must be an integer >= 0"),
        ("noise_multiplier", 0.0, ValueError, r"must be in \[1e-06, 1e\+06\] or inf"),
        ("noise_multiplier", 1e300, ValueError, r"noise_multiplier must be in \[1e-06, 1e\+06\]"),
        ("noise_multiplier", float("nan"), ValueError, "noise_multiplier must not be NaN"),
        ("accountant", "moments", ValueError, r"accountant must be one of \('rdp', 'pld'\)"),
        ("neighboring", "zero_out", ValueError, "neighboring must be one of"),
        ("count_every", 0, ValueError, r"count_every must be an integer >= 1"),
        ("count_noise_stddev", -1.0, ValueError, r"count_noise_stddev must be in \[1e-06"),
        ("count_noise_stddev", 1e-300, ValueError, r"count_noise_stddev must be in \[1e-06"),
    ],
)
def test_epsilon_errors_name_the_field(field, value, error, message):
    with pytest.raises(error, match=message):
        acc.epsilon(noised_coordinates=None, **{**GOOD, field: value})


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("target_epsilon", 0.0, r"target_epsilon must be in \(0, 100\]"),
        ("target_epsilon", math.inf, r"target_epsilon must be in \(0, 100\]"),
        ("target_epsilon", 1000.0, r"target_epsilon must be in \(0, 100\]"),
        ("accountant", "moments", r"accountant must be one of \("),
        ("neighboring", "zero_out", "neighboring must be one of"),
        ("sampling_prob", -0.1, r"sampling_prob must be in \(0, 1\]"),
    ],
)
def test_budget_errors_name_the_field(field, value, message):
    good = dict(noise_multiplier=1.0, sampling_prob=0.1, delta=1e-5, target_epsilon=1.0)
    with pytest.raises(ValueError, match=message):
        acc.PrivacyBudget(noised_coordinates=None, **{**good, field: value})


# ---- the snapped noise's floating-point residual ------------------------------------


def test_cell_log_ratio_bounds_the_exact_mass_change_mpmath():
    """A cell [a, b] whose edges move by the accounted z-error tau, at its widest
    (1/32) and narrowest (1/64) and anywhere within 8 and 11 sigma: the exact
    log-ratio of the moved to the true Gaussian mass (40-digit mpmath) is within
    the per-cell bound noise_residual composes."""
    import mpmath

    from dpmp.noise._snapped import CONTRACT

    _U_REL, _cell_log_ratio = CONTRACT.uniform_rel_error, CONTRACT.cell_log_ratio

    mpmath.mp.dps = 50
    rng = np.random.default_rng(1)
    for reach, kappa in CONTRACT.ndtri_rel_error:
        bound = _cell_log_ratio(reach, kappa)
        # tau at the reach, inflated a million times so the ratio rises far above
        # mpmath's rounding; the bound, linear in tau, is inflated alike
        tau = mpmath.mpf((kappa + _U_REL) * (reach + 2.0)) * 10**6
        worst = 0.0
        for width in (1 / 32, 1 / 64):
            for a in np.append(rng.uniform(-reach, reach - width, 200), reach - width):
                a, b = mpmath.mpf(a), mpmath.mpf(a) + mpmath.mpf(width)
                exact = mpmath.ncdf(b) - mpmath.ncdf(a)
                grown = mpmath.ncdf(b + tau) - mpmath.ncdf(a - tau)
                shrunk = mpmath.ncdf(b - tau) - mpmath.ncdf(a + tau)
                worst = max(
                    worst, float(mpmath.log(grown / exact)), -float(mpmath.log(shrunk / exact))
                )
        assert 0.5 * bound * 10**6 < worst <= bound * 10**6 * 1.001, (reach, worst, bound)


@pytest.mark.slow  # ~4 s on 2 cores
def test_epsilon_with_noised_coordinates_includes_the_residual():
    plan = dict(sampling_prob=0.01, steps=500, delta=1e-5, noise_multiplier=1.1)
    exact = acc.epsilon(noised_coordinates=None, **plan)
    drawn = acc.epsilon(**plan, noised_coordinates=20_000)
    res = acc.noise_residual(coordinates=20_000, releases=500, noise_multiplier=1.1, delta=1e-5)
    assert 0 < res.delta_tail <= 2 * acc.RESIDUAL_DELTA_SHARE * 1e-5 and res.epsilon > 0
    # the residual epsilon, plus the (tiny) cost of the delta it takes away
    assert res.epsilon <= drawn - exact <= res.epsilon * 1.1 + 1e-6
    breakdown = acc.epsilon_breakdown(**plan, count_noise_stddev=None, noised_coordinates=20_000)
    assert breakdown.total == drawn and breakdown.noise_residual == pytest.approx(drawn - exact)
    # it hardly depends on sigma (calibration evaluates it once, at a floor)
    eps = [
        acc.noise_residual(coordinates=20_000, releases=500, noise_multiplier=s, delta=1e-5).epsilon
        for s in (0.5, 0.7, 1.0, 2.0)
    ]
    assert max(eps) <= 1.2 * min(eps)


def test_residual_grows_with_the_square_root_of_a_steps_coordinates():
    """Concentrated within each step: 4x the coordinates about doubles it (summing
    the per-cell bounds, as before, quadrupled it); 2x the steps a little more
    than doubles it (the union bound over steps adds to the log)."""

    def lam(d, t):
        return acc.noise_residual(
            coordinates=d, releases=t, noise_multiplier=1.0, delta=1e-5
        ).log_ratio

    for d in (10**6, 10**8):
        assert 1.9 < lam(4 * d, 1000) / lam(d, 1000) < 2.1
    assert 2.0 < lam(10**7, 2000) / lam(10**7, 1000) < 2.1
    # replace-one: three mixture components, a shift twice as large: a little more
    more = acc.noise_residual(
        coordinates=10**7,
        releases=1000,
        noise_multiplier=1.0,
        delta=1e-5,
        neighboring="replace_one",
    )
    assert lam(10**7, 1000) < more.log_ratio < 1.2 * lam(10**7, 1000)


@pytest.mark.parametrize(
    "coordinates,steps,target",
    [(125_000_000, 5_000, 0.01), (7_000_000_000, 1_000, 0.02), (10**10, 10_000, 0.2)],
)
def test_residual_stays_small_at_the_sizes_models_are_trained(coordinates, steps, target):
    """RDP, q 0.01, sigma 1, delta 1e-5: the epsilon the snapped noise adds (total
    minus exact, the delta it takes included). Summing per-cell bounds gave 9-10
    at 125M x 5,000 and refused 7B x 1,000 outright."""
    plan = dict(noise_multiplier=1.0, sampling_prob=0.01, steps=steps, delta=1e-5)
    parts = acc.epsilon_breakdown(
        **plan, accountant="rdp", count_noise_stddev=None, noised_coordinates=coordinates
    )
    assert 0 < parts.noise_residual <= target
    assert parts.total == pytest.approx(parts.dpsgd + parts.noise_residual)


@pytest.mark.slow  # ~4 s on 2 cores
def test_residual_of_the_default_run_is_below_1e_5():
    """The default config (digits MLP, epsilon 2): its calibrated plan's residual."""
    from dpmp.app.inputs import load_data, model_from_config
    from dpmp.app.trainer.plan import noise_plan

    config = dpmp.Config()
    data = load_data(config.data, config.training.seed)
    model = model_from_config(config.model, data, config.precision)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    plan = noise_plan(config, num_train=data.num_train, params_shape=shapes)
    assert plan.noised_coordinates == sum(x.size for x in jax.tree.leaves(shapes))
    parts = acc.epsilon_breakdown(
        noise_multiplier=plan.noise_multiplier,
        sampling_prob=plan.sampling_prob,
        steps=config.training.steps,
        delta=config.privacy.delta,
        count_noise_stddev=plan.count_noise_stddev,
        noised_coordinates=plan.noised_coordinates,
    )
    assert 0 < parts.noise_residual <= 1e-5


def test_residual_delta_is_not_multiplied_by_e_to_the_epsilon():
    """The failure set is defined under both neighbours' likelihoods, so its
    probability enters delta as it is: a large epsilon target is not refused by
    the residual (a bound with e^(eps + E) beta refused a target of 30)."""
    plan = dict(sampling_prob=0.05, steps=300, delta=1e-5, noised_coordinates=2_000_000)
    sigma = acc.calibrate_noise_multiplier(target_epsilon=30.0, accountant="rdp", **plan)
    spent = acc.epsilon(noise_multiplier=sigma, accountant="rdp", **plan)
    assert 29 < spent <= 30
    res = acc.noise_residual(
        coordinates=2_000_000, releases=300, noise_multiplier=sigma, delta=1e-5
    )
    assert res.ideal_delta(1e-5) == pytest.approx(
        math.exp(-res.log_ratio) * (1e-5 - res.delta_tail)
    )


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_residual_constants_against_mpmath():
    """Each constant of the derivation against a 50-digit mpmath reference: the
    sampler's accurate reach covers SNAP_TAIL and a cell; the tail masses; the L1
    distance of shifted snapped cell distributions (the mean term's sqrt(2/pi));
    and the Chernoff count of tail coordinates against the exact Poisson tail."""
    import mpmath
    from scipy import stats

    from dpmp.accounting._residual import _outside_mass, _tail_count
    from dpmp.noise._snapped import CONTRACT

    SNAP_TAIL = CONTRACT.tail

    mpmath.mp.dps = 50
    # the uniform is exact down to 2^-77: |z| = 10.01 > SNAP_TAIL + a cell + slack
    reach = -mpmath.sqrt(2) * mpmath.erfinv(2 * mpmath.mpf(2) ** -77 - 1)
    assert float(reach) > SNAP_TAIL + 1 / 32 + 1e-3
    assert float(reach) == pytest.approx(10.014, abs=1e-3)
    # Sum_i P(|Z + t_i| > L) over random splits of |t| <= t_max: within the bound
    rng = np.random.default_rng(3)
    for L, n, t_max in ((8 - 1 / 32, 1000, 1.0), (SNAP_TAIL - 1 / 32, 50, 2.0)):
        bound = _outside_mass(L, n, t_max)
        for _ in range(5):
            t = rng.normal(size=n) * rng.uniform(0, 1, n) ** 4
            t *= t_max / np.linalg.norm(t)
            exact = sum(
                mpmath.ncdf(-L - mpmath.mpf(x)) + mpmath.ncdf(-L + mpmath.mpf(x)) for x in t
            )
            assert float(exact) <= bound
        zero = n * 2 * mpmath.ncdf(-L)
        assert float(zero) <= bound
    # L1 distance of the snapped cells of N(x, 1) and N(x + t, 1) <= t sqrt(2/pi)
    for t in (1e-3, 0.1, 0.7):
        for width, x in ((1 / 32, 0.0), (1 / 64, 0.013)):
            edges = [mpmath.mpf(k) * width - width / 2 for k in range(-700, 701)]
            p = [mpmath.ncdf(b - x) - mpmath.ncdf(a - x) for a, b in zip(edges, edges[1:])]
            q = [mpmath.ncdf(b - x - t) - mpmath.ncdf(a - x - t) for a, b in zip(edges, edges[1:])]
            l1 = sum(abs(a - b) for a, b in zip(p, q))
            assert float(l1) <= t * math.sqrt(2 / math.pi)
            assert float(l1) >= 0.9 * t * math.sqrt(2 / math.pi)  # and the bound is tight
    # Chernoff's count k: the exact Poisson tail (the extreme of Bernoulli sums
    # with that mean) beyond k is within the target, and k is not far above it
    for mu, target in ((0.5, 1e-12), (30.0, 1e-12), (1e4, 1e-11)):
        k = _tail_count(mu, math.log(target))
        assert stats.poisson.sf(k, mu) <= target
        exact_k = int(stats.poisson.isf(target, mu))
        assert k <= max(2 * exact_k, exact_k + 10)


def test_tail_count_counts_coordinates_not_coordinate_component_pairs():
    """Step 4 of the residual's derivation counts coordinates outside some
    component's core. One coordinate, two components of one mean (t = 0), outside
    each core with probability 1e-3 (the same event for both): the union bound's
    mean, as the residual computes it, is 2e-3, and Chernoff's count for a 1e-4
    failure is k = 1. Exactly: the coordinate count is 1 with probability 1e-3, so it
    exceeds k never; the pair count is 2 with probability 1e-3 > 1e-4, so Chernoff's
    bound fails for pairs, which are dependent."""
    from scipy import special, stats

    from dpmp.accounting._residual import _outside_mass, _tail_count

    p, target, components = 1e-3, 1e-4, 2
    reach = -float(special.ndtri(p / 2))  # P(|Z| > reach) = p
    mu = components * 1 * _outside_mass(reach, 1, 0.0)  # c T _outside_mass, as in residual
    assert mu == pytest.approx(components * p, rel=1e-12)
    k = _tail_count(mu, math.log(target))
    assert k == 1
    assert math.exp(-mu) * (math.e * mu / (k + 1)) ** (k + 1) <= target  # the bound k rests on
    coordinates = {0: 1 - p, 1: p}  # exact distributions: one Bernoulli ...
    pairs = {0: 1 - p, components: p}  # ... and the same event counted twice
    assert sum(q for n, q in coordinates.items() if n > k) == 0 <= target
    assert sum(q for n, q in pairs.items() if n > k) == pytest.approx(p) and p > target
    # the same against scipy: the pairs of one mean are c times a binomial count
    assert stats.binom.sf(k // components, 1, p) == pytest.approx(p)


@pytest.mark.parametrize(
    "coordinates,steps,components,p,target",
    [
        (1, 1, 2, 1e-3, 1e-4),
        (1_000, 100, 2, 1e-6, 1e-8),
        (10_000, 50, 2, 1e-4, 1e-10),
        (100_000, 1_000, 3, 1e-8, 1e-12),
        (19_210, 300, 2, 1.6e-15, 5e-12),  # the default run's core, 8 - 1/32 stddevs
    ],
)
def test_tail_count_bounds_the_binomial_count_of_tail_coordinates(
    coordinates, steps, components, p, target
):
    """``_tail_count`` against scipy's binomial tail: a coordinate outside each of
    ``c`` cores with probability ``p`` is outside some core with probability at most
    ``c p`` (disjoint events are the union bound's worst case); over ``d T``
    independent coordinates their count is then at most a Binomial(d T, c p), whose
    exact tail beyond the ``k`` computed from the residual's mean ``c T d p`` is
    within the target, and ``k`` is not far above the exact quantile."""
    from scipy import special, stats

    from dpmp.accounting._residual import _outside_mass, _tail_count

    reach = -float(special.ndtri(p / 2))
    mu = components * steps * _outside_mass(reach, coordinates, 0.0)
    assert mu == pytest.approx(components * steps * coordinates * p, rel=1e-9)
    k = _tail_count(mu, math.log(target))
    trials, union = coordinates * steps, min(1.0, components * p)
    assert stats.binom.sf(k, trials, union) <= target
    exact_k = int(stats.binom.isf(target, trials, union))
    assert exact_k <= k <= max(2 * exact_k, exact_k + 10)


def test_core_mean_lemma_numerically():
    """Step 3's lemma: for pmfs p~ = p e^a with |a| <= eta on a core set, the mean
    sum_core p~ a lies within [P~ - P, P~ - P + (e^eta - 1)^2] (float64 with a
    large eta, so rounding cannot matter)."""
    rng = np.random.default_rng(4)
    for eta in (1e-3, 0.05):
        p = rng.dirichlet(np.ones(400))
        a = rng.uniform(-eta, eta, 400)
        core = np.arange(400) < 300
        drawn = p * np.exp(a)
        drawn[~core] *= (1 - drawn[core].sum()) / drawn[~core].sum()  # a pmf again
        mean = np.sum(drawn[core] * a[core])
        diff = drawn[core].sum() - p[core].sum()
        assert diff - 1e-15 <= mean <= diff + math.expm1(eta) ** 2 + 1e-15


def test_calibration_and_tracker_cover_the_residual():
    plan = dict(sampling_prob=0.05, steps=200, delta=1e-5, accountant="rdp")
    sigma = acc.calibrate_noise_multiplier(target_epsilon=2.0, noised_coordinates=50_000, **plan)
    assert sigma > acc.calibrate_noise_multiplier(
        noised_coordinates=None, target_epsilon=2.0, **plan
    )
    assert acc.epsilon(noise_multiplier=sigma, noised_coordinates=50_000, **plan) <= 2.0
    budget = acc.PrivacyBudget(
        noise_multiplier=sigma,
        sampling_prob=0.05,
        delta=1e-5,
        target_epsilon=3.0,
        accountant="rdp",
        noised_coordinates=50_000,
    )
    tracker = acc.BudgetTracker(budget, steps=200)
    expected = acc.epsilon(noise_multiplier=sigma, noised_coordinates=50_000, **plan)
    assert tracker.spent() == pytest.approx(expected, rel=1e-6)
    parts = tracker.breakdown()
    assert parts.noise_residual > 0 and parts.total == pytest.approx(
        parts.dpsgd + parts.noise_residual
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: acc.epsilon(noise_multiplier=1.0, sampling_prob=0.1, steps=1, delta=1e-5),
        lambda: acc.calibrate_noise_multiplier(
            target_epsilon=1.0, sampling_prob=0.1, steps=1, delta=1e-5
        ),
        lambda: acc.PrivacyBudget(
            noise_multiplier=1.0, sampling_prob=0.1, delta=1e-5, target_epsilon=1.0
        ),
    ],
)
def test_accounting_refuses_to_guess_the_noised_coordinates(call):
    with pytest.raises(ValueError, match="noised_coordinates: required: the number"):
        call()


def test_noise_residual_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="coordinates"):
        acc.noise_residual(coordinates=0, releases=1, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        acc.noise_residual(coordinates=1, releases=1, noise_multiplier=1.0, delta=2.0)
    with pytest.raises(ValueError, match="noised_coordinates"):
        acc.epsilon(
            noise_multiplier=1.0, sampling_prob=0.1, steps=1, delta=1e-5, noised_coordinates=-3
        )
    # too little noise: the message names the setting and a value that would fit
    with pytest.raises(ValueError, match=r"noise_multiplier: too small .* \(about ([0-9.]+)") as e:
        acc.epsilon(
            noise_multiplier=0.08,
            sampling_prob=0.5,
            steps=300,
            delta=1e-5,
            noised_coordinates=10**6,
            accountant="rdp",
        )
    enough = float(re.search(r"about ([0-9.]+)", str(e.value)).group(1))
    acc.noise_residual(coordinates=10**6, releases=300, noise_multiplier=enough, delta=1e-5)
    assert (
        acc.noise_residual(
            coordinates=10**6, releases=300, noise_multiplier=enough, delta=1e-5
        ).delta_tail
        <= 0.5e-5
    )


@pytest.mark.slow  # three calibrations, ~30 s; test_cli refuses 1e6 in the default suite
def test_calibration_stops_at_its_floor_with_one_line_instead_of_searching_on():
    """A target no noise multiplier >= MIN_CALIBRATED_NOISE needs is refused, in
    bounded time (it was minutes for 1e6), with the epsilon the floor spends
    (checked against dp-accounting directly)."""
    floor = acc.MIN_CALIBRATED_NOISE
    event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(floor))
    spent = (
        dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        .compose(event, 10)
        .get_epsilon(1e-5)
    )
    for target in (acc.MAX_EPSILON, spent + 1):
        with pytest.raises(ValueError, match=rf"noise multiplier {floor:g} already spends"):
            acc.calibrate_noise_multiplier(
                noised_coordinates=None,
                target_epsilon=target,
                sampling_prob=0.1,
                steps=10,
                delta=1e-5,
            )
    sigma = acc.calibrate_noise_multiplier(
        noised_coordinates=None, target_epsilon=spent - 1, sampling_prob=0.1, steps=10, delta=1e-5
    )
    assert floor < sigma < 1.2 * floor


@pytest.mark.parametrize("fn", ["epsilon", "calibrate_noise_multiplier"])
def test_more_than_max_steps_is_refused_before_any_allocation(fn):
    kwargs = dict(sampling_prob=0.01, steps=acc.MAX_STEPS + 1, delta=1e-5, noised_coordinates=None)
    kwargs["noise_multiplier" if fn == "epsilon" else "target_epsilon"] = 1.0
    with pytest.raises(ValueError, match="steps must be at most 1,000,000"):
        getattr(acc, fn)(**kwargs)


@pytest.mark.slow  # ~3 s on 2 cores
def test_a_plan_beyond_max_epsilon_is_refused_at_once_not_accounted_for_minutes():
    """sigma 1, q 0.5, 10^6 steps: its PLD was killed for memory on a 24 GiB
    machine, sigma 0.1 over 10 steps took 15 s. Both are refused in well under a
    second, because dp-accounting's own RDP accountant bounds them above 100."""
    import time

    for sigma, q, steps in ((1.0, 0.5, 10**6), (0.1, 0.1, 10)):
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
        assert dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5) > acc.MAX_EPSILON
        start = time.perf_counter()
        with pytest.raises(ValueError, match="spends more than epsilon 100 .*RDP bound"):
            acc.epsilon(
                noised_coordinates=None,
                noise_multiplier=sigma,
                sampling_prob=q,
                steps=steps,
                delta=1e-5,
            )
        assert time.perf_counter() - start < 2.0
        tracker = acc.BudgetTracker(
            acc.PrivacyBudget(
                noised_coordinates=None,
                noise_multiplier=sigma,
                sampling_prob=q,
                delta=1e-5,
                target_epsilon=100.0,
            )
        )
        assert tracker.remaining_steps(steps) < steps  # beyond the limit counts as spent


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_a_plan_within_max_epsilon_is_dp_accountings_pld():
    """The guard leaves plans below the limit alone: epsilon near 64 (RDP bound
    82) is what dp-accounting's PLD accountant gives."""
    sigma, q, steps = 1.0, 0.5, 200
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    want = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    got = acc.epsilon(
        noised_coordinates=None, noise_multiplier=sigma, sampling_prob=q, steps=steps, delta=1e-5
    )
    assert 50 < want < acc.MAX_EPSILON and got == pytest.approx(want, rel=1e-9)


def test_a_tiny_count_noise_is_refused_in_one_line_not_an_overflow():
    with pytest.raises(ValueError, match=r"count_noise_stddev must be in \[1e-06"):
        acc.epsilon(
            noised_coordinates=None,
            noise_multiplier=1.0,
            sampling_prob=0.1,
            steps=10,
            delta=1e-5,
            count_noise_stddev=1e-300,
        )
    # the effective multiplier of the smallest allowed values is finite and exact
    got = acc.effective_noise_multiplier(1e-6, 1e-6)
    assert got == pytest.approx(1e-6 / math.sqrt(2), rel=1e-15)
