"""Secret randomness: keys and seeds come from os.urandom, every bit of them."""

import jax
import numpy as np
import pytest

from dpmp.noise import _entropy as entropy
from dpmp.noise._key128 import key128_impl

from ._entropy import install


def test_fresh_key_is_the_entropy_bytes(monkeypatch):
    fake = install(monkeypatch, seed=5)
    key = entropy.fresh_key()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(key))
    # dpmp's key: four uint32 words, 128 bits, all from the stream
    want = np.frombuffer(type(fake)(5)(data.nbytes), data.dtype).reshape(data.shape)
    np.testing.assert_array_equal(data, want)
    assert data.nbytes == 16 and fake.calls == 1
    assert jax.random.key_impl(key) == key128_impl()


def test_fresh_keys_and_seeds_differ_and_use_all_their_bits():
    keys = np.array([np.asarray(jax.random.key_data(entropy.fresh_key())) for _ in range(64)])
    assert len({k.tobytes() for k in keys}) == 64
    # all four 32-bit words vary, and their top bits are set about half of the time
    assert keys.shape == (64, 4)
    assert all(len(np.unique(keys[:, w])) == 64 for w in range(keys.shape[1]))
    top = (keys >> 31) & 1
    assert 0.2 < top.mean() < 0.8
    seeds = [entropy.fresh_seed() for _ in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**128 for s in seeds)
    assert max(seeds) >= 2**120  # 128-bit seeds, not 32-bit ones


def test_key_from():
    a, b = entropy.key_from(None), entropy.key_from(None)
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))
    np.testing.assert_array_equal(
        jax.random.key_data(entropy.key_from(3)), jax.random.key_data(jax.random.key(3))
    )
    k = jax.random.key(9)
    assert entropy.key_from(k) is k
    for raw in (np.array([1, 2], np.uint32), np.array([1, 2, 3, 4], np.uint32)):
        np.testing.assert_array_equal(jax.random.key_data(entropy.key_from(raw)), raw)
    assert jax.random.key_impl(entropy.key_from(raw)) == key128_impl()
    with pytest.raises(TypeError, match="prng_key"):
        entropy.key_from(True)
