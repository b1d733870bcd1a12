"""Dense layers, attention projections and einsums: a parameter in a ``dot_general``.

For a layer ``y = x W`` the gradient of one example's loss with respect to
``W`` is ``x_i^T g_i``, where ``g_i = dL_i/dy_i`` is the layer's output
gradient. Its norm needs neither ``x_i^T g_i`` nor any other per-example
gradient (Goodfellow 2015, "Efficient per-example gradient computations";
Li et al. 2022, "Large language models can be strong differentially private
learners", the Gram form for sequences):

* flat input (one token):  ``||x_i^T g_i||^2 = ||x_i||^2 ||g_i||^2``;
* T tokens:                ``||X_i^T G_i||_F^2 = <X_i X_i^T, G_i G_i^T>`` (two
  T x T Gram matrices, ``dpmp.clipping.ghost._gram.gram``).

The clipped sum ``sum_i c_i x_i^T g_i`` is then one contraction over the batch
and the tokens (``DenseRule.clipped_sum``), from the very values the norms
were taken from. A ``dot_general`` with batch dimensions, or a parameter that
reaches it through a non-bijective layout op (a broadcast), forms its
per-example gradient instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dpmp.clipping._rounding import HIGHEST
from dpmp.clipping._weighted import after, kept_rows, weighted_examples
from dpmp.clipping.ghost._gram import gram, gram_magnitude_ratio, gram_mode
from dpmp.clipping.ghost._operands import contract, half_operands
from dpmp.clipping.ghost._rule import Unsupported, is_float
from dpmp.precision._opaque import always_true, opaque_ints

__all__ = [
    "DenseRule",
    "contract_examples",
    "dot_operands",
    "in_blocks",
    "kn_to_operand",
    "weighted_columns",
]


class DenseRule:
    """Ghost norms of dense layers: the Gram form on tokens."""

    primitives = ("dot_general",)
    described = "dense/einsum"
    norm = "gram"  # ||x||^2 ||g||^2 for one token, <X X^T, G G^T> for several
    half_operands = True  # sq_norms and operand_grad read bf16/fp16 operands as they are

    def classify(self, eqn, pos, bijective, path):
        (_, _), (lb, rb) = eqn.params["dimension_numbers"]
        if not is_float(eqn.invars[1 - pos].aval.dtype):
            raise Unsupported(f"parameter {path}: dot_general with a non-float operand")
        if bijective and not lb and not rb:
            return "dense", True
        return "dense (batched)", False

    def mode(self, eqn, pos):
        if not is_float(eqn.invars[1 - pos].aval.dtype):
            return "ghost"
        return gram_mode(*_tkn(eqn, pos))

    def rows(self, eqn, pos):
        return _tkn(eqn, pos)[0]

    def magnitude_ratio(self, eqn, pos, dtype, wide_dtype):
        act, out = eqn.invars[1 - pos].aval.dtype, eqn.outvars[0].aval.dtype
        ops = half_operands(act, out, dtype, anywhere=True)  # the smaller ratio: either holds
        return gram_magnitude_ratio(*_tkn(eqn, pos), dtype, ops)

    def sq_norms(self, eqn, pos, a, g, dtype, wide_dtype):
        """Per example, certified ``||x_i^T g_i||^2`` and ``sum_t |x_t| |g_t|`` (``gram``)."""
        return jax.vmap(lambda a_, g_: gram(*dot_operands(eqn, pos, a_, g_), dtype, wide_dtype))(
            a, g
        )

    def operand_grad(self, eqn, pos, a, g, dtype):
        """One example's gradient of the parameter operand: ``A^T G`` as one
        contraction over the tokens of A [T, K], G [T, N] (``dot_operands``).

        The vjp of the layer gives the same sum, but on the example's own shapes
        (``[1, T, K]`` for a flax layer): under ``vmap`` XLA:CPU then copies one
        operand into another layout before a slower batched product (1.25x the
        batch gradient's time against 0.75x for this form, ViT of
        benchmarks/clipping.py). ``a``, ``g`` in ``dtype``, or both in one half dtype,
        read as they are (float32 accumulation of exact products): the gradient
        formed is the one normed and summed, so its rounding needs no bound.
        """
        am, gm = dot_operands(eqn, pos, a, g)
        kn = contract(am, gm, (((0,), (0,)), ((), ())), dtype)
        return kn_to_operand(eqn, pos, kn)

    def clipped_sum(self, eqn, pos, a, g, factor, keep, before, dtype, out_dtype):
        """``sum_i factor_i x_i^T g_i``, laid out as the parameter operand and rounded to
        ``out_dtype``: ONE contraction over examples and tokens, accumulated in
        ``dtype``. ``a``, ``g``: the layer's inputs and unscaled output gradients
        (clip dtype); rows of examples not in ``keep`` add exactly 0.

        In the accumulate dtype itself (``dtype == out_dtype``) the weighted ``g`` and
        the zero-filled ``x`` overwrite their operands in place. Wider (float64):
        ``factor_i g_it`` is exact there and each product with ``x_it`` rounded once,
        so the whole sum is within ``gamma_{BT} sum_i factor_i sum_t |x_t| |g_t|`` of the
        exact one. The float64 operands and result cannot be written in place, so the
        output's columns are taken in blocks of at most ``max(B T, 128)``, each
        rounded to ``out_dtype`` as soon as it is done and the next one started only
        then (``after``): the float64 result of one block, not of the layer, is
        held at a time (float32 MLP of benchmarks/clipping.py, 784-1024-1024-1024-10
        at batch 256: 10,516,240 B of compiled temp memory unblocked).
        """
        if jnp.dtype(dtype) == jnp.dtype(out_dtype):
            rows = after(keep, before)
            wg = kept_rows(weighted_examples(g, factor, dtype), rows)
            am, gm = _batch_operands(eqn, pos, kept_rows(a.astype(dtype), rows), wg)
            kn = contract_examples(am, gm, dtype)
        else:
            kn = _blocked_sum(eqn, pos, a, g, factor, keep, before, dtype, out_dtype)
        return kn_to_operand(eqn, pos, kn)


def _batch_operands(eqn, pos, x, w):
    """[B T, K] and [B T, N]: examples and tokens contracted together."""
    am, gm = jax.vmap(lambda a_, g_: dot_operands(eqn, pos, a_, g_))(x, w)
    return am.reshape(-1, am.shape[-1]), gm.reshape(-1, gm.shape[-1])


def contract_examples(x, w, dtype):
    """``x^T w``: the leading (examples and tokens) axis of both contracted, in ``dtype``."""
    return lax.dot_general(
        x, w, (((0,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=dtype
    )


def in_blocks(out, n: int, rows: int, block, axis: int, before, keep):
    """``out`` with its ``n`` entries along ``axis`` written a block at a time, for a
    wide sum over ``rows`` (examples x tokens) that holds one block at a time: blocks
    of at most ``max(rows, 128)`` entries, ``block(lo, size, done)`` giving the
    ``size`` entries from ``lo`` on from the one done just before it (``before`` for
    the first, read through ``after``), so that each is started only once the one
    before is done.

    ``block`` gets ``lo`` as an int32 scalar that XLA cannot fold (on XLA:CPU, read
    from ``keep``: ``dpmp.precision._opaque.opaque_ints``), so that the blocks'
    weightings of one size are one kernel, not one per block: GPT-2 small's private
    full fine-tuning step (12 transformer blocks whose four dense layers take 9, 3,
    12 and 3 blocks of columns, and the tied table's 197 blocks of rows) compiled
    425 of them at constant offsets (10 s of its 32 s of LLVM time, summed over
    threads) and 17 so; its whole compile took 36.3 s against 38.6 s (the least of
    three each, side by side in one process), its temporary memory and step time
    unchanged. Each block is written at its constant offset: there XLA writes the
    blocks into the result in place, but at an offset it cannot fold it copied the
    result (the float32 MLP of ``test_ghost``: 2.28x the non-private step's
    temporary memory instead of 1.53x)."""
    done, width = before, max(rows, 128)
    starts = range(0, n, width)
    for lo, at in zip(starts, opaque_ints(starts, always_true(keep)), strict=True):
        done = block(at, min(n, lo + width) - lo, done)
        # int32 start indices: under enable_x64 Python ints would be int64, which
        # a later vmap of this function (outside the scope) truncates with a warning.
        out = lax.dynamic_update_slice_in_dim(out, done, np.int32(lo), axis)
    return out


def weighted_columns(gm, lo, size: int, factor, keep, dtype):
    """Columns ``lo:lo + size`` of the output gradients ``gm [B, T, N]`` weighted by
    ``factor`` in ``dtype``, as ``[B T, size]``; rows of examples not in ``keep``
    exactly 0."""
    columns = lax.dynamic_slice_in_dim(gm, lo, size, axis=gm.ndim - 1)
    wg = kept_rows(weighted_examples(columns, factor, dtype), keep)
    return wg.reshape(gm.shape[0] * gm.shape[1], size)


def _blocked_sum(eqn, pos, a, g, factor, keep, before, dtype, out_dtype):
    """``DenseRule.clipped_sum`` accumulated in a wider ``dtype``, a block of the
    output's columns at a time (``in_blocks``), as ``[K, N]`` in ``out_dtype``."""
    am, gm = jax.vmap(lambda a_, g_: dot_operands(eqn, pos, a_, g_))(a, g)
    bt, k, n = am.shape[0] * am.shape[1], am.shape[-1], gm.shape[-1]
    x = kept_rows(am.astype(dtype), after(keep, before)).reshape(bt, k)

    def block(lo, size, done):
        wg = weighted_columns(gm, lo, size, factor, after(keep, done), dtype)
        return contract_examples(x, wg, dtype).astype(out_dtype)

    return in_blocks(jnp.zeros((k, n), out_dtype), n, bt, block, 1, before, keep)


def _tkn(eqn, pos) -> tuple[int, int, int]:
    """A dense layer's (tokens T, fan-in K, fan-out N) for one example."""
    w = eqn.invars[pos].aval.shape
    (lc, rc), _ = eqn.params["dimension_numbers"]
    a = eqn.invars[1 - pos].aval.shape
    k = math.prod(a[d] for d in (rc if pos == 0 else lc))
    return math.prod(a) // k, k, math.prod(w) // k


def dot_operands(eqn, pos, a, g):
    """One example's activation and output gradient of a dense layer as A [T, K], G [T, N].

    T are the activation's free dims (tokens), K its contracting dims in the order
    the parameter's contracting dims pair with them, N the parameter's free dims;
    the parameter's per-example gradient is ``A^T G`` laid out [K, N].
    """
    (lc, rc), _ = eqn.params["dimension_numbers"]
    ca = tuple(rc if pos == 0 else lc)
    fa = tuple(d for d in range(a.ndim) if d not in ca)
    t = math.prod(a.shape[d] for d in fa)
    k = math.prod(a.shape[d] for d in ca)
    n = g.size // max(t, 1)
    am = jnp.transpose(a, fa + ca).reshape(t, k)
    gm = g.reshape(t, n) if pos == 1 else g.reshape(n, t).T
    return am, gm


def kn_to_operand(eqn, pos, kn):
    """A dense layer's gradient as ``[K, N]`` -> laid out as its parameter operand W'
    (contracting dims cw, then its free dims, as ``dot_operands`` orders them)."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    cw = tuple(lc if pos == 0 else rc)
    w_shape = eqn.invars[pos].aval.shape
    fw = tuple(d for d in range(len(w_shape)) if d not in cw)
    kn = kn.reshape(tuple(w_shape[d] for d in cw + fw))
    return jnp.transpose(kn, np.argsort(cw + fw))
