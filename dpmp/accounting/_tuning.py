"""A hyperparameter search inside epsilon: random stopping (Papernot & Steinke 2022).

A search runs a random number ``K`` of candidates, each a full private run with
hyperparameters drawn at random, and releases only the best candidate's output
(its model, its hyperparameters and its score) -- nothing of the others, and
not ``K``. Papernot & Steinke ("Hyperparameter Tuning with Renyi Differential
Privacy", ICLR 2022) bound the Renyi DP of that release by the candidate's own
RDP curve when ``K`` is random. Reference implementation: repository
``tensorflow/privacy``, ``research/hyperparameters_2022``.

``CandidateCount`` is the distribution of ``K``, an object that answers for
itself: ``PoissonCount(mean)`` (Theorem 6) and
``TruncatedNegativeBinomialCount(eta, gamma)`` (Theorem 2; ``eta = 1`` is the
geometric distribution, ``eta = 0`` the logarithmic one). Each gives the
search's RDP curve from a candidate's (``search_rdp``), its mean, and a draw.
``search_epsilon`` converts a search's curve to epsilon; ``CandidatePlan`` is
one dpmp candidate run (DP-SGD steps, count releases, a preprocessing release,
its drawn noise and a truncated Poisson sample), ``search_guarantee`` its
search's (epsilon, delta) and ``calibrate_search_noise`` the per-candidate
noise multiplier that meets a target.

Formal Guarantees:
  Assumptions, each of which the caller (``dpmp.app.tune``) must make true:

  * (A1) Every candidate is ``Q``: hyperparameters drawn from fixed ranges,
    then a private run, then its score. ``Q`` is ``(lambda, eps(lambda))``-RDP
    at every order used, with ONE curve ``eps`` whatever hyperparameters are
    drawn: the ranges leave the privacy plan (noise multiplier, sampling
    probability, steps, releases, noised coordinates) unchanged.
  * (A2) The candidates' randomness (hyperparameter draws, noise keys, sampler
    seeds, a tie-break) is independent across candidates and of ``K``; ``K``
    is drawn independently of the data; all of it is secret.
  * (A3) Only the best candidate's output is released: its model, its
    hyperparameters and its score, which orders the outputs totally (ties
    broken by a uniform draw that is part of each candidate's output). If
    ``K = 0`` (Poisson only) the search releases that nothing was chosen.
    Releasing ``K``, or any other candidate's score, is not covered: knowing
    ``K = k`` the release is the best of ``k`` runs, whose privacy loss grows
    with ``k``.
  * (A4) Add-or-remove (zero-out) neighbours, as a dpmp run's accounting.

  Theorem 2 (truncated negative binomial ``D_{eta,gamma}``, ``eta > -1``,
  ``0 < gamma < 1``: ``P[K = k]`` proportional to
  ``binom(k + eta - 1, k) (1 - gamma)^k`` for ``k >= 1``): if ``Q`` is
  ``(lambda, eps)``-RDP and ``(lambda_hat, eps_hat)``-RDP, ``lambda > 1``,
  ``lambda_hat >= 1``, the search is ``(lambda, eps')``-RDP with::

      eps' = eps + (1 + eta) (1 - 1/lambda_hat) eps_hat
                 + (1 + eta) log(1/gamma) / lambda_hat + log E[K] / (lambda - 1)
      E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta))      (eta != 0)
           = (1/gamma - 1) / log(1/gamma)                   (eta = 0)

  Theorem 6 (``K ~ Poisson(mu)``): if ``Q`` is ``(lambda, eps)``-RDP and
  ``(eps_hat, delta_hat)``-DP with ``e^eps_hat <= 1 + 1/(lambda - 1)``, the
  search is ``(lambda, eps + mu delta_hat + log(mu) / (lambda - 1))``-RDP.

  Proof sketch (the paper's): the best of ``K`` runs has the density
  ``Q(y) f'(F(y))`` (up to ties), ``F`` the CDF of ``Q``'s score and ``f`` the
  probability generating function of ``K``. Hoelder's inequality splits the
  Renyi divergence into ``Q``'s own at ``lambda`` and a term in
  ``f'(F) / f'(F')``; for the negative binomial ``f'`` is a power of
  ``1 - (1 - gamma) F``, bounded through ``Q``'s divergence at
  ``lambda_hat`` (Theorem 2); for the Poisson ``f' = mu e^(mu (F - 1))``, and
  the ``(eps_hat, delta_hat)`` bound on ``F - F'`` keeps the exponent within
  ``mu delta_hat`` (Theorem 6). ``E[K] = f'(1)``.

  What is computed here, and where it departs from the reference code:

  * ``lambda`` and ``lambda_hat`` range over the same orders (``orders``), and
    ``lambda_hat = 1``, where the ``eps_hat`` term vanishes, is one more choice
    (the theorem allows it); the minimum over ``lambda_hat`` does not depend on
    ``lambda``. Orders where the candidate's RDP is infinite are skipped.
  * The reference's figure code writes the negative-binomial and logarithmic
    cases with smaller terms than Theorem 2 (``log((1 - gamma)/gamma)`` or
    ``log(1/gamma - 1)`` for ``log(1/gamma)`` beside ``lambda_hat``); on
    random four-outcome mechanisms, whose best-of-K divergence is
    exact, those smaller terms fall below the true divergence (by up to 0.34),
    so this module follows the theorem as stated. Its geometric and Poisson
    cases are the theorem's.
  * Poisson: ``eps_hat = log(1 + 1/(lambda - 1))`` (the largest allowed) and
    ``delta_hat`` from the candidate's RDP curve by dp-accounting's
    ``compute_delta`` (the reference does the same). ``mu < 1`` is refused:
    there ``log(mu) / (lambda - 1) < 0`` and the stated bound falls below the
    true divergence (a two-outcome mechanism at ``mu = 0.9`` shows it).
  * A dpmp candidate's curve is dp-accounting's ``RdpAccountant`` at
    ``SEARCH_ORDERS``, lowered to its running minimum from the top order down
    (Renyi divergence does not decrease with the order, so a higher order's
    bound holds at every lower one; dp-accounting's fractional orders can lie
    far above their integer neighbours).
  * RDP to (epsilon, delta): dp-accounting's ``compute_epsilon`` (Canonne,
    Kamath & Steinke 2020, Proposition 12, with its KL shortcut), as the
    reference's ``get_privacy_spent``.

  A dpmp candidate is not exactly the ideal mechanism whose curve
  dp-accounting computes (``CandidatePlan``): its noise is drawn by a
  sampler with an accounting contract, and its Poisson sample may be truncated.

  * Drawn noise. The contract's ``NoiseResidual(log_ratio=L, delta_tail=b)``
    says: outside a set ``G^c`` of probability at most ``b`` under the drawn
    mechanism of either neighbour, the drawn and ideal likelihoods of the
    run's transcript differ by at most ``L`` in log, under both neighbours.
    Let ``R`` be the drawn run conditioned on ``G`` (for each pair of
    neighbours, given the hyperparameters). On ``G`` the drawn density is
    within ``e^L`` of the ideal ``P`` under both, so
    ``D_a(R || R') <= D_a(P || P') + L (2a - 1)/(a - 1) + a log(1/(1 - b))/(a - 1)``:
    ``R`` is RDP with the candidate's curve raised by that (``search_rdp`` is
    applied to it), and the drawn run is within total variation ``b`` of
    ``R`` (it is ``(1 - b_x) R + b_x B``). Mixing over hyperparameters keeps
    the bound (quasi-convexity), and the score and the tie-break are
    post-processing.
  * Truncation. A Poisson sample truncated to a padded size with probability
    at most ``p`` per step differs from the untruncated run in total variation
    by at most ``T p`` (``truncation_tv``).
  * The search. Coupling each of the ``K`` candidates with its ``R``-version
    puts the search within total variation ``E[K] (b + T p)`` of the search
    over ``R``, which is ``(eps, delta_rdp)``-DP by the theorems and the
    conversion; a mechanism within total variation ``t`` of an
    ``(eps, d)``-DP one is ``(eps, d + t (1 + e^eps))``-DP. So the search is
    ``(eps, delta_rdp + E[K] (b + T p)(1 + e^eps))``-DP.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER, NoiseResidual, noise_contract
from dpmp.accounting._events import dpsgd_event, split_steps
from dpmp.accounting._residual import plan_residual

__all__ = [
    "SEARCH_ORDERS",
    "CandidateCount",
    "CandidatePlan",
    "PoissonCount",
    "SearchGuarantee",
    "TruncatedNegativeBinomialCount",
    "calibrate_search_noise",
    "search_epsilon",
    "search_guarantee",
]

# The Renyi orders of a search: the reference's (fractional near 1, every integer
# to 63, then 128, 256, 512), and 1024. Integer orders are fast to compute for the
# sampled Gaussian; any set gives an upper bound.
SEARCH_ORDERS: tuple[float, ...] = (
    (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5)
    + tuple(float(a) for a in range(5, 64))
    + (128.0, 256.0, 512.0, 1024.0)
)


def _orders(orders: Sequence[float]) -> np.ndarray:
    """``orders`` as a non-empty float64 array of finite reals > 1."""
    a = np.asarray(orders, dtype=np.float64)
    if a.ndim != 1 or a.size == 0 or not (np.all(np.isfinite(a)) and np.all(a > 1)):
        raise ValueError(f"orders: a non-empty list of finite reals > 1, got {orders!r}.")
    return a


def _curve(orders: Sequence[float], rdp: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(orders, rdp)`` as float64 arrays of one length, orders > 1, rdp >= 0 or inf."""
    a = _orders(orders)
    r = np.asarray(rdp, dtype=np.float64)
    if a.shape != r.shape:
        raise ValueError(f"orders and rdp: one length each, got {a.shape} and {r.shape}.")
    if np.any(np.isnan(r)) or np.any(r < 0):
        raise ValueError("rdp: each value must be >= 0 (or inf where there is no bound).")
    return a, r


