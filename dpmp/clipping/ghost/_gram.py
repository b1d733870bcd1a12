"""Certified ghost norms: the Gram form with a bound on its rounding, and the floor
against cancellation.

A ghost norm is a formula, and over several tokens it can cancel: with equal
activations and output gradients ``(h, -h, e)`` the Gram terms are ``|x|^2
|h|^2`` while the norm is ``|x| |e|``, and float32 rounding of the large terms
can leave an estimate far below the norm, or negative (NaN after the square
root). So each ghost rule returns its computed value PLUS a bound on its
rounding error (Higham's ``gamma_n`` bounds, see ``gram``), never below the
exact squared norm; and the clip factor takes each ghost layer's norm as at
least ``sum_t |x_t| |g_t| / 64`` (``cancellation_floor``), which keeps the
rounding of the clip-weighted contraction of a cancelling example below ``64 u
C``. A negative or NaN value counts as overflow: the example is dropped and
counted. On ordinary examples the bound adds about ``(K + N + T^2) u`` relative
(0.08% of the norm on a 64-token transformer; nothing on single-token layers).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from dpmp.clipping._rounding import (
    HIGHEST,
    certified_sum_of_squares,
    higham_gamma,
    sum_of_squares,
    unit_roundoff,
    wide,
)
from dpmp.clipping.ghost._operands import HALF_ACCUMULATION_U, accumulation_roundoff, contract

__all__ = [
    "CANCELLATION",
    "cancellation_floor",
    "gamma",
    "gram",
    "gram_magnitude_ratio",
    "gram_mode",
    "gram_operands",
    "keep",
    "row_dot_sum",
]

CANCELLATION = 64.0  # a ghost layer's norm is at least sum_t |x_t| |g_t| / 64
# The Gram bound's terms grow like (T^2 + K + N) u in the worst case (the bound of
# gamma_K E_K, with E_K up to T times the norm): past 5% (T above ~900 tokens in
# float32) the layer forms its per-example gradient.
_U32 = 2.0**-24
_MAX_GAMMA = 0.05


def gamma(n: int, dtype, operands=None) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` for the unit roundoff ``u`` of ``dtype``
    (of a contraction of half-precision ``operands`` accumulated in ``dtype``:
    ``dpmp.clipping.ghost._operands.accumulation_roundoff``).

    A dot product of length ``n`` computed in floating point, summed in any
    order, is within ``gamma_n |x|.|y|`` of the exact one (Higham 2002,
    "Accuracy and Stability of Numerical Algorithms", Eq. 3.5). Capped at 1 when
    ``n u >= 1/2``, which only an unsafe (below float32) clip dtype reaches: the
    plan keeps float32 bounds below 5% (``gram_mode``, ``gram_operands``).
    """
    nu = n * accumulation_roundoff(operands, dtype)
    return nu / (1 - nu) if nu < 0.5 else 1.0


def gram(am, gm, dtype, wide_dtype):
    """Certified ``||A^T G||_F^2`` for A [T, K], G [T, N], and ``m = sum_t |a_t| |g_t|``.

    One token: ``||a||^2 ||g||^2``, a product of two sums of squares (no
    cancellation), each accumulated in ``wide_dtype`` and made an upper bound
    (``certified_sum_of_squares``); ``m`` is then the norm itself. Several tokens: the Gram
    form ``S = <A A^T, G G^T> = sum_{t,s} P_ts Q_ts`` mixes signs and can cancel
    (equal ``a_t`` with ``g = (h, -h, e)`` has ``S = |a|^2 |e|^2`` from terms of size
    ``|a|^2 |h|^2``), so the computed ``S^`` comes with a bound on its error and
    ``S^ + bound`` is returned, never below the exact ``S``. With ``P^, Q^`` the
    computed Gram matrices, ``|P^_ts - P_ts| <= gamma_K |a_t| |a_s|`` and
    ``|Q^_ts - Q_ts| <= gamma_N |g_t| |g_s|`` (``gamma``), so::

        |S - S^| <= gamma_K  sum_ts |a_t||a_s| |Q^_ts|       (errors of P)
                  + gamma_N  sum_ts |g_t||g_s| |P^_ts|       (errors of Q)
                  + gamma_2T sum_ts |P^_ts Q^_ts|            (the final sum)
                  + gamma_K gamma_N m^2                       (second order)

    with ``|a_t|, |g_t|`` read off the Gram diagonals. The final sum is T row dot
    products ``sum_s P^_ts Q^_ts`` (one ``dot_general``, length T) and then a sum of
    T rows, so its error is within ``gamma_2T``, whatever order XLA adds in; one
    flat reduction of the T^2 products could only be bounded by ``gamma_{T^2}``.
    The bound is doubled, which covers the rounding of the bound itself and of
    those norms. On ordinary inputs the extra terms are the size of the diagonal,
    so the bound adds about ``(K + N + 2T) u`` relative; on a cancelling example it
    grows with the cancelled terms, and the example is clipped as hard as they
    require.

    ``am``, ``gm`` may be in one half-precision dtype (the stored values): the Gram
    matrices then read them as they are, accumulated in ``dtype``, and ``gamma_K``,
    ``gamma_N`` take the unit roundoff of that accumulation (``2^-22``,
    ``dpmp.clipping.ghost._operands``), unless ``gram_operands`` finds the
    bound too loose for it and they are read in ``dtype``. The other terms are
    float32 sums of float32 values, bounded as before.
    """
    t, k = am.shape
    n = gm.shape[1]
    if t == 1:
        with wide(wide_dtype):
            sa = sum_of_squares(am, k, dtype, wide_dtype)
            sg = sum_of_squares(gm, n, dtype, wide_dtype)
            sq = certified_sum_of_squares(sa * sg, 0, wide_dtype).astype(dtype)
        return sq, jnp.sqrt(sq)
    ops = gram_operands(t, k, n, am.dtype, dtype)
    am, gm = am.astype(ops), gm.astype(ops)
    gram_of = lambda x: contract(x, x, (((1,), (1,)), ((), ())), dtype)  # noqa: E731
    p, q = gram_of(am), gram_of(gm)
    na = jnp.sqrt(jnp.maximum(jnp.diagonal(p), 0))
    ng = jnp.sqrt(jnp.maximum(jnp.diagonal(q), 0))
    m = jnp.sum(na * ng)
    # The bound's terms are sums of non-negative numbers (rounding there is covered
    # by the doubling), taken elementwise: no reduced-precision (TF32) matmul.
    gk, gn = gamma(k, dtype, ops), gamma(n, dtype, ops)
    err = (
        gk * jnp.sum(na[:, None] * jnp.abs(q) * na[None, :])
        + gn * jnp.sum(ng[:, None] * jnp.abs(p) * ng[None, :])
        + gamma(2 * t, dtype) * jnp.sum(jnp.abs(p * q))
        + gk * gn * m * m
    )
    return row_dot_sum(p, q, dtype) + 2 * err, m


