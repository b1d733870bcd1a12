"""The releases of a DP-SGD run, as dp-accounting events.

A DP-SGD run releases, at every step, the sum of clipped per-example gradients
of a Poisson-sampled batch plus Gaussian noise (Abadi et al. 2016). A run that
uses a *private dynamic loss scale* also releases, every ``count_every`` steps,
a noised count of the examples of that step's batch whose gradient overflowed.
Each release is one of three kinds (``Release``); the events, per step (``q`` =
sampling probability, ``sigma`` = noise multiplier, ``sigma_c`` =
``count_noise_stddev``)::

    Release.STEP:             PoissonSampledDpEvent(q, GaussianDpEvent(sigma))
    Release.STEP_WITH_COUNT:  PoissonSampledDpEvent(q, GaussianDpEvent(sigma_eff))
                              sigma_eff = (sigma**-2 + sigma_c**-2) ** -0.5
    run of n steps:           ComposedDpEvent([SelfComposedDpEvent(plain, n - k),
                                               SelfComposedDpEvent(with_count, k)])
                              k = n // count_every
    Release.PREPROCESSING:    GaussianDpEvent(sigma_p), once, composed with the run
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
  * Poisson-sampled batches that were truncated to a fixed size are not
    described by these events; see ``dpmp.PoissonSampler`` for the bound.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import dp_accounting

from dpmp.accounting import _validate as check
from dpmp.accounting._groups import unit_event

__all__ = [
    "NEIGHBOURING_RELATION_NOTE",
    "GaussianRelease",
    "Release",
    "count_releases",
    "dpsgd_event",
    "effective_noise_multiplier",
]

# The relation a dpmp run's guarantee is stated for, in words (report, docs).
NEIGHBOURING_RELATION_NOTE = (
    "zero-out: two datasets are neighbours if one record of one is replaced, in the "
    "other, by a null record that contributes nothing (a zero gradient, zero to every "
    "count and statistic). The number of records n is public, and so are the "
    "sampling probability and noise multiplier computed from it. Poisson sampling "
    "is accounted with the add-or-remove-one analysis, which covers zero-out "
    "neighbours (a null record behaves exactly like a removed one)."
)


class Release(enum.IntEnum):
    """The kinds of release a run composes (see the module docstring)."""

    STEP = 0  # a DP-SGD step: the noised gradient sum of a Poisson sample
    STEP_WITH_COUNT = 1  # a step that also releases a noised overflow count
    PREPROCESSING = 2  # one Gaussian release of the whole training set, before training


class GaussianRelease(NamedTuple):
    """One release: a Gaussian mechanism at ``noise_multiplier``, on a Poisson sample
    of probability ``sampling_prob`` (``sampled``) or on every record.

    ``records_per_unit``: the most records one privacy unit gives, each sampled on
    its own (a user of example-level sampling, ``dpmp.accounting._groups``); 1 for
    a record, or for a user sampled as a whole. A release on every record then has
    sensitivity ``records_per_unit``.
    """

    noise_multiplier: float
    sampling_prob: float
    sampled: bool = True
    records_per_unit: int = 1

    def event(self) -> dp_accounting.DpEvent:
        k = self.records_per_unit
        if not self.sampled:
            return dp_accounting.GaussianDpEvent(self.noise_multiplier / k)
        return unit_event(self.noise_multiplier, self.sampling_prob, k)


def effective_noise_multiplier(noise_multiplier: float, count_noise_stddev: float | None) -> float:
    """Noise multiplier of one step that releases both the gradient and a count.

    ``(sigma**-2 + sigma_c**-2) ** -0.5``: the two releases are one Gaussian
    mechanism on a shared Poisson sample (see the module docstring). With
    ``count_noise_stddev=None`` (no count) or ``inf`` this is ``sigma``.
    """
    sigma = check.noise_multiplier(noise_multiplier)
    sigma_c = check.optional_noise(count_noise_stddev, "count_noise_stddev")
    if sigma_c is None or sigma_c == math.inf:
        return sigma
    if sigma == math.inf:
        return sigma_c
    # 1 / hypot: the sum of inverse squares overflowed for sigma near 1e-300
    return 1.0 / math.hypot(1.0 / sigma, 1.0 / sigma_c)


def count_releases(steps: int, count_every: int = 1) -> int:
    """Number of counts released in ``steps`` steps: one at steps k, 2k, ... (1-based)."""
    steps = check.steps(steps, 0)
    count_every = check.integer("count_every", count_every, 1)
    return steps // count_every


def split_steps(steps: int, count_noise_stddev: float | None, count_every: int) -> tuple[int, int]:
    """(steps without a count release, steps with one)."""
    with_count = 0 if count_noise_stddev is None else count_releases(steps, count_every)
    return steps - with_count, with_count


def _run_event(
    sigma: float, sampling_prob: float, sigma_eff: float, plain: int, with_count: int, k: int
) -> dp_accounting.DpEvent:
    parts = []
    for noise, count in ((sigma, plain), (sigma_eff, with_count)):
        if count == 0 or noise == math.inf:
            continue  # Nothing released, or pure noise: no privacy cost.
        step = GaussianRelease(noise, sampling_prob, records_per_unit=k).event()
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
    records_per_unit: int = 1,
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
      records_per_unit: the most records of one privacy unit, each Poisson-sampled
        on its own (``GaussianRelease``); 1 for a record unit.

    Returns:
      A ``SelfComposedDpEvent`` of Poisson-sampled Gaussian steps, or a
      ``ComposedDpEvent`` of two of them when some steps also release a count,
      composed with a ``GaussianDpEvent`` for the preprocessing release.
      Any dp-accounting accountant that supports these events can consume it.
    """
    sigma = check.noise_multiplier(noise_multiplier)
    q = check.sampling_prob(sampling_prob)
    steps = check.steps(steps, 0)
    count_every = check.integer("count_every", count_every, 1)
    sigma_p = check.optional_noise(preprocessing_noise_multiplier, "preprocessing_noise_multiplier")
    sigma_eff = effective_noise_multiplier(sigma, count_noise_stddev)
    plain, with_count = split_steps(steps, count_noise_stddev, count_every)
    k = check.integer("records_per_unit", records_per_unit, 1)
    run = _run_event(sigma, q, sigma_eff, plain, with_count, k)
    if sigma_p is None or sigma_p == math.inf:
        return run
    pre = GaussianRelease(sigma_p, 1.0, sampled=False, records_per_unit=k).event()
    if isinstance(run, dp_accounting.NoOpDpEvent):
        return pre
    return dp_accounting.ComposedDpEvent([pre, run])
