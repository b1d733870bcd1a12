"""Privacy accounting for everything a dpmp run releases, on dp-accounting events.

A DP-SGD run releases, at every step, the sum of clipped per-example gradients
of a Poisson-sampled batch plus Gaussian noise (Abadi et al. 2016). A run that
uses a *private dynamic loss scale* also releases, every ``count_every`` steps,
a noised count of the examples of that step's batch whose gradient overflowed.
This module turns such a plan into dp-accounting events and asks dp-accounting's
RDP or PLD accountant for epsilon; it does not re-implement any of the analysis.

The events, per step (``q`` = sampling probability, ``sigma`` = noise
multiplier, ``sigma_c`` = ``count_noise_stddev``)::

    plain step:       PoissonSampledDpEvent(q, GaussianDpEvent(sigma))
    step with count:  PoissonSampledDpEvent(q, GaussianDpEvent(sigma_eff))
                      sigma_eff = (sigma**-2 + sigma_c**-2) ** -0.5
    run of n steps:   ComposedDpEvent([SelfComposedDpEvent(plain, n - k),
                                       SelfComposedDpEvent(with_count, k)])
                      k = n // count_every
    preprocessing:    GaussianDpEvent(sigma_p), once, composed with the run
                      (a release computed from the whole training set before
                      training, e.g. private feature statistics; not subsampled)

Formal Guarantees:
  * Each step's gradient sum has L2 sensitivity ``D`` and gets noise of stddev
    ``sigma * D``: ``D = g.sensitivity(batch_size=...)`` of ``dpmp.private_grad``,
    the clip norm ``C`` plus a bound on the sum's floating-point rounding (the
    trainer draws its noise for it); each released count has sensitivity 1 (one
    example changes a count over the batch by at most one) and gets noise of
    stddev ``sigma_c``. Both are computed from the *same* Poisson sample, so
    they are not two independently subsampled mechanisms: they form one
    Gaussian mechanism on the vector ``(sum / (sigma C), count / sigma_c)``
    whose L2 sensitivity is ``sqrt(sigma**-2 + sigma_c**-2) = 1 / sigma_eff``,
    and a Gaussian mechanism's privacy loss depends only on that ratio.
    dp-accounting's RDP accountant applies the same reduction to
    ``PoissonSampledDpEvent(q, ComposedDpEvent([Gaussian(sigma),
    Gaussian(sigma_c)]))``; we write it out so that the PLD accountant, which
    only takes a Gaussian under a Poisson event, accounts for it too. (If an
    overflowed example is zeroed out of the gradient sum, the sensitivity is
    really ``max(1/sigma, 1/sigma_c)``; we do not rely on that.)
  * A count released every ``count_every`` steps is assumed to be the count of
    the batch of that one step. A count summed over several steps' batches has
    a larger sensitivity and is *not* covered by these events.
  * ``accountant="rdp"``: Renyi DP of the sampled Gaussian mechanism (Mironov
    2017, "Renyi differential privacy"; Mironov, Talwar & Zhang 2019, "Renyi
    differential privacy of the sampled Gaussian mechanism"), converted to
    (epsilon, delta) by dp-accounting. An upper bound; typically loose by
    5-20 percent.
  * ``accountant="pld"``: privacy loss distributions (Koskela, Jalko & Honkela
    2020, "Computing tight differential privacy guarantees using FFT";
    Doroshenko et al. 2022, "Connect the dots: tighter discrete approximations
    of privacy loss distributions"), with dp-accounting's *pessimistic*
    discretisation: the reported epsilon is an upper bound for every
    ``value_discretization_interval``; a coarser interval gives a slightly
    larger (safer) epsilon, faster.
  * ``neighboring="add_or_remove"`` (default) is adjacency by adding or
    removing one example, the relation under which Poisson sampling is
    analysed. ``"replace_one"`` (substitute one example) is supported by the
    PLD accountant only; its count analysis is conservative (it allows a
    count to move by 2 where a substitution moves it by at most 1).
  * Poisson-sampled batches that were truncated to a fixed size are not
    described by these events; see ``dpmp.PoissonSampler`` for the bound.
  * The events assume exactly Gaussian noise. Every function here takes
    ``noised_coordinates`` (the trainable parameter count; required, no silent
    default), so that each epsilon covers the noise dpmp actually draws,
    ``dpmp.snapped_gaussian``: ``noise_residual`` bounds its deviation from
    the Gaussian per grid cell and composes it over the run, concentrated
    within each step (it grows like the square root of the coordinates).
    ``noised_coordinates=None`` accounts an exact Gaussian sampler instead.

Reference point: De et al. 2022 ("Unlocking high-accuracy differentially
private image classification through scale"), CIFAR-10 with q = 4096/50000,
sigma = 10, 875 steps, delta = 1e-5, reports epsilon = 1; this module gives
0.9877 with RDP and 0.9028 with PLD for exact Gaussian noise, and 0.9879 with
RDP for dpmp's snapped noise on its 2.75M parameters.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import numbers
from typing import Any, NamedTuple

import dp_accounting
import numpy as np
from dp_accounting import mechanism_calibration
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special as scipy_special

__all__ = [
    "ACCOUNTANTS",
    "NEIGHBORING_RELATIONS",
    "NEIGHBOURING_RELATION_NOTE",
    "REPORT_DISCRETIZATION",
    "REQUIRED",
    "RESIDUAL_DELTA_SHARE",
    "SNAP_TAIL",
    "TRACKING_DISCRETIZATION",
    "BudgetExceededError",
    "BudgetTracker",
    "EpsilonBreakdown",
    "NoiseResidual",
    "PrivacyBudget",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "count_releases",
    "dpsgd_event",
    "effective_noise_multiplier",
    "epsilon",
    "epsilon_breakdown",
    "noise_residual",
]

ACCOUNTANTS = ("rdp", "pld")
NEIGHBORING_RELATIONS = ("add_or_remove", "replace_one")

_NEIGHBORING = {
    "add_or_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE,
}

# dp-accounting's own default: used for the numbers a run reports.
REPORT_DISCRETIZATION = 1e-4
# The most steps a plan may have. Epsilon of 10^6 steps takes 1-5 s (q 0.01 to
# 0.5); of 10^7 steps at q 0.5, 30-100 s per evaluation (minutes to calibrate);
# of 10^9 it runs out of memory (what a user typo would otherwise reach).
MAX_STEPS = 10**6
# Calibration does not go below this noise multiplier: an epsilon that needs
# less noise promises little, and its accounting slows down (seconds per
# evaluation at 0.3, minutes for the whole search at 0.1).
MIN_CALIBRATED_NOISE = 0.3
# The most epsilon dpmp accounts. A plan is first bounded by dp-accounting's RDP
# accountant at a few integer orders (a valid upper bound, ~15 ms at any step
# count); one whose bound exceeds this is refused by ``epsilon`` and counts as
# infinite in calibration and in the tracker. Such a guarantee is void, and its
# privacy loss distribution is what runs away: PLD epsilon 330 took 15 s, 1300
# took 46 s, and a plan near 10^6 (sigma 1, q 0.5, 10^6 steps) was killed for
# memory on a 24 GiB machine; at an RDP bound near 100 the PLD takes ~2 s and
# under 0.5 GB.
MAX_EPSILON = 100.0
# Noise multipliers outside [1 / this, this] are refused (dp-accounting
# overflows near 1e300 and 1e-300; no plan needs either: calibration stops at
# 1e6 too, and below 1e-6 nothing is private). ``inf`` means no release.
MAX_NOISE_MULTIPLIER = 1e6
_BOUND_ORDERS = (1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)

# Used by the per-step budget tracker: 10x coarser, still pessimistic (an upper
# bound), about 10x faster; epsilon moves in the 5th significant digit.
TRACKING_DISCRETIZATION = 1e-3


# The relation a dpmp run's guarantee is stated for, in words (report, README).
NEIGHBOURING_RELATION_NOTE = (
    "zero-out: two datasets are neighbours if one record of one is replaced, in the "
    "other, by a null record that contributes nothing (a zero gradient, zero to every "
    "count and statistic). The number of records n is public, and so are the "
    "sampling probability and noise multiplier computed from it. Poisson sampling "
    "is accounted with the add-or-remove-one analysis, which covers zero-out "
    "neighbours (a null record behaves exactly like a removed one)."
)


class BudgetExceededError(RuntimeError):
    """Raised when a step would take the run past its target epsilon."""


class EpsilonBreakdown(NamedTuple):
    """Epsilon of a run, and the parts of it that the other releases cost.

    Attributes:
      total: epsilon of everything released (preprocessing, DP-SGD steps, counts).
      dpsgd: epsilon of the DP-SGD steps alone, as if nothing else were released.
      counts: what the count releases add to ``dpsgd``: the loss scale's cost.
      preprocessing: what the preprocessing release adds on top.
      noise_residual: what the drawn noise adds to the exact Gaussian's epsilon
        (``noise_residual``; 0 when the plan does not count noised coordinates):
        ``total = dpsgd + counts + preprocessing + noise_residual``.
    """

    total: float
    dpsgd: float
    counts: float
    preprocessing: float = 0.0
    noise_residual: float = 0.0


# ---------------------------------------------------------------------------
# Validation: every error names the field and its allowed range.
# ---------------------------------------------------------------------------


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN.")
    return value


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    value = _real(name, value)
    low, high = 1 / MAX_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
    if not (low <= value <= high or value == math.inf):
        raise ValueError(f"{name} must be in [{low:g}, {high:g}] or inf, got {value}.")
    return value


def _check_sampling_prob(value: Any) -> float:
    value = _real("sampling_prob", value)
    if not 0 < value <= 1:
        raise ValueError(f"sampling_prob must be in (0, 1], got {value}.")
    return value


def _check_delta(value: Any) -> float:
    value = _real("delta", value)
    if not 0 < value < 1:
        raise ValueError(f"delta must be in (0, 1), got {value}.")
    return value


def _check_target_epsilon(value: Any) -> float:
    value = _real("target_epsilon", value)
    if not 0 < value <= MAX_EPSILON:
        raise ValueError(
            f"target_epsilon must be in (0, {MAX_EPSILON:g}], got {value} (dpmp accounts no "
            f"plan beyond epsilon {MAX_EPSILON:g}: such a guarantee promises nothing)."
        )
    return value


def _check_steps(value: Any, minimum: int) -> int:
    steps = _check_int("steps", value, minimum)
    if steps > MAX_STEPS:
        raise ValueError(f"steps must be at most {MAX_STEPS:,}, got {steps:,}.")
    return steps


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}.")
    return value


def _check_accountant(value: Any) -> str:
    if value not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {value!r}.")
    return value


def _check_neighboring(value: Any, accountant: str) -> str:
    if value not in NEIGHBORING_RELATIONS:
        raise ValueError(f"neighboring must be one of {NEIGHBORING_RELATIONS}, got {value!r}.")
    if value == "replace_one" and accountant != "pld":
        raise ValueError(
            'neighboring="replace_one" needs accountant="pld": dp-accounting\'s RDP '
            "accountant has no replace-one analysis of Poisson sampling."
        )
    return value


def _check_count_noise(value: Any) -> float | None:
    if value is None:
        return None
    return _check_noise_multiplier(value, "count_noise_stddev")


def _check_preprocessing(value: Any) -> float | None:
    if value is None:
        return None
    return _check_noise_multiplier(value, "preprocessing_noise_multiplier")


def _check_interval(value: Any) -> float:
    value = _real("value_discretization_interval", value)
    if not 0 < value < 1:
        raise ValueError(f"value_discretization_interval must be in (0, 1), got {value}.")
    return value


# ---------------------------------------------------------------------------
# Events.
# ---------------------------------------------------------------------------


def effective_noise_multiplier(noise_multiplier: float, count_noise_stddev: float | None) -> float:
    """Noise multiplier of one step that releases both the gradient and a count.

    ``(sigma**-2 + sigma_c**-2) ** -0.5``: the two releases are one Gaussian
    mechanism on a shared Poisson sample (see the module docstring). With
    ``count_noise_stddev=None`` (no count) or ``inf`` this is ``sigma``.
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    sigma_c = _check_count_noise(count_noise_stddev)
    if sigma_c is None or sigma_c == math.inf:
        return sigma
    if sigma == math.inf:
        return sigma_c
    # 1 / hypot: the sum of inverse squares overflowed for sigma near 1e-300
    return 1.0 / math.hypot(1.0 / sigma, 1.0 / sigma_c)


