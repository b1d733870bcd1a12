"""Data and sampling: which examples each step uses, and how they reach the step.

``make_sampler`` builds the run's sampler: Poisson sampling (what the
accountant assumes; every example joins each step's logical batch with
probability ``q``), padded to a fixed size so that one compiled step serves
every batch, or fixed shuffled batches (``privacy.sampling = "shuffle"``, not
covered by the Poisson epsilon). The padded size is a multiple of
``training.physical_batch_size`` (and of ``training.microbatch_size``).

With ``privacy.unit = "user"`` the sampler draws users
(``dpmp.data._user_sampling.UserPoissonSampler``): the expected, physical and
micro batch sizes count users, and a batch is ``[padded users, k, ...]``;
with ``privacy.user_sampling = "records"`` it draws records, each user's
capped at ``privacy.user_records`` (``dpmp.data._capped_sampling``), and the
batches are record batches.

``gather`` reads a batch's examples from the training split -- an in-memory
array, a memory-mapped ``.npy`` file or any random-access source -- so only
the batch is ever in memory; ``physical_chunks`` cuts it into the chunks the
device sees one at a time.
"""

from __future__ import annotations

import functools

import numpy as np

from dpmp.app.config import Config, ConfigError
from dpmp.app.trainer.plan import max_truncation_prob
from dpmp.clipping._users import RECORD_MASK
from dpmp.data._capped_sampling import CappedUserSampler
from dpmp.data._cyclic_sampling import CyclicPoissonSampler
from dpmp.data._dataset import Dataset
from dpmp.data._preprocess import FeatureStats, exact_feature_stats, private_feature_stats
from dpmp.data._sampling import PoissonSampler, SampledBatch, ShuffledSampler
from dpmp.data._user_sampling import UserBatch, UserPoissonSampler
from dpmp.noise._mechanisms import mechanism
from dpmp.step._step import physical_chunks

__all__ = [
    "chunk_size",
    "feature_stats",
    "gather",
    "input_dtype",
    "make_sampler",
    "physical_chunks",
]


def chunk_size(config: Config, devices: int = 1) -> int | None:
    """The size every padded batch must be a multiple of, or None: the physical
    batch, or a microbatch on each of ``devices`` devices."""
    t = config.training
    unit = (t.microbatch_size or 1) * devices
    if t.physical_batch_size is None:
        return unit if unit > 1 else None
    if t.physical_batch_size % unit:  # microbatch divides physical: validated
        raise ConfigError(
            f"training.physical_batch_size: {t.physical_batch_size} does not split over "
            f"training.devices = {devices} devices"
            + (f" in microbatches of {t.microbatch_size}" if t.microbatch_size else "")
            + f"; make it a multiple of {unit}"
        )
    return t.physical_batch_size


