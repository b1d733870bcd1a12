"""The plan of a run, one frozen record, and its epsilon.

``AccountingPlan`` records the mechanism: what each step releases (noise
multiplier, sampling probability, the overflow counts and a preprocessing
release), how many steps, the neighbouring relation, the accountant and the
noise's accounting contract with the coordinates it noises (modelled on
jax-privacy's ``DpParams``). ``dpmp.accounting.epsilon`` and the calibration
functions take it, or build it from their keyword arguments; the budget
tracker builds it from a ``PrivacyBudget``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import dp_accounting

from dpmp.accounting import _validate as check
from dpmp.accounting._accountants import (
    Accountant,
    as_accountant,
    check_neighboring,
    check_within_limit,
)
from dpmp.accounting._bandmf import bandmf_event, bands_of
from dpmp.accounting._contract import NoiseContract, NoiseResidual
from dpmp.accounting._events import (
    GaussianRelease,
    Release,
    dpsgd_event,
    effective_noise_multiplier,
    split_steps,
)
from dpmp.accounting._residual import epsilon_of_drawn_noise, plan_residual

__all__ = ["AccountingPlan", "EpsilonBreakdown", "plan_breakdown", "plan_epsilons"]


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class AccountingPlan:
    """What a run releases, as the accountant needs it. Checked on construction.

    Attributes:
      noise_multiplier: gradient noise stddev divided by the L2 sensitivity, in
        [1e-6, 1e6] or inf; None in a plan to calibrate.
      sampling_prob: Poisson sampling probability, in (0, 1].
      steps: number of DP-SGD steps, >= 0.
      delta: in (0, 1).
      accountant: an ``Accountant`` with its settings (``PldAccountant(...)``,
        ``RdpAccountant(...)``), or the name of a registered one (``"pld"``,
        ``"rdp"``), which the plan holds as that object.
      neighboring: ``"add_or_remove"`` or ``"replace_one"`` (where the
        accountant analyses it).
      count_noise_stddev: noise stddev of each released overflow count, or None.
      count_every: a count is released at steps k, 2k, ... (1-based), k >= 1.
      preprocessing_noise_multiplier: a one-off Gaussian release of the whole
        training set before training, or None.
      noised_coordinates: coordinates noised at each step (the trainable
        parameters), or None: accounted as exact Gaussian noise.
      noise: the drawn noise's ``NoiseContract`` (its sampler's), or None: exact.
        Its residual is accounted when ``noised_coordinates`` is given too.
      bands: 1 for DP-SGD; b > 1 for amplified banded matrix factorization on
        b-cyclic Poisson samples (``sampling_prob`` within a group): the steps
        compose as ``ceil(steps / b)`` rounds (``dpmp.accounting._bandmf``).
      records_per_unit: the most records one privacy unit gives, each
        Poisson-sampled at ``sampling_prob`` on its own (a user under example-level
        sampling: the binomial mixture of Gaussians, ``dpmp.accounting._groups``);
        1 (default) for a record, or a user sampled as a whole. Add or remove
        only, and not with bands.
    """

    noise_multiplier: float | None
    sampling_prob: float
    steps: int
    delta: float
    accountant: Accountant | str = "pld"
    neighboring: str = "add_or_remove"
    count_noise_stddev: float | None = None
    count_every: int = 1
    preprocessing_noise_multiplier: float | None = None
    noised_coordinates: int | None = None
    noise: NoiseContract | None = None
    bands: int = 1
    records_per_unit: int = 1

    def __post_init__(self):
        acct = as_accountant(self.accountant)
        if self.records_per_unit != 1:
            # A mixture's PLD takes 29 s to build at the 1e-4 interval (k = 3; 4 s at
            # 1e-3), once per noise multiplier a calibration tries: the coarser
            # interval, still an upper bound (2.4354 against 2.4352 there).
            acct = acct.for_tracking()
        sigma = self.noise_multiplier
        fields = dict(
            accountant=acct,
            neighboring=check_neighboring(self.neighboring, acct),
            delta=check.delta(self.delta),
            noised_coordinates=check.coordinates(self.noised_coordinates),
            noise_multiplier=None if sigma is None else check.noise_multiplier(sigma),
            sampling_prob=check.sampling_prob(self.sampling_prob),
            steps=check.steps(self.steps, 0),
            count_every=check.integer("count_every", self.count_every, 1),
            preprocessing_noise_multiplier=check.optional_noise(
                self.preprocessing_noise_multiplier, "preprocessing_noise_multiplier"
            ),
            count_noise_stddev=check.optional_noise(self.count_noise_stddev, "count_noise_stddev"),
            bands=bands_of(self.bands),
            records_per_unit=check.records_per_unit(self.records_per_unit, self.neighboring),
        )
        if fields["records_per_unit"] > 1 and fields["bands"] > 1:
            raise ValueError(
                "records_per_unit: units of several records are accounted for DP-SGD "
                "steps, not for banded matrix factorization (bands > 1)."
            )
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> AccountingPlan:
        return dataclasses.replace(self, **changes)

    def _sigma(self) -> float:
        if self.noise_multiplier is None:
            raise ValueError("noise_multiplier: this plan has none (calibrate it first).")
        return self.noise_multiplier

    @property
    def accounts_residual(self) -> bool:
        """Whether the drawn noise's residual is part of the plan's epsilon."""
        return self.noise is not None and self.noised_coordinates is not None

    @property
    def with_count(self) -> int:
        """Steps that also release a count."""
        return split_steps(self.steps, self.count_noise_stddev, self.count_every)[1]

    def releases(self) -> dict[Release, GaussianRelease]:
        """Each kind of release (infinite noise: that kind releases nothing)."""
        sigma, q, k = self._sigma(), self.sampling_prob, self.records_per_unit
        pre = self.preprocessing_noise_multiplier
        return {
            Release.STEP: GaussianRelease(sigma, q, records_per_unit=k),
            Release.STEP_WITH_COUNT: GaussianRelease(
                effective_noise_multiplier(sigma, self.count_noise_stddev), q, records_per_unit=k
            ),
            Release.PREPROCESSING: GaussianRelease(
                math.inf if pre is None else pre, 1.0, sampled=False, records_per_unit=k
            ),
        }

    def event(self) -> dp_accounting.DpEvent:
        """The dp-accounting event of the whole plan (``dpsgd_event``; with bands,
        ``bandmf_event``)."""
        if self.bands > 1:
            return bandmf_event(
                noise_multiplier=self._sigma(),
                sampling_prob=self.sampling_prob,
                steps=self.steps,
                bands=self.bands,
                count_noise_stddev=self.count_noise_stddev,
                preprocessing_noise_multiplier=self.preprocessing_noise_multiplier,
            )
        return dpsgd_event(
            noise_multiplier=self._sigma(),
            sampling_prob=self.sampling_prob,
            steps=self.steps,
            count_noise_stddev=self.count_noise_stddev,
            count_every=self.count_every,
            preprocessing_noise_multiplier=self.preprocessing_noise_multiplier,
            records_per_unit=self.records_per_unit,
        )

    def residual(self, noise_multiplier: float | None = None) -> NoiseResidual | None:
        """The noise residual of the plan (at another noise multiplier if given);
        None when the noise is accounted as exact."""
        return plan_residual(
            self.noise,
            self.noised_coordinates,
            steps=self.steps,
            with_count=self.with_count,
            sigma=self._sigma() if noise_multiplier is None else noise_multiplier,
            count_noise_stddev=self.count_noise_stddev,
            delta=self.delta,
            neighboring=self.neighboring,
            records_per_unit=self.records_per_unit,
        )


def plan_epsilons(plan: AccountingPlan) -> tuple[float, float]:
    """(exact-Gaussian epsilon, epsilon of the drawn noise) from one composition."""
    event = plan.event()
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0, 0.0
    acct = plan.accountant
    if acct.bounded_first:
        check_within_limit(event, plan.delta)
    composed = acct.make(plan.neighboring).compose(event)
    exact = float(composed.get_epsilon(plan.delta))
    drawn = epsilon_of_drawn_noise(
        composed.get_epsilon, plan.residual(), plan.delta, plan.noise, plan.residual
    )
    return exact, float(drawn)


def plan_breakdown(plan: AccountingPlan) -> EpsilonBreakdown:
    """Epsilon with and without the count and preprocessing releases.

    Epsilon does not add up over mechanisms, so each part is a difference at
    the same delta: ``counts = epsilon(steps and counts) - epsilon(steps)``,
    ``preprocessing = epsilon(everything) - epsilon(steps and counts)``, and
    ``noise_residual`` = the total with the drawn noise minus the exact one.
    """
    exact_counts = plan.replace(preprocessing_noise_multiplier=None, noised_coordinates=None)
    dpsgd = plan_epsilons(exact_counts.replace(count_noise_stddev=None))[1]
    with_counts = dpsgd if plan.count_noise_stddev is None else plan_epsilons(exact_counts)[1]
    if plan.preprocessing_noise_multiplier is None and plan.noised_coordinates is None:
        exact = total = with_counts
    else:  # one composition gives both
        exact, total = plan_epsilons(plan)
    return EpsilonBreakdown(
        total=total,
        dpsgd=dpsgd,
        counts=with_counts - dpsgd,
        preprocessing=exact - with_counts,
        noise_residual=total - exact,
    )