class CandidateCount(abc.ABC):
    """The distribution of the number ``K`` of candidates a search runs.

    A new distribution is a subclass: its mean, its draw, a JSON record, and
    the RDP curve of the best of ``K`` runs from one run's curve, with the
    theorem it rests on in its docstring.
    """

    @property
    @abc.abstractmethod
    def mean(self) -> float:
        """``E[K]``."""

    @abc.abstractmethod
    def draw(self, rng: np.random.Generator) -> int:
        """One ``K``, from ``rng`` (which must be secret: seeded from the OS entropy)."""

    @abc.abstractmethod
    def search_rdp(self, orders: Sequence[float], rdp: Sequence[float]) -> np.ndarray:
        """The RDP of releasing the best of ``K`` runs, at ``orders``, of a run whose
        RDP at ``orders`` is ``rdp`` (inf: no bound at that order)."""

    @abc.abstractmethod
    def record(self) -> dict[str, Any]:
        """The distribution as JSON (its kind and parameters)."""

    @abc.abstractmethod
    def pgf(self, x: float) -> float:
        """The probability generating function ``E[x^K]``, ``x`` in ``[0, 1]``."""

    def expected_best(self, scores: Sequence[float], *, nothing: float = 0.0) -> float:
        """The expected score of the best of ``K`` candidates, each drawn uniformly
        from ``scores`` (a sweep's results; larger is better); ``nothing`` is the
        score of releasing nothing (``K = 0``; 0, as the reference's figure
        counts it).

        With ``a_1 <= ... <= a_m`` the sorted scores, the best of ``K`` draws is at
        most ``a_i`` with probability ``(i/m)^K``, whose expectation over ``K``
        is ``pgf(i/m)``: ``E = nothing pgf(0) + sum_i a_i (pgf(i/m) - pgf((i-1)/m))``.
        """
        a = np.sort(np.asarray(scores, dtype=np.float64))
        if a.ndim != 1 or a.size == 0 or not np.all(np.isfinite(a)):
            raise ValueError("scores: a non-empty list of finite numbers.")
        m = a.size
        cdf = np.array([self.pgf(i / m) for i in range(m + 1)])
        return float(nothing * cdf[0] + np.sum(a * np.diff(cdf)))


