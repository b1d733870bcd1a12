"""The written-out Threefry blocks against Random123's known answers and JAX's
primitive, and dpmp's 128-bit key implementation against its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmp.noise import _key128 as key128
from dpmp.noise._threefry import threefry2x32, threefry4x32, threefry4x32_rolled

# Random123 (Salmon et al. 2011), tests/kat_vectors: rounds, counter, key, output.
KAT_4X32 = [
    (13, "00000000 00000000 00000000 00000000", "00000000 00000000 00000000 00000000",
     "531c7e4f 39491ee5 2c855a92 3d6abf9a"),
    (20, "00000000 00000000 00000000 00000000", "00000000 00000000 00000000 00000000",
     "9c6ca96a e17eae66 fc10ecd4 5256a7d8"),
    (20, "ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff ffffffff ffffffff",
     "2a881696 57012287 f6c7446e a16a6732"),
    (20, "243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0 082efa98 ec4e6c89",
     "59cd1dbb b8879579 86b5d00c ac8b6d84"),
    (72, "243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0 082efa98 ec4e6c89",
     "09930adf 7f27bd55 9ed68ce1 97f803f6"),
]  # fmt: skip


def _words(text: str) -> tuple:
    return tuple(jnp.asarray([int(w, 16)], jnp.uint32) for w in text.split())


@pytest.mark.parametrize("rounds,counter,key,want", KAT_4X32)
def test_threefry4x32_gives_random123s_known_answers(rounds, counter, key, want):
    out = jax.jit(lambda k, c: threefry4x32(k, c, rounds))(_words(key), _words(counter))
    assert [f"{int(w[0]):08x}" for w in out] == want.split()


def test_threefry2x32_is_jaxs_primitive_bit_for_bit():
    """The written-out Threefry-2x32 against JAX's ``threefry2x32`` primitive on
    random keys and counters, and on Random123's vector for key and counter zero."""
    from jax.extend.random import threefry2x32_p

    rng = np.random.default_rng(2)
    for _ in range(3):
        k = jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint32))
        x = jnp.asarray(rng.integers(0, 2**32, (2, 100_000), dtype=np.uint32))
        ref = jax.jit(lambda k, x: threefry2x32_p.bind(k[0], k[1], x[0], x[1]))(k, x)
        mine = jax.jit(lambda k, x: threefry2x32(k[0], k[1], x[0], x[1]))(k, x)
        for a, b in zip(ref, mine, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    zero = jnp.zeros(1, jnp.uint32)
    out = threefry2x32(zero[0], zero[0], zero, zero)
    assert [int(w[0]) for w in out] == [0x6B200159, 0x99BA4EFE]  # Random123's kat_vectors


def _np_block(key, index: int, tag: int) -> np.ndarray:
    """One block by the written-out function on numpy scalars (no JAX program)."""
    k = tuple(np.array([w], np.uint32) for w in np.asarray(key, np.uint32))
    c = tuple(np.array([w], np.uint32) for w in (index, 0, 0, tag))
    with np.errstate(over="ignore"):
        return np.array([int(w[0]) for w in threefry4x32(k, c)], np.uint32)


def test_the_128_bit_key_derives_every_key_and_bit_by_its_definition():
    """``split``, ``fold_in`` and ``bits`` of a 128-bit key are the blocks of their
    tagged counters; children are themselves 128-bit keys of the same kind."""
    impl = key128.key128_impl()
    data = np.array([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], np.uint32)
    key = jax.random.wrap_key_data(jnp.asarray(data), impl=impl)
    children = jax.random.key_data(jax.random.split(key, 3))
    for i in range(3):
        np.testing.assert_array_equal(children[i], _np_block(data, i, key128.SPLIT))
    folded = jax.random.key_data(jax.random.fold_in(key, 77))
    np.testing.assert_array_equal(folded, _np_block(data, 77, key128.FOLD))
    bits = np.asarray(jax.random.bits(key, (6,), jnp.uint32))
    want = np.concatenate([_np_block(data, j, key128.BITS) for j in range(2)])[:6]
    np.testing.assert_array_equal(bits, want)
    # past ``ROLLED_MAX`` blocks the rounds are written out: the same definition
    n = 4 * (key128.ROLLED_MAX + 3)
    many = np.asarray(jax.random.bits(key, (n,), jnp.uint32)).reshape(-1, 4)
    for j in (0, key128.ROLLED_MAX, n // 4 - 1):
        np.testing.assert_array_equal(many[j], _np_block(data, j, key128.BITS))
    assert jax.random.key_impl(jax.random.split(key)[0]) == impl
    assert key128.is_key128(key) and not key128.is_key128(jax.random.key(0))


def test_the_128_bit_keys_normals_are_standard_normal():
    """``jax.random.normal`` through the 128-bit key's bits: a KS test accepts
    N(0, 1) and rejects N(0, 1.05^2) on 200k draws."""
    from scipy import stats

    key = jax.random.key(11, impl=key128.key128_impl())
    z = np.asarray(jax.random.normal(key, (200_000,)), np.float64)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z, "norm", args=(0, 1.05)).pvalue < 1e-6
    # 8- and 16-bit draws are cut from the same words, uniform over their range
    b8 = np.asarray(jax.random.bits(key, (100_000,), jnp.uint8))
    counts = np.bincount(b8, minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4


@pytest.mark.parametrize("rounds,counter,key,want", [v for v in KAT_4X32 if v[0] == 20])
def test_the_rolled_threefry4x32_gives_the_known_answers(rounds, counter, key, want):
    out = jax.jit(threefry4x32_rolled)(_words(key), _words(counter))
    assert [f"{int(w[0]):08x}" for w in out] == want.split()


def test_the_rolled_threefry4x32_is_the_written_out_one_bit_for_bit():
    """On random keys (scalar, as a key's words) and counters of several shapes."""
    rng = np.random.default_rng(4)
    for shape in [(), (7,), (3, 64)]:
        k = tuple(jnp.uint32(w) for w in rng.integers(0, 2**32, 4, dtype=np.uint32))
        c = tuple(jnp.asarray(rng.integers(0, 2**32, shape, dtype=np.uint32)) for _ in range(4))
        want = jax.jit(threefry4x32)(k, c)
        got = jax.jit(threefry4x32_rolled)(k, c)
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