def count_releases(steps: int, count_every: int = 1) -> int:
    """Number of counts released in ``steps`` steps: one at steps k, 2k, ... (1-based)."""
    steps = _check_steps(steps, 0)
    count_every = _check_int("count_every", count_every, 1)
    return steps // count_every


def _split_steps(steps: int, count_noise_stddev: float | None, count_every: int) -> tuple[int, int]:
    """(steps without a count release, steps with one)."""
    with_count = 0 if count_noise_stddev is None else count_releases(steps, count_every)
    return steps - with_count, with_count


def _run_event(
    sigma: float, sampling_prob: float, sigma_eff: float, plain: int, with_count: int
) -> dp_accounting.DpEvent:
    parts = []
    for noise, count in ((sigma, plain), (sigma_eff, with_count)):
        if count == 0 or noise == math.inf:
            continue  # Nothing released, or pure noise: no privacy cost.
        step = dp_accounting.PoissonSampledDpEvent(
            sampling_prob, dp_accounting.GaussianDpEvent(noise)
        )
        parts.append(dp_accounting.SelfComposedDpEvent(step, count))
    if not parts:
        return dp_accounting.NoOpDpEvent()
    if len(parts) == 1:
        return parts[0]
    return dp_accounting.ComposedDpEvent(parts)


def dpsgd_event(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    count_noise_stddev: float | None = None,
    count_every: int = 1,
    preprocessing_noise_multiplier: float | None = None,
) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``steps`` DP-SGD steps and their count releases.

    Args:
      noise_multiplier: noise stddev of the gradient sum divided by the clip norm.
      sampling_prob: Poisson sampling probability ``q`` of each example per step.
      steps: number of DP-SGD steps.
      count_noise_stddev: stddev of the Gaussian noise on each released overflow
        count (sensitivity 1), or ``None`` if no count is released.
      count_every: a count is released at steps ``count_every``,
        ``2 * count_every``, ... (1-based).
      preprocessing_noise_multiplier: noise multiplier of one Gaussian release
        of the whole training set made once before training (sensitivity
        normalised to 1), or ``None`` if there is none.

    Returns:
      A ``SelfComposedDpEvent`` of Poisson-sampled Gaussian steps, or a
      ``ComposedDpEvent`` of two of them when some steps also release a count,
      composed with a ``GaussianDpEvent`` for the preprocessing release.
      Any dp-accounting accountant that supports these events can consume it.
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sampling_prob(sampling_prob)
    steps = _check_steps(steps, 0)
    count_every = _check_int("count_every", count_every, 1)
    sigma_p = _check_preprocessing(preprocessing_noise_multiplier)
    sigma_eff = effective_noise_multiplier(sigma, count_noise_stddev)
    plain, with_count = _split_steps(steps, count_noise_stddev, count_every)
    run = _run_event(sigma, q, sigma_eff, plain, with_count)
    if sigma_p is None or sigma_p == math.inf:
        return run
    pre = dp_accounting.GaussianDpEvent(sigma_p)
    if isinstance(run, dp_accounting.NoOpDpEvent):
        return pre
    return dp_accounting.ComposedDpEvent([pre, run])


def _make_accountant(
    accountant: str, neighboring: str, value_discretization_interval: float
) -> dp_accounting.PrivacyAccountant:
    relation = _NEIGHBORING[neighboring]
    if accountant == "rdp":
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    return dp_accounting.pld.PLDAccountant(
        neighboring_relation=relation,
        value_discretization_interval=value_discretization_interval,
    )


def _rdp_curve(event: dp_accounting.DpEvent) -> Any:
    """``event``'s RDP at ``_BOUND_ORDERS`` (add-or-remove adjacency); inf where
    dp-accounting's arithmetic overflows."""
    try:
        with _absl_quiet():
            return dp_accounting.rdp.RdpAccountant(orders=_BOUND_ORDERS).compose(event).rdp
    except ArithmeticError:  # ZeroDivisionError, OverflowError at extreme sigmas
        return np.full(len(_BOUND_ORDERS), np.inf)


