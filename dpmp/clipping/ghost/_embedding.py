"""Embedding tables: a parameter as the operand of a row-lookup ``gather``.

One example's gradient of the table has row ``r`` equal to ``sum_{t: id_t = r}
g_t``; its squared norm is ``sum_{t,s} [id_t = id_s] <g_t, g_s>``
(``EmbeddingRule.sq_norms``), from the ids and the output gradients alone.
Any other gather of a parameter forms its per-example gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from dpmp.clipping._rounding import higham_gamma, sum_of_squares, unit_roundoff, wide
from dpmp.clipping.ghost._gram import gamma, keep, row_dot_sum
from dpmp.clipping.ghost._operands import accumulation_roundoff, contract, half_operands
from dpmp.clipping.ghost._rule import Unsupported

__all__ = ["EmbeddingRule"]


class EmbeddingRule:
    """Ghost norms of embedding lookups: the Gram form over equal ids."""

    primitives = ("gather",)
    described = "embedding"
    norm = "id-gram"  # sum over equal ids of <g_t, g_s>
    half_operands = True  # sq_norms reads bf16/fp16 output gradients as they are
    operand_grad = None  # never formed: the ids are always cheaper to keep
    clipped_sum = None  # the vjp of the lookup (a scatter-add), weighted

    def classify(self, eqn, pos, bijective, path):
        if pos != 0:
            raise Unsupported(f"parameter {path}: used as gather indices")
        if bijective and _is_embedding_gather(eqn):
            return "embedding", True
        return "gather", False

    def mode(self, eqn, pos):
        return "ghost"

    def rows(self, eqn, pos):
        return math.prod(eqn.invars[1].aval.shape)

    def magnitude_ratio(self, eqn, pos, dtype, wide_dtype):
        """``m = ||R_abs||_F``; the Gram form bounds it through row sums (``sqrt((1 -
        g_D)(1 - g_2T)) (1 - u)^4``), the table form through a scatter-add of T rows
        and a sum of V D squares in the wide dtype (``(1 - g_T) sqrt(1 - g'_{V D})
        (1 - u)^3``; ``g'`` in ``wide_dtype``). Half output gradients
        (``dpmp.clipping.ghost._operands``): ``g_D`` at their accumulation's
        roundoff, and ``(1 - u)^2`` more for the division by the loss scale."""
        u = unit_roundoff(dtype)
        vocab, dim = eqn.invars[0].aval.shape
        t = self.rows(eqn, pos)
        ids, out = eqn.invars[1].aval.dtype, eqn.outvars[0].aval.dtype
        ops = half_operands(ids, out, dtype, anywhere=True)  # the smaller ratio: either holds
        unscale = 1.0 if ops is None else (1 - u) ** 2
        if t * t <= vocab * dim:
            k_dim = keep(dim, dtype, accumulation_roundoff(ops, dtype))
            return math.sqrt(k_dim * keep(2 * t, dtype)) * (1 - u) ** 4 * unscale
        wide_keep = max(0.0, 1.0 - higham_gamma(vocab * dim, wide_dtype))
        return keep(t, dtype) * math.sqrt(wide_keep) * (1 - u) ** 3 * unscale

    def sq_norms(self, eqn, pos, a, g, dtype, wide_dtype):
        return jax.vmap(lambda i_, g_: _sq_norm_embed(eqn, i_, g_, dtype, wide_dtype))(a, g)


def _is_embedding_gather(eqn) -> bool:
    op, idx = eqn.invars
    if len(op.aval.shape) != 2:
        return False
    dn = eqn.params["dimension_numbers"]
    out_nd = len(eqn.outvars[0].aval.shape)
    return (
        tuple(dn.offset_dims) == (out_nd - 1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and not tuple(getattr(dn, "operand_batching_dims", ()))
        and tuple(eqn.params["slice_sizes"]) == (1, op.aval.shape[1])
        and idx.aval.shape[-1] == 1
    )


def _sq_norm_embed(eqn, idx, g, dtype, wide_dtype):
    """Certified squared norm of one example's embedding-table gradient, and its magnitude.

    The gradient's row ``r`` is ``sum_{t: id_t = r} g_t``. Few tokens: the Gram form
    ``sum_{t,s} [id_t = id_s] <g_t, g_s>``, which cancels like the dense one and is
    bounded the same way (``dpmp.clipping.ghost._gram.gram``; the id mask is
    exact). Many tokens: the rows themselves, each a sum of at most T vectors, so
    ``||R - R^||_F <= gamma_T ||R_abs||_F`` with ``R_abs`` the rows of ``|g_t|``. The
    magnitude ``m`` is ``||R_abs||_F`` (or its Gram bound ``sum [id_t = id_s] |g_t|
    |g_s|`` squared). ``g`` in ``dtype``, or in a half dtype: the Gram matrix then reads
    it as it is (``gamma_D`` at that accumulation's roundoff), the rows widen it.
    """
    vocab, dim = eqn.invars[0].aval.shape
    ids = idx.reshape(-1)
    t = ids.shape[0]
    gm = g.reshape(t, dim)
    mode = eqn.params["mode"]
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        valid = (ids >= 0) & (ids < vocab)
    else:
        ids = jnp.clip(ids, 0, vocab - 1)
        valid = jnp.ones_like(ids, dtype=bool)
    if t * t <= vocab * dim:
        same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]
        mask = same.astype(dtype)
        q = contract(gm, gm, (((1,), (1,)), ((), ())), dtype)
        ng = jnp.sqrt(jnp.maximum(jnp.diagonal(q), 0))
        # Row sums, then a sum of T (gamma_2T), as in gram: never one flat T^2 reduction.
        mm = row_dot_sum(mask, ng[:, None] * ng[None, :], dtype)
        g_dim = gamma(dim, dtype, gm.dtype)
        err = g_dim * mm + gamma(2 * t, dtype) * row_dot_sum(mask, jnp.abs(q), dtype)
        return row_dot_sum(mask, q, dtype) + 2 * err, jnp.sqrt(mm)
    slot = jnp.where(valid, ids, vocab)
    gm = gm.astype(dtype)  # exact
    rows = jnp.zeros((vocab, dim), dtype).at[slot].add(gm, mode="drop")
    rows_abs = jnp.zeros((vocab, dim), dtype).at[slot].add(jnp.abs(gm), mode="drop")
    # Sums of squares over the whole table: added up in the wide dtype, the norm's made
    # an upper bound of its exact value (in float32 a flat V D reduction is off by up
    # to gamma_{V D}, which for a large table bounds nothing).
    with wide(wide_dtype):
        m = jnp.sqrt(jnp.sum(jnp.square(rows_abs).astype(wide_dtype))).astype(dtype)
        norm = jnp.sqrt(sum_of_squares(rows, vocab * dim, dtype, wide_dtype)).astype(dtype)
    return jnp.square(norm * (1 + 4 * gamma(1, dtype)) + 2 * gamma(t, dtype) * m), m
