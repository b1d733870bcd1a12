"""The privacy plan of a run: its secret keys, its noise multiplier and its budget.

``run_keys(config)`` draws the randomness that protects privacy from the OS
(``privacy.reproducible_noise`` derives it from ``training.seed`` instead and
the run says it is NOT private). ``noise_plan(config, q, ...)`` calibrates
sigma (``dpmp.accounting``) so that ``training.steps`` steps at sampling rate
``q`` spend ``privacy.target_epsilon`` -- every release composed: gradient
noise, the noised overflow counts of a private dynamic loss scale, private
standardisation and the snapped noise's floating-point residual -- or takes
``privacy.noise_multiplier`` as given. ``privacy.delta`` is the run's whole
delta: the residual's failure probability and a truncated Poisson sample's
are part of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

import dpmp.accounting as accounting
from dpmp.app.config import Config, ConfigError
from dpmp.app.config_users import records_per_unit
from dpmp.data._preprocess import release_noise_multiplier
from dpmp.data._sampling import MAX_TRUNCATION_PROB
from dpmp.noise import drawn_sampler
from dpmp.noise._entropy import fresh_key, fresh_seed
from dpmp.noise._key128 import key128_impl
from dpmp.noise._mechanisms import mechanism

__all__ = [
    "NoisePlan",
    "RunKeys",
    "count_noise_stddev",
    "max_truncation_prob",
    "noise_plan",
    "population",
    "run_keys",
    "truncation_delta",
    "units",
]


@dataclasses.dataclass(frozen=True, eq=False)
class RunKeys:
    """The randomness of a run that protects privacy, and whether it is secret.

    Attributes:
      noise: PRNG key of the gradient noise.
      loss_scale: PRNG key of the noise on released overflow counts.
      sampler_seed: seed of the Poisson sampler (which examples each step uses).
      standardize_seed: seed of the noise on private feature statistics.
      reproducible: derived from ``training.seed`` (public: NOT private)
        rather than drawn from the OS entropy.
    """

    noise: Any
    loss_scale: Any
    sampler_seed: int
    standardize_seed: int
    reproducible: bool


def run_keys(config: Config) -> RunKeys:
    """Fresh OS entropy for a run (128-bit keys and seeds), or, with
    ``privacy.reproducible_noise``, keys and seeds derived from ``training.seed``
    (keys of the same kind, so that both runs compile the same step)."""
    seed = config.training.seed
    if config.privacy.reproducible_noise:
        _, noise, scale = jax.random.split(jax.random.key(seed, impl=key128_impl()), 3)
        return RunKeys(noise, scale, sampler_seed=seed, standardize_seed=seed, reproducible=True)
    return RunKeys(fresh_key(), fresh_key(), fresh_seed(), fresh_seed(), reproducible=False)


def _preprocessing_sigma(config: Config) -> float | None:
    d = config.data
    if d.standardize != "private":
        return None
    return release_noise_multiplier(d.standardize_noise_multiplier)


def _noised_coordinates(config: Config, policy, params_shape) -> int | None:
    """Coordinates of each noisy release when the sampler that draws the noise has
    an accounting contract (its residual is then accounted), else None."""
    if params_shape is None:
        return None
    if drawn_sampler(config.privacy.noise_sampler, policy).contract is None:
        return None
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params_shape))


# The share of privacy.delta a truncated Poisson sample may take: the padded
# batch size is chosen for it (a larger epsilon target needs a rarer truncation).
TRUNCATION_DELTA_SHARE = 1e-3


def max_truncation_prob(config: Config) -> float:
    """The truncation probability per step the Poisson sampler's padded size must
    not exceed: at most ``MAX_TRUNCATION_PROB`` (1e-12), and small enough that
    ``truncation_delta`` stays within ``TRUNCATION_DELTA_SHARE`` of ``privacy.delta``
    whatever the epsilon target (its bound carries a factor e^epsilon)."""
    p, steps = config.privacy, config.training.steps
    spread = steps * (1.0 + math.exp(min(p.target_epsilon, 700.0)))
    return min(MAX_TRUNCATION_PROB, TRUNCATION_DELTA_SHARE * p.delta / spread)


def truncation_delta(config: Config, truncation_probability: float) -> float:
    """The delta a Poisson sample truncated to its padded size may add to the run:
    ``min(1, steps p) (1 + e^target_epsilon)`` (``dpmp.PoissonSampler``), the run's
    epsilon never exceeding its target."""
    if not truncation_probability:
        return 0.0
    eta = min(1.0, config.training.steps * truncation_probability)
    return eta * (1.0 + math.exp(config.privacy.target_epsilon))


def _calibrate(
    config: Config, q: float, count_sigma: float | None, coordinates: int | None, delta: float
) -> tuple[float, bool, accounting.PrivacyBudget]:
    p = config.privacy
    steps = config.training.steps
    pre_sigma = _preprocessing_sigma(config)

    def budget(sigma):
        return accounting.PrivacyBudget(
            noise_multiplier=sigma,
            sampling_prob=q,
            delta=delta,
            target_epsilon=p.target_epsilon,
            accountant=p.accountant,
            count_noise_stddev=count_sigma,
            count_every=1,
            preprocessing_noise_multiplier=pre_sigma,
            noised_coordinates=coordinates,
            noise_sampler=p.noise_sampler,
            bands=_bands(config),
            records_per_unit=records_per_unit(config.privacy),
        )

    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
        return sigma, False, budget(sigma)
    try:
        # Calibrate with the accountant the tracker runs (``for_tracking``: the
        # PLD's coarser discretisation), so that the tracker -- which enforces
        # the budget step by step -- admits all ``steps``.
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=p.target_epsilon,
            sampling_prob=q,
            steps=steps,
            delta=delta,
            accountant=accounting.get_accountant(p.accountant).for_tracking(),
            count_noise_stddev=count_sigma,
            count_every=1,
            preprocessing_noise_multiplier=pre_sigma,
            noised_coordinates=coordinates,
            noise_sampler=p.noise_sampler,
            bands=_bands(config),
            records_per_unit=records_per_unit(config.privacy),
        )
    except ValueError as e:
        raise ConfigError(f"privacy.target_epsilon: cannot be reached: {e}") from e
    for _ in range(100):  # guard against rounding between accountant code paths
        if accounting.BudgetTracker(budget(sigma)).remaining_steps(steps) >= steps:
            break
        sigma *= 1 + 1e-4
    return sigma, True, budget(sigma)


def _bands(config: Config) -> int:
    """The bands the accounting composes steps in: ``privacy.bands`` for a mechanism
    on b-cyclic Poisson samples, else 1 (``dpmp.accounting._bandmf``)."""
    return config.privacy.bands if mechanism(config.privacy.mechanism).cyclic else 1


def count_noise_stddev(config: Config) -> float | None:
    """Noise on each released overflow count (a private dynamic loss scale), or None."""
    ls = config.loss_scale
    return float(ls.count_noise_stddev) if ls.kind == "private_dynamic" else None


@dataclasses.dataclass(frozen=True)
class NoisePlan:
    """The noise of a run and the budget it is tracked against.

    Attributes:
      noise_multiplier: sigma of the gradient noise.
      calibrated: sigma was calibrated to ``privacy.target_epsilon``.
      budget: the ``PrivacyBudget`` a ``BudgetTracker`` enforces step by step.
      sampling_prob: q = expected_batch_size / num_train.
      count_noise_stddev: noise on each released overflow count, or None.
      noised_coordinates: coordinates of each snapped release (its residual is
        accounted), or None.
      truncation_delta: the part of ``privacy.delta`` kept for a truncated
        Poisson sample; the accountant's (``budget.delta``) is the rest.
    """

    noise_multiplier: float
    calibrated: bool
    budget: accounting.PrivacyBudget
    sampling_prob: float
    count_noise_stddev: float | None
    noised_coordinates: int | None
    truncation_delta: float = 0.0


def population(config: Config, data: Any) -> int:
    """n of the sampling, ``q = expected_batch_size / n``: the training records, or with
    ``privacy.unit = "user"`` the users (``Dataset.num_users``), or under example-level
    sampling of users the records kept, ``sum over users of min(count, k)``
    (``dpmp.data._capped_sampling``)."""
    p = config.privacy
    if p.unit != "user" or data.num_users is None:
        return data.num_train
    if p.user_sampling == "users":
        return data.num_users
    counts = np.bincount(np.asarray(data.users_train))
    return int(np.minimum(counts, p.user_records).sum())


def units(config: Config, data: Any) -> int:
    """The privacy units the guarantee counts (delta must be below 1/this): the
    training records, or the users with ``privacy.unit = "user"``."""
    if config.privacy.unit == "user" and data.num_users is not None:
        return data.num_users
    return data.num_train


def noise_plan(
    config: Config,
    *,
    num_train: int,
    params_shape: Any,
    truncation_probability: float = 0.0,
    num_units: int | None = None,
) -> NoisePlan:
    """The noise multiplier and budget of ``config`` for ``num_train`` examples (users,
    with ``privacy.unit = "user"``: see ``population``) and
    trainable parameters shaped like ``params_shape`` (a pytree of arrays or
    ``jax.ShapeDtypeStruct``; None: the plan of exact Gaussian noise, which a
    snapped noise's residual can only add to).

    ``privacy.delta`` is the run's whole delta: the accountant (whose epsilon
    covers the snapped noise's residual, its failure probability included) gets
    what a possibly truncated Poisson sample (``truncation_probability`` per
    step) leaves of it. ``num_units``: the privacy units delta is checked against
    (``units``; default ``num_train``)."""
    what = "users" if config.privacy.unit == "user" else "training records"
    n = num_train if num_units is None else num_units
    if config.privacy.delta >= 1 / n and not config.privacy.allow_large_delta:
        raise ConfigError(
            f"privacy.delta: {config.privacy.delta:g} is not below 1/n = {1 / n:.3g} "
            f"for the n = {n:,} {what}, so the guarantee would allow "
            "publishing a record in the clear; use a delta below 1/n (1e-5 is usual), or "
            "privacy.allow_large_delta = true to train anyway (NOT differentially private)"
        )
    # within a group of n // b records on b-cyclic Poisson samples (b = 1: all n)
    q = config.training.expected_batch_size / (num_train // _bands(config))
    count_sigma = count_noise_stddev(config)
    coordinates = _noised_coordinates(config, config.precision, params_shape)
    reserved = truncation_delta(config, truncation_probability)
    if not reserved <= config.privacy.delta / 2:
        raise ConfigError(
            f"privacy.delta: {config.privacy.delta:g} is too small for the chance that a "
            f"Poisson batch outgrows its padded size ({truncation_probability:.3g} per step, "
            f"delta {reserved:.3g} at epsilon {config.privacy.target_epsilon:g}); raise delta"
        )
    delta = config.privacy.delta - reserved
    sigma, calibrated, budget = _calibrate(config, q, count_sigma, coordinates, delta)
    return NoisePlan(sigma, calibrated, budget, q, count_sigma, coordinates, reserved)
