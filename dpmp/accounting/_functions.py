"""The questions of ``dpmp.accounting``, one spelling each: ``epsilon`` (with
``breakdown=True``, its parts), ``calibrate_noise_multiplier`` and
``calibrate_steps``. Each takes an ``AccountingPlan`` or the plan's fields as
keyword arguments; the other names are thin wrappers kept for their callers."""

from __future__ import annotations

from typing import Any, Literal, TypedDict, Unpack, overload

from dpmp.accounting import _validate as check
from dpmp.accounting._accountants import Accountant
from dpmp.accounting._calibrate import noise_for_target, steps_for_target
from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER, NoiseResidual, noise_contract
from dpmp.accounting._plan import AccountingPlan, EpsilonBreakdown, plan_breakdown, plan_epsilons
from dpmp.accounting._validate import MAX_STEPS, REQUIRED

__all__ = [
    "PlanFields",
    "calibrate_noise_multiplier",
    "calibrate_plan",
    "calibrate_steps",
    "epsilon",
    "epsilon_breakdown",
    "noise_residual",
    "plan_epsilon",
    "plan_epsilon_breakdown",
]


class PlanFields(TypedDict, total=False):
    """The keyword arguments that describe an ``AccountingPlan`` (see there; the
    plan's ``noise`` is given by ``noise_sampler``)."""

    noise_multiplier: float
    sampling_prob: float
    steps: int
    delta: float
    accountant: Accountant | str
    neighboring: str
    count_noise_stddev: float | None
    count_every: int
    preprocessing_noise_multiplier: float | None
    noised_coordinates: int | None
    noise_sampler: str
    bands: int
    records_per_unit: int


def _as_plan(
    question: str, plan: AccountingPlan | None, fields: dict[str, Any], **fixed: Any
) -> AccountingPlan:
    """``plan``, or the plan of the keyword ``fields`` (with ``fixed`` set); the
    sampler's contract is looked up only when coordinates are counted."""
    if plan is not None:
        if not isinstance(plan, AccountingPlan):
            raise TypeError(f"{question}: plan must be an AccountingPlan, got {plan!r}.")
        if fields:
            raise TypeError(
                f"{question}: give a plan or its fields as keywords, not both (got a plan "
                f"and {', '.join(sorted(fields))}); plan.replace(...) changes a plan."
            )
        return plan
    known = PlanFields.__annotations__.keys()
    for name in fields:
        if name not in known or name in fixed:
            allowed = sorted(set(known) - set(fixed))
            raise TypeError(f"{question}: unexpected argument {name!r}; allowed: {allowed}.")
    fields = dict(fields)
    coordinates = check.coordinates(fields.pop("noised_coordinates", REQUIRED))
    sampler = fields.pop("noise_sampler", DEFAULT_NOISE_SAMPLER)
    noise = None if coordinates is None else noise_contract(sampler)
    return AccountingPlan(noised_coordinates=coordinates, noise=noise, **fields, **fixed)


@overload
def epsilon(
    plan: AccountingPlan | None = None,
    /,
    *,
    breakdown: Literal[False] = False,
    **fields: Unpack[PlanFields],
) -> float: ...


@overload
def epsilon(
    plan: AccountingPlan | None = None,
    /,
    *,
    breakdown: Literal[True],
    **fields: Unpack[PlanFields],
) -> EpsilonBreakdown: ...


