"""dpmp's secret PRNG keys: 128 bits, Threefry-4x32.

A typed JAX key (``jax.random.key_impl(key)`` is ``dpmp_threefry4x32``) whose
data is four uint32 words. Everything JAX does with a key works on it --
``split``, ``fold_in``, ``bits``, ``normal`` -- and each call is one
Threefry-4x32 block per 128 bits (``dpmp.noise._threefry.threefry4x32``) with
the counter ``(i, 0, 0, tag)``; the tag keeps the uses apart:

    split(key, shape)     child i is the block of (i, 0, 0, SPLIT)
    fold_in(key, d)       the block of (d, 0, 0, FOLD)
    random_bits(key, w)   word j is word j % 4 of the block of (j // 4, 0, 0, BITS)
    snapped noise         coordinate i: the block of (i, 0, 0, NOISE) under the
                          leaf's key (``dpmp.noise._snapped``)

Every derived key is a full 128-bit block: the whole run's noise and its
sampler hang on the 128 bits ``dpmp.noise.fresh_key`` reads from the OS.
A key made from an integer seed (``jax.random.key(seed, impl=...)``) is public
and reproducible, as any seeded key.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dpmp.noise._threefry import threefry4x32, threefry4x32_rolled

__all__ = ["NAME", "NOISE", "block", "is_key128", "key128_impl"]

NAME = "dpmp_threefry4x32"
NOISE, SPLIT, FOLD, BITS = 0, 1, 2, 3


# Up to this many blocks the rounds are a loop (a key's split, fold_in, a table of
# leaf keys: compiled in a fraction of the written-out rounds' time); more (bits
# for an array: ``jax.random.normal`` with such a key) are written out, fused
# with what consumes them.
ROLLED_MAX = 4096


def block(key_data: jax.Array, index: jax.Array, tag: int) -> jax.Array:
    """The Threefry-4x32 blocks of counters ``(index, 0, 0, tag)`` under the key
    words ``key_data`` (uint32[4]); uint32 of ``index.shape + (4,)``."""
    index = jnp.asarray(index, jnp.uint32)
    zero = jnp.zeros_like(index)
    rounds = threefry4x32_rolled if index.size <= ROLLED_MAX else threefry4x32
    words = rounds(tuple(key_data[w] for w in range(4)), (index, zero, zero, zero + tag))
    return jnp.stack(words, axis=-1)


def _seed(seed: jax.Array) -> jax.Array:
    """Key words from an integer seed, as JAX's Threefry seeds: its high and low
    32 bits (public: a seeded key is reproducible, never secret)."""
    seed = jnp.asarray(seed)
    if seed.dtype.itemsize == 8:
        with jax.enable_x64(True):
            low = (seed & 0xFFFFFFFF).astype(jnp.uint32)
            high = (seed >> 32).astype(jnp.uint32)
    else:
        low, high = seed.astype(jnp.uint32), jnp.zeros((), jnp.uint32)
    zero = jnp.zeros((), jnp.uint32)
    return jnp.stack([zero, zero, high, low])


def _split(key_data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    n = math.prod(shape)
    return block(key_data, jax.lax.iota(jnp.uint32, n), SPLIT).reshape(*shape, 4)


def _fold_in(key_data: jax.Array, data: jax.Array) -> jax.Array:
    return block(key_data, jnp.asarray(data, jnp.uint32), FOLD)


def _random_bits(key_data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """``bit_width``-bit words (8, 16, 32 or 64) of ``shape``: 32-bit words from
    consecutive blocks, cut to the width (8 and 16) or paired (64)."""
    n = math.prod(shape)
    per = 2 if bit_width == 64 else 1
    blocks = -(-n * per // 4)
    if blocks > 2**32:
        raise ValueError(f"random bits: {n:,} values exceed the counter's 2^32 blocks")
    words = block(key_data, jax.lax.iota(jnp.uint32, blocks), BITS).reshape(-1)
    if words.shape[0] != n * per:
        words = words[: n * per]
    if bit_width == 64:
        with jax.enable_x64(True):
            pairs = words.reshape(n, 2).astype(jnp.uint64)
            return ((pairs[:, 0] << 32) | pairs[:, 1]).reshape(shape)
    dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bit_width]
    return jax.lax.convert_element_type(words, dtype).reshape(shape)


@functools.cache
def key128_impl():
    """The PRNG implementation of dpmp's 128-bit keys (defined on first use: no
    work at import)."""
    import jax.extend as jex

    # Each function jitted, as JAX's own Threefry functions are: called eagerly (a
    # key split in Python), one dispatch rather than ~200 small ones.
    return jex.random.define_prng_impl(
        key_shape=(4,),
        seed=jax.jit(_seed),
        split=jax.jit(_split, static_argnums=1),
        random_bits=jax.jit(_random_bits, static_argnums=(1, 2)),
        fold_in=jax.jit(_fold_in),
        name=NAME,
        tag=NAME,
    )


def is_key128(key) -> bool:
    """Whether ``key`` is a typed key of this implementation."""
    if not jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        return False
    return jax.random.key_impl(key) == key128_impl()
