"""A dynamic loss scale whose only input is a noised overflow count.

Why this exists: a dynamic loss scale backs off when some gradient overflowed.
In private training "some gradient overflowed" means "some example in this
batch has a gradient too large for float16" — a function of private data. The
sequence of loss scales is visible (it is in every checkpoint and log, and it
shapes every later update), so an exact-count decision leaks, and nothing in
the DP-SGD accounting pays for it.

``PrivateDynamicLossScale`` makes the decision from a Gaussian-noised count
of the examples whose gradient was not finite:

    noised = count + N(0, count_noise_stddev**2)      # dpmp.snapped_gaussian
    overflow = noised > threshold
    (then the usual grow-after-``period`` / back-off-by-``factor`` rule)

Formal guarantees:
  Under add/remove-one adjacency the count has L2 sensitivity 1 (one example
  either overflowed or did not), so each release is a Gaussian mechanism with
  noise multiplier ``count_noise_stddev`` applied to the same Poisson-sampled
  batch as the gradient. ``dpmp.accounting`` composes these releases with the
  DP-SGD steps; the loss-scale sequence is then post-processing of released
  values. The released value is returned in ``PrivateGrad.stats`` as
  ``noised_overflow_count`` so that it can be logged without further cost.

The threshold trades false back-offs for missed overflows: with the default
``3 * count_noise_stddev`` a clean step backs off with probability 0.13%.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.noise._entropy import key_from
from dpmp.noise._snapped import snapped_gaussian
from dpmp.precision._loss_scale import (
    _as_f32_scale,
    _check_static,
    _new,
    _scale_tree,
    _unscale_tree,
    _validate_dynamic_fields,
    dynamic_rule,
)

__all__ = ["PrivateDynamicLossScale"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PrivateDynamicLossScale:
    """Dynamic loss scaling driven by a Gaussian-noised count of overflowed examples.

    Args:
      loss_scale: initial scale (stored as float32).
      prng_key: secret key for the count noise (a typed key or raw uint32 key
        data). None (the default) draws it from the OS entropy; an int derives
        it from a public number, which is reproducible and NOT private. The key
        advances inside the object, so checkpoint the object to resume.
      count_noise_stddev: standard deviation of the noise on the count
        (sensitivity 1, so this is also the noise multiplier of the release).
      threshold: back off when the noised count exceeds this; defaults to
        ``3 * count_noise_stddev``.
      period: as in ``DynamicLossScale``.
      factor: as in ``DynamicLossScale``.
      min_scale: as in ``DynamicLossScale``.
      max_scale: as in ``DynamicLossScale``.
      counter: finite steps since the last change.
    """

    loss_scale: Any
    prng_key: Any = None
    count_noise_stddev: float = 8.0
    threshold: float | None = None
    period: int = 200
    factor: float = 2.0
    min_scale: float = 1.0
    max_scale: float = float(2**24)
    counter: Any = None

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _as_f32_scale(self.loss_scale))
        counter = jnp.zeros((), jnp.int32) if self.counter is None else self.counter
        object.__setattr__(self, "counter", jnp.asarray(counter).astype(jnp.int32))
        object.__setattr__(self, "prng_key", key_from(self.prng_key))
        stddev = _check_static("count_noise_stddev", self.count_noise_stddev)
        object.__setattr__(self, "count_noise_stddev", stddev)
        threshold = 3.0 * stddev if self.threshold is None else self.threshold
        object.__setattr__(self, "threshold", _check_static("threshold", threshold, positive=False))
        _validate_dynamic_fields(self)

    def scale(self, tree):
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree):
        return _unscale_tree(tree, self.loss_scale)

    def adjust_private(self, overflow_count) -> tuple[PrivateDynamicLossScale, jax.Array]:
        """Releases a noised ``overflow_count`` and returns ``(next_scale, noised_count)``."""
        key, sub = jax.random.split(self.prng_key)
        # The snapped Gaussian: a float32 normal's lattice would leak the count.
        count = jnp.asarray(overflow_count).astype(jnp.float32)
        noised = snapped_gaussian(sub, count, self.count_noise_stddev)
        loss_scale, counter = dynamic_rule(self, noised <= jnp.float32(self.threshold))
        new = dataclasses.replace(self, loss_scale=loss_scale, counter=counter, prng_key=key)
        return new, noised

    def tree_flatten(self):
        aux = (
            self.count_noise_stddev,
            self.threshold,
            self.period,
            self.factor,
            self.min_scale,
            self.max_scale,
        )
        return (self.loss_scale, self.counter, self.prng_key), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        stddev, threshold, period, factor, min_scale, max_scale = aux
        loss_scale, counter, key = children
        return _new(
            cls,
            loss_scale=loss_scale,
            counter=counter,
            prng_key=key,
            count_noise_stddev=stddev,
            threshold=threshold,
            period=period,
            factor=factor,
            min_scale=min_scale,
            max_scale=max_scale,
        )
