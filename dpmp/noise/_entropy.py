"""Secret randomness: PRNG keys and seeds from the operating system's entropy.

Whatever protects privacy in DP-SGD -- the gradient noise, the noise on a
released overflow count, which examples the Poisson sampler picks -- must be
unknown to the observer. A key derived from a public seed is not: anyone who
knows the seed and every other record can rerun the training under each
hypothesis about the remaining record, and only the true dataset reproduces the
released parameters bit for bit. So dpmp draws these from ``os.urandom``:

    fresh_key()    a 128-bit JAX PRNG key (``dpmp.noise._key128``, Threefry-4x32)
                   whose every bit comes from os.urandom, not a 32-bit seed
    fresh_seed()   a 128-bit integer seed for numpy's generators

Why 128 bits: a key is searchable when an observer can test a guess. A
coordinate whose clipped sum is known (zero for a token no private record
holds, or a padding row) shows its noise exactly, so each guess of a 64-bit
key (JAX's default Threefry-2x32) costs a few block evaluations, 2^64 in all:
feasible for a determined attacker with hardware to spare. A 128-bit key puts
the search at 2^128. Every key the run derives (each step's, each leaf's) is a
full 128-bit block of the one before, so no derived key is easier to find
than the first.

``key_from(prng_key)`` is what every public function with an optional
``prng_key`` does with it: ``None`` draws a fresh key; an int derives a key from
that (public) number, which is reproducible and therefore *not private*; a key
is used as given.

The functions read ``os.urandom`` through the module attribute ``_urandom``, so
tests can replace it with a deterministic stream.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["fresh_key", "fresh_seed", "key_from"]

_urandom = os.urandom
SEED_BITS = 128


def fresh_seed() -> int:
    """A non-negative integer of ``SEED_BITS`` bits from the OS entropy source."""
    return int.from_bytes(_urandom(SEED_BITS // 8), "little")


def fresh_key(impl: Any = None):
    """A typed JAX PRNG key filled from ``os.urandom``: of ``impl``, by default
    dpmp's 128-bit keys (``dpmp.noise._key128.key128_impl()``)."""
    import jax
    import numpy as np

    from dpmp.noise._key128 import key128_impl

    impl = key128_impl() if impl is None else impl
    shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    size = int(np.prod(shape.shape)) * shape.dtype.itemsize
    words = np.frombuffer(_urandom(size), dtype=shape.dtype).reshape(shape.shape)
    return jax.random.wrap_key_data(words, impl=impl)


def key_from(prng_key: Any):
    """``None`` -> ``fresh_key()``; an int -> ``jax.random.key(int)`` (public, reproducible);
    a typed key as is; raw ``uint32`` key data wrapped as a key: four words (the
    data of a 128-bit key) as dpmp's 128-bit key, two as JAX's Threefry."""
    import jax
    import jax.numpy as jnp

    if prng_key is None:
        return fresh_key()
    if isinstance(prng_key, bool):
        raise TypeError(f"prng_key: must be a PRNG key, an int or None, got {prng_key!r}")
    if isinstance(prng_key, int):
        return jax.random.key(prng_key)
    if jax.dtypes.issubdtype(jnp.asarray(prng_key).dtype, jax.dtypes.prng_key):
        return prng_key
    data = jnp.asarray(prng_key, jnp.uint32)
    if data.shape[-1:] == (4,):
        from dpmp.noise._key128 import key128_impl

        return jax.random.wrap_key_data(data, impl=key128_impl())
    return jax.random.wrap_key_data(data)
