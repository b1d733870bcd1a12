"""Batch samplers: Poisson sampling in fixed-size padded batches, and shuffling.

DP-SGD's accounting (``dpmp.accounting``) assumes Poisson sampling: at every
step each example joins the batch independently with probability ``q``, so the
batch size is Binomial(n, q). A compiled step wants one shape, so batches are
padded to a fixed ``padded_batch_size`` and come with an ``is_padding_example``
mask; padding slots hold index -1 (jax-privacy's convention) and must reach
the gradient function as padding, where they contribute nothing.

Both samplers are built on ``jax_privacy.batch_selection``:
``CyclicPoissonSampling`` draws the Poisson sample and
``split_and_pad_global_batch`` pads it. They wrap it for three properties it
does not give on its own:

* *Resumable state.* jax-privacy's ``batch_iterator`` keeps its state in a
  live numpy ``Generator`` inside a Python generator frame, which cannot be
  saved. Here step ``t`` draws from its own generator seeded by
  ``(seed, t)``, so the batch of step ``t`` is a pure function of the seed
  and ``t``: the state is two integers, and a run resumed at step ``k`` gets
  exactly the batches of an uninterrupted run.
* *Secret seed.* Which examples a step uses is part of what privacy
  amplification by subsampling assumes hidden, so the seed defaults to 128
  bits of OS entropy (``seed=None``). It lives in ``state_dict()``: keep that
  (a checkpoint) as secret as the data. A given seed is public and
  reproducible, for tests and debugging: NOT private.
* *Counted truncation.* jax-privacy's ``truncated_batch_size`` drops examples
  silently; here a sample larger than ``padded_batch_size`` is cut to a
  uniformly random subset of that size (the same distribution as
  jax-privacy's truncation) and the event is counted.
* *Fixed shape.* jax-privacy yields variable-size batches; these are padded.

``BatchSelectionStrategy`` notes that batch indices are sensitive; so are the
truncation counts in principle (they reveal batch sizes, not data).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np
from jax_privacy import batch_selection
from scipy import stats

from dpmp.noise._entropy import fresh_seed

__all__ = [
    "PoissonSampler",
    "SampledBatch",
    "ShuffledSampler",
]

PADDING_INDEX = -1
# The default bound on a step's truncation probability (``PoissonSampler``): a
# padded size chosen for it, or rounded up from it, truncates no more often.
MAX_TRUNCATION_PROB = 1e-12


class SampledBatch(NamedTuple):
    """One step's batch of example indices, padded to a fixed size.

    Attributes:
      indices: int32 array ``[padded_batch_size]``; the real examples first,
        then ``-1`` in every padding slot.
      is_padding_example: bool array of the same shape, True at padding slots.
    """

    indices: np.ndarray
    is_padding_example: np.ndarray


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}.")
    return int(value)


def _pad(indices: np.ndarray, size: int) -> SampledBatch:
    (padded,) = batch_selection.split_and_pad_global_batch(indices.astype(np.int32), size)
    return SampledBatch(padded, padded == PADDING_INDEX)


def _check_state(sampler: Any, state: dict[str, Any], fields: tuple[str, ...]) -> None:
    if state.get("kind") != sampler.kind:
        raise ValueError(f"state is for a {state.get('kind')!r} sampler, not {sampler.kind!r}.")
    for name in fields:
        if state.get(name) != getattr(sampler, name):
            raise ValueError(
                f"state {name}={state.get(name)!r} does not match this sampler's "
                f"{name}={getattr(sampler, name)!r}."
            )


class _TruncatedSteps:
    """What a Poisson sampler does with its ``_draw(step) -> (batch, dropped)``: the
    batch of a step, iteration that advances ``step`` and counts truncated steps and
    dropped examples, and its state (``_CONFIG``, ``kind``, the step and counters)."""

    def batch(self, step: int):
        """The batch of ``step``, without advancing the sampler or its counters."""
        return self._draw(_check_int("step", step, 0))[0]

    def __iter__(self):
        return self

    def __next__(self):
        if self.num_steps is not None and self.step >= self.num_steps:
            raise StopIteration
        batch, dropped = self._draw(self.step)
        self.step += 1
        self.num_truncated += dropped > 0
        self.num_dropped += dropped
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: the configuration, the next step, the counters."""
        state = {name: getattr(self, name) for name in self._CONFIG}
        state.update(
            kind=self.kind,
            step=self.step,
            num_truncated=self.num_truncated,
            num_dropped=self.num_dropped,
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at ``state['step']``; the configuration must match."""
        _check_state(self, state, self._CONFIG)
        self.step = _check_int("step", state["step"], 0)
        self.num_truncated = _check_int("num_truncated", state["num_truncated"], 0)
        self.num_dropped = _check_int("num_dropped", state["num_dropped"], 0)


class PoissonSampler(_TruncatedSteps):
    """Poisson-sampled batches of fixed size, with a resumable state.

    At step ``t`` every example is included independently with probability
    ``sampling_prob``; the sample is padded with ``-1`` to ``padded_batch_size``.

    Example:
      >>> sampler = PoissonSampler(1437, expected_batch_size=256)  # secret seed
      >>> indices, is_padding_example = next(sampler)
      >>> indices.shape == (sampler.padded_batch_size,)
      True

    Truncation: if a sample has more than ``padded_batch_size`` examples, a
    uniformly random subset of ``padded_batch_size`` of them is kept and the
    rest are dropped from that step; ``num_truncated`` counts such steps and
    ``num_dropped`` the dropped examples. The default ``padded_batch_size`` is
    the smallest size whose truncation probability per step is at most
    ``max_truncation_prob`` (1e-12), for this dataset and for one with an
    extra example.

    Formal Guarantees:
      * Without truncation the batches are exactly Poisson samples, as
        ``dpmp.accounting`` assumes (Abadi et al. 2016; the analyses of
        Mironov et al. 2019 and Koskela et al. 2020 are for this sampling).
      * With truncation, for every dataset the run's output distribution is
        within total variation ``eta = steps * truncation_probability`` of the
        untruncated one, so an ``(epsilon, delta)``-DP untruncated run is
        ``(epsilon, delta + eta * (1 + e**epsilon))``-DP when truncation can
        happen: ``truncation_delta(steps, epsilon)`` gives that extra delta.
        (dp-accounting's ``TruncatedSubsampledGaussianDpEvent`` is a tighter
        analysis of the truncated mechanism.)
      * The normalisation of the noisy sum should use the *expected* batch
        size, never the realised one, which depends on the sample.

    Args:
      num_examples: dataset size n >= 1.
      expected_batch_size: n * q; give this or ``sampling_prob``.
      sampling_prob: q in (0, 1]; give this or ``expected_batch_size``.
      padded_batch_size: fixed batch size; default as described above.
      max_truncation_prob: truncation probability per step that the default
        ``padded_batch_size`` must not exceed, in (0, 1).
      seed: non-negative integer; batches are a function of ``(seed, step)``.
        None (the default): a secret 128-bit seed from the OS entropy. A seed
        you give is public, and the run NOT private.
      num_steps: iteration stops after this many steps (None: never).
    """

    poisson = True
    kind = "poisson"
    privacy_note = (
        "Poisson sampling: the sampled-Gaussian accounting of dpmp.accounting "
        "applies with sampling_prob = this sampler's sampling_prob."
    )

    def __init__(
        self,
        num_examples: int,
        expected_batch_size: float | None = None,
        *,
        sampling_prob: float | None = None,
        padded_batch_size: int | None = None,
        max_truncation_prob: float = MAX_TRUNCATION_PROB,
        seed: int | None = None,
        num_steps: int | None = None,
    ):
        self.num_examples = _check_int("num_examples", num_examples, 1)
        if (expected_batch_size is None) == (sampling_prob is None):
            raise ValueError("give exactly one of expected_batch_size and sampling_prob.")
        if sampling_prob is None:
            if not 0 < expected_batch_size <= self.num_examples:
                raise ValueError(
                    f"expected_batch_size must be in (0, num_examples={self.num_examples}], "
                    f"got {expected_batch_size}."
                )
            sampling_prob = expected_batch_size / self.num_examples
        if not 0 < sampling_prob <= 1:
            raise ValueError(f"sampling_prob must be in (0, 1], got {sampling_prob}.")
        self.sampling_prob = float(sampling_prob)
        if not 0 < max_truncation_prob < 1:
            raise ValueError(f"max_truncation_prob must be in (0, 1), got {max_truncation_prob}.")
        if padded_batch_size is None:
            padded_batch_size = self._default_padded_size(max_truncation_prob)
        self.padded_batch_size = _check_int("padded_batch_size", padded_batch_size, 1)
        self.seed = fresh_seed() if seed is None else _check_int("seed", seed, 0)
        self.num_steps = None if num_steps is None else _check_int("num_steps", num_steps, 0)
        self.step = 0
        self.num_truncated = 0
        self.num_dropped = 0

    def _neighbour_draws(self) -> int:
        """The most records a neighbouring dataset's step draws from at the sampling
        probability: a neighbour may have one more example, n + 1. The padded size
        and the truncation probability are taken at it."""
        return self.num_examples + 1

    def _default_padded_size(self, tail: float) -> int:
        """The smallest size whose truncation probability is at most ``tail``: a
        bisection on the binomial tail (``binom.sf`` stays accurate down to 1e-300;
        ``binom.isf`` returns n below about 1e-17)."""
        n, q = self._neighbour_draws(), self.sampling_prob
        low, high = -1, n  # sf(n) = 0 <= tail
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if stats.binom.sf(mid, n, q) <= tail else (mid, high)
        return max(high, 1)

    @property
    def expected_batch_size(self) -> float:
        return self.num_examples * self.sampling_prob

    @property
    def truncation_probability(self) -> float:
        """P(one step's sample exceeds ``padded_batch_size``), at a neighbour's most
        records (``_neighbour_draws``: n + 1 examples)."""
        return float(
            stats.binom.sf(self.padded_batch_size, self._neighbour_draws(), self.sampling_prob)
        )

    def truncation_delta(self, steps: int, epsilon: float) -> float:
        """Extra delta that possible truncation adds to an (epsilon, delta) run."""
        steps = _check_int("steps", steps, 0)
        eta = min(1.0, steps * self.truncation_probability)
        return eta * (1 + math.exp(epsilon))

    def _draw(self, step: int) -> tuple[SampledBatch, int]:
        rng = np.random.default_rng([self.seed, step])
        strategy = batch_selection.CyclicPoissonSampling(
            sampling_prob=self.sampling_prob, iterations=1
        )
        (sample,) = strategy.batch_iterator(self.num_examples, rng=rng)
        dropped = max(0, sample.size - self.padded_batch_size)
        if dropped:
            sample = rng.choice(sample, size=self.padded_batch_size, replace=False)
        return _pad(sample, self.padded_batch_size), dropped

    _CONFIG = ("num_examples", "sampling_prob", "padded_batch_size", "seed")

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, num_steps: int | None = None):
        sampler = cls(
            state["num_examples"],
            sampling_prob=state["sampling_prob"],
            padded_batch_size=state["padded_batch_size"],
            seed=state["seed"],
            num_steps=num_steps,
        )
        sampler.load_state_dict(state)
        return sampler

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(num_examples={self.num_examples}, "
            f"sampling_prob={self.sampling_prob:.6g}, "
            f"padded_batch_size={self.padded_batch_size}, step={self.step})"
        )


class ShuffledSampler:
    """Fixed-size batches of a fresh shuffle each epoch, every example once.

    NOT Poisson sampling: ``poisson`` is False and the epsilon that
    ``dpmp.accounting`` computes for Poisson sampling does not apply to runs
    that use it (shuffling needs a different, weaker analysis; see Chua et al.
    2024, "How private are DP-SGD implementations?"). Use it for non-private
    baselines. jax-privacy's ``FixedBatchSampling`` samples every batch
    independently, so it cannot give one pass per epoch; the epoch's
    permutation is split with its ``split_and_pad_global_batch``.

    The last batch of an epoch is padded (``-1``, ``is_padding_example``) when
    ``batch_size`` does not divide ``num_examples``.
    """

    poisson = False
    kind = "shuffled"
    privacy_note = (
        "Shuffled batches are not Poisson sampling: the Poisson-based epsilon "
        "of dpmp.accounting does not apply to this sampler."
    )

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        seed: int | None = None,
        num_steps: int | None = None,
    ):
        self.num_examples = _check_int("num_examples", num_examples, 1)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        if self.batch_size > self.num_examples:
            raise ValueError(
                f"batch_size must be <= num_examples={self.num_examples}, got {batch_size}."
            )
        self.seed = fresh_seed() if seed is None else _check_int("seed", seed, 0)
        self.num_steps = None if num_steps is None else _check_int("num_steps", num_steps, 0)
        self.steps_per_epoch = -(-self.num_examples // self.batch_size)
        self.step = 0
        self._epoch_cache: tuple[int, list[np.ndarray]] | None = None

    @property
    def padded_batch_size(self) -> int:
        return self.batch_size

    def batch(self, step: int) -> SampledBatch:
        """The batch of ``step``, without advancing the sampler."""
        step = _check_int("step", step, 0)
        epoch, position = divmod(step, self.steps_per_epoch)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            batches = batch_selection.split_and_pad_global_batch(
                order.astype(np.int32), self.batch_size
            )
            self._epoch_cache = (epoch, batches)
        indices = self._epoch_cache[1][position]
        return SampledBatch(indices, indices == PADDING_INDEX)

    def __iter__(self) -> ShuffledSampler:
        return self

    def __next__(self) -> SampledBatch:
        if self.num_steps is not None and self.step >= self.num_steps:
            raise StopIteration
        batch = self.batch(self.step)
        self.step += 1
        return batch

    _CONFIG = ("num_examples", "batch_size", "seed")

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._CONFIG}
        state.update(kind=self.kind, step=self.step)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state(self, state, self._CONFIG)
        self.step = _check_int("step", state["step"], 0)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, num_steps: int | None = None):
        sampler = cls(
            state["num_examples"], state["batch_size"], seed=state["seed"], num_steps=num_steps
        )
        sampler.load_state_dict(state)
        return sampler

    def __repr__(self) -> str:
        return (
            f"ShuffledSampler(num_examples={self.num_examples}, batch_size={self.batch_size}, "
            f"step={self.step}, poisson=False)"
        )
