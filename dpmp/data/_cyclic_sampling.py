"""b-cyclic Poisson sampling: what amplified banded matrix factorization accounts.

The records are split once, by a seeded permutation of their positions (never
a function of the records), into ``groups`` groups of ``n // groups`` records
(jax-privacy's ``PartitionType.EQUAL_SPLIT``: the ``n mod groups`` left over
are never sampled); step ``t`` Poisson-samples group ``t mod groups`` with
probability ``q = expected_batch_size / (n // groups)``. A record then takes
part in at most one step of every ``groups`` consecutive ones, which is what
``dpmp.accounting._bandmf`` (Choquette-Choo et al. 2023, Theorem 4) assumes.
It is ``jax_privacy.batch_selection.CyclicPoissonSampling(cycle_length=b)``
with the state, secret seed, counted truncation and fixed shape of
``dpmp.PoissonSampler``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dpmp.data._sampling import PoissonSampler, SampledBatch, _check_int, _pad

__all__ = ["CyclicPoissonSampler"]


class CyclicPoissonSampler(PoissonSampler):
    """Poisson samples of one group of records per step, the groups in turn.

    Args:
      num_examples: dataset size n >= groups.
      expected_batch_size: the expected batch of a step, ``q (n // groups)``.
      groups: b >= 1, the number of groups (a banded strategy's bands).
      padded_batch_size, max_truncation_prob, seed, num_steps: as
        ``PoissonSampler``'s (truncation is sized for a group of
        ``n // groups + 1`` records).

    Formal guarantees:
      * A record is sampled only at steps ``t`` with ``t mod groups`` its
        group's, each independently with probability ``sampling_prob``.
      * ``groups = 1`` is ``PoissonSampler`` over all n records.
    """

    kind = "cyclic_poisson"
    privacy_note = (
        "b-cyclic Poisson sampling: the records are split once into b groups and each "
        "step Poisson-samples the next group; amplified banded matrix factorization's "
        "accounting applies with sampling_prob = this sampler's (within a group)."
    )

    def __init__(
        self,
        num_examples: int,
        expected_batch_size: float | None = None,
        *,
        groups: int,
        sampling_prob: float | None = None,
        padded_batch_size: int | None = None,
        max_truncation_prob: float = 1e-12,
        seed: int | None = None,
        num_steps: int | None = None,
    ):
        self.groups = _check_int("groups", groups, 1)
        n = _check_int("num_examples", num_examples, 1)
        if self.groups > n:
            raise ValueError(f"groups must be at most num_examples = {n}, got {self.groups}.")
        if sampling_prob is None and expected_batch_size is not None:
            if not 0 < expected_batch_size <= self.group_size(n):
                raise ValueError(
                    f"expected_batch_size must be in (0, {self.group_size(n)}], the records of "
                    f"one of {self.groups} groups, got {expected_batch_size}."
                )
            sampling_prob = expected_batch_size / self.group_size(n)
            expected_batch_size = None
        super().__init__(
            n,
            expected_batch_size,
            sampling_prob=sampling_prob,
            padded_batch_size=padded_batch_size,
            max_truncation_prob=max_truncation_prob,
            seed=seed,
            num_steps=num_steps,
        )
        order = np.random.default_rng([self.seed, 0, self.groups]).permutation(n)
        size = self.group_size(n)
        self._partition = [part[:size] for part in np.array_split(order, self.groups)]

    def group_size(self, n: int | None = None) -> int:
        """Records in each group: ``n // groups``."""
        return (self.num_examples if n is None else n) // self.groups

    def _neighbour_draws(self) -> int:
        """A step draws from one group: a neighbour's is one record larger."""
        return self.group_size() + 1

    @property
    def expected_batch_size(self) -> float:
        return self.group_size() * self.sampling_prob

    def _draw(self, step: int) -> tuple[SampledBatch, int]:
        rng = np.random.default_rng([self.seed, step])
        group = self._partition[step % self.groups]
        sample = group[rng.random(len(group)) < self.sampling_prob]
        dropped = max(0, sample.size - self.padded_batch_size)
        if dropped:
            sample = rng.choice(sample, size=self.padded_batch_size, replace=False)
        return _pad(np.sort(sample), self.padded_batch_size), dropped

    _CONFIG = ("num_examples", "sampling_prob", "padded_batch_size", "seed", "groups")

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, num_steps: int | None = None):
        sampler = cls(
            state["num_examples"],
            groups=state["groups"],
            sampling_prob=state["sampling_prob"],
            padded_batch_size=state["padded_batch_size"],
            seed=state["seed"],
            num_steps=num_steps,
        )
        sampler.load_state_dict(state)
        return sampler

    def __repr__(self) -> str:
        return (
            f"CyclicPoissonSampler(num_examples={self.num_examples}, groups={self.groups}, "
            f"sampling_prob={self.sampling_prob:.6g}, "
            f"padded_batch_size={self.padded_batch_size}, step={self.step})"
        )
