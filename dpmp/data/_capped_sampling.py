"""Example-level sampling of users (ELS): records Poisson-sampled on their own, at most
k of each user's.

The other way to protect users (Charles et al., "Fine-Tuning Large Language
Models with User-Level Differential Privacy", SaTML 2025): before training,
each user keeps at most ``k`` of its records, ``min(k, its count)`` of them
chosen uniformly at random without replacement by the sampler's own secret
generator (a public rule that reads nothing but how many records the user
has); then every kept record joins a step independently with probability
``q = expected batch / kept records``, exactly as ``PoissonSampler`` draws
records, and is clipped on its own. One user changes a step's sum by its
sampled records' clipped gradients, ``m ~ Binomial(k, q)`` of them: the plan
accounts the binomial mixture of Gaussians (``records_per_unit = k``,
``dpmp.accounting._groups``).

The kept records' count is public as the records' count is at record level
(zero-out of a user keeps its records, nulled); the padded batch is sized for
``k`` more records than are kept, a neighbour's most.

The state is that of ``PoissonSampler`` plus ``records_per_user``: the kept
records are a pure function of the seed and the users, step ``t``'s batch of
``(seed, t)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpmp.data._sampling import (
    MAX_TRUNCATION_PROB,
    PADDING_INDEX,
    PoissonSampler,
    SampledBatch,
    _check_int,
)
from dpmp.data._user_sampling import checked_users
from dpmp.noise._entropy import fresh_seed

__all__ = ["CappedUserSampler", "kept_records"]

# The stream that picks the kept records: a seed sequence of another length than the
# steps' ``[seed, step]``, so never one of theirs.
_KEEP_STREAM = (0x454C53, 1)


def kept_records(users: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The sorted indices of the records kept: for each user, ``min(k, count)`` of its
    records chosen uniformly at random without replacement from ``seed``'s stream."""
    users = np.asarray(users)
    rng = np.random.default_rng([seed, *_KEEP_STREAM])
    order = np.lexsort((rng.random(len(users)), users))  # by user, then a random key
    grouped = users[order]
    first = np.searchsorted(grouped, grouped, side="left")  # each user's first position
    rank = np.arange(len(users)) - first
    return np.sort(order[rank < k]).astype(np.int64)


class CappedUserSampler(PoissonSampler):
    """Poisson sampling of records, each user's records capped at ``records_per_user``.

    Args:
      users: int ``[n]``, the user ``0..U-1`` of each training record.
      expected_batch_size: the expected number of records per step.
      records_per_user: k, the most records a user keeps.
      sampling_prob: instead of ``expected_batch_size``: q per kept record.
      padded_batch_size: the batch's fixed size (default: truncated with
        probability at most ``max_truncation_prob`` at ``k`` more records).
      max_truncation_prob: see ``PoissonSampler``.
      seed: the secret seed (default: OS entropy); it picks the kept records too.
      num_steps: see ``PoissonSampler``.
    """

    kind = "capped_user_poisson"
    privacy_note = (
        "example-level sampling of users: every record Poisson-sampled at sampling_prob, "
        "at most records_per_user of each user's; accounted as the binomial mixture of "
        "Gaussians (records_per_unit)."
    )

    def __init__(
        self,
        users: Any,
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
        seed = fresh_seed() if seed is None else _check_int("seed", seed, 0)
        self._users = users
        self._kept = kept_records(users, self.records_per_user, seed)
        super().__init__(
            len(self._kept),
            expected_batch_size,
            sampling_prob=sampling_prob,
            padded_batch_size=padded_batch_size,
            max_truncation_prob=max_truncation_prob,
            seed=seed,
            num_steps=num_steps,
        )

    def _neighbour_draws(self) -> int:
        """A neighbour may have ``k`` more kept records (a user's most): the padded size
        and the truncation probability are taken at them."""
        return self.num_examples + self.records_per_user

    def _draw(self, step: int) -> tuple[SampledBatch, int]:
        batch, dropped = super()._draw(step)
        real = batch.indices >= 0
        indices = np.where(real, self._kept[np.maximum(batch.indices, 0)], PADDING_INDEX)
        return SampledBatch(indices.astype(np.int32), batch.is_padding_example), dropped

    _CONFIG = ("num_examples", "sampling_prob", "padded_batch_size", "seed", "records_per_user")

    def from_state_dict(self, state: dict[str, Any], *, num_steps: int | None = None):
        """A sampler over this one's users with ``state``'s seed, at its step (a resumed
        run's; the users are the data's, so this is asked of a sampler)."""
        sampler = CappedUserSampler(
            self._users,
            sampling_prob=state["sampling_prob"],
            records_per_user=state["records_per_user"],
            padded_batch_size=state["padded_batch_size"],
            seed=state["seed"],
            num_steps=num_steps,
        )
        sampler.load_state_dict(state)
        return sampler

    def __repr__(self) -> str:
        return (
            f"CappedUserSampler(kept_records={self.num_examples}, "
            f"records_per_user={self.records_per_user}, "
            f"sampling_prob={self.sampling_prob:.6g}, "
            f"padded_batch_size={self.padded_batch_size}, step={self.step})"
        )