def row_dot_sum(p, q, dtype):
    """``sum_ts p_ts q_ts`` as T row dot products then a sum of T (error <= gamma_2T);
    ``p``, ``q`` in ``dtype`` (float32 Gram matrices: never half)."""
    rows = lax.dot_general(
        p, q, (((1,), (1,)), ((0,), (0,))), precision=HIGHEST, preferred_element_type=dtype
    )
    return jnp.sum(rows)


def cancellation_floor(sq, m):
    """A ghost layer's squared norm as the clip factor uses it: ``max(sq, (m / 64)^2)``.

    ``sq`` is already an upper bound of the exact squared norm (its rounding error
    added). The clip-weighted sum of a ghost layer is one contraction over
    examples AND tokens (or patches, or ids), whose rounding for example ``i`` is
    about ``u c_i m_i`` with ``m_i = sum_t |x_t| |g_t|``: a few ulps of the
    cancelled terms. Taking the norm as at least ``m_i / 64`` keeps ``c_i m_i <= 64 C``,
    so that rounding stays below ``64 u C`` (4e-6 C in float32) however much the
    tokens cancel. An ordinary example's tokens cancel far less than 64-fold in
    norm, and this leaves it alone. A negative or NaN ``sq`` is never finite.
    """
    floor = jnp.square(m / CANCELLATION)
    return jnp.where(sq >= 0, jnp.maximum(sq, floor), jnp.full_like(sq, jnp.nan))


def gram_mode(t: int, k: int, n: int) -> str:
    """``"ghost"`` or ``"example"`` for a layer of T tokens, fan-in K, fan-out N.

    Per layer, the smaller of the two (Bu et al. 2022, "Scalable and efficient
    training of large convolutional neural networks with differential privacy",
    mixed ghost clipping): the ghost norm stores T (K + N) numbers per example
    and its Gram form costs about T^2 (K + N), the per-example gradient K N and T
    K N. A layer on so many tokens that the Gram form's rounding bound
    (``gram``) would exceed 5% forms its per-example gradient too.
    """
    if (t * t + k + n + 1) * _U32 > _MAX_GAMMA:  # the Gram bound would be too loose
        return "example"
    return "example" if k * n <= t * (k + n) else "ghost"


def gram_operands(t: int, k: int, n: int, operands, dtype):
    """The dtype ``gram`` reads A [T, K] and G [T, N] in, given in ``operands``:
    those where the Gram bound at the half-operand roundoff stays within 5% (as
    ``gram_mode`` asks of float32), else ``dtype``. One token reads no
    contraction: its operands stay as given."""
    if jnp.dtype(operands) == jnp.dtype(dtype) or t == 1:
        return jnp.dtype(operands)
    if (t * t + k + n + 1) * HALF_ACCUMULATION_U > _MAX_GAMMA:
        return jnp.dtype(dtype)
    return jnp.dtype(operands)


def gram_magnitude_ratio(t: int, k: int, n: int, dtype, operands=None) -> float:
    """``lambda`` of ``gram``'s magnitude: ``|x_t|``, ``|g_t|`` are square roots of
    dot products of length K and N, their products summed over T rows, so
    ``lambda = sqrt((1 - g_K)(1 - g_N)) (1 - g_T) (1 - u)^4`` (``g_n``:
    ``higham_gamma`` in ``dtype``, ``g_K`` and ``g_N`` at the roundoff of the
    Gram matrices' ``operands``; 0 where no bound exists). Half ``operands``
    (``dpmp.clipping.ghost._operands``) add ``(1 - u)^2`` for the division by
    the loss scale."""
    u = unit_roundoff(dtype)
    ratio = keep(t, dtype) * (1 - u) ** 4
    if operands is None or jnp.dtype(operands) == jnp.dtype(dtype):
        return math.sqrt(keep(k, dtype) * keep(n, dtype)) * ratio
    ops = gram_operands(t, k, n, operands, dtype)
    u_ops = accumulation_roundoff(ops, dtype)
    return math.sqrt(keep(k, dtype, u_ops) * keep(n, dtype, u_ops)) * ratio * (1 - u) ** 2


def keep(n: int, dtype, u: float | None = None) -> float:
    """``1 - gamma_n`` (``higham_gamma``; at the unit roundoff ``u`` where given),
    or 0 where no bound exists."""
    if u is None:
        return max(0.0, 1.0 - higham_gamma(n, dtype))
    nu = max(n, 0) * u
    return max(0.0, 1.0 - nu / (1 - nu)) if nu < 1 else 0.0
