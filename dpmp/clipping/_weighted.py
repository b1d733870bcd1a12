"""Clip-weighted sums over the examples of a batch: ``sum_i factor_i x_i``.

An example that is not kept (padding, or a non-finite gradient) adds exactly
zero: its rows are set to 0 with ``where``, never multiplied by 0, since an
overflowed example's ``inf * 0`` would be NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dpmp.clipping._rounding import HIGHEST

__all__ = [
    "after",
    "clip_factors",
    "kept_rows",
    "weighted_example_dot",
    "weighted_example_sum",
    "weighted_examples",
    "weighted_kept_sum",
]


def clip_factors(sq, is_padding, clip_norm: float, dtype):
    """``(norms, finite, keep, factor)`` per example from its squared norm ``sq``:
    ``keep`` the finite, unpadded examples, ``factor = min(1, clip_norm / norm)`` for
    them and exactly 0 for the others (never a quotient of a non-finite norm)."""
    norms = jnp.sqrt(sq)
    finite = jnp.isfinite(sq)
    keep = finite & ~is_padding
    safe = jnp.where(keep, norms, jnp.ones_like(norms))
    factor = jnp.minimum(jnp.ones_like(safe), jnp.asarray(clip_norm, dtype) / safe)
    return norms, finite, keep, jnp.where(keep, factor, jnp.zeros_like(factor))


def weighted_example_sum(x, factor, keep, dtype):
    """``sum_i factor_i x_i`` over the leading (example) axis, in ``dtype``.

    Examples not kept add exactly zero: ``where``, not a multiply by 0, since an
    overflowed example's ``inf * 0`` would be NaN.
    """
    return jnp.sum(kept_rows(weighted_examples(x, factor, dtype), keep), axis=0)


def kept_rows(x, keep):
    """``x`` with the rows (leading axis) of examples not kept set to exactly 0."""
    rows = keep.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(rows, x, jnp.zeros_like(x))


def after(keep, before):
    """``keep``, made to read ``before`` (the sum done just before) without changing:
    a scheduling dependency (see the ordering note in
    ``dpmp.clipping.ghost._clipped_sum``)."""
    if before is None or not before.size:
        return keep
    b = before.ravel()[0]
    return keep & (jnp.isnan(b) | ~jnp.isnan(b))


def weighted_examples(x, factor, dtype):
    """``factor_i x_i`` per example in ``dtype`` (a non-finite ``x_i`` stays non-finite)."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    return x.astype(dtype) * factor.astype(dtype).reshape(shape)


def weighted_example_dot(x, factor, dtype):
    """``sum_i factor_i x_i`` as one contraction over the example axis, in ``dtype``
    (every ``x_i`` finite): no weighted copy of ``x`` is formed. Wider than ``x``
    (float64), a reduction instead: XLA:CPU fuses the widening, the product and the
    sum into it, where a float64 contraction would first copy ``x`` to float64."""
    if jnp.dtype(dtype) != x.dtype:
        return jnp.sum(weighted_examples(x, factor, dtype), axis=0)
    return lax.dot_general(
        factor.astype(dtype),
        x.astype(dtype),
        (((0,), (0,)), ((), ())),
        precision=HIGHEST,
        preferred_element_type=dtype,
    )


def weighted_kept_sum(x, factor, keep, dtype):
    """``sum_i factor_i x_i`` over the kept examples, in ``dtype``: the rows not kept
    set to 0, then one contraction (``weighted_example_dot``); wider than ``x``,
    one reduction of ``where(keep, factor * x)`` (XLA:CPU fuses it whole, where a
    zeroed copy of ``x`` would be kept first: 1.33x the temp memory of a float64
    ghost step)."""
    if jnp.dtype(dtype) != x.dtype:
        return weighted_example_sum(x, factor, keep, dtype)
    return weighted_example_dot(kept_rows(x, keep), factor, dtype)
