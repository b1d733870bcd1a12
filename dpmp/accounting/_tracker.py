"""The running budget: epsilon spent so far by a run, step by step.

``PrivacyBudget`` is a run's plan without its length, and its target;
``BudgetTracker`` counts the releases and asks the accountant's curve for
their epsilon, refusing any step past the target.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from typing import Any

from dpmp.accounting import _validate as check
from dpmp.accounting._accountants import (
    Accountant,
    accountant_from_record,
    accountant_record,
    as_accountant,
    check_neighboring,
)
from dpmp.accounting._bandmf import bands_of, round_counts
from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER, NoiseResidual, noise_contract
from dpmp.accounting._events import Release
from dpmp.accounting._plan import AccountingPlan, EpsilonBreakdown
from dpmp.accounting._residual import epsilon_of_drawn_noise, plan_residual
from dpmp.accounting._validate import REQUIRED, _Required

__all__ = [
    "BudgetExceededError",
    "BudgetTracker",
    "PrivacyBudget",
    "largest_fitting",
    "plan_curve",
]


class BudgetExceededError(RuntimeError):
    """Raised when a step would take the run past its target epsilon."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacyBudget:
    """The privacy plan of a run: what each step releases, and the target.

    Attributes:
      noise_multiplier: gradient noise stddev divided by the clip norm.
      sampling_prob: Poisson sampling probability, in (0, 1].
      delta: in (0, 1).
      target_epsilon: the run may not exceed this epsilon, in (0, MAX_EPSILON].
      accountant: an ``Accountant`` with its settings, or a registered one's name
        (``"pld"``, ``"rdp"``), held as that object. The tracker runs its
        ``for_tracking()``: the default PLD at the coarser
        ``TRACKING_DISCRETIZATION`` (1e-3), still an upper bound; give
        ``PldAccountant(value_discretization_interval=1e-4)`` for the finer grid
        a one-shot ``epsilon(...)`` uses.
      neighboring: ``"add_or_remove"``, or ``"replace_one"`` where the accountant
        analyses it (``accountant.neighboring_relations``).
      count_noise_stddev: noise stddev of each released overflow count, or None.
      count_every: a count is released at steps k, 2k, ... (1-based), k >= 1.
      preprocessing_noise_multiplier: noise multiplier of a one-off Gaussian
        release of the whole training set before training, or None.
      noised_coordinates: required: coordinates of each gradient release, for
        dpmp's snapped Gaussian noise (its ``noise_residual`` is then part of
        every epsilon); ``None`` for an exact Gaussian sampler.
      noise_sampler: the registered sampler (``dpmp.noise``) that draws the
        noise, whose accounting contract the noised coordinates are taken
        under (``"snapped"``; ``"plain"`` is accounted as exact); recorded as
        the default when ``noised_coordinates`` is None.
      bands: 1 (DP-SGD), or the bands of amplified banded matrix factorization,
        whose steps compose in rounds of ``bands`` (``AccountingPlan.bands``).
      records_per_unit: the most records of one privacy unit, each sampled on its
        own (``AccountingPlan.records_per_unit``); 1 for a record unit.

    ``plan(steps)`` is the ``AccountingPlan`` of a run of ``steps`` steps.
    """

    noise_multiplier: float
    sampling_prob: float
    delta: float
    target_epsilon: float
    accountant: Accountant | str = "pld"
    neighboring: str = "add_or_remove"
    count_noise_stddev: float | None = None
    count_every: int = 1
    preprocessing_noise_multiplier: float | None = None
    noised_coordinates: int | None | _Required = REQUIRED
    noise_sampler: str = DEFAULT_NOISE_SAMPLER
    bands: int = 1
    records_per_unit: int = 1

    def __post_init__(self):
        acct = as_accountant(self.accountant)
        fields = dict(
            bands=bands_of(self.bands),
            accountant=acct,
            noise_multiplier=check.noise_multiplier(self.noise_multiplier),
            sampling_prob=check.sampling_prob(self.sampling_prob),
            delta=check.delta(self.delta),
            target_epsilon=check.target_epsilon(self.target_epsilon),
            neighboring=check_neighboring(self.neighboring, acct),
            count_noise_stddev=check.optional_noise(self.count_noise_stddev, "count_noise_stddev"),
            count_every=check.integer("count_every", self.count_every, 1),
            preprocessing_noise_multiplier=check.optional_noise(
                self.preprocessing_noise_multiplier, "preprocessing_noise_multiplier"
            ),
            noised_coordinates=check.coordinates(self.noised_coordinates),
            records_per_unit=check.records_per_unit(self.records_per_unit, self.neighboring),
        )
        if fields["noised_coordinates"] is None:
            # No residual is accounted: the sampler plays no part in the plan, and
            # budgets that differ only by it are the same plan.
            fields["noise_sampler"] = DEFAULT_NOISE_SAMPLER
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def plan(self, steps: int = 0) -> AccountingPlan:
        """The ``AccountingPlan`` of ``steps`` steps of this budget's run, as the
        tracker accounts it (with ``accountant.for_tracking()``)."""
        coordinates = self.noised_coordinates
        return AccountingPlan(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            steps=steps,
            delta=self.delta,
            accountant=as_accountant(self.accountant).for_tracking(),
            neighboring=self.neighboring,
            count_noise_stddev=self.count_noise_stddev,
            count_every=self.count_every,
            preprocessing_noise_multiplier=self.preprocessing_noise_multiplier,
            noised_coordinates=coordinates,
            noise=None if coordinates is None else noise_contract(self.noise_sampler),
            bands=self.bands,
            records_per_unit=self.records_per_unit,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON: the fields, the accountant as its name when it is the registered
        one, else as its settings (``from_dict`` restores either)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["accountant"] = accountant_record(as_accountant(self.accountant))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyBudget:
        data = dict(data)
        # A budget saved before accountants carried their settings kept the PLD's
        # interval beside the accountant's name: it is that accountant's setting.
        interval = data.pop(_OLD_INTERVAL, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"unknown PrivacyBudget fields {sorted(unknown)}; known: {sorted(known)}."
            )
        if "accountant" in data:
            data["accountant"] = accountant_from_record(data["accountant"])
        if interval is not None:
            data["accountant"] = _with_interval(data.get("accountant", "pld"), interval)
        return cls(**data)


_OLD_INTERVAL = "value_discretization_interval"


def _with_interval(accountant: Any, interval: float) -> Any:
    """``accountant`` tracking on the discretisation ``interval`` of an old saved
    budget: unchanged when it has no such setting (RDP) or tracks on it already."""
    acct = as_accountant(accountant)
    names = {f.name for f in dataclasses.fields(acct)} if dataclasses.is_dataclass(acct) else ()
    if _OLD_INTERVAL not in names:
        return acct
    if getattr(acct.for_tracking(), _OLD_INTERVAL) == interval:
        return acct
    return dataclasses.replace(acct, **{_OLD_INTERVAL: interval})


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
        steps = check.steps(steps, 0)
        count_releases = check.integer("count_releases", count_releases, 0)
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

    def remaining_steps(self, max_steps: int = check.MAX_STEPS) -> int:
        """How many more steps, following the plan's count schedule, fit the target."""
        b = self._budget

        def split(extra: int) -> tuple[int, int]:
            releases = 0
            if b.count_noise_stddev is not None:
                releases = (self._steps + extra) // b.count_every - self._steps // b.count_every
            return self._steps + extra, self._count_releases + releases

        def fits(extra: int) -> bool:
            return self._eps(*split(extra)) <= b.target_epsilon

        return largest_fitting(fits, check.integer("max_steps", max_steps, 0))

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
        saved = check.real("epsilon", state["epsilon"])
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


class _EpsilonCurve:
    """epsilon(plain steps, steps with a count) of a budget's plan, memoised; the
    plan's one-off preprocessing release, if any, is part of every value. The
    accountant's ``Curve`` composes (see ``Accountant.curve``); this adds the
    drawn noise's residual and the memo."""

    _MEMO_SIZE = 4096

    def __init__(self, plan: AccountingPlan):
        self._plan = plan
        # Bounded: a long run's trainer only ever asks about recent steps.
        self._memo: collections.OrderedDict[tuple[int, int], float] = collections.OrderedDict()
        self._releases = plan.releases()
        self._pre = int(self._releases[Release.PREPROCESSING].noise_multiplier < math.inf)
        self._curve = as_accountant(plan.accountant).curve(
            self._releases, neighboring=plan.neighboring, delta=plan.delta
        )

    def _noise(self, kind: Release) -> float:
        return self._releases[kind].noise_multiplier

    def __call__(self, plain: int, with_count: int) -> float:
        # Steps with infinite noise release nothing about the data.
        plain = 0 if self._noise(Release.STEP) == math.inf else plain
        with_count = 0 if self._noise(Release.STEP_WITH_COUNT) == math.inf else with_count
        key = (plain, with_count)
        if key == (0, 0) and not self._pre:
            return 0.0
        if key in self._memo:
            self._memo.move_to_end(key)
            return self._memo[key]
        composed = round_counts(plain, with_count, self._plan.bands)
        counts = {
            Release.STEP: composed[0],
            Release.STEP_WITH_COUNT: composed[1],
            Release.PREPROCESSING: self._pre,
        }
        eps_at = self._curve(counts)
        if eps_at is None:  # beyond MAX_EPSILON: not composed
            self._memo[key] = math.inf
            return math.inf
        p = self._plan

        def res_at(sigma: float) -> NoiseResidual | None:
            return plan_residual(
                p.noise,
                p.noised_coordinates,
                steps=plain + with_count,
                with_count=with_count,
                sigma=sigma,
                count_noise_stddev=p.count_noise_stddev,
                delta=p.delta,
                neighboring=p.neighboring,
            )

        eps = epsilon_of_drawn_noise(
            eps_at, res_at(self._noise(Release.STEP)), p.delta, p.noise, res_at
        )
        self._memo[key] = float(eps)
        if len(self._memo) > self._MEMO_SIZE:
            self._memo.popitem(last=False)
        return float(eps)


_CURVES: dict[AccountingPlan, _EpsilonCurve] = {}


def plan_curve(plan: AccountingPlan) -> _EpsilonCurve:
    """epsilon(plain steps, steps with a count) of ``plan`` (its ``steps`` aside),
    memoised. Plans are frozen and hashable: trackers and calibrations of the
    same plan share one memo. Bounded, since a process only ever sees a few."""
    key = plan.replace(steps=0)
    if key not in _CURVES:
        if len(_CURVES) >= 64:
            _CURVES.pop(next(iter(_CURVES)))
        _CURVES[key] = _EpsilonCurve(key)
    return _CURVES[key]


def _curve_for(budget: PrivacyBudget) -> _EpsilonCurve:
    return plan_curve(budget.plan())


def largest_fitting(fits, limit: int) -> int:
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
