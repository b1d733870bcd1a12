"""The keyword functions of ``dpmp.accounting``: each builds an ``AccountingPlan``."""

from __future__ import annotations

from typing import Any

from dpmp.accounting import _validate as check
from dpmp.accounting._calibrate import calibrate_plan
from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER, NoiseResidual, noise_contract
from dpmp.accounting._plan import (
    AccountingPlan,
    EpsilonBreakdown,
    plan_epsilon,
    plan_epsilon_breakdown,
)
from dpmp.accounting._tracker import BudgetTracker, PrivacyBudget
from dpmp.accounting._validate import MAX_STEPS, REPORT_DISCRETIZATION, REQUIRED, _Required

__all__ = [
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "epsilon",
    "epsilon_breakdown",
    "noise_residual",
]


def _plan(noised_coordinates: Any, noise_sampler: str, **fields: Any) -> AccountingPlan:
    """The plan of the keyword arguments; the sampler's contract is looked up only
    when coordinates are counted."""
    coordinates = check.coordinates(noised_coordinates)
    noise = None if coordinates is None else noise_contract(noise_sampler)
    return AccountingPlan(noised_coordinates=coordinates, noise=noise, **fields)


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
    noise_sampler: str = DEFAULT_NOISE_SAMPLER,
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
      accountant: ``"pld"`` (tight), ``"rdp"`` (an upper bound), or another
        registered ``Accountant``'s name.
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
      noise_sampler: the registered sampler (``dpmp.noise``) whose accounting
        contract the noised coordinates are taken under (default ``"snapped"``).

    ``plan_epsilon`` of the ``AccountingPlan`` these arguments describe.

    Returns:
      The epsilon that dp-accounting's accountant gives for ``dpsgd_event``
      (plus the noise residual unless ``noised_coordinates`` is None).

    Formal Guarantees:
      See the module docstring: the run is ``(epsilon, delta)``-DP under
      ``neighboring`` if every step clips each example to the clip norm, adds
      the stated noise, and uses an untruncated Poisson sample.
    """
    return plan_epsilon(
        _plan(
            noised_coordinates,
            noise_sampler,
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
        )
    )


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
    noise_sampler: str = DEFAULT_NOISE_SAMPLER,
) -> EpsilonBreakdown:
    """Epsilon with and without the count and preprocessing releases.

    Epsilon does not add up over mechanisms, so each part is a difference at
    the same delta: ``counts = epsilon(steps and counts) - epsilon(steps)``,
    ``preprocessing = epsilon(everything) - epsilon(steps and counts)``, and
    ``noise_residual`` = the total with ``noised_coordinates`` minus without.
    """
    return plan_epsilon_breakdown(
        _plan(
            noised_coordinates,
            noise_sampler,
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
        )
    )


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
    noise_sampler: str = DEFAULT_NOISE_SAMPLER,
) -> float:
    """The smallest noise multiplier whose run stays within ``target_epsilon``.

    Uses dp-accounting's ``calibrate_dp_mechanism`` (Brent's method, then a
    check that the returned value does not exceed the target) inside a bracket
    found by doubling. With count or preprocessing releases, their noise is
    held fixed and only the gradient noise is calibrated.

    The other arguments (``sampling_prob``, ``steps``, ``delta``,
    ``accountant``, ``neighboring``, ``count_noise_stddev``, ``count_every``,
    ``value_discretization_interval``, ``preprocessing_noise_multiplier``,
    ``noised_coordinates``, ``noise_sampler``) are as in ``epsilon``; steps >=
    1. With ``noised_coordinates`` the target covers the noise residual too:
    the exact plan is calibrated to the target minus the residual, at the delta
    the residual leaves.

    Args:
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
    plan = _plan(
        noised_coordinates,
        noise_sampler,
        noise_multiplier=None,
        sampling_prob=sampling_prob,
        steps=check.steps(steps, 1),
        delta=delta,
        accountant=accountant,
        neighboring=neighboring,
        count_noise_stddev=count_noise_stddev,
        count_every=count_every,
        value_discretization_interval=value_discretization_interval,
        preprocessing_noise_multiplier=preprocessing_noise_multiplier,
    )
    return calibrate_plan(plan, target, rtol=rtol)


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
    noise_sampler: str = DEFAULT_NOISE_SAMPLER,
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
        noise_sampler=noise_sampler,
    )
    max_steps = check.integer("max_steps", max_steps, 0)
    return BudgetTracker(budget).remaining_steps(max_steps)


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
