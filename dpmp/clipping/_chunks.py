"""Examples a chunk at a time: float64 reductions of per-example gradients in chunks,
and microbatches summed one after another."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dpmp.clipping import _replay as replay
from dpmp.clipping._rounding import wide

__all__ = ["by_example_chunks", "microbatched"]

# float64 reductions of per-example gradients: examples per chunk, at least 1/32 of
# the batch (and 2), and as many as fit in this many bytes of float64 values
_EXAMPLE_CHUNKS = 32
_CHUNK_BYTES = 2**20


def by_example_chunks(fn: Callable, xs, acc_dtype=None):
    """``fn`` over consecutive chunks of the examples (leading axis) of ``xs``, one
    chunk at a time: ``fn(chunk) -> (sums, per_example)``; the sums (a pytree, or
    None) are added up in ``acc_dtype``, the per-example values concatenated.

    A chunk holds ``B / 32`` examples (at least 2), or as many as have 1 MiB of
    float64 values if that is more: XLA:CPU materialises the float64 products it
    reduces, and this bounds them to a chunk's. Compiled temp memory against the
    same step with float32 sums, for 1, 2, 4, ..., 128 chunks: the ReLU MLP of
    tests/test_ghost.py (batch 128) 2.00, 2.01, 1.51, 1.26, 1.14, 1.08, 1.05, 1.29
    (chunks of one example lay the gradients out anew); benchmarks/clipping.py's
    CNN 1.09, then 1.003 up to 32 chunks, 1.12 from 64; its ViT 1.004 from 2; its
    MLP (2.9M parameters, batch 256) 1.13 at 16, 1.07 at 32, 1.02 at 128 chunks.
    The last chunk takes the remainder."""
    leaves = jax.tree.leaves(xs)
    b = leaves[0].shape[0]
    per_example = max(1, sum(x.size for x in leaves) // max(b, 1)) * 8
    size = max(min(b, 2), b // _EXAMPLE_CHUNKS, min(b, _CHUNK_BYTES // per_example))
    count, rest = divmod(b, size)

    def add(acc, sums):
        if acc is None or sums is None:
            return sums if acc is None else acc
        with wide(acc_dtype):
            return jax.tree.map(lambda c, x: c + x.astype(acc_dtype), acc, sums)

    def widen(sums):
        if sums is None or acc_dtype is None:
            return sums
        with wide(acc_dtype):
            return jax.tree.map(lambda x: x.astype(acc_dtype), sums)

    head = jax.tree.map(lambda x: x[: count * size], xs)
    if count == 1:
        acc, per = fn(head)
        acc = widen(acc)
    else:
        parts = jax.tree.map(lambda x: jnp.reshape(x, (count, size) + jnp.shape(x)[1:]), head)

        def body(acc, chunk):
            sums, per = fn(chunk)
            return add(acc, sums), per

        init = None
        if acc_dtype is not None:
            shapes = jax.eval_shape(lambda c: fn(c)[0], jax.tree.map(lambda x: x[0], parts))
            with wide(acc_dtype):
                init = jax.tree.map(lambda a: jnp.zeros(a.shape, acc_dtype), shapes)
            init = replay.vary_like(init, xs)
        acc, per = jax.lax.scan(body, init, parts)
        if per is not None:
            per = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), per)
    if rest:
        tail_sums, tail_per = fn(jax.tree.map(lambda x: x[count * size :], xs))
        acc = add(acc, widen(tail_sums))
        if per is not None:
            per = jax.tree.map(lambda a, t: jnp.concatenate([a, t]), per, tail_per)
    return acc, per


def microbatched(base: Callable, size: int, acc_dtype) -> Callable:
    """``base(params, s, others, is_padding, *batch)`` over consecutive microbatches of
    ``size`` examples, one at a time (``lax.scan``): the sums are carried in
    ``acc_dtype`` (float64 by default, so that microbatches add no rounding of their
    own), the per-example values concatenated back in batch order."""

    def fun(params, s, others, is_padding, *batch):
        count = is_padding.shape[0] // size

        def split(x):
            return jnp.reshape(x, (count, size) + jnp.shape(x)[1:])

        xs = (split(is_padding), tuple(jax.tree.map(split, b) for b in batch))
        with wide(acc_dtype):
            init = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype), params)
        init = replay.vary_like(init, batch)

        def body(acc, x):
            pad, part = x
            sums, aux = base(params, s, others, pad, *part)
            with wide(acc_dtype):
                acc = jax.tree.map(lambda c, x: c + x.astype(acc_dtype), acc, sums)
            return acc, aux

        total, aux = jax.lax.scan(body, init, xs)
        return total, jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), aux)

    return fun