def _real(name: str, value: Any, low: float, high: float | None = None) -> float:
    """``value`` as a float in ``(low, high)`` (open), else ``ValueError`` naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and value > low and (high is None or value < high)
    if not ok:
        within = f"in ({low:g}, {high:g})" if high is not None else f"> {low:g}"
        raise ValueError(f"{name}: must be a real number {within}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class PoissonCount(CandidateCount):
    """``K ~ Poisson(mean)`` (Papernot & Steinke, Theorem 6); ``K = 0`` releases
    that nothing was chosen.

    Attributes:
      mean: ``mu >= 1`` (below 1 the theorem's bound is not an upper bound:
        the module docstring says why).
    """

    mean: float = 10.0

    def __post_init__(self):
        mu = _real("PoissonCount.mean", self.mean, 0.0)
        if mu < 1.0:
            raise ValueError(
                f"PoissonCount.mean: must be >= 1, got {mu:g} (below 1 the Poisson bound, "
                "eps + mu delta_hat + log(mu)/(lambda - 1), is not an upper bound)."
            )
        object.__setattr__(self, "mean", mu)

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.poisson(self.mean))

    def pgf(self, x: float) -> float:
        return math.exp(self.mean * (x - 1.0))

    def search_rdp(self, orders: Sequence[float], rdp: Sequence[float]) -> np.ndarray:
        a, r = _curve(orders, rdp)
        out = np.full(a.shape, np.inf)
        with _absl_quiet():
            for i, (order, eps) in enumerate(zip(a, r, strict=True)):
                if not math.isfinite(eps):
                    continue
                eps_hat = math.log1p(1.0 / (order - 1.0))
                delta_hat = rdp_privacy_accountant.compute_delta(a, r, eps_hat)[0]
                out[i] = eps + self.mean * delta_hat + math.log(self.mean) / (order - 1.0)
        return out

    def record(self) -> dict[str, Any]:
        return {"distribution": "poisson", "mean": self.mean}


@dataclasses.dataclass(frozen=True)
class TruncatedNegativeBinomialCount(CandidateCount):
    """``K ~ D_{eta,gamma}`` (Papernot & Steinke, Theorem 2): ``P[K = k]``
    proportional to ``binom(k + eta - 1, k) (1 - gamma)^k`` for ``k >= 1``.

    ``eta = 1`` is the geometric distribution (``E[K] = 1/gamma``); ``eta = 0``
    the logarithmic one (its limit). ``with_mean(mean, eta)`` picks ``gamma``.

    Attributes:
      eta: ``> -1``; larger concentrates ``K`` around its mean and costs more
        epsilon per unit of ``log(1/gamma)``.
      gamma: in ``(0, 1)``; smaller means more candidates.
    """

    eta: float
    gamma: float

    def __post_init__(self):
        object.__setattr__(self, "eta", _real("TruncatedNegativeBinomialCount.eta", self.eta, -1))
        gamma = _real("TruncatedNegativeBinomialCount.gamma", self.gamma, 0.0, 1.0)
        object.__setattr__(self, "gamma", gamma)

    @classmethod
    def with_mean(cls, mean: float, eta: float = 1.0) -> TruncatedNegativeBinomialCount:
        """The distribution of parameter ``eta`` whose ``E[K]`` is ``mean`` (> 1)."""
        mean = _real("mean", mean, 1.0)
        probe = cls(eta, 0.5)  # checks eta
        low, high = 1e-300, 1.0 - 1e-16  # E[K] falls from inf to 1 as gamma rises
        if _mean(probe.eta, low) < mean:
            raise ValueError(f"mean: {mean:g} is beyond any gamma at eta = {probe.eta:g}.")
        for _ in range(200):
            mid = math.sqrt(low * high)
            low, high = (mid, high) if _mean(probe.eta, mid) > mean else (low, mid)
            if high / low < 1 + 1e-13:
                break
        return cls(probe.eta, high)

    @property
    def mean(self) -> float:
        return _mean(self.eta, self.gamma)

    def draw(self, rng: np.random.Generator) -> int:
        # Inverse CDF: p_1 = (1 - gamma) eta / (gamma^-eta - 1) (its eta -> 0 limit
        # (1 - gamma) / log(1/gamma)), p_{k+1} = p_k (1 - gamma) (k + eta) / (k + 1).
        u, k, p = rng.random(), 1, self._first()
        total = p
        while total < u and p > 0.0:
            p *= (1.0 - self.gamma) * (k + self.eta) / (k + 1)
            k += 1
            total += p
        return k

    def pgf(self, x: float) -> float:
        # ((1 - (1 - gamma) x)^-eta - 1) / (gamma^-eta - 1);
        # eta = 0: log(1 - (1 - gamma) x) / log(gamma)
        g, eta = self.gamma, self.eta
        log_base = math.log1p(-(1.0 - g) * x)
        if eta == 0.0:
            return log_base / math.log(g)
        return math.expm1(-eta * log_base) / math.expm1(-eta * math.log(g))

    def _first(self) -> float:
        """``P[K = 1]``."""
        g, eta = self.gamma, self.eta
        if eta == 0.0:
            return (1.0 - g) / math.log(1.0 / g)
        return (1.0 - g) * eta / math.expm1(-eta * math.log(g))

    def search_rdp(self, orders: Sequence[float], rdp: Sequence[float]) -> np.ndarray:
        a, r = _curve(orders, rdp)
        scale, log_inv_gamma = 1.0 + self.eta, -math.log(self.gamma)
        finite = np.isfinite(r)
        # min over lambda_hat, of the orders and lambda_hat = 1 (eps_hat term zero)
        hat = scale * (1.0 - 1.0 / a[finite]) * r[finite] + scale * log_inv_gamma / a[finite]
        best = min(scale * log_inv_gamma, float(np.min(hat)) if hat.size else math.inf)
        return r + best + math.log(self.mean) / (a - 1.0)

    def record(self) -> dict[str, Any]:
        return {
            "distribution": "truncated_negative_binomial",
            "eta": self.eta,
            "gamma": self.gamma,
            "mean": self.mean,
        }


def _mean(eta: float, gamma: float) -> float:
    """``E[K]`` of ``D_{eta,gamma}``."""
    log_inv = -math.log(gamma)
    if eta == 0.0:
        return (1.0 / gamma - 1.0) / log_inv
    # eta (1 - gamma) / (gamma (1 - gamma^eta)), with gamma^eta = exp(-eta log_inv)
    return eta * (1.0 - gamma) / (gamma * -math.expm1(-eta * log_inv))


def search_epsilon(
    count: CandidateCount, *, orders: Sequence[float], rdp: Sequence[float], delta: float
) -> float:
    """Epsilon at ``delta`` of the best of ``K ~ count`` runs, each of RDP ``rdp``
    at ``orders`` (the theorems alone: a run that is exactly its curve)."""
    delta = _real("delta", delta, 0.0, 1.0)
    a, _ = _curve(orders, rdp)
    return _epsilon(a, count.search_rdp(a, rdp), delta)[0]


def _epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """dp-accounting's RDP to (epsilon, delta) conversion: ``(epsilon, order)``
    (epsilon inf: no finite bound)."""
    with _absl_quiet():
        eps, order = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
    return float(eps), float(order)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CandidatePlan:
    """What one candidate run releases, as the search's accounting needs it.

    Attributes:
      noise_multiplier: the gradient noise's sigma (None in a plan to calibrate).
      sampling_prob: Poisson sampling probability per step.
      steps: DP-SGD steps.
      count_noise_stddev: noise on an overflow count released every step, or None.
      preprocessing_noise_multiplier: a one-off Gaussian release, or None.
      noised_coordinates: coordinates noised per step (an upper bound will do:
        the residual grows with them), or None with ``noise_sampler=None``.
      noise_sampler: the sampler whose accounting contract the residual comes
        from (``dpmp.accounting.noise_contract``); None: exact Gaussian noise.
      truncation_tv: a bound on the probability that the run's Poisson sample
        is ever truncated (steps times the per-step bound); 0 if it never is.
    """

    noise_multiplier: float | None
    sampling_prob: float
    steps: int
    count_noise_stddev: float | None = None
    preprocessing_noise_multiplier: float | None = None
    noised_coordinates: int | None = None
    noise_sampler: str | None = DEFAULT_NOISE_SAMPLER
    truncation_tv: float = 0.0

    def __post_init__(self):
        if self.noise_multiplier is not None:
            _real("noise_multiplier", self.noise_multiplier, 0.0)
        _real("sampling_prob", self.sampling_prob, 0.0, 1.0 + 1e-12)
        if not isinstance(self.steps, numbers.Integral) or self.steps < 1:
            raise ValueError(f"steps: must be an integer >= 1, got {self.steps!r}.")
        if not 0.0 <= self.truncation_tv < 1.0:
            raise ValueError(f"truncation_tv: must be in [0, 1), got {self.truncation_tv!r}.")
        if self.noise_sampler is not None and self.noised_coordinates is None:
            raise ValueError(
                "noised_coordinates: required with a noise_sampler (its residual grows with "
                "the coordinates); noise_sampler=None accounts exact Gaussian noise."
            )

    def replace(self, **changes: Any) -> CandidatePlan:
        return dataclasses.replace(self, **changes)

    def rdp(self, orders: Sequence[float]) -> np.ndarray:
        """The ideal (exact Gaussian, untruncated) run's RDP at ``orders``
        (dp-accounting's ``RdpAccountant``; inf where it gives no bound)."""
        event = dpsgd_event(
            noise_multiplier=self._sigma(),
            sampling_prob=self.sampling_prob,
            steps=self.steps,
            count_noise_stddev=self.count_noise_stddev,
            preprocessing_noise_multiplier=self.preprocessing_noise_multiplier,
        )
        try:
            with _absl_quiet():
                acct = dp_accounting.rdp.RdpAccountant(orders=list(orders)).compose(event)
        except ArithmeticError:  # overflow at extreme sigmas: no bound
            return np.full(len(orders), np.inf)
        rdp = np.nan_to_num(np.asarray(acct.rdp, dtype=np.float64), nan=np.inf)
        return _nondecreasing(np.asarray(orders, dtype=np.float64), rdp)

    def residual(self, delta: float) -> NoiseResidual:
        """The drawn noise's residual over the run (zero for exact noise)."""
        contract = None if self.noise_sampler is None else noise_contract(self.noise_sampler)
        res = plan_residual(
            contract,
            self.noised_coordinates,
            steps=self.steps,
            with_count=split_steps(self.steps, self.count_noise_stddev, 1)[1],
            sigma=self._sigma(),
            count_noise_stddev=self.count_noise_stddev,
            delta=delta,
            neighboring="add_or_remove",
        )
        return NoiseResidual(0.0, 0.0, 0.0) if res is None else res

    def _sigma(self) -> float:
        if self.noise_multiplier is None:
            raise ValueError("noise_multiplier: this plan has none (calibrate it first).")
        return self.noise_multiplier


def _nondecreasing(orders: np.ndarray, rdp: np.ndarray) -> np.ndarray:
    """The curve lowered to its running minimum from the highest order down.

    Renyi divergence does not decrease with its order (van Erven & Harremoes
    2014, Theorem 3), so a bound at a higher order bounds every lower one.
    dp-accounting's fractional orders of a sampled Gaussian with a large
    sampling probability come out far above the integer orders around them
    (q = 0.36, sigma = 6: 11.7 at order 1.25 against 1.07 at order 2); this
    keeps what the higher orders already prove.
    """
    order = np.argsort(orders)
    sorted_rdp = rdp[order]
    lowered = np.minimum.accumulate(sorted_rdp[::-1])[::-1]
    out = np.empty_like(rdp)
    out[order] = lowered
    return out


class SearchGuarantee(NamedTuple):
    """The (epsilon, delta) of a search, and its parts.

    Attributes:
      epsilon: the whole search's epsilon at ``delta``.
      delta: the whole search's delta: ``delta_rdp + delta_tv``.
      delta_rdp: the delta the RDP conversion is asked at.
      delta_tv: ``E[K] (residual tail + truncation)(1 + e^epsilon)``.
      order: the Renyi order the conversion chose.
      candidate_epsilon: one ideal candidate's epsilon at ``delta`` (RDP; for
        comparison: what a single run at this noise would be said to cost).
      expected_candidates: ``E[K]``.
      residual_log_ratio: the drawn noise's ``L`` per candidate.
    """

    epsilon: float
    delta: float
    delta_rdp: float
    delta_tv: float
    order: float
    candidate_epsilon: float
    expected_candidates: float
    residual_log_ratio: float


def _raised_rdp(orders: np.ndarray, rdp: np.ndarray, res: NoiseResidual) -> np.ndarray:
    """The curve of the drawn run conditioned on its good set (module docstring)."""
    lam, b = res.log_ratio, res.delta_tail
    return (
        rdp + lam * (2.0 * orders - 1.0) / (orders - 1.0) - orders * math.log1p(-b) / (orders - 1.0)
    )


def search_guarantee(
    plan: CandidatePlan,
    count: CandidateCount,
    *,
    delta: float,
    orders: Sequence[float] = SEARCH_ORDERS,
) -> SearchGuarantee:
    """The (epsilon, ``delta``) of a search of ``K ~ count`` candidates of ``plan``.

    Raises:
      ValueError: ``delta`` is too small for the residual's and the truncation's
        share (``E[K] (b + T p)(1 + e^epsilon)`` must leave some of it).
    """
    delta = _real("delta", delta, 0.0, 1.0)
    a = _orders(orders)
    res = plan.residual(delta)
    ideal = plan.rdp(a)
    curve = count.search_rdp(a, _raised_rdp(a, ideal, res))
    tv = count.mean * (res.delta_tail + plan.truncation_tv)
    # epsilon at delta - tv (1 + e^epsilon): a fixed point, approached from below
    eps = _epsilon(a, curve, delta)[0]
    for _ in range(50):
        rest = delta - tv * (1.0 + math.exp(min(eps, 700.0)))
        if not rest > 0:
            raise ValueError(
                f"delta: {delta:g} is too small for this search: its candidates' noise "
                f"residual and truncation take {tv:.3g} (1 + e^epsilon) of it."
            )
        new, order = _epsilon(a, curve, rest)
        if new <= eps:
            break
        eps = new * (1.0 + 1e-12)
    else:  # pragma: no cover - tv is many orders of magnitude below delta
        raise ValueError(f"delta: {delta:g}: the search's epsilon did not settle.")
    return SearchGuarantee(
        epsilon=eps,
        delta=delta,
        delta_rdp=rest,
        delta_tv=delta - rest,
        order=order,
        candidate_epsilon=_epsilon(a, ideal, delta)[0],
        expected_candidates=count.mean,
        residual_log_ratio=res.log_ratio,
    )


def calibrate_search_noise(
    plan: CandidatePlan,
    count: CandidateCount,
    *,
    target_epsilon: float,
    delta: float,
    orders: Sequence[float] = SEARCH_ORDERS,
    rtol: float = 1e-3,
) -> float:
    """The smallest noise multiplier (within ``rtol``) whose search of ``K ~ count``
    candidates of ``plan`` (its own noise multiplier ignored) is
    ``(target_epsilon, delta)``-DP by ``search_guarantee``.

    Bisection on ``log(sigma)``: every part of the guarantee falls as sigma
    rises (the sampled Gaussian's RDP at each order, the theorems' maps and the
    conversion are monotone; the residual shrinks with sigma).

    Raises:
      ValueError: no sigma up to 1e6 meets the target (say, a target below what
        the number of candidates alone costs).
    """
    target = _real("target_epsilon", target_epsilon, 0.0)
    delta = _real("delta", delta, 0.0, 1.0)

    def fits(sigma: float) -> bool:
        try:
            sized = plan.replace(noise_multiplier=sigma)
            return search_guarantee(sized, count, delta=delta, orders=orders).epsilon <= target
        except ValueError:  # delta too small at this sigma: it does not fit
            return False

    if not fits(_SIGMA_CEILING):
        raise ValueError(
            f"target_epsilon: {target:g} at delta {delta:g} is out of reach of this search "
            f"(E[K] = {count.mean:g}) at any noise multiplier up to {_SIGMA_CEILING:g}."
        )
    # a bracket: low does not fit, high does
    if fits(1.0):
        low, high = 0.5, 1.0
        while fits(low):
            if low <= _SIGMA_FLOOR:
                return low
            low, high = low / 2.0, low
    else:
        low, high = 1.0, 2.0
        while not fits(high):
            low, high = high, min(2.0 * high, _SIGMA_CEILING)
    while high / low > 1.0 + rtol:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


# Calibration looks no lower: a search that fits below this noise multiplier
# promises little, and the sampled Gaussian's RDP is slow to compute there.
_SIGMA_FLOOR = 0.1
# ... and no higher (dpmp.accounting.MAX_NOISE_MULTIPLIER).
_SIGMA_CEILING = 1e6


@contextlib.contextmanager
def _absl_quiet() -> Iterator[None]:
    """Silences dp-accounting's absl warnings (an order that did not converge is
    left out: inf, no bound there)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