def make_sampler(config: Config, num_train: int, seed: int, devices: int = 1, users=None):
    """The run's sampler over ``num_train`` examples with the secret ``seed``, its
    padded batches split evenly over ``devices`` devices; with ``privacy.unit =
    "user"``, over the users of ``users`` (``Dataset.users_train``)."""
    t = config.training
    by_user = config.privacy.unit == "user" and config.privacy.user_sampling == "users"
    count, what = (int(users.max()) + 1, "users") if by_user else (num_train, "examples")
    # a batch never holds more than every example (a larger physical or micro
    # batch would be padding, allocated)
    for name in ("expected_batch_size", "physical_batch_size", "microbatch_size"):
        size = getattr(t, name)
        if size is not None and size > count:
            raise ConfigError(f"training.{name}: {size} exceeds the {count} training {what}")
    unit = chunk_size(config, devices)
    if by_user:
        return _user_sampler(config, users, seed, unit)
    if config.privacy.sampling == "shuffle":
        if unit and t.expected_batch_size % unit:
            raise ConfigError(
                f"training.expected_batch_size: {t.expected_batch_size} shuffled examples "
                f"per step do not split into batches of {unit}"
            )
        return ShuffledSampler(num_train, t.expected_batch_size, seed=seed, num_steps=t.steps)
    tail = max_truncation_prob(config)
    make = _poisson_kind(config, num_train)
    if config.privacy.unit == "user":  # records sampled on their own, capped per user
        make = functools.partial(_capped, users=users, records_per_user=config.privacy.user_records)
    sampler = make(
        num_train, t.expected_batch_size, seed=seed, num_steps=t.steps, max_truncation_prob=tail
    )
    if unit and sampler.padded_batch_size % unit:
        padded = -(-sampler.padded_batch_size // unit) * unit
        sampler = make(
            num_train, t.expected_batch_size, padded_batch_size=padded, seed=seed, num_steps=t.steps
        )
    return sampler


def _poisson_kind(config: Config, num_train: int):
    """``PoissonSampler``, or for a mechanism accounted on b-cyclic Poisson samples
    (``privacy.bands`` groups) the ``CyclicPoissonSampler`` of its bands."""
    p, size = config.privacy, config.training.expected_batch_size
    if not mechanism(p.mechanism).cyclic:
        return PoissonSampler
    if size > num_train // p.bands:
        raise ConfigError(
            f"privacy.bands: {p.bands} groups of {num_train // p.bands} training examples "
            f"cannot give training.expected_batch_size = {size} per step; use at most "
            f"{max(1, num_train // size)} bands"
        )
    return functools.partial(CyclicPoissonSampler, groups=p.bands)


def _user_sampler(config: Config, users, seed: int, unit: int | None) -> UserPoissonSampler:
    """Users Poisson-sampled, padded to a multiple of ``unit`` users."""
    t = config.training
    kwargs = dict(records_per_user=config.privacy.user_records, seed=seed, num_steps=t.steps)
    tail = max_truncation_prob(config)
    sampler = UserPoissonSampler(users, t.expected_batch_size, max_truncation_prob=tail, **kwargs)
    if unit and sampler.padded_batch_size % unit:
        padded = -(-sampler.padded_batch_size // unit) * unit
        sampler = UserPoissonSampler(
            users, t.expected_batch_size, padded_batch_size=padded, **kwargs
        )
    return sampler


def feature_stats(config: Config, data: Dataset, seed: int) -> FeatureStats | None:
    """The standardisation statistics ``data.standardize`` asks for, or None."""
    d = config.data
    if d.standardize == "private":
        return private_feature_stats(
            data.x_train,
            clip=d.standardize_clip,
            noise_multiplier=d.standardize_noise_multiplier,
            seed=seed,
        )
    if d.standardize == "nonprivate":
        return exact_feature_stats(data.x_train)
    return None


def gather(data: Dataset, batch) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The batch's training examples ``{"x": float32 (int32 tokens), "y": int32}`` and
    its padding mask.

    Padding rows repeat example 0 (masked out of every sum). Only the batch's
    rows are read, so a memory-mapped split is never loaded whole. A
    ``UserBatch``'s leaves are ``[users, k, ...]``, with the real-record mask
    (``RECORD_MASK``, ``[users, k]``) beside ``x`` and ``y``; its padding mask
    is the padding users'.
    """
    if isinstance(batch, UserBatch):
        return _gather_users(data, batch)
    pad = np.asarray(batch.is_padding_example, bool)
    idx = np.where(pad, 0, np.asarray(batch.indices))
    x = np.asarray(data.x_train[idx], input_dtype(data))
    return {"x": x, "y": np.asarray(data.y_train[idx], np.int32)}, pad


def input_dtype(data: Dataset) -> type:
    """What the model takes: int32 tokens for next-token data, else float32 features."""
    return np.int32 if data.task == "next_token" else np.float32


def _gather_users(data: Dataset, batch: UserBatch) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``gather`` of a user batch: its records read as one flat batch, then one row per user."""
    shape = batch.indices.shape
    flat = SampledBatch(batch.indices.reshape(-1), batch.is_padding_record.reshape(-1))
    rows, _ = gather(data, flat)
    out = {name: value.reshape(*shape, *value.shape[1:]) for name, value in rows.items()}
    out[RECORD_MASK] = ~np.asarray(batch.is_padding_record, bool)
    return out, np.asarray(batch.is_padding_example, bool)


def _capped(num_train: int, *args, users, records_per_user: int, **kwargs) -> CappedUserSampler:
    """``CappedUserSampler`` called as ``PoissonSampler`` is (its ``num_train`` is that
    of the users' records, all of them)."""
    del num_train
    return CappedUserSampler(users, *args, records_per_user=records_per_user, **kwargs)
