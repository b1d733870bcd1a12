"""The per-example path of ``private_grad``: ``jax.grad`` of one example under ``vmap``,
each gradient normed and clipped, the clip-weighted sum accumulated in the
accumulate dtype (float64 by default)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dpmp.clipping import _replay as replay
from dpmp.clipping._chunks import by_example_chunks
from dpmp.clipping._rounding import certified_sum_of_squares, wide
from dpmp.clipping._setup import Setup
from dpmp.clipping._weighted import clip_factors, weighted_example_sum
from dpmp.precision._stages import STAGES

__all__ = ["vmap_clipped_sum"]


def vmap_clipped_sum(setup: Setup, params, s, others, is_padding, *batch):
    """Clipped sum over one (micro)batch: the casts are fused into the reductions.

    Returns ``(sums, (norms, finite, losses))``: the sum in ``setup.acc_dtype``, and
    per example the certified norm (clip dtype), its finiteness and the float32 loss.
    """
    clip_dtype, acc_dtype = setup.clip_dtype, setup.acc_dtype
    per_example = functools.partial(_per_example, setup)
    in_axes = (None, None, None) + (0,) * len(setup.argnums)
    with jax.named_scope(STAGES["forward_backward"]):
        grads, losses = jax.vmap(per_example, in_axes=in_axes)(params, s, others, *batch)
    # Per-example gradients are B x P values. Reduced in float32, XLA:CPU keeps
    # the products it reduces (squares, weighted gradients) at that size; reduced
    # in float64 its products would be twice as large, so there the gradients are
    # read a chunk of examples at a time (``by_example_chunks``).
    widened = jnp.dtype(acc_dtype) != jnp.dtype(setup.sum_dtype)
    sq_norms = jax.vmap(functools.partial(_example_sq_norm, setup), in_axes=(0, None))
    with jax.named_scope(STAGES["norms"]):
        if jnp.dtype(setup.norm_dtype) != jnp.dtype(clip_dtype):
            sq = by_example_chunks(lambda g: (None, sq_norms(g, s)), grads)[1]
        else:
            sq = sq_norms(grads, s)
        norms, finite, keep, factor = clip_factors(sq, is_padding, setup.clip_norm, clip_dtype)
        factor = factor / s.astype(clip_dtype)

    def weighted_sums(chunk):
        g, f, k = chunk
        with wide(acc_dtype):
            sums = jax.tree.map(lambda x: weighted_example_sum(x, f, k, acc_dtype), g)
        return sums, None

    with jax.named_scope(STAGES["clipped_sum"]):
        if widened:
            sums = by_example_chunks(weighted_sums, (grads, factor, keep), acc_dtype)[0]
        else:
            sums = weighted_sums((grads, factor, keep))[0]
    return sums, (norms, finite, losses)


def _per_example(setup: Setup, params, s, others, *example):
    """Scaled gradient of one example (grad dtype) and its float32 loss."""

    def scaled_loss(p):
        # Replayed, so that XLA:CPU sees no batch axis of 1 in its reductions
        # (see dpmp.clipping._replay: 15-20x slower product-and-reduce fusions).
        loss32 = replay.replayed(setup.example_loss)(p, others, *example)
        return loss32 * s, loss32

    return jax.grad(scaled_loss, has_aux=True)(params)


def _example_sq_norm(setup: Setup, grads, s):
    """Certified squared norm (clip dtype) of ONE example's unscaled gradient: the
    scale leaves before any norm (cast up, then divide: exact for powers of two);
    the squares are added up in the norm dtype (float64 by default) and the total
    made an upper bound of its exact value before it is rounded to the clip dtype.

    A non-finite entry makes the sum of squares inf or NaN, so ``isfinite`` of it
    covers every entry without a second pass over the per-example gradients (a
    finite gradient whose squared norm overflows is dropped too: safe)."""
    clip_dtype, norm_dtype = setup.clip_dtype, setup.norm_dtype
    s_clip = s.astype(clip_dtype)
    leaves = [(g.astype(clip_dtype) / s_clip) for g in jax.tree.leaves(grads)]
    entries = sum(x.size for x in leaves)
    with wide(norm_dtype):
        sq = _global_sq_norm([x.astype(norm_dtype) for x in leaves])
        return certified_sum_of_squares(sq, entries, norm_dtype).astype(clip_dtype)


def _global_sq_norm(tree):
    """Sum of squares over all leaves, in the leaves' dtype."""
    leaves = [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)]
    return sum(leaves[1:], leaves[0])
