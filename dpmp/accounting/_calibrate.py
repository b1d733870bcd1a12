"""Calibration: the smallest noise multiplier, or the most steps, whose plan stays
within a target (``dpmp.accounting.calibrate_noise_multiplier`` and
``calibrate_steps`` ask these of a plan)."""

from __future__ import annotations

import math

import dp_accounting
from dp_accounting import mechanism_calibration

from dpmp.accounting import _validate as check
from dpmp.accounting._accountants import rdp_bound, rdp_curve
from dpmp.accounting._events import split_steps
from dpmp.accounting._plan import AccountingPlan, plan_epsilons
from dpmp.accounting._tracker import largest_fitting, plan_curve

__all__ = ["noise_for_target", "steps_for_target"]

# The residual's epsilon is first estimated at this noise multiplier (see
# ``noise_for_target``).
_RESIDUAL_SIGMA_FLOOR = 0.5


def noise_for_target(plan: AccountingPlan, target_epsilon: float, *, rtol: float = 1e-4) -> float:
    """The smallest noise multiplier whose ``plan`` stays within ``target_epsilon``.

    Uses dp-accounting's ``calibrate_dp_mechanism`` (Brent's method, then a
    check that the returned value does not exceed the target) inside a bracket
    found by doubling. The plan's own ``noise_multiplier`` is ignored; the
    noise of its count and preprocessing releases is held fixed. With a noise
    contract and noised coordinates the target covers the noise residual too:
    the exact plan is calibrated to the target minus the residual, at the delta
    the residual leaves.

    Returns:
      ``sigma`` with ``epsilon(plan.replace(noise_multiplier=sigma)) <=
      target_epsilon`` and, within ``rtol`` in sigma, the smallest such value.

    Raises:
      ValueError: if the count and preprocessing releases alone exceed the
        target, or the plan has no steps.
    """
    target = check.target_epsilon(target_epsilon)
    check.steps(plan.steps, 1)
    rtol = check.real("rtol", rtol)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1), got {rtol}.")
    delta = plan.delta
    if not plan.accounts_residual:
        return _calibrate_exact(plan, target, delta, rtol)
    # The residual's epsilon hardly depends on sigma; its tail delta falls as sigma
    # grows. So it is estimated once at a floor sigma, the exact plan calibrated
    # against it, and the result checked (and nudged up) with the residual at the
    # calibrated sigma itself. If the fixed floor is too low, the exact plan's own
    # sigma (which the answer cannot be below) is the floor.
    res = None
    for floor in (_RESIDUAL_SIGMA_FLOOR, None):
        floor = _calibrate_exact(plan, target, delta, rtol) if floor is None else floor
        res = plan.residual(floor)
        if not res.delta_tail <= 0.5 * delta:
            continue
        sigma = _calibrate_exact(plan, target - res.epsilon, res.ideal_delta(delta), rtol)
        if sigma < floor:
            continue
        # The reported epsilon bounds the residual at sigma itself (its tail count
        # k and tail delta may round the other way): step up until it fits.
        for _ in range(20):
            if plan_epsilons(plan.replace(noise_multiplier=sigma))[1] <= target:
                return sigma
            sigma *= 1 + 1e-4
    raise ValueError(
        f"target_epsilon={target}: no noise multiplier keeps the run and the "
        f"{plan.noise.sampler} noise's residual (epsilon {res.epsilon:.3g}, tail delta "
        f"{res.delta_tail:.3g}) within it at delta={delta:g}; lower the target or raise delta."
    )


def _refuse_fixed_releases(plan: AccountingPlan, target: float) -> None:
    sigma_c, sigma_p = plan.count_noise_stddev, plan.preprocessing_noise_multiplier
    fixed = []
    if sigma_c is not None:
        fixed.append(f"count_noise_stddev={sigma_c} (raise it or count_every)")
    if sigma_p is not None:
        fixed.append(f"preprocessing_noise_multiplier={sigma_p} (raise it)")
    raise ValueError(
        f"the releases of {' and '.join(fixed)} alone cost more than target_epsilon={target}."
    )


def _calibrate_exact(plan: AccountingPlan, target: float, delta: float, rtol: float) -> float:
    """``noise_for_target`` of ``plan`` with exact Gaussian noise, at ``delta``."""
    if not target > 0:
        raise ValueError(f"target_epsilon: the noise residual leaves nothing of {target}.")
    acct = plan.accountant

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return plan.replace(noise_multiplier=sigma).event()

    def make_accountant() -> dp_accounting.PrivacyAccountant:
        return acct.make(plan.neighboring)

    def eps(sigma: float) -> float:
        event = make_event(sigma)
        if acct.bounded_first and rdp_bound(rdp_curve(event), delta) > check.MAX_EPSILON:
            return math.inf  # too little noise for any target (<= MAX_EPSILON)
        return make_accountant().compose(event).get_epsilon(delta)

    extra = plan.count_noise_stddev is not None or plan.preprocessing_noise_multiplier is not None
    if extra and eps(math.inf) > target:
        _refuse_fixed_releases(plan, target)
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
            if low <= check.MIN_CALIBRATED_NOISE:
                raise ValueError(
                    f"target_epsilon={target}: noise multiplier {low:g} already spends only "
                    f"epsilon {spent:.4g}, and calibration stops there (an epsilon this large "
                    "promises little): lower the target, or give the noise multiplier."
                )
            low, high = max(low / 2, check.MIN_CALIBRATED_NOISE), low
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


def steps_for_target(plan: AccountingPlan, target_epsilon: float, max_steps: int) -> int:
    """The largest ``n <= max_steps`` whose run of ``plan`` (its own ``steps``
    ignored) stays within ``target_epsilon``; 0 if even one step exceeds it.

    An exact integer search (doubling, then bisection; epsilon grows with the
    number of steps) on the accountant's curve at the plan's own settings.
    """
    target = check.target_epsilon(target_epsilon)
    max_steps = check.integer("max_steps", max_steps, 0)
    curve = plan_curve(plan)

    def fits(n: int) -> bool:
        with_count = split_steps(n, plan.count_noise_stddev, plan.count_every)[1]
        return curve(n - with_count, with_count) <= target

    return largest_fitting(fits, max_steps)