def _rdp_bound(rdp: Any, delta: float) -> float:
    """An upper bound on the epsilon at ``delta`` of the RDP curve ``rdp`` (at
    ``_BOUND_ORDERS``: any set of orders gives a valid bound), cheap at any
    number of steps; inf where it overflows."""
    try:
        with _absl_quiet():
            return float(rdp_privacy_accountant.compute_epsilon(_BOUND_ORDERS, rdp, delta)[0])
    except ArithmeticError:
        return math.inf


@contextlib.contextmanager
def _absl_quiet():
    """Silences dp-accounting's absl warnings (e.g. an RDP order that did not
    converge, which the bound simply leaves out) while bounding a plan."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_within_limit(event: dp_accounting.DpEvent, delta: float) -> None:
    """Refuses a plan whose RDP bound exceeds ``MAX_EPSILON`` (see there)."""
    bound = _rdp_bound(_rdp_curve(event), delta)
    if bound > MAX_EPSILON:
        raise ValueError(
            f"this plan spends more than epsilon {MAX_EPSILON:g} (its RDP bound is "
            f"{bound:.4g} at delta {delta:g}), which dpmp does not account: such a guarantee "
            "promises nothing, and its PLD would take minutes and gigabytes; add noise, "
            "sample less or take fewer steps."
        )


# ---------------------------------------------------------------------------
# The floating-point residual of dpmp's snapped Gaussian noise.
# ---------------------------------------------------------------------------

# The contract of ``dpmp.snapped_gaussian`` (dpmp/noise/_noise.py implements it,
# tests/test_noise.py measures it). Each coordinate's noisy value is
# ``grid * K``, ``grid = 2**floor(log2(stddev / 32))``, so a grid cell is a
# ``1 / r`` of the noise stddev with ``r = stddev / grid`` in [32, 64).
SNAP_CELLS_PER_STDDEV = (32, 64)
# Relative error of the float64 inverse normal CDF (jax.scipy.special.ndtri)
# on |z| <= 8 and on 8 < |z| <= 11: the largest measured against a 40-digit
# mpmath reference are 6.2e-16 and 2.1e-14; these bounds are 6x and 5x that.
SNAP_NDTRI_REL_ERROR = ((8.0, 4e-15), (11.0, 1e-13))
# The sampler's uniforms are exact (to a relative 2^-51) down to 2^-77, |z| =
# 10.01; below, its last 2^-77 of mass is drawn in [2^-78, 2^-77). Cells within
# SNAP_TAIL of the mean are accurate; the rest of the mass is delta.
SNAP_TAIL = 9.9
_SNAP_CORE = SNAP_NDTRI_REL_ERROR[0][0]  # cells within 8 stddevs: the bulk of the bound
_U_REL = 2.0**-51  # relative spacing of the sampler's uniforms and its float64 arithmetic
# The share of delta the residual's own failure events may take (its concentration
# and its count of tail coordinates, each half of it): small enough that asking the
# accountant for epsilon at the delta it leaves costs ~1e-7 epsilon.
RESIDUAL_DELTA_SHARE = 1e-6


class NoiseResidual(NamedTuple):
    """What the drawn noise costs beyond the exact Gaussian the accountant assumes.

    Attributes:
      epsilon: added to the accountant's epsilon (``2 lambda`` in the derivation).
      log_ratio: ``lambda``, the bound on the log-ratio of drawn to exact
        likelihood of the run's outputs (under either neighbour) outside a set
        of probability ``delta_tail``.
      delta_tail: ``beta``, the probability of that set: added to delta.
    """

    epsilon: float
    log_ratio: float
    delta_tail: float

    def ideal_delta(self, delta: float) -> float:
        """The delta to ask the exact mechanism's accountant for, so that the drawn
        noise is ``(epsilon + self.epsilon, delta)``-DP: ``e^-lambda (delta - beta)``."""
        return math.exp(-self.log_ratio) * (delta - self.delta_tail)


def _cell_log_ratio(reach: float, rel_error: float) -> float:
    """Bound on |log(drawn / exact probability)| of one coordinate's grid cell
    lying within ``reach`` stddevs of its mean."""
    shift = (rel_error + _U_REL) * (reach + 2.0)  # the largest error of z, in stddevs
    r_min, r_max = SNAP_CELLS_PER_STDDEV
    x = 2.0 * shift * r_max * math.exp((1.0 / r_min + 2.0 * shift) * reach)
    return -math.log1p(-x)


def _outside_mass(reach: float, coordinates: int, t_max: float) -> float:
    """Upper bound of sum_i P(|Z + t_i| > reach) per release, over all splits of
    the shift t (the neighbour's difference, in stddevs) with |t|_2 <= t_max.

    P(|Z + t| > L) <= 2 Phi(-(L - t)) <= 2 Phi(-L) exp(t lam), lam = L + 1/L
    bounding the normal hazard on [L - t, L]; exp(t lam) <= 1 + t lam exp(t_max lam)
    and sum_i t_i <= sqrt(n) t_max.
    """
    lam = reach + 1.0 / reach
    log_tail = math.log(2.0) + float(scipy_special.log_ndtr(-reach))
    log_shifted = (
        math.log(lam * math.sqrt(coordinates) * t_max) + t_max * lam if t_max else -math.inf
    )
    log_spread = float(np.logaddexp(math.log(coordinates), log_shifted))
    return math.exp(min(log_tail + log_spread, 700.0))


def _tail_count(mu: float, log_target: float) -> int:
    """Fewest k with P(N > k) <= exp(log_target) for a count N of events whose
    conditional probabilities, given everything before, sum to at most ``mu``
    (a sum of adaptively chosen Bernoullis): Chernoff's
    P(N >= a) <= e^-mu (e mu / a)^a for a > mu (E e^(s N) <= e^(mu (e^s - 1))
    holds for such sums, a supermartingale argument)."""
    if mu <= 0:
        return 0

    def log_tail(a: int) -> float:  # log P(N >= a)
        return -mu + a * (1.0 + math.log(mu) - math.log(a))

    if mu < 1 and log_tail(1) <= log_target:
        return 0
    low, high = max(1, math.floor(mu)), max(2, 2 * math.ceil(mu))
    while log_tail(high) > log_target:
        low, high = high, 2 * high
    while high - low > 1:  # log_tail falls for a > mu
        mid = (low + high) // 2
        low, high = (mid, high) if log_tail(mid) > log_target else (low, mid)
    return high - 1


def noise_residual(
    *,
    coordinates: int,
    releases: int,
    noise_multiplier: float,
    delta: float,
    neighboring: str = "add_or_remove",
) -> NoiseResidual:
    """The accounted cost of drawing dpmp's snapped Gaussian instead of an exact one.

    Args:
      coordinates: noised coordinates per release (parameters, plus one for a
        released count).
      releases: number of noisy releases (steps).
      noise_multiplier: the effective noise multiplier of one release (the
        neighbour moves the noise mean by at most ``1 / noise_multiplier``
        stddevs in L2 norm; twice that under ``"replace_one"``).
      delta: the run's target delta (fixes how rare the failure events must be).
      neighboring: ``"add_or_remove"`` or ``"replace_one"``.

    Returns:
      The ``NoiseResidual``: the drawn noise is ``(eps + epsilon, delta)``-DP
      when the exact-Gaussian accountant's ``eps`` is taken at
      ``ideal_delta(delta)``.

    Derivation. Units of the noise stddev; ``d`` = ``coordinates``, ``T`` =
    ``releases``. Pseudo-randomness is assumed ideal.

    1. *One cell.* A coordinate's release is ``K = round(x / grid + r z)`` with
       ``z = ndtri(U)`` (sign-symmetric) and ``U`` a float64 uniform with 51
       fraction bits (see ``dpmp.noise._noise``). With ``z`` exactly normal ``K``
       is a post-processing of the Gaussian mechanism (the *ideal* mechanism,
       which the accountant's ``(eps, delta)`` covers). Drawn and exact ``z``
       differ by at most ``tau(z) = (kappa + 2^-51)(|z| + 2)`` (``ndtri``'s
       relative error ``kappa``, the float64 arithmetic and the uniform's
       lattice), so the drawn probability ``p~`` of a cell of width ``w = 1/r``
       within ``L`` of the mean is within a log-ratio
       ``eta(L) = -log(1 - 2 tau r e^((w + 2 tau) L))`` of its exact mass ``p``
       (``_cell_log_ratio``): ``eta = eta(8)`` for the *core* cells (within 8),
       ``eta_t = eta(SNAP_TAIL)`` for the others within ``SNAP_TAIL``; beyond, no
       bound (the sampler reaches 10.08).
    2. *One step, its batch revealed.* Let the ideal and the drawn mechanism
       also release which of the other records each step sampled (``B``).
       Releasing more only loses privacy, and the accountant's bound still holds
       for the ideal one: given ``B`` a step is ``(1-q) N(mu_B) + q N(mu_B + g)``
       against ``N(mu_B)`` (add/remove), which the Poisson-subsampled Gaussian
       that dp-accounting analyses dominates, whatever ``mu_B``. So each step's
       output density is a mixture of ``c`` product densities (``c = 2``;
       ``c = 3`` under replace-one, the components ``mu_B``, ``mu_B + g``,
       ``mu_B + g'``), whose means differ by ``t`` with ``|t|_2 <= t_max = 1 /
       sigma`` (``2 / sigma``). The drawn-to-exact ratio of a mixture lies
       between those of its components, so ``|log(M~ / M)|`` of a step is at
       most ``max_j |A_j|``, ``A_j = sum_i log(p~_ji(o_i) / p_ji(o_i))``.
    3. *Concentration within a step.* Under any component ``k`` the
       coordinates are independent. Split ``A_j`` into its core cells
       (``|a| <= eta`` each) and the rest. Hoeffding: the core part deviates
       from its mean by more than ``s = eta sqrt(2 d ln(2 c T / beta_H))`` with
       probability at most ``beta_H / (c T)``, per ``j``. Its mean under ``k``
       is at most ``m = eta t_max sqrt(2 d / pi) + d ((e^eta - 1)^2 +
       2 eta (e^eta - 1) + (1 + 2 eta) D)``: under ``j`` itself it is
       ``sum p~ log(p~/p) in [P~ - P, P~ - P + (e^eta - 1)^2]`` over the core
       (``P`` its mass; ``D >= |P~ - P|`` the drawn-to-exact difference outside
       it), and changing ``j`` to ``k`` moves it by ``eta`` times the L1
       distance of the two cell distributions, at most ``|t_i| sqrt(2/pi)``
       (Gaussians, then post-processing) plus twice ``(e^eta - 1) + D``.
    4. *Tail coordinates.* A coordinate-component pair outside the core has
       probability at most ``_outside_mass(8 - w)`` per step, summed over
       coordinates and all ``c`` components (with the worst split of ``t``);
       over the run they number more than ``k`` with probability at most
       ``beta_k`` (Chernoff for adaptive counts, ``_tail_count``), each adding at
       most ``eta_t``; one beyond ``SNAP_TAIL`` has probability at most
       ``beta_out = c T _outside_mass(SNAP_TAIL - w)``.
    5. *The run.* Outside an event of probability ``beta = beta_H + beta_k +
       beta_out`` (under the drawn mechanism of either neighbour), the drawn and
       the ideal likelihoods of the whole output (adaptive composition: the
       product of the steps' conditionals) differ by at most
       ``lambda = T (s + m) + k eta_t`` in log, under both neighbours. Let G be
       that set of outputs. For any S, ``P~(S) <= P~(S & G) + beta <=
       e^lambda P(S & G) + beta <= e^lambda (e^eps P'(S & G) + delta_I) + beta
       <= e^(eps + 2 lambda) P~'(S) + e^lambda delta_I + beta``: with
       ``delta_I = ideal_delta(delta) = e^-lambda (delta - beta)`` the drawn
       noise is ``(eps + 2 lambda, delta)``-DP. (No factor ``e^eps`` multiplies
       ``beta``: the set G is defined under both neighbours' likelihoods and
       its complement's probability is taken under the drawn mechanism.)

    The bound grows with ``sqrt(d log T)`` per step where summing the cells'
    bounds grows with ``d``: about 7.3e-12 sqrt(2 d ln(4 T / beta_H)) T. With
    ``beta_H = beta_k = RESIDUAL_DELTA_SHARE delta / 2``: 125M coordinates x
    5,000 steps at sigma 1 give ``epsilon`` ~ 7.6e-3.
    """
    n = _check_int("coordinates", coordinates, 1)
    releases = _check_int("releases", releases, 0)
    sigma = _check_noise_multiplier(noise_multiplier)
    delta = _check_delta(delta)
    neighboring = _check_neighboring(neighboring, "pld")
    if releases == 0 or sigma == math.inf:
        return NoiseResidual(0.0, 0.0, 0.0)
    replace = neighboring == "replace_one"
    c, t_max = (3, 2.0 / sigma) if replace else (2, 1.0 / sigma)
    eta = _cell_log_ratio(_SNAP_CORE, SNAP_NDTRI_REL_ERROR[0][1])
    eta_t = _cell_log_ratio(SNAP_TAIL, SNAP_NDTRI_REL_ERROR[1][1])
    cell = 1.0 / SNAP_CELLS_PER_STDDEV[0]
    slack = cell + 1e-9  # a cell's width, and the drawn z's error
    budget = RESIDUAL_DELTA_SHARE * delta / 2.0
    # 3: concentration of the core cells, and their mean
    s = eta * math.sqrt(2.0 * n * math.log(2.0 * c * releases / budget))
    own = 2.0 * float(np.exp(scipy_special.log_ndtr(-(SNAP_TAIL - slack))))  # beyond the tail
    core_out = 2.0 * float(np.exp(scipy_special.log_ndtr(-(_SNAP_CORE - slack))))
    diff = core_out * math.expm1(eta_t) + 2.0 * own  # D: drawn vs exact mass outside the core
    e1 = math.expm1(eta)
    mean = eta * t_max * math.sqrt(2.0 * n / math.pi) + n * (
        e1 * e1 + 2.0 * eta * e1 + (1.0 + 2.0 * eta) * diff
    )
    # 4: tail coordinates, and the mass beyond the sampler's accurate reach
    mu_tail = c * releases * _outside_mass(_SNAP_CORE - slack, n, t_max)
    k = _tail_count(mu_tail, math.log(budget))
    beta_out = c * releases * _outside_mass(SNAP_TAIL - slack, n, t_max)
    log_ratio = releases * (s + mean) + k * eta_t
    return NoiseResidual(2.0 * log_ratio, log_ratio, 2.0 * budget + beta_out)


class _Required:
    """The default of ``noised_coordinates``: an epsilon of dpmp's noise needs it."""

    def __repr__(self) -> str:
        return "REQUIRED"


# ``noised_coordinates`` has no silent default: leaving it out would account an
# exact Gaussian that dpmp does not draw.
REQUIRED = _Required()


def _check_coordinates(value: Any) -> int | None:
    if value is REQUIRED:
        raise ValueError(
            "noised_coordinates: required: the number of coordinates noised at each step "
            "(the trainable parameter count), so that the snapped noise's floating-point "
            "residual is accounted; None accounts an exact Gaussian sampler instead (dpmp "
            "draws none: an idealisation, e.g. to compare with published epsilons)"
        )
    return None if value is None else _check_int("noised_coordinates", value, 1)


def _plan_residual(
    coordinates: int | None,
    *,
    steps: int,
    with_count: int,
    sigma: float,
    count_noise_stddev: float | None,
    delta: float,
    neighboring: str,
) -> NoiseResidual | None:
    """The noise residual of a plan of ``steps`` releases of ``coordinates`` gradient
    coordinates at noise multiplier ``sigma``; with count releases, the count's noise
    is one more coordinate and the neighbour's shift is that of the effective noise
    multiplier. None: the plan does not count coordinates (exact Gaussian noise) or
    releases nothing."""
    if coordinates is None or steps == 0:
        return None
    if with_count:
        coordinates = coordinates + 1
        sigma = effective_noise_multiplier(sigma, count_noise_stddev)
    return noise_residual(
        coordinates=coordinates,
        releases=steps,
        noise_multiplier=sigma,
        delta=delta,
        neighboring=neighboring,
    )


def _smallest_fitting_sigma(res_at: Any, delta: float) -> float:
    """The smallest noise multiplier (to 1%) whose residual's tail delta fits in
    ``delta`` (``res_at(sigma)`` is the plan's residual at ``sigma``)."""
    low, high = 1e-3, 1.0
    while res_at(high).delta_tail > delta / 2:
        low, high = high, 2 * high
        if high > MAX_NOISE_MULTIPLIER:
            return math.inf
    while high / low > 1.01:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if res_at(mid).delta_tail <= delta / 2 else (mid, high)
    return high


def _epsilon_of_drawn_noise(eps_at, res: NoiseResidual | None, delta: float, res_at=None) -> float:
    """``eps_at(delta')`` is the accountant's epsilon of the exact-Gaussian plan;
    returns the epsilon at ``delta`` of the noise dpmp draws, whose residual is
    ``res`` (None: exact noise, the accountant's epsilon). ``res_at(sigma)``, the
    residual at another noise multiplier, lets a refusal say what would fit."""
    if res is None:
        return eps_at(delta)
    if not res.delta_tail <= 0.5 * delta:
        hint = ""
        if res_at is not None:
            hint = f" (about {_smallest_fitting_sigma(res_at, delta):.3g} or more)"
        raise ValueError(
            f"noise_multiplier: too small for the snapped noise at delta={delta:g}: the "
            f"chance that some noised coordinate of the run lands beyond the sampler's "
            f"{SNAP_TAIL}-sigma reach is {res.delta_tail:.3g}, more than half of delta; "
            f"raise the noise multiplier{hint} or delta."
        )
    return eps_at(res.ideal_delta(delta)) + res.epsilon


# ---------------------------------------------------------------------------
# One-shot queries.
# ---------------------------------------------------------------------------


def epsilon(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_or_remove",
    count_noise_stddev: float | None = None,
    count_every: int = 1,
    value_discretization_interval: float = REPORT_DISCRETIZATION,
    preprocessing_noise_multiplier: float | None = None,
    noised_coordinates: int | None | _Required = REQUIRED,
) -> float:
    """Epsilon at ``delta`` of a DP-SGD run (and its count and preprocessing releases).

    Example:
      >>> import dpmp.accounting
      >>> plan = dict(noise_multiplier=10.0, sampling_prob=4096 / 50000, steps=875,
      ...             delta=1e-5, accountant="rdp")
      >>> # exact Gaussian noise: De et al. 2022 report epsilon = 1 for this plan
      >>> round(dpmp.accounting.epsilon(**plan, noised_coordinates=None), 4)
      0.9877
      >>> # dpmp's snapped noise on a WRN-16-4 (2.75M parameters): a little more
      >>> round(dpmp.accounting.epsilon(**plan, noised_coordinates=2_750_000), 4)
      0.9879

    Args:
      noise_multiplier: noise stddev divided by the clip norm, in [1e-6, 1e6] or inf.
      sampling_prob: Poisson sampling probability, in (0, 1].
      steps: number of steps, an integer >= 0 (0 steps cost epsilon 0).
      delta: target delta, in (0, 1).
      accountant: ``"pld"`` (tight) or ``"rdp"`` (an upper bound).
      neighboring: ``"add_or_remove"`` or ``"replace_one"`` (PLD only).
      count_noise_stddev: noise stddev of each released overflow count, or
        ``None`` when the loss scale releases nothing.
      count_every: a count is released every this many steps.
      value_discretization_interval: PLD discretisation (ignored by RDP).
      preprocessing_noise_multiplier: a one-off Gaussian release before
        training (see ``dpsgd_event``), or ``None``.
      noised_coordinates: required: the coordinates of each gradient release
        (the number of trainable parameters), for dpmp's snapped Gaussian noise:
        the result then includes its ``noise_residual``. ``None`` accounts an
        exact Gaussian sampler (which no floating-point program draws).

    Returns:
      The epsilon that dp-accounting's accountant gives for ``dpsgd_event``
      (plus the noise residual unless ``noised_coordinates`` is None).

    Formal Guarantees:
      See the module docstring: the run is ``(epsilon, delta)``-DP under
      ``neighboring`` if every step clips each example to the clip norm, adds
      the stated noise, and uses an untruncated Poisson sample.
    """
    return _epsilons(
        noise_multiplier=noise_multiplier,
        sampling_prob=sampling_prob,
        steps=steps,
        delta=delta,
        accountant=accountant,
        neighboring=neighboring,
        count_noise_stddev=count_noise_stddev,
        count_every=count_every,
        value_discretization_interval=value_discretization_interval,
        preprocessing_noise_multiplier=preprocessing_noise_multiplier,
        noised_coordinates=noised_coordinates,
    )[1]


def _epsilons(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    delta: float,
    accountant: str,
    neighboring: str,
    count_noise_stddev: float | None,
    count_every: int,
    value_discretization_interval: float,
    preprocessing_noise_multiplier: float | None,
    noised_coordinates: int | None,
) -> tuple[float, float]:
    """(exact-Gaussian epsilon, ``epsilon``'s value) from one composed accountant."""
    accountant = _check_accountant(accountant)
    neighboring = _check_neighboring(neighboring, accountant)
    delta = _check_delta(delta)
    interval = _check_interval(value_discretization_interval)
    coordinates = _check_coordinates(noised_coordinates)
    event = dpsgd_event(
        noise_multiplier=noise_multiplier,
        sampling_prob=sampling_prob,
        steps=steps,
        count_noise_stddev=count_noise_stddev,
        count_every=count_every,
        preprocessing_noise_multiplier=preprocessing_noise_multiplier,
    )
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0, 0.0
    if accountant == "pld":
        _check_within_limit(event, delta)
    acct = _make_accountant(accountant, neighboring, interval).compose(event)
    sigma = _check_noise_multiplier(noise_multiplier)
    with_count = _split_steps(steps, _check_count_noise(count_noise_stddev), count_every)[1]

    def res_at(s: float) -> NoiseResidual | None:
        return _plan_residual(
            coordinates,
            steps=steps,
            with_count=with_count,
            sigma=s,
            count_noise_stddev=count_noise_stddev,
            delta=delta,
            neighboring=neighboring,
        )

    exact = float(acct.get_epsilon(delta))
    return exact, float(_epsilon_of_drawn_noise(acct.get_epsilon, res_at(sigma), delta, res_at))


def epsilon_breakdown(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    delta: float,
    count_noise_stddev: float | None,
    count_every: int = 1,
    accountant: str = "pld",
    neighboring: str = "add_or_remove",
    value_discretization_interval: float = REPORT_DISCRETIZATION,
    preprocessing_noise_multiplier: float | None = None,
    noised_coordinates: int | None | _Required = REQUIRED,
) -> EpsilonBreakdown:
    """Epsilon with and without the count and preprocessing releases.

    Epsilon does not add up over mechanisms, so each part is a difference at
    the same delta: ``counts = epsilon(steps and counts) - epsilon(steps)``,
    ``preprocessing = epsilon(everything) - epsilon(steps and counts)``, and
    ``noise_residual`` = the total with ``noised_coordinates`` minus without.
    """
    coordinates = _check_coordinates(noised_coordinates)
    common = dict(
        noise_multiplier=noise_multiplier,
        sampling_prob=sampling_prob,
        steps=steps,
        delta=delta,
        accountant=accountant,
        neighboring=neighboring,
        value_discretization_interval=value_discretization_interval,
    )
    dpsgd = epsilon(**common, noised_coordinates=None)
    common.update(count_noise_stddev=count_noise_stddev, count_every=count_every)
    with_counts = (
        dpsgd if count_noise_stddev is None else epsilon(**common, noised_coordinates=None)
    )
    if preprocessing_noise_multiplier is None and coordinates is None:
        exact = total = with_counts
    else:  # one composition gives both
        exact, total = _epsilons(
            **common,
            preprocessing_noise_multiplier=preprocessing_noise_multiplier,
            noised_coordinates=noised_coordinates,
        )
    return EpsilonBreakdown(
        total=total,
        dpsgd=dpsgd,
        counts=with_counts - dpsgd,
        preprocessing=exact - with_counts,
        noise_residual=total - exact,
    )


# ---------------------------------------------------------------------------
# Calibration.
# ---------------------------------------------------------------------------


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    sampling_prob: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_or_remove",
    count_noise_stddev: float | None = None,
    count_every: int = 1,
    value_discretization_interval: float = REPORT_DISCRETIZATION,
    rtol: float = 1e-4,
    preprocessing_noise_multiplier: float | None = None,
    noised_coordinates: int | None | _Required = REQUIRED,
) -> float:
    """The smallest noise multiplier whose run stays within ``target_epsilon``.

    Uses dp-accounting's ``calibrate_dp_mechanism`` (Brent's method, then a
    check that the returned value does not exceed the target) inside a bracket
    found by doubling. With count or preprocessing releases, their noise is
    held fixed and only the gradient noise is calibrated.

    Args:
      target_epsilon: in (0, MAX_EPSILON].
      sampling_prob, steps, delta, accountant, neighboring, count_noise_stddev,
        count_every, value_discretization_interval,
        preprocessing_noise_multiplier, noised_coordinates: as in
        ``epsilon``; steps >= 1. With ``noised_coordinates`` the target covers
        the noise residual too: the exact plan is calibrated to the target
        minus the residual, at the delta the residual leaves.
      rtol: relative tolerance on the noise multiplier.

    Returns:
      ``sigma`` with ``epsilon(sigma) <= target_epsilon`` and, within ``rtol``
      in sigma, the smallest such value.

    Raises:
      ValueError: if the count and preprocessing releases alone exceed
        ``target_epsilon``.
    """
    target = _check_target_epsilon(target_epsilon)
    q = _check_sampling_prob(sampling_prob)
    steps = _check_steps(steps, 1)
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    neighboring = _check_neighboring(neighboring, accountant)
    sigma_c = _check_count_noise(count_noise_stddev)
    sigma_p = _check_preprocessing(preprocessing_noise_multiplier)
    count_every = _check_int("count_every", count_every, 1)
    interval = _check_interval(value_discretization_interval)
    rtol = _real("rtol", rtol)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1), got {rtol}.")
    coordinates = _check_coordinates(noised_coordinates)
    exact = functools.partial(
        _calibrate_exact,
        sampling_prob=q,
        steps=steps,
        accountant=accountant,
        neighboring=neighboring,
        count_noise_stddev=sigma_c,
        count_every=count_every,
        interval=interval,
        rtol=rtol,
        preprocessing_noise_multiplier=sigma_p,
    )
    if coordinates is None:
        return exact(target, delta)
    plan = dict(
        sampling_prob=q,
        steps=steps,
        delta=delta,
        accountant=accountant,
        neighboring=neighboring,
        count_noise_stddev=sigma_c,
        count_every=count_every,
        value_discretization_interval=interval,
        preprocessing_noise_multiplier=sigma_p,
        noised_coordinates=coordinates,
    )
    with_count = _split_steps(steps, sigma_c, count_every)[1]
    # The residual's epsilon hardly depends on sigma; its tail delta falls as sigma
    # grows. So it is estimated once at a floor sigma, the exact plan calibrated
    # against it, and the result checked (and nudged up) with the residual at the
    # calibrated sigma itself. If the fixed floor is too low, the exact plan's own
    # sigma (which the answer cannot be below) is the floor.
    res = None
    for floor in (_RESIDUAL_SIGMA_FLOOR, None):
        floor = exact(target, delta) if floor is None else floor
        res = _plan_residual(
            coordinates,
            steps=steps,
            with_count=with_count,
            sigma=floor,
            count_noise_stddev=sigma_c,
            delta=delta,
            neighboring=neighboring,
        )
        if not res.delta_tail <= 0.5 * delta:
            continue
        ideal = res.ideal_delta(delta)
        sigma = exact(target - res.epsilon, ideal)
        if sigma < floor:
            continue
        # The reported epsilon bounds the residual at sigma itself (its tail count
        # k and tail delta may round the other way): step up until it fits.
        for _ in range(20):
            if epsilon(noise_multiplier=sigma, **plan) <= target:
                return sigma
            sigma *= 1 + 1e-4
    raise ValueError(
        f"target_epsilon={target}: no noise multiplier keeps the run and the snapped "
        f"noise's residual (epsilon {res.epsilon:.3g}, tail delta {res.delta_tail:.3g}) "
        f"within it at delta={delta:g}; lower the target or raise delta."
    )


_RESIDUAL_SIGMA_FLOOR = 0.5


def _calibrate_exact(
    target: float,
    delta: float,
    *,
    sampling_prob: float,
    steps: int,
    accountant: str,
    neighboring: str,
    count_noise_stddev: float | None,
    count_every: int,
    interval: float,
    rtol: float,
    preprocessing_noise_multiplier: float | None,
) -> float:
    """``calibrate_noise_multiplier`` for exact Gaussian noise, arguments checked."""
    q, sigma_c, sigma_p = sampling_prob, count_noise_stddev, preprocessing_noise_multiplier
    if not target > 0:
        raise ValueError(f"target_epsilon: the noise residual leaves nothing of {target}.")

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return dpsgd_event(
            noise_multiplier=sigma,
            sampling_prob=q,
            steps=steps,
            count_noise_stddev=sigma_c,
            count_every=count_every,
            preprocessing_noise_multiplier=sigma_p,
        )

    def make_accountant() -> dp_accounting.PrivacyAccountant:
        return _make_accountant(accountant, neighboring, interval)

    def eps(sigma: float) -> float:
        event = make_event(sigma)
        if accountant == "pld" and _rdp_bound(_rdp_curve(event), delta) > MAX_EPSILON:
            return math.inf  # too little noise for any target (<= MAX_EPSILON)
        return make_accountant().compose(event).get_epsilon(delta)

    if (sigma_c is not None or sigma_p is not None) and eps(math.inf) > target:
        fixed = []
        if sigma_c is not None:
            fixed.append(f"count_noise_stddev={sigma_c} (raise it or count_every)")
        if sigma_p is not None:
            fixed.append(f"preprocessing_noise_multiplier={sigma_p} (raise it)")
        raise ValueError(
            f"the releases of {' and '.join(fixed)} alone cost more than target_epsilon={target}."
        )
    # Bracket the root by doubling from sigma = 1. (dp-accounting's own
    # LowerEndpointAndGuess starts at sigma = 0, where epsilon is infinite.)
    low = high = 1.0
    if eps(high) > target:
        while eps(high) > target:
            low, high = high, 2 * high
            if high > 1e6:
                raise ValueError(f"no noise_multiplier <= 1e6 reaches epsilon {target}.")
    else:
        while (spent := eps(low)) <= target:
            if low <= MIN_CALIBRATED_NOISE:
                raise ValueError(
                    f"target_epsilon={target}: noise multiplier {low:g} already spends only "
                    f"epsilon {spent:.4g}, and calibration stops there (an epsilon this large "
                    "promises little): lower the target, or give the noise multiplier."
                )
            low, high = max(low / 2, MIN_CALIBRATED_NOISE), low
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            make_accountant,
            make_event,
            target,
            delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
            tol=rtol * low,
        )
    )


def calibrate_steps(
    *,
    target_epsilon: float,
    noise_multiplier: float,
    sampling_prob: float,
    delta: float,
    accountant: str = "pld",
    neighboring: str = "add_or_remove",
    count_noise_stddev: float | None = None,
    count_every: int = 1,
    value_discretization_interval: float = REPORT_DISCRETIZATION,
    max_steps: int = MAX_STEPS,
    preprocessing_noise_multiplier: float | None = None,
    noised_coordinates: int | None | _Required = REQUIRED,
) -> int:
    """The most steps whose run stays within ``target_epsilon``.

    An exact integer search (doubling, then bisection; epsilon grows with the
    number of steps), rather than dp-accounting's ``calibrate_dp_mechanism``
    with ``discrete=True``, which may return one step less than the maximum.

    Returns:
      The largest ``n <= max_steps`` with ``epsilon(n steps) <= target_epsilon``
      (0 if even one step exceeds it).
    """
    budget = PrivacyBudget(
        noise_multiplier=noise_multiplier,
        sampling_prob=sampling_prob,
        delta=delta,
        target_epsilon=target_epsilon,
        accountant=accountant,
        neighboring=neighboring,
        count_noise_stddev=count_noise_stddev,
        count_every=count_every,
        value_discretization_interval=value_discretization_interval,
        preprocessing_noise_multiplier=preprocessing_noise_multiplier,
        noised_coordinates=noised_coordinates,
    )
    max_steps = _check_int("max_steps", max_steps, 0)
    return BudgetTracker(budget).remaining_steps(max_steps)


# ---------------------------------------------------------------------------
# Epsilon as a function of step counts, memoised (for the budget tracker).
# ---------------------------------------------------------------------------


class _EpsilonCurve:
    """epsilon(plain steps, steps with a count), memoised; the plan's one-off
    preprocessing release, if any, is part of every value.

    RDP: the per-step RDP curves are computed once by dp-accounting's
    accountant; a run's curve is ``plain * rdp_plain + with_count * rdp_count``
    (+ ``rdp_preprocessing``; what the accountant does for a
    ``SelfComposedDpEvent``), converted with dp-accounting's ``compute_epsilon``.

    PLD: the per-step PLDs are built once (as ``PLDAccountant`` builds them);
    a run's PLD is their self-composition. When queries walk forward one step
    at a time, as a trainer's do, the last PLD is extended by one composition
    instead of being rebuilt: both paths are pessimistic and agree to about
    1e-9 relative.
    """

    _INCREMENTAL_LIMIT = 8
    _MEMO_SIZE = 4096

    def __init__(self, budget: PrivacyBudget):
        self._budget = budget
        # Bounded: a long run's trainer only ever asks about recent steps.
        self._memo: collections.OrderedDict[tuple[int, int], float] = collections.OrderedDict()
        sigma = budget.noise_multiplier
        sigma_eff = effective_noise_multiplier(sigma, budget.count_noise_stddev)
        sigma_p = budget.preprocessing_noise_multiplier
        # kinds: 0 a plain step, 1 a step with a count, 2 the preprocessing release
        self._sigmas = (sigma, sigma_eff, math.inf if sigma_p is None else sigma_p)
        self._pre = int(self._sigmas[2] < math.inf)  # how often kind 2 is released
        self._per_step: list[Any] = [None, None, None]
        self._bound_per_step: list[Any] = [None, None, None]
        self._cursor: tuple[int, int, Any] | None = None

    def _release(self, kind: int) -> dp_accounting.DpEvent:
        """One release of ``kind``: a sampled step, or the preprocessing (every record)."""
        gaussian = dp_accounting.GaussianDpEvent(self._sigmas[kind])
        if kind == 2:
            return gaussian
        return dp_accounting.PoissonSampledDpEvent(self._budget.sampling_prob, gaussian)

    def _beyond_limit(self, plain: int, with_count: int) -> bool:
        """The plan's RDP bound exceeds ``MAX_EPSILON``: its PLD is not built."""
        rdp = 0
        for kind, n in ((0, plain), (1, with_count), (2, self._pre)):
            if n > 0:
                if self._bound_per_step[kind] is None:
                    self._bound_per_step[kind] = _rdp_curve(self._release(kind))
                rdp = rdp + n * self._bound_per_step[kind]
        return _rdp_bound(rdp, self._budget.delta) > MAX_EPSILON

    def _single(self, kind: int) -> Any:
        if self._per_step[kind] is None:
            b = self._budget
            q = 1.0 if kind == 2 else b.sampling_prob  # preprocessing reads every record
            if b.accountant == "rdp":
                acct = dp_accounting.rdp.RdpAccountant(
                    neighboring_relation=_NEIGHBORING[b.neighboring]
                )
                acct.compose(self._release(kind))
                self._per_step[kind] = (acct.orders, acct.rdp)
            else:
                self._per_step[kind] = privacy_loss_distribution.from_gaussian_mechanism(
                    standard_deviation=self._sigmas[kind],
                    value_discretization_interval=b.value_discretization_interval,
                    sampling_prob=q,
                    neighboring_relation=_NEIGHBORING[b.neighboring],
                )
        return self._per_step[kind]

    def _pld(self, plain: int, with_count: int) -> Any:
        if self._cursor is not None:
            p0, c0, pld = self._cursor
            if (
                plain >= p0
                and with_count >= c0
                and (plain - p0) + (with_count - c0) <= self._INCREMENTAL_LIMIT
            ):
                for _ in range(plain - p0):
                    pld = pld.compose(self._single(0))
                for _ in range(with_count - c0):
                    pld = pld.compose(self._single(1))
                return pld
        counts = ((0, plain), (1, with_count), (2, self._pre))
        parts = [self._single(kind).self_compose(n) for kind, n in counts if n > 0]
        pld = parts[0]
        for part in parts[1:]:
            pld = pld.compose(part)
        return pld

    def __call__(self, plain: int, with_count: int) -> float:
        # Steps with infinite noise release nothing about the data.
        plain = 0 if self._sigmas[0] == math.inf else plain
        with_count = 0 if self._sigmas[1] == math.inf else with_count
        key = (plain, with_count)
        if key == (0, 0) and not self._pre:
            return 0.0
        if key in self._memo:
            self._memo.move_to_end(key)
            return self._memo[key]
        b = self._budget
        if b.accountant == "rdp":
            rdp = 0
            for kind, n in ((0, plain), (1, with_count), (2, self._pre)):
                if n > 0:
                    orders, per_step = self._single(kind)
                    rdp = rdp + n * per_step

            def eps_at(delta):
                return rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0]
        elif self._beyond_limit(plain, with_count):
            self._memo[key] = math.inf
            return math.inf
        else:
            pld = self._pld(plain, with_count)
            self._cursor = (plain, with_count, pld)
            eps_at = pld.get_epsilon_for_delta

        def res_at(sigma: float) -> NoiseResidual | None:
            return _plan_residual(
                b.noised_coordinates,
                steps=plain + with_count,
                with_count=with_count,
                sigma=sigma,
                count_noise_stddev=b.count_noise_stddev,
                delta=b.delta,
                neighboring=b.neighboring,
            )

        eps = _epsilon_of_drawn_noise(eps_at, res_at(self._sigmas[0]), b.delta, res_at)
        self._memo[key] = float(eps)
        if len(self._memo) > self._MEMO_SIZE:
            self._memo.popitem(last=False)
        return float(eps)


_CURVES: dict[PrivacyBudget, _EpsilonCurve] = {}


def _curve_for(budget: PrivacyBudget) -> _EpsilonCurve:
    # Plans are frozen and hashable: trackers and calibrations of the same plan
    # share one memo. Bounded, since a process only ever sees a few plans.
    if budget not in _CURVES:
        if len(_CURVES) >= 64:
            _CURVES.pop(next(iter(_CURVES)))
        _CURVES[budget] = _EpsilonCurve(budget)
    return _CURVES[budget]


def _largest_fitting(fits, limit: int) -> int:
    """Largest n in [0, limit] with fits(n), for fits monotone (True then False)."""
    if limit == 0 or not fits(1):
        return 0
    good, bad = 1, 2
    while bad <= limit and fits(bad):
        good, bad = bad, 2 * bad
    bad = min(bad, limit + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


# ---------------------------------------------------------------------------
# The running budget.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacyBudget:
    """The privacy plan of a run: what each step releases, and the target.

    Attributes:
      noise_multiplier: gradient noise stddev divided by the clip norm.
      sampling_prob: Poisson sampling probability, in (0, 1].
      delta: in (0, 1).
      target_epsilon: the run may not exceed this epsilon, in (0, MAX_EPSILON].
      accountant: ``"pld"`` or ``"rdp"``.
      neighboring: ``"add_or_remove"`` or ``"replace_one"`` (PLD only).
      count_noise_stddev: noise stddev of each released overflow count, or None.
      count_every: a count is released at steps k, 2k, ... (1-based), k >= 1.
      preprocessing_noise_multiplier: noise multiplier of a one-off Gaussian
        release of the whole training set before training, or None.
      value_discretization_interval: PLD discretisation used while tracking;
        defaults to the coarser ``TRACKING_DISCRETIZATION`` (1e-3), which is
        still an upper bound. Report the final number with ``epsilon(...)``
        at 1e-4 if you want the tighter value.
      noised_coordinates: required: coordinates of each gradient release, for
        dpmp's snapped Gaussian noise (its ``noise_residual`` is then part of
        every epsilon); ``None`` for an exact Gaussian sampler.
    """

    noise_multiplier: float
    sampling_prob: float
    delta: float
    target_epsilon: float
    accountant: str = "pld"
    neighboring: str = "add_or_remove"
    count_noise_stddev: float | None = None
    count_every: int = 1
    value_discretization_interval: float = TRACKING_DISCRETIZATION
    preprocessing_noise_multiplier: float | None = None
    noised_coordinates: int | None | _Required = REQUIRED

    def __post_init__(self):
        accountant = _check_accountant(self.accountant)
        fields = dict(
            noise_multiplier=_check_noise_multiplier(self.noise_multiplier),
            sampling_prob=_check_sampling_prob(self.sampling_prob),
            delta=_check_delta(self.delta),
            target_epsilon=_check_target_epsilon(self.target_epsilon),
            neighboring=_check_neighboring(self.neighboring, accountant),
            count_noise_stddev=_check_count_noise(self.count_noise_stddev),
            count_every=_check_int("count_every", self.count_every, 1),
            value_discretization_interval=_check_interval(self.value_discretization_interval),
            preprocessing_noise_multiplier=_check_preprocessing(
                self.preprocessing_noise_multiplier
            ),
            noised_coordinates=_check_coordinates(self.noised_coordinates),
        )
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyBudget:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown PrivacyBudget fields {sorted(unknown)}; known: {sorted(known)}."
            )
        return cls(**data)


class BudgetTracker:
    """Epsilon spent so far by a run, advanced by the trainer once per step.

    The tracker's history is two integers: the steps that released only the
    noised gradient, and the steps that also released a noised count. Epsilon
    depends on nothing else (composition is commutative), so it is computed
    as a function of those two counts and memoised; a trainer that queries
    ``spent()`` and ``can_step()`` every step pays one PLD composition per step.

    Example:
      >>> budget = PrivacyBudget(noise_multiplier=1.0, sampling_prob=0.01,
      ...                        delta=1e-5, target_epsilon=1.0,
      ...                        noised_coordinates=100_000)
      >>> tracker = BudgetTracker(budget)
      >>> while tracker.can_step():
      ...     _ = tracker.step()  # ... one DP-SGD step ...
      >>> tracker.spent() <= 1.0
      True

    Formal Guarantees:
      ``spent()`` is the epsilon (at ``budget.delta``) of ``dpsgd_event`` with
      this history, from dp-accounting's accountant (see the module docstring).
      ``step()`` never lets ``spent()`` exceed ``budget.target_epsilon``.
    """

    def __init__(self, budget: PrivacyBudget, *, steps: int = 0, count_releases: int = 0):
        if not isinstance(budget, PrivacyBudget):
            raise TypeError(f"budget must be a PrivacyBudget, got {type(budget).__name__}.")
        steps = _check_steps(steps, 0)
        count_releases = _check_int("count_releases", count_releases, 0)
        if count_releases > steps:
            raise ValueError(f"count_releases ({count_releases}) must be <= steps ({steps}).")
        if count_releases and budget.count_noise_stddev is None:
            raise ValueError("count_releases > 0 needs a budget with count_noise_stddev.")
        self._budget = budget
        self._steps = steps
        self._count_releases = count_releases
        self._curve = _curve_for(budget)
        # ((steps, count_releases), epsilon) restored from a checkpoint.
        self._pinned: tuple[tuple[int, int], float] | None = None

    @property
    def budget(self) -> PrivacyBudget:
        return self._budget

    @property
    def steps(self) -> int:
        """Steps taken so far."""
        return self._steps

    @property
    def count_releases(self) -> int:
        """Steps so far that also released a noised count."""
        return self._count_releases

    def _next_releases_count(self, count_released: bool | None) -> bool:
        if count_released is None:
            b = self._budget
            return b.count_noise_stddev is not None and (self._steps + 1) % b.count_every == 0
        if count_released and self._budget.count_noise_stddev is None:
            raise ValueError("count_released=True needs a budget with count_noise_stddev.")
        return bool(count_released)

    def _eps(self, steps: int, count_releases: int) -> float:
        if self._pinned is not None and self._pinned[0] == (steps, count_releases):
            return self._pinned[1]
        return self._curve(steps - count_releases, count_releases)

    def spent(self) -> float:
        """Epsilon at ``budget.delta`` of every release so far."""
        return self._eps(self._steps, self._count_releases)

    def breakdown(self) -> EpsilonBreakdown:
        """``spent()`` split into the DP-SGD steps alone, the extra for counts and
        the extra for the preprocessing release (see ``EpsilonBreakdown``)."""
        total = self.spent()
        split = (self._steps - self._count_releases, self._count_releases)
        exact_plan = dataclasses.replace(self._budget, noised_coordinates=None)
        exact = _curve_for(exact_plan)(*split)
        no_pre = dataclasses.replace(exact_plan, preprocessing_noise_multiplier=None)
        with_counts = _curve_for(no_pre)(*split)
        plain = _curve_for(dataclasses.replace(no_pre, count_noise_stddev=None))
        dpsgd = plain(self._steps, 0)
        return EpsilonBreakdown(
            total=total,
            dpsgd=dpsgd,
            counts=with_counts - dpsgd,
            preprocessing=exact - with_counts,
            noise_residual=total - exact,
        )

    def peek(self, count_released: bool | None = None) -> float:
        """Epsilon after one more step (``None``: follow the plan's count schedule)."""
        released = self._next_releases_count(count_released)
        return self._eps(self._steps + 1, self._count_releases + released)

    def can_step(self, count_released: bool | None = None) -> bool:
        """Whether one more step keeps epsilon within ``budget.target_epsilon``."""
        return self.peek(count_released) <= self._budget.target_epsilon

    def step(self, count_released: bool | None = None) -> float:
        """Records one step and returns the epsilon spent after it.

        Args:
          count_released: whether this step also released a noised count;
            ``None`` follows the plan (a count at steps ``count_every``,
            ``2 * count_every``, ...).

        Raises:
          BudgetExceededError: if the step would exceed ``target_epsilon``; the
            tracker is left unchanged.
        """
        released = self._next_releases_count(count_released)
        eps = self._eps(self._steps + 1, self._count_releases + released)
        if eps > self._budget.target_epsilon:
            raise BudgetExceededError(
                f"step {self._steps + 1} would spend epsilon {eps:.6g} > "
                f"target_epsilon {self._budget.target_epsilon:.6g} (delta "
                f"{self._budget.delta:g}); the run must stop after {self._steps} steps."
            )
        self._steps += 1
        self._count_releases += released
        return eps

    def remaining_steps(self, max_steps: int = MAX_STEPS) -> int:
        """How many more steps, following the plan's count schedule, fit the target."""
        b = self._budget

        def split(extra: int) -> tuple[int, int]:
            releases = 0
            if b.count_noise_stddev is not None:
                releases = (self._steps + extra) // b.count_every - self._steps // b.count_every
            return self._steps + extra, self._count_releases + releases

        def fits(extra: int) -> bool:
            return self._eps(*split(extra)) <= b.target_epsilon

        return _largest_fitting(fits, _check_int("max_steps", max_steps, 0))

    # -- serialisation ----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable record of the plan, the history and the epsilon."""
        return {
            "version": 1,
            "budget": self._budget.to_dict(),
            "steps": self._steps,
            "count_releases": self._count_releases,
            "epsilon": self.spent(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BudgetTracker:
        """Restores a tracker; ``spent()`` returns the saved epsilon exactly."""
        if state.get("version") != 1:
            raise ValueError(f"unsupported BudgetTracker state version {state.get('version')!r}.")
        tracker = cls(
            PrivacyBudget.from_dict(state["budget"]),
            steps=state["steps"],
            count_releases=state["count_releases"],
        )
        # The saved value came from the same plan and history; keep it so that
        # a resumed run reports the number it checkpointed, to the last bit.
        # Recomputing it may take another path through the PLD compositions,
        # which agrees to ~1e-9; anything further apart is not this plan's.
        saved = _real("epsilon", state["epsilon"])
        recomputed = tracker.spent()
        if not math.isclose(saved, recomputed, rel_tol=1e-6, abs_tol=1e-12):
            raise ValueError(
                f"saved epsilon {saved} does not match the plan and history "
                f"(recomputed {recomputed}); the state was not made by this plan."
            )
        tracker._pinned = ((tracker._steps, tracker._count_releases), saved)
        return tracker

    def to_json(self) -> str:
        return json.dumps(self.state_dict())

    @classmethod
    def from_json(cls, text: str) -> BudgetTracker:
        return cls.from_state_dict(json.loads(text))

    def __repr__(self) -> str:
        return (
            f"BudgetTracker(steps={self._steps}, count_releases={self._count_releases}, "
            f"spent={self.spent():.6g}, target_epsilon={self._budget.target_epsilon:g})"
        )
