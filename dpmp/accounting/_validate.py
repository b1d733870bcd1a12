"""The limits of what dpmp accounts, and the checks of every accounting input.

Every error names the field and its allowed range.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "MAX_EPSILON",
    "MAX_NOISE_MULTIPLIER",
    "MAX_STEPS",
    "MIN_CALIBRATED_NOISE",
    "NEIGHBORING_RELATIONS",
    "REPORT_DISCRETIZATION",
    "REQUIRED",
    "TRACKING_DISCRETIZATION",
]

NEIGHBORING_RELATIONS = ("add_or_remove", "replace_one")

# dp-accounting's own default: used for the numbers a run reports.
REPORT_DISCRETIZATION = 1e-4
# Used by the per-step budget tracker: 10x coarser, still pessimistic (an upper
# bound), about 10x faster; epsilon moves in the 5th significant digit.
TRACKING_DISCRETIZATION = 1e-3
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


class _Required:
    """The default of ``noised_coordinates``: an epsilon of dpmp's noise needs it."""

    def __repr__(self) -> str:
        return "REQUIRED"


# ``noised_coordinates`` has no silent default: leaving it out would account an
# exact Gaussian that dpmp does not draw.
REQUIRED = _Required()


def real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}.")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN.")
    return value


def integer(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}.")
    return value


def noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    value = real(name, value)
    low, high = 1 / MAX_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER
    if not (low <= value <= high or value == math.inf):
        raise ValueError(f"{name} must be in [{low:g}, {high:g}] or inf, got {value}.")
    return value


def optional_noise(value: Any, name: str) -> float | None:
    """A noise multiplier of an extra release, or None when there is none."""
    return None if value is None else noise_multiplier(value, name)


def sampling_prob(value: Any) -> float:
    value = real("sampling_prob", value)
    if not 0 < value <= 1:
        raise ValueError(f"sampling_prob must be in (0, 1], got {value}.")
    return value


def delta(value: Any) -> float:
    value = real("delta", value)
    if not 0 < value < 1:
        raise ValueError(f"delta must be in (0, 1), got {value}.")
    return value


def target_epsilon(value: Any) -> float:
    value = real("target_epsilon", value)
    if not 0 < value <= MAX_EPSILON:
        raise ValueError(
            f"target_epsilon must be in (0, {MAX_EPSILON:g}], got {value} (dpmp accounts no "
            f"plan beyond epsilon {MAX_EPSILON:g}: such a guarantee promises nothing)."
        )
    return value


def steps(value: Any, minimum: int) -> int:
    n = integer("steps", value, minimum)
    if n > MAX_STEPS:
        raise ValueError(f"steps must be at most {MAX_STEPS:,}, got {n:,}.")
    return n


def interval(value: Any, name: str = "value_discretization_interval") -> float:
    value = real(name, value)
    if not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value}.")
    return value


def name(field: str, value: Any) -> str:
    """A variant's name: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field} must be a non-empty string, got {value!r}.")
    return value


def coordinates(value: Any) -> int | None:
    if value is REQUIRED:
        raise ValueError(
            "noised_coordinates: required: the number of coordinates noised at each step "
            "(the trainable parameter count), so that the snapped noise's floating-point "
            "residual is accounted; None accounts an exact Gaussian sampler instead (dpmp "
            "draws none: an idealisation, e.g. to compare with published epsilons)"
        )
    return None if value is None else integer("noised_coordinates", value, 1)


def records_per_unit(value: Any, neighboring: str) -> int:
    """A privacy unit's records, each sampled on its own: an integer >= 1; above 1 only
    under add or remove (the mixture of Gaussians is analysed for it alone)."""
    k = integer("records_per_unit", value, 1)
    if k > 1 and neighboring != "add_or_remove":
        raise ValueError(
            f"records_per_unit: {k} records per unit are accounted under add_or_remove "
            f"only, got neighboring={neighboring!r}."
        )
    return k