def epsilon(
    plan: AccountingPlan | None = None,
    /,
    *,
    breakdown: bool = False,
    **fields: Unpack[PlanFields],
) -> float | EpsilonBreakdown:
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
      >>> # the same plan as one record
      >>> record = dpmp.accounting.AccountingPlan(**plan, noised_coordinates=None)
      >>> round(dpmp.accounting.epsilon(record), 4)
      0.9877

    Args:
      plan: an ``AccountingPlan``; or none, and its fields as keywords (below).
      breakdown: return an ``EpsilonBreakdown`` instead: the total and what the
        DP-SGD steps, the counts, the preprocessing release and the noise
        residual each add. Epsilon does not add up over mechanisms, so each
        part is a difference at the same delta: ``counts = epsilon(steps and
        counts) - epsilon(steps)``, ``preprocessing = epsilon(everything) -
        epsilon(steps and counts)``, ``noise_residual`` = the total minus the
        total of exact Gaussian noise.

    Keyword Args:
      noise_multiplier: noise stddev divided by the clip norm, in [1e-6, 1e6] or inf.
      sampling_prob: Poisson sampling probability, in (0, 1].
      steps: number of steps, an integer >= 0 (0 steps cost epsilon 0).
      delta: target delta, in (0, 1).
      accountant: ``"pld"`` (tight, default), ``"rdp"`` (an upper bound), another
        registered ``Accountant``'s name, or an accountant with its settings
        (``PldAccountant(value_discretization_interval=...)``,
        ``RdpAccountant(orders=...)``).
      neighboring: ``"add_or_remove"`` (default), or ``"replace_one"`` where the
        accountant analyses it (the PLD).
      count_noise_stddev: noise stddev of each released overflow count, or
        ``None`` (default) when the loss scale releases nothing.
      count_every: a count is released every this many steps (default 1).
      preprocessing_noise_multiplier: a one-off Gaussian release before
        training (see ``dpsgd_event``), or ``None``.
      noised_coordinates: required: the coordinates of each gradient release
        (the number of trainable parameters), for dpmp's snapped Gaussian noise:
        the result then includes its ``noise_residual``. ``None`` accounts an
        exact Gaussian sampler (which no floating-point program draws).
      noise_sampler: the registered sampler (``dpmp.noise``) whose accounting
        contract the noised coordinates are taken under (default ``"snapped"``).

    Returns:
      The epsilon that dp-accounting's accountant gives for ``dpsgd_event``
      (plus the noise residual unless ``noised_coordinates`` is None), or its
      ``EpsilonBreakdown``.

    Formal Guarantees:
      See the module docstring: the run is ``(epsilon, delta)``-DP under
      ``neighboring`` if every step clips each example to the clip norm, adds
      the stated noise, and uses an untruncated Poisson sample.
    """
    plan = _as_plan("epsilon", plan, dict(fields))
    return plan_breakdown(plan) if breakdown else plan_epsilons(plan)[1]


def calibrate_noise_multiplier(
    plan: AccountingPlan | None = None,
    /,
    *,
    target_epsilon: float,
    rtol: float = 1e-4,
    **fields: Unpack[PlanFields],
) -> float:
    """The smallest noise multiplier whose run stays within ``target_epsilon``.

    Uses dp-accounting's ``calibrate_dp_mechanism`` (Brent's method, then a
    check that the returned value does not exceed the target) inside a bracket
    found by doubling. With count or preprocessing releases, their noise is
    held fixed and only the gradient noise is calibrated.

    Args:
      plan: an ``AccountingPlan`` (its own ``noise_multiplier`` is ignored); or
        none, and its fields as keywords, as in ``epsilon`` but without
        ``noise_multiplier``; steps >= 1. With ``noised_coordinates`` the
        target covers the noise residual too: the exact plan is calibrated to
        the target minus the residual, at the delta the residual leaves.
      target_epsilon: in (0, MAX_EPSILON].
      rtol: relative tolerance on the noise multiplier.

    Returns:
      ``sigma`` with ``epsilon(sigma) <= target_epsilon`` and, within ``rtol``
      in sigma, the smallest such value.

    Raises:
      ValueError: if the count and preprocessing releases alone exceed
        ``target_epsilon``.
    """
    target = check.target_epsilon(target_epsilon)
    plan = _as_plan("calibrate_noise_multiplier", plan, dict(fields), noise_multiplier=None)
    return noise_for_target(plan, target, rtol=rtol)


def calibrate_steps(
    plan: AccountingPlan | None = None,
    /,
    *,
    target_epsilon: float,
    max_steps: int = MAX_STEPS,
    **fields: Unpack[PlanFields],
) -> int:
    """The most steps whose run stays within ``target_epsilon``.

    An exact integer search (doubling, then bisection; epsilon grows with the
    number of steps), rather than dp-accounting's ``calibrate_dp_mechanism``
    with ``discrete=True``, which may return one step less than the maximum.

    Args:
      plan: an ``AccountingPlan`` (its own ``steps`` is ignored); or none, and
        its fields as keywords, as in ``epsilon`` but without ``steps``.
      target_epsilon: in (0, MAX_EPSILON].
      max_steps: the most steps to consider.

    Returns:
      The largest ``n <= max_steps`` with ``epsilon(n steps) <= target_epsilon``
      (0 if even one step exceeds it).
    """
    plan = _as_plan("calibrate_steps", plan, dict(fields), steps=0)
    return steps_for_target(plan, target_epsilon, max_steps)


def epsilon_breakdown(**fields: Unpack[PlanFields]) -> EpsilonBreakdown:
    """Same as ``epsilon(**fields, breakdown=True)``."""
    return epsilon(**fields, breakdown=True)


def plan_epsilon(plan: AccountingPlan) -> float:
    """Same as ``epsilon(plan)``."""
    return epsilon(plan)


def plan_epsilon_breakdown(plan: AccountingPlan) -> EpsilonBreakdown:
    """Same as ``epsilon(plan, breakdown=True)``."""
    return epsilon(plan, breakdown=True)


def calibrate_plan(plan: AccountingPlan, target_epsilon: float, *, rtol: float = 1e-4) -> float:
    """Same as ``calibrate_noise_multiplier(plan, target_epsilon=..., rtol=...)``."""
    return calibrate_noise_multiplier(plan, target_epsilon=target_epsilon, rtol=rtol)


def noise_residual(
    *,
    coordinates: int,
    releases: int,
    noise_multiplier: float,
    delta: float,
    neighboring: str = "add_or_remove",
    noise_sampler: str = DEFAULT_NOISE_SAMPLER,
) -> NoiseResidual:
    """The accounted cost of drawing dpmp's snapped Gaussian instead of an exact one.

    ``noise_contract(noise_sampler).residual(...)``: see
    ``GridNoiseContract.residual`` for the arguments and the derivation.
    The bound grows with ``sqrt(d log T)`` per step where summing the cells'
    bounds grows with ``d``: about 7.3e-12 sqrt(2 d ln(4 T / beta_H)) T. With
    ``beta_H = beta_k = RESIDUAL_DELTA_SHARE delta / 2``: 125M coordinates x
    5,000 steps at sigma 1 give ``epsilon`` ~ 7.6e-3.
    """
    contract = noise_contract(noise_sampler)
    if contract is None:
        raise ValueError(f"noise_sampler: {noise_sampler!r} is accounted as exact: no residual")
    return contract.residual(
        coordinates=coordinates,
        releases=releases,
        noise_multiplier=noise_multiplier,
        delta=delta,
        neighboring=neighboring,
    )
