"""The accounting of amplified banded matrix factorization (``bands`` > 1).

Banded matrix factorization (Choquette-Choo et al., "(Amplified) Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023) releases
``Y = C X + Z`` for a lower-triangular ``b``-banded strategy ``C`` with columns
of L2 norm 1 (``X`` the steps' clipped sums, one row a step; ``Z`` i.i.d.
Gaussian). With *b-cyclic Poisson sampling* -- the records split once into
``b`` groups, step ``t`` Poisson-samples group ``t mod b`` with probability
``q`` -- a record takes part in at most one step of every ``b`` consecutive
ones, whose column of ``C`` it moves, and Theorem 4 of the paper reduces the
whole release to ``ceil(steps / b)`` rounds of the Poisson-subsampled Gaussian
mechanism at the same noise multiplier and ``q``: DP-SGD's event over rounds
instead of steps. That event is jax-privacy's ``amplified_bandmf_event``; this
module builds it, and maps a tracker's steps to its rounds.

Formal guarantees:
  * With no other release, ``bandmf_event`` is jax-privacy's
    ``amplified_bandmf_event(sigma, steps, num_bands=b, sampling_prob=q)``.
  * A noised count released at a step (a private dynamic loss scale) is
    computed from that step's sample, which the record joins at most once per
    round: a round then releases one Gaussian mechanism on the vector
    ``(column of Y, count)``, as a DP-SGD step with a count does
    (``dpmp.accounting._events``). Every round is accounted as one with a count
    whenever any count is released: an upper bound for any ``count_every``.
  * ``bands = 1`` is DP-SGD, unchanged.
"""

from __future__ import annotations

import math

import dp_accounting
from jax_privacy.experimental import accounting as jp_accounting

from dpmp.accounting import _validate as check
from dpmp.accounting._events import dpsgd_event

__all__ = ["bandmf_event", "bands_of", "round_counts", "rounds"]


def bands_of(value) -> int:
    """``value`` as a number of bands (an int >= 1), or a ``ValueError`` naming it."""
    return check.integer("bands", value, 1)


def rounds(steps: int, bands: int) -> int:
    """Rounds of ``b`` steps in ``steps`` (the last one may be partial)."""
    return math.ceil(check.steps(steps, 0) / bands_of(bands))


def round_counts(plain: int, with_count: int, bands: int) -> tuple[int, int]:
    """``(rounds without a count, rounds with one)`` for a tracker's ``plain`` steps
    and ``with_count`` steps that released a count (every round counted when any
    count was released: see the module docstring). ``bands = 1``: unchanged."""
    if bands == 1:
        return plain, with_count
    total = rounds(plain + with_count, bands)
    return (0, total) if with_count else (total, 0)


def bandmf_event(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    bands: int,
    count_noise_stddev: float | None = None,
    preprocessing_noise_multiplier: float | None = None,
) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``steps`` steps of amplified banded MF with
    ``bands`` bands on b-cyclic Poisson samples of probability ``sampling_prob``
    (within a group), with the counts and preprocessing release of ``dpsgd_event``.

    Example::

      >>> e = bandmf_event(noise_multiplier=1.0, sampling_prob=0.1, steps=10, bands=4)
      >>> e == jp_accounting.amplified_bandmf_event(1.0, 10, num_bands=4, sampling_prob=0.1)
      True
    """
    bands = bands_of(bands)
    sigma = check.noise_multiplier(noise_multiplier)
    n = rounds(steps, bands)
    if count_noise_stddev is None and preprocessing_noise_multiplier is None:
        if n == 0 or sigma == math.inf:
            return dp_accounting.NoOpDpEvent()
        return jp_accounting.amplified_bandmf_event(
            sigma, check.steps(steps, 0), num_bands=bands, sampling_prob=sampling_prob
        )
    return dpsgd_event(
        noise_multiplier=sigma,
        sampling_prob=sampling_prob,
        steps=n,
        count_noise_stddev=count_noise_stddev,
        count_every=1,
        preprocessing_noise_multiplier=preprocessing_noise_multiplier,
    )
