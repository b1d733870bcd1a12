"""Rounding bounds of the reductions a clipped sum's sensitivity depends on.

Both paths of ``private_grad`` (per-example gradients and ghost clipping) take
each per-example squared norm as an upper bound of its exact value, from
Higham's ``gamma_n`` bounds (Higham 2002, "Accuracy and Stability of Numerical
Algorithms", Lemma 3.1 and Eq. 3.5), and form 64-bit sums inside ``wide``
only.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "HIGHEST",
    "certified_sum_of_squares",
    "higham_gamma",
    "sum_of_squares",
    "unit_roundoff",
    "wide",
]

# The precision of every contraction a norm or a clipped sum reads (no TF32 on GPUs).
HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def unit_roundoff(dtype) -> float:
    """``u = 2^-p`` for a dtype with ``p`` significand bits (float32: 2^-24, float64: 2^-53)."""
    return float(jnp.finfo(dtype).eps) / 2


def higham_gamma(n: int, dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` of ``dtype``, ``inf`` when ``n u >= 1``:
    the relative error bound of a sum of ``n + 1`` terms (or of a dot product of
    length ``n``) added in any order (Higham 2002, Lemma 3.1 and Eq. 3.5)."""
    nu = max(n, 0) * unit_roundoff(dtype)
    return nu / (1 - nu) if nu < 1 else math.inf


def wide(dtype):
    """A context in which values of ``dtype`` can be formed: ``jax.enable_x64`` for a
    64-bit dtype (which JAX otherwise truncates to 32 bits), else nothing.

    Only reductions run inside it; the loss and its gradients are traced outside,
    so that a model's own constants keep the dtypes the user gave them.
    """
    if jnp.dtype(dtype).itemsize >= 8 and not jax.config.jax_enable_x64:
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def certified_sum_of_squares(sq, terms: int, dtype, term_dtype=None):
    """An upper bound of the exact value of ``sq``, a sum of ``terms`` non-negative
    numbers (squares, products of norms) computed in ``dtype`` in any order.

    A sum of non-negative terms is never below the exact one by more than a
    factor ``1 - gamma_terms`` (``higham_gamma``; the rounding of each square is
    one more term of it), so ``sq / (1 - gamma)`` bounds it from above; the factor
    is rounded up by ``(1 + 8 u)``, which covers the rounding of the constant and of
    the multiply. ``term_dtype``: each term was rounded to it (relative
    ``u_term``) before the sum, which a factor ``1 + 2 u_term`` covers (squares
    taken in float32 and added in float64, so that XLA need not keep a float64
    copy of what is squared). In float64 this changes a float32 norm by at most a
    few ulps; in float32, a norm over ``P`` entries grows by up to ``P u / 2``
    relative. Raises ``ValueError`` when ``gamma_terms >= 1/2``: no useful bound
    exists.
    """
    gamma = higham_gamma(terms + 2, dtype)
    if not gamma < 0.5:
        raise ValueError(
            f"a squared norm over {terms:,} terms computed in {jnp.dtype(dtype).name} has no "
            "useful rounding bound (n u >= 1/3); accumulate it in float64 "
            "(private_grad(accumulation='float64'), the default)"
        )
    factor = (1 + 8 * unit_roundoff(dtype)) / (1 - gamma)
    if term_dtype is not None:
        factor *= 1 + 2 * unit_roundoff(term_dtype)
    return sq * jnp.asarray(factor, sq.dtype)


def sum_of_squares(x, terms: int, dtype, wide_dtype, axis=None):
    """Certified sum of squares of ``x`` (``terms`` entries per sum) in ``wide_dtype``:
    squared in ``dtype`` and then widened, not widened and then squared, so that
    the widened ``x`` is not a value XLA can share with (and keep for) another
    consumer of ``x``: it stays inside the reduction."""
    sq = jnp.sum(jnp.square(x.astype(dtype)).astype(wide_dtype), axis=axis)
    same = jnp.dtype(dtype) == jnp.dtype(wide_dtype)
    return certified_sum_of_squares(sq, terms, wide_dtype, None if same else dtype)
