"""``accountant="pld"``: privacy loss distributions, tight.

Koskela, Jalko & Honkela 2020 ("Computing tight differential privacy
guarantees using FFT"); Doroshenko et al. 2022 ("Connect the dots: tighter
discrete approximations of privacy loss distributions"), with dp-accounting's
*pessimistic* discretisation: the reported epsilon is an upper bound for
every ``value_discretization_interval``; a coarser interval gives a slightly
larger (safer) epsilon, faster. Both neighbouring relations; under
``"replace_one"`` the count analysis is conservative (it allows a count to
move by 2 where a substitution moves it by at most 1), and the step's is
dp-accounting's ``REPLACE_ONE``: the substituted records' clipped gradients
colinear and opposite, a pair assumed, not proved, to dominate every other
(``dpmp.accounting``'s Formal Guarantees).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution

from dpmp.accounting import _validate as check
from dpmp.accounting._accountants import NEIGHBORING, Curve, EpsilonAt, rdp_bound, rdp_curve
from dpmp.accounting._events import GaussianRelease, Release
from dpmp.accounting._validate import MAX_EPSILON, REPORT_DISCRETIZATION, TRACKING_DISCRETIZATION

__all__ = ["PLD", "PldAccountant"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PldAccountant:
    """dp-accounting's ``PLDAccountant``; plans beyond ``MAX_EPSILON`` are refused
    first (their PLD would take minutes and gigabytes).

    Example:
      >>> import dpmp.accounting as acc
      >>> fine = acc.PldAccountant(value_discretization_interval=1e-5)
      >>> plan = dict(noise_multiplier=10.0, sampling_prob=4096 / 50000, steps=875,
      ...             delta=1e-5, noised_coordinates=None)
      >>> # a finer grid: a slightly tighter upper bound, slower
      >>> acc.epsilon(**plan, accountant=fine) <= acc.epsilon(**plan, accountant="pld")
      True

    Attributes:
      value_discretization_interval: the width of the privacy-loss grid, in
        (0, 1); dp-accounting's *pessimistic* discretisation gives an upper
        bound at any width, a coarser one a slightly larger epsilon, faster.
        None (default): dp-accounting's 1e-4 (``REPORT_DISCRETIZATION``) for a
        one-shot epsilon or calibration, and the 10x coarser 1e-3
        (``TRACKING_DISCRETIZATION``) for a ``BudgetTracker``, which asks at
        every step (``for_tracking``). A value given is used for both.
      name: the name it is registered and recorded by.
    """

    neighboring_relations: ClassVar[tuple[str, ...]] = ("add_or_remove", "replace_one")
    bounded_first: ClassVar[bool] = True

    value_discretization_interval: float | None = None
    name: str = "pld"

    def __post_init__(self):
        interval = self.value_discretization_interval
        if interval is not None:
            interval = check.interval(interval, "PldAccountant.value_discretization_interval")
        object.__setattr__(self, "value_discretization_interval", interval)
        object.__setattr__(self, "name", check.name("PldAccountant.name", self.name))

    @property
    def interval(self) -> float:
        """The discretisation ``make`` and ``curve`` use."""
        interval = self.value_discretization_interval
        return REPORT_DISCRETIZATION if interval is None else interval

    def make(self, neighboring: str) -> dp_accounting.PrivacyAccountant:
        return dp_accounting.pld.PLDAccountant(
            neighboring_relation=NEIGHBORING[neighboring],
            value_discretization_interval=self.interval,
        )

    def for_tracking(self) -> PldAccountant:
        if self.value_discretization_interval is not None:
            return self
        return dataclasses.replace(self, value_discretization_interval=TRACKING_DISCRETIZATION)

    def curve(
        self, releases: Mapping[Release, GaussianRelease], *, neighboring: str, delta: float
    ) -> Curve:
        return _PldCurve(releases, NEIGHBORING[neighboring], self.interval, delta)


class _PldCurve:
    """The per-release PLDs are built once (as ``PLDAccountant`` builds them); a
    run's PLD is their self-composition. When queries walk forward one step at a
    time, as a trainer's do, the last PLD is extended by one composition instead
    of being rebuilt: both paths are pessimistic and agree to about 1e-9 relative.
    """

    _INCREMENTAL_LIMIT = 8

    def __init__(self, releases, relation, interval: float, delta: float):
        self._releases = releases
        self._relation = relation
        self._interval = interval
        self._delta = delta
        self._single: dict[Release, Any] = {}
        self._bound: dict[Release, Any] = {}
        self._cursor: tuple[dict[Release, int], Any] | None = None

    def _beyond_limit(self, counts: Mapping[Release, int]) -> bool:
        """The plan's RDP bound exceeds ``MAX_EPSILON``: its PLD is not built."""
        rdp = 0
        for kind, n in counts.items():
            if n > 0 and self._releases[kind].records_per_unit > 1:
                return False  # a mixture: its RDP bound is far too loose (has_mixture)
        for kind, n in counts.items():
            if n > 0:
                if kind not in self._bound:
                    self._bound[kind] = rdp_curve(self._releases[kind].event())
                rdp = rdp + n * self._bound[kind]
        return rdp_bound(rdp, self._delta) > MAX_EPSILON

    def _one(self, kind: Release) -> Any:
        if kind not in self._single:
            self._single[kind] = _release_pld(self._releases[kind], self._relation, self._interval)
        return self._single[kind]

    def _pld(self, counts: Mapping[Release, int]) -> Any:
        if self._cursor is not None:
            before, pld = self._cursor
            more = {kind: counts[kind] - before.get(kind, 0) for kind in counts}
            steps = (Release.STEP, Release.STEP_WITH_COUNT)
            if (
                all(n >= 0 for n in more.values())
                and more.get(Release.PREPROCESSING, 0) == 0
                and sum(more.get(kind, 0) for kind in steps) <= self._INCREMENTAL_LIMIT
            ):
                for kind in steps:
                    for _ in range(more.get(kind, 0)):
                        pld = pld.compose(self._one(kind))
                return pld
        parts = [self._one(kind).self_compose(n) for kind, n in counts.items() if n > 0]
        pld = parts[0]
        for part in parts[1:]:
            pld = pld.compose(part)
        return pld

    def __call__(self, counts: Mapping[Release, int]) -> EpsilonAt | None:
        if self._beyond_limit(counts):
            return None
        pld = self._pld(counts)
        self._cursor = (dict(counts), pld)
        return pld.get_epsilon_for_delta


PLD = PldAccountant()


def _release_pld(r: GaussianRelease, relation: Any, interval: float) -> Any:
    """The PLD of one release's event (``GaussianRelease.event``): a Gaussian,
    Poisson-sampled or not, or for a unit of several records each sampled on its own
    the mixture of Gaussians (``dpmp.accounting._groups``)."""
    event = r.event()
    if isinstance(event, dp_event.MixtureOfGaussiansDpEvent):
        return privacy_loss_distribution.from_mixture_gaussian_mechanism(
            standard_deviation=event.standard_deviation,
            sensitivities=event.sensitivities,
            sampling_probs=event.sampling_probs,
            value_discretization_interval=interval,
        )
    sampled = isinstance(event, dp_accounting.PoissonSampledDpEvent)
    gaussian = event.event if sampled else event
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=gaussian.noise_multiplier,
        value_discretization_interval=interval,
        sampling_prob=event.sampling_probability if sampled else 1.0,
        neighboring_relation=relation,
    )
