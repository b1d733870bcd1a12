"""User-level Poisson sampling: users join a step, each with up to k of its records.

For user-level privacy (``privacy.unit = "user"``) the unit sampled is a user,
not a record (ULS, Charles et al. 2025): at step ``t`` every user joins the
batch independently with probability ``q = expected users / U``, exactly as
``PoissonSampler`` draws records (it draws the users here: the same padding
to a fixed number of users, the same counted truncation, the same bound on
the padded size). Each sampled user then gives up to ``k`` of its records,
``min(k, its count)`` of them chosen uniformly at random without replacement
by the sampler's own secret generator: a public rule that reads nothing but
how many records the user has. A step's batch is ``[padded users, k]`` record
indices, one row per user, padded with ``-1``; two masks say which rows are
padding users and which slots padding records.

A user with no training records is not a user here (``U`` counts the users
among the training records); a user with thousands of records gives at most
``k`` to any step.

The state is that of ``PoissonSampler``: step ``t``'s batch is a pure function
of ``(seed, t)`` (and the users), the seed secret by default.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from dpmp.data._sampling import (
    MAX_TRUNCATION_PROB,
    PADDING_INDEX,
    PoissonSampler,
    _check_int,
    _TruncatedSteps,
)

__all__ = ["UserBatch", "UserPoissonSampler", "checked_users"]


def checked_users(users: Any) -> np.ndarray:
    """``users`` as an array: a non-empty 1-D array of user indices >= 0, else refused."""
    users = np.asarray(users)
    if users.ndim != 1 or not len(users) or users.dtype.kind not in "iu" or users.min() < 0:
        raise ValueError("users must be a non-empty 1-D array of user indices >= 0.")
    return users


class UserBatch(NamedTuple):
    """One step's users and their records, padded to fixed sizes.

    Attributes:
      indices: int32 ``[padded_users, k]``: each row a sampled user's record
        indices (the real users first), ``-1`` in every padding slot.
      is_padding_example: bool ``[padded_users]``, True at padding users (the
        unit ``private_grad`` clips is a user).
      is_padding_record: bool ``[padded_users, k]``, True at every slot that is
        not a record (all of a padding user's, and those past a user's count).
    """

    indices: np.ndarray
    is_padding_example: np.ndarray
    is_padding_record: np.ndarray


class UserPoissonSampler(_TruncatedSteps):
    """Poisson sampling over users, each sampled user giving up to ``k`` records.

    Example:
      >>> users = np.repeat(np.arange(100), 3)       # 100 users, 3 records each
      >>> sampler = UserPoissonSampler(users, expected_batch_size=10, records_per_user=2, seed=0)
      >>> batch = next(sampler)
      >>> batch.indices.shape == (sampler.padded_batch_size, 2)
      True

    Formal Guarantees:
      * Without truncation each user is in a step's batch independently with
        probability ``sampling_prob``: the Poisson-subsampled accounting of
        ``dpmp.accounting`` holds with users as the unit and ``n = U``.
      * Which of a sampled user's records it gives is drawn from its record
        count alone, by the secret generator of the step: no other user's
        records, and no record's content, change it.
      * Truncation (more users sampled than ``padded_batch_size``) is
        ``PoissonSampler``'s: a uniformly random subset of the sampled users is
        kept, counted, and ``truncation_delta`` bounds what it may cost.

    Args:
      users: int ``[n]``, the user ``0..U-1`` of each training record
        (``Dataset.users_train``); every index below ``U`` must have a record.
      expected_batch_size: expected users per step, ``U * q``; or give
        ``sampling_prob``.
      records_per_user: k >= 1, the most records a sampled user gives.
      sampling_prob, padded_batch_size, max_truncation_prob, seed, num_steps:
        as ``PoissonSampler``'s, with users for examples.
    """

    poisson = True
    kind = "user_poisson"
    privacy_note = (
        "Poisson sampling over users, each sampled user giving at most user_records of its "
        "records: the sampled-Gaussian accounting of dpmp.accounting applies at the user "
        "level with sampling_prob = this sampler's sampling_prob and n = the number of users."
    )

    def __init__(
        self,
        users: np.ndarray,
        expected_batch_size: float | None = None,
        *,
        records_per_user: int,
        sampling_prob: float | None = None,
        padded_batch_size: int | None = None,
        max_truncation_prob: float = MAX_TRUNCATION_PROB,
        seed: int | None = None,
        num_steps: int | None = None,
    ):
        users = checked_users(users)
        self.records_per_user = _check_int("records_per_user", records_per_user, 1)
        order = np.argsort(users, kind="stable")
        counts = np.bincount(users)
        if not counts.all():
            raise ValueError(f"users: user {int(np.argmin(counts))} has no record.")
        self._records = order.astype(np.int32)  # the records of user u: a contiguous run
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._users = PoissonSampler(
            len(counts),
            expected_batch_size,
            sampling_prob=sampling_prob,
            padded_batch_size=padded_batch_size,
            max_truncation_prob=max_truncation_prob,
            seed=seed,
        )
        self.num_steps = None if num_steps is None else _check_int("num_steps", num_steps, 0)
        self.step = 0
        self.num_truncated = 0
        self.num_dropped = 0

    # What PoissonSampler says of examples, this says of users.
    num_examples = property(lambda self: self._users.num_examples)
    num_users = num_examples
    sampling_prob = property(lambda self: self._users.sampling_prob)
    padded_batch_size = property(lambda self: self._users.padded_batch_size)
    seed = property(lambda self: self._users.seed)
    expected_batch_size = property(lambda self: self._users.expected_batch_size)
    truncation_probability = property(lambda self: self._users.truncation_probability)

    def truncation_delta(self, steps: int, epsilon: float) -> float:
        """Extra delta that possible truncation adds to an (epsilon, delta) run."""
        return self._users.truncation_delta(steps, epsilon)

    def _draw(self, step: int) -> tuple[UserBatch, int]:
        sampled, dropped = self._users._draw(step)
        k = self.records_per_user
        indices = np.full((len(sampled.indices), k), PADDING_INDEX, np.int32)
        # a generator of its own, so that the users drawn are PoissonSampler's
        rng = np.random.default_rng([self.seed, step, 1])
        for row, user in enumerate(sampled.indices[~sampled.is_padding_example]):
            start, stop = self._starts[user], self._starts[user + 1]
            count = int(stop - start)
            if count <= k:
                chosen = self._records[start:stop]
            else:
                chosen = self._records[start + rng.choice(count, size=k, replace=False)]
            indices[row, : len(chosen)] = chosen
        batch = UserBatch(indices, sampled.is_padding_example, indices == PADDING_INDEX)
        return batch, dropped

    # the users themselves are the data's, not the state's
    _CONFIG = ("num_examples", "records_per_user", "sampling_prob", "padded_batch_size", "seed")

    def from_state_dict(self, state: dict[str, Any], *, num_steps: int | None = None):
        """A sampler over this one's users with ``state``'s seed, at its step (a
        resumed run's; the users are the data's, so this is asked of a sampler)."""
        sampler = UserPoissonSampler(
            self._user_of_records(),
            sampling_prob=state["sampling_prob"],
            records_per_user=state["records_per_user"],
            padded_batch_size=state["padded_batch_size"],
            seed=state["seed"],
            num_steps=num_steps,
        )
        sampler.load_state_dict(state)
        return sampler

    def _user_of_records(self) -> np.ndarray:
        """The user of each record (the ``users`` this sampler was built from)."""
        users = np.empty(len(self._records), np.int64)
        users[self._records] = np.repeat(np.arange(len(self._starts) - 1), np.diff(self._starts))
        return users

    def __repr__(self) -> str:
        return (
            f"UserPoissonSampler(num_users={self.num_users}, "
            f"records_per_user={self.records_per_user}, "
            f"sampling_prob={self.sampling_prob:.6g}, "
            f"padded_batch_size={self.padded_batch_size}, step={self.step})"
        )
