"""What a noise sampler's floating-point output costs beyond the exact Gaussian.

``GridNoiseContract`` is the analysis of a sampler that snaps a float64
inverse-CDF normal to a power-of-two grid (``dpmp.snapped_gaussian``); its
constants are the sampler's, measured with it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from scipy import special as scipy_special

from dpmp.accounting import _validate as check
from dpmp.accounting._contract import NoiseContract, NoiseResidual
from dpmp.accounting._events import effective_noise_multiplier

__all__ = ["RESIDUAL_DELTA_SHARE", "GridNoiseContract"]

# The share of delta the residual's own failure events may take (its concentration
# and its count of tail coordinates, each half of it): small enough that asking the
# accountant for epsilon at the delta it leaves costs ~1e-7 epsilon.
RESIDUAL_DELTA_SHARE = 1e-6


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


def _outside_mass_split(reach: float, coordinates: int, t_max: float) -> float:
    """The bound of ``_outside_mass`` by another argument, tighter for shifts of a few
    stddevs (a unit of several records): for any ``tau`` in (0, t_max], at most
    ``(t_max / tau)^2`` coordinates have ``t_i > tau``, each with ``P(|Z + t_i| >
    L) <= 2 Phi(-(L - t_max))``, and each of the others at most ``2 Phi(-(L -
    tau))``; the smallest over a grid of ``tau``."""
    if t_max <= 0:
        return _outside_mass(reach, coordinates, t_max)
    best = math.inf
    for tau in t_max * np.geomspace(1e-3, 1.0, 61):
        few = min(float(coordinates), math.ceil((t_max / tau) ** 2))
        log_many = math.log(coordinates) + float(scipy_special.log_ndtr(-(reach - tau)))
        log_few = math.log(few) + float(scipy_special.log_ndtr(-(reach - t_max)))
        best = min(best, 2.0 * math.exp(min(float(np.logaddexp(log_many, log_few)), 700.0)))
    return best


def _tail_count(mu: float, log_target: float) -> int:
    """Fewest k with P(N > k) <= exp(log_target) for a count N of events whose
    conditional probabilities, given everything before, sum to at most ``mu``
    (a sum of adaptively chosen Bernoullis): Chernoff's
    P(N >= a) <= e^-mu (e mu / a)^a for a > mu (E e^(s N) <= e^(mu (e^s - 1))
    holds for such sums, a supermartingale argument). The residual's N counts
    coordinates, independent given the past, not coordinate-component pairs: once
    one pair of a coordinate occurs, another of the same coordinate is all but
    certain, so the pairs' conditional probabilities do not sum to their mean."""
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class GridNoiseContract:
    """The contract of a sampler that adds ``grid * round(x / grid + r z)`` noise.

    Attributes:
      sampler: the sampler's name.
      cells_per_stddev: the range ``[r_min, r_max)`` of ``r = stddev / grid``
        (a grid cell is a ``1 / r`` of the noise stddev).
      ndtri_rel_error: ``((reach, kappa), ...)``: the relative error of the
        drawn normal ``z`` is at most ``kappa`` for ``|z| <= reach``; the first
        reach bounds the *core* cells, the last covers ``tail``.
      tail: cells within this many stddevs of the mean are accurate; the rest
        of the mass is delta.
      uniform_rel_error: the relative spacing of the sampler's uniforms and of
        its float64 arithmetic.
    """

    sampler: str
    cells_per_stddev: tuple[int, int]
    ndtri_rel_error: tuple[tuple[float, float], ...]
    tail: float
    uniform_rel_error: float

    @property
    def core(self) -> float:
        """Cells within this many stddevs carry the bulk of the bound."""
        return self.ndtri_rel_error[0][0]

    def cell_log_ratio(self, reach: float, rel_error: float) -> float:
        """Bound on |log(drawn / exact probability)| of one coordinate's grid cell
        lying within ``reach`` stddevs of its mean."""
        shift = (rel_error + self.uniform_rel_error) * (reach + 2.0)  # z's largest error
        r_min, r_max = self.cells_per_stddev
        x = 2.0 * shift * r_max * math.exp((1.0 / r_min + 2.0 * shift) * reach)
        return -math.log1p(-x)

    def residual(
        self,
        *,
        coordinates: int,
        releases: int,
        noise_multiplier: float,
        delta: float,
        neighboring: str = "add_or_remove",
        records_per_unit: int = 1,
    ) -> NoiseResidual:
        """The accounted cost of drawing this sampler's noise instead of an exact one.

        Args:
          coordinates: noised coordinates per release (parameters, plus one for a
            released count).
          releases: number of noisy releases (steps).
          noise_multiplier: the effective noise multiplier of one release (the
            neighbour moves the noise mean by at most ``1 / noise_multiplier``
            stddevs in L2 norm; twice that under ``"replace_one"``).
          delta: the run's target delta (fixes how rare the failure events must be).
          neighboring: ``"add_or_remove"`` or ``"replace_one"``.
          records_per_unit: ``k``, the most records of one privacy unit, each
            Poisson-sampled on its own (example-level sampling of users); add or
            remove only. See *Units of k records* below.

        Returns:
          The ``NoiseResidual``: the drawn noise is ``(eps + epsilon, delta)``-DP
          when the exact-Gaussian accountant's ``eps`` is taken at
          ``ideal_delta(delta)``.

        Derivation. Units of the noise stddev; ``d`` = ``coordinates``, ``T`` =
        ``releases``. Pseudo-randomness is assumed ideal.

        1. *One cell.* A coordinate's release is ``K = round(x / grid + r z)`` with
           ``z = ndtri(U)`` (sign-symmetric) and ``U`` a float64 uniform with 51
           fraction bits (see ``dpmp.noise._snapped``). With ``z`` exactly normal ``K``
           is a post-processing of the Gaussian mechanism (the *ideal* mechanism,
           which the accountant's ``(eps, delta)`` covers). Drawn and exact ``z``
           differ by at most ``tau(z) = (kappa + 2^-51)(|z| + 2)`` (``ndtri``'s
           relative error ``kappa``, the float64 arithmetic and the uniform's
           lattice), so the drawn probability ``p~`` of a cell of width ``w = 1/r``
           within ``L`` of the mean is within a log-ratio
           ``eta(L) = -log(1 - 2 tau r e^((w + 2 tau) L))`` of its exact mass ``p``
           (``cell_log_ratio``): ``eta = eta(8)`` for the *core* cells (within 8),
           ``eta_t = eta(tail)`` for the others within ``tail``; beyond, no
           bound (the sampler reaches 10.08).
        2. *One step, its batch revealed.* Let the ideal and the drawn mechanism
           also release which of the other records each step sampled (``B``).
           Releasing more only loses privacy, and the accountant's bound still holds
           for the ideal one: given ``B`` a step is ``(1-q) N(mu_B) + q N(mu_B + g)``
           against ``N(mu_B)`` (add/remove), which the Poisson-subsampled Gaussian
           that dp-accounting analyses dominates, whatever ``mu_B``. Under
           replace-one it is ``(1-q) N(mu_B) + q N(mu_B + g)`` against ``(1-q)
           N(mu_B) + q N(mu_B + g')``, ``|g|, |g'| <= 1 / sigma``; dp-accounting's
           ``REPLACE_ONE`` analyses the colinear pair ``g' = -g`` (in one dimension,
           ``(1-q) N(0) + q N(-1 / sigma)`` against ``(1-q) N(0) + q N(1 / sigma)``).
           *Assumed, not proved here:* that pair dominates every pair of clipped
           gradients (it puts the substituted records' components furthest apart,
           ``|g - g'|_2 = 2 / sigma``); a replace-one epsilon, the accountant's and
           so this one, rests on it. So each step's output density is a mixture of
           ``c`` product densities (``c = 2``; ``c = 3`` under replace-one, the
           components ``mu_B``, ``mu_B + g``, ``mu_B + g'``), whose means differ by
           ``t`` with ``|t|_2 <= t_max = 1 / sigma`` (``2 / sigma``). The
           drawn-to-exact ratio of a mixture lies between those of its components,
           so ``|log(M~ / M)|`` of a step is at most ``max_j |A_j|``,
           ``A_j = sum_i log(p~_ji(o_i) / p_ji(o_i))``.
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
        4. *Tail coordinates.* Count the coordinates outside *some* component's
           core (``|o_i - mu_ji| > 8`` for some ``j``). Given the past and the
           component ``l`` that drew the step, the coordinates are independent, and
           by the union bound over the ``c`` components coordinate ``i`` is outside
           some core with probability at most ``sum_j P(|Z + t_lj,i| > 8 - w)``
           (``t_lj = mu_l - mu_j``, ``|t_lj|_2 <= t_max``); summed over the
           coordinates that is at most ``c _outside_mass(8 - w)`` per step, with the
           worst split of each ``t_lj``. Over the run these coordinates number more
           than ``k`` with probability at most ``beta_k`` (Chernoff for adaptive
           counts, ``_tail_count``, of mean ``c T _outside_mass(8 - w)``). For each
           ``j``, the coordinates outside ``j``'s core are among them, so each
           ``A_j`` has at most ``k`` terms outside its core part, each at most
           ``eta_t``. (Coordinate-component pairs would not do: the pairs of one
           coordinate are dependent, as one far out is outside every core at
           once, and Chernoff's bound fails for their count: one coordinate, two
           components of one mean, outside with probability 1e-3; the pairs' mean
           is 2e-3, whose ``k`` at ``beta_k = 1e-4`` is 1, yet the pairs number 2
           with probability 1e-3.) A coordinate beyond ``tail`` of some component
           has probability at most ``beta_out = c T _outside_mass(tail - w)`` over
           the run (the union bound over steps, components and coordinates).
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

        *Units of k records* (add or remove). Given ``B``, a step is the mixture
        ``sum_S p_S N(mu_B + g_S)`` over the subsets ``S`` of the unit's records
        that the step sampled, ``g_S`` the sum of their clipped gradients, against
        ``N(mu_B)``; the binomial mixture of Gaussians dominates it for the
        accountant (``dpmp.accounting._groups``). The argument above holds with
        ``c = 2^k`` components for the union bounds of 3 (one per subset, the
        empty one ``mu_B``) and ``t_max = k / sigma`` (two subsets' means differ
        by the gradients of their symmetric difference, at most ``k`` records of
        norm ``1 / sigma`` each). In 4 and for ``beta_out`` the union over the
        components is taken per coordinate instead: every component mean lies in
        the box ``mu_B,i +- T_i``, ``T_i = sum_r |g_r,i|`` (``|T|_2 <= k / sigma``),
        so coordinate ``i`` is outside some component's core only if ``|Z| > 8 - T_i``
        under the component that drew it, at most ``2 Phi(-(8 - T_i))``: one
        ``_outside_mass`` at ``t_max = k / sigma`` bounds the sum, and the factor
        ``c = 2`` kept there makes ``k = 1`` the analysis above exactly. For
        ``k > 1`` that sum is bounded by ``_outside_mass_split`` instead, tighter
        at shifts of a few stddevs (few coordinates can hold a large part of the
        shift).

        The bound grows with ``sqrt(d log T)`` per step where summing the cells'
        bounds grows with ``d``: about 7.3e-12 sqrt(2 d ln(4 T / beta_H)) T. With
        ``beta_H = beta_k = RESIDUAL_DELTA_SHARE delta / 2``: 125M coordinates x
        5,000 steps at sigma 1 give ``epsilon`` ~ 7.6e-3.
        """
        n = check.integer("coordinates", coordinates, 1)
        releases = check.integer("releases", releases, 0)
        sigma = check.noise_multiplier(noise_multiplier)
        delta = check.delta(delta)
        if neighboring not in check.NEIGHBORING_RELATIONS:
            raise ValueError(
                f"neighboring must be one of {check.NEIGHBORING_RELATIONS}, got {neighboring!r}."
            )
        if releases == 0 or sigma == math.inf:
            return NoiseResidual(0.0, 0.0, 0.0)
        group = check.integer("records_per_unit", records_per_unit, 1)
        replace = neighboring == "replace_one"
        if replace and group > 1:
            raise ValueError(
                "records_per_unit: units of several records are accounted under "
                "add_or_remove only, not replace_one."
            )
        c, t_max = (3, 2.0 / sigma) if replace else (2, group / sigma)
        c_h = 2.0**group if group > 1 else c  # the components of 3's union bounds
        eta = self.cell_log_ratio(self.core, self.ndtri_rel_error[0][1])
        eta_t = self.cell_log_ratio(self.tail, self.ndtri_rel_error[-1][1])
        slack = 1.0 / self.cells_per_stddev[0] + 1e-9  # a cell's width, and the drawn z's error
        budget = RESIDUAL_DELTA_SHARE * delta / 2.0
        # 3: concentration of the core cells, and their mean
        s = eta * math.sqrt(2.0 * n * math.log(2.0 * c_h * releases / budget))
        own = 2.0 * float(np.exp(scipy_special.log_ndtr(-(self.tail - slack))))  # beyond the tail
        core_out = 2.0 * float(np.exp(scipy_special.log_ndtr(-(self.core - slack))))
        diff = core_out * math.expm1(eta_t) + 2.0 * own  # D: drawn vs exact mass outside the core
        e1 = math.expm1(eta)
        mean = eta * t_max * math.sqrt(2.0 * n / math.pi) + n * (
            e1 * e1 + 2.0 * eta * e1 + (1.0 + 2.0 * eta) * diff
        )
        # 4: the coordinates outside some component's core (per coordinate the union
        # bound over the c components; summed over coordinates and steps), and the
        # mass beyond the sampler's accurate reach
        outside = _outside_mass if group == 1 else _outside_mass_split
        mu_tail = c * releases * outside(self.core - slack, n, t_max)
        k = _tail_count(mu_tail, math.log(budget))
        beta_out = c * releases * outside(self.tail - slack, n, t_max)
        log_ratio = releases * (s + mean) + k * eta_t
        return NoiseResidual(2.0 * log_ratio, log_ratio, 2.0 * budget + beta_out)


def plan_residual(
    contract: NoiseContract | None,
    coordinates: int | None,
    *,
    steps: int,
    with_count: int,
    sigma: float,
    count_noise_stddev: float | None,
    delta: float,
    neighboring: str,
    records_per_unit: int = 1,
) -> NoiseResidual | None:
    """The noise residual of a plan of ``steps`` releases of ``coordinates`` gradient
    coordinates at noise multiplier ``sigma``; with count releases, the count's noise
    is one more coordinate and the neighbour's shift is that of the effective noise
    multiplier. None: the plan does not count coordinates, its sampler is accounted
    as exact, or it releases nothing. ``records_per_unit`` (a unit's records, each
    sampled on its own) reaches the contract only when above 1."""
    if coordinates is None or contract is None or steps == 0:
        return None
    if with_count:
        coordinates = coordinates + 1
        sigma = effective_noise_multiplier(sigma, count_noise_stddev)
    group = {} if records_per_unit == 1 else {"records_per_unit": records_per_unit}
    return contract.residual(
        coordinates=coordinates,
        releases=steps,
        noise_multiplier=sigma,
        delta=delta,
        neighboring=neighboring,
        **group,
    )


def _smallest_fitting_sigma(res_at: Callable, delta: float) -> float:
    """The smallest noise multiplier (to 1%) whose residual's tail delta fits in
    ``delta`` (``res_at(sigma)`` is the plan's residual at ``sigma``)."""
    low, high = 1e-3, 1.0
    while res_at(high).delta_tail > delta / 2:
        low, high = high, 2 * high
        if high > check.MAX_NOISE_MULTIPLIER:
            return math.inf
    while high / low > 1.01:
        mid = math.sqrt(low * high)
        low, high = (low, mid) if res_at(mid).delta_tail <= delta / 2 else (mid, high)
    return high


def epsilon_of_drawn_noise(
    eps_at: Callable[[float], float],
    res: NoiseResidual | None,
    delta: float,
    contract: NoiseContract | None = None,
    res_at: Callable | None = None,
) -> float:
    """``eps_at(delta')`` is the accountant's epsilon of the exact-Gaussian plan;
    returns the epsilon at ``delta`` of the noise drawn under ``contract``, whose
    residual is ``res`` (None: exact noise, the accountant's epsilon).
    ``res_at(sigma)``, the residual at another noise multiplier, lets a refusal
    say what would fit."""
    if res is None:
        return eps_at(delta)
    if not res.delta_tail <= 0.5 * delta:
        hint = ""
        if res_at is not None:
            hint = f" (about {_smallest_fitting_sigma(res_at, delta):.3g} or more)"
        raise ValueError(
            f"noise_multiplier: too small for the {contract.sampler} noise at delta={delta:g}: "
            f"the chance that some noised coordinate of the run lands beyond the sampler's "
            f"{contract.tail}-sigma reach is {res.delta_tail:.3g}, more than half of delta; "
            f"raise the noise multiplier{hint} or delta."
        )
    return eps_at(res.ideal_delta(delta)) + res.epsilon
