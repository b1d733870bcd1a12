import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import dpmp

from ._hlo import fused_bodies
from ._reference import classification_batch, mlp_init, mlp_loss

N_DRAWS = 10_000_000
SIGMA = 2.5
CENTRE = 0.3  # off the grid (2^-4 at sigma 2.5), and not a float32-exact decimal


@pytest.fixture(scope="module")
def draws():
    priv = dpmp.gaussian_privatizer(stddev=SIGMA, prng_key=7, policy="bf16")
    centre = jnp.full(N_DRAWS, CENTRE, jnp.float32)
    noisy, _ = jax.jit(priv.update)(centre, priv.init(centre))
    assert noisy.dtype == jnp.float32
    return np.asarray(noisy, np.float64)


def _cell_masses(centre, sigma, grid, cells):
    """Exact Gaussian mass of each grid cell [k - 1/2, k + 1/2) * grid (scipy, float64)."""
    edges = (np.append(cells, cells[-1] + 1) - 0.5) * grid
    return np.diff(stats.norm.cdf(edges, loc=centre, scale=sigma))


def test_snapped_cells_have_the_gaussian_masses(draws):
    """Every release is a grid point; the counts per cell match the exact Gaussian
    cell masses around the float32 centre (chi-square over cells, tails pooled),
    and the same test rejects a sigma 1% off."""
    grid = dpmp.snap_grid(SIGMA)
    assert grid == 2.0**-4
    k = draws / grid
    np.testing.assert_array_equal(k, np.round(k))
    cells = np.arange(int(np.floor((-4 * SIGMA) / grid)), int(np.ceil(4.6 * SIGMA / grid)))
    observed = np.bincount((k - cells[0]).astype(np.int64).clip(0, len(cells) - 1))
    centre = float(np.float32(CENTRE))

    def pvalue(sigma):
        p = _cell_masses(centre, sigma, grid, cells)
        p[0] += stats.norm.cdf((cells[0] - 0.5) * grid, centre, sigma)
        p[-1] += stats.norm.sf((cells[-1] + 0.5) * grid, centre, sigma)
        return stats.chisquare(observed, N_DRAWS * p / p.sum()).pvalue

    assert pvalue(SIGMA) > 1e-3
    assert pvalue(1.01 * SIGMA) < 1e-6


def test_tail_probability_matches_gaussian(draws):
    z = (draws - float(np.float32(CENTRE))) / SIGMA
    p4 = 2 * stats.norm.sf(4.0)  # 6.334e-5
    observed = np.mean(np.abs(z) > 4.0)
    mc_sd = np.sqrt(p4 * (1 - p4) / N_DRAWS)
    assert abs(observed - p4) < 4 * mc_sd + 2 * stats.norm.pdf(4.0) * 2.0**-4 / SIGMA
    assert np.abs(z).max() > 5.0  # a tail bf16 noise (max ~2.9 sigma) never has


def test_bf16_normal_noise_takes_few_values_and_has_no_tail():
    """What lifting the sum to the noise dtype avoids (dpmp.noise._noise): normals
    drawn in bfloat16 take about 128 distinct values, none beyond ~2.9 sigma,
    where 2M Gaussian draws reach about 5 sigma; a bf16 sum privatized with the
    plain sampler gets float32 noise, with as many values as draws."""
    x = jax.random.normal(jax.random.key(0), (2_000_000,), jnp.bfloat16)
    x = np.asarray(x.astype(jnp.float32))
    assert len(np.unique(x)) <= 130
    assert np.abs(x).max() < 2.95
    priv = dpmp.gaussian_privatizer(stddev=1.0, policy="bf16", prng_key=0, sampler="plain")
    g = jnp.zeros(200_000, jnp.bfloat16)
    noisy, _ = priv.update(g, priv.init(g))
    assert noisy.dtype == jnp.float32
    assert len(np.unique(np.asarray(noisy))) > 190_000
    assert np.abs(np.asarray(noisy)).max() > 4.0


@pytest.mark.slow  # ~4 s on 2 cores
def test_ndtri_is_within_the_accounted_relative_error():
    """The float64 inverse normal CDF the sampler uses (``ndtri_lower``), against a
    40-digit mpmath reference from p = 2^-97 (its reach, |z| = 11.3) to 1/2, with
    its branch points on both sides (0.075; exp(-25), where sqrt(-log p) = 5; the
    quantile -8) and the uniforms' extremes: its relative error is within the
    snapped contract's ndtri_rel_error, the bound noise_residual accounts."""
    import mpmath

    from dpmp.noise._ndtri import ndtri_lower
    from dpmp.noise._snapped import CONTRACT

    rng = np.random.default_rng(0)
    exponents = rng.integers(1, 97, 1500)
    p = np.concatenate(
        [np.ldexp(rng.uniform(1, 2, 1500), -exponents - 1), rng.uniform(0.02, 0.5, 500)]
    )
    edges = [0.075, stats.norm.cdf(-8.0), 2.0**-78, 2.0**-77]
    edges = [np.nextafter(e, d) for e in edges for d in (0.0, 1.0)] + edges
    r_is_5 = np.exp(-25.0) * (1 + np.arange(-32, 33) * 2.0**-52)  # its rounded sqrt crosses 5
    p = np.concatenate([p, edges, r_is_5, [2.0**-97, 2.0**-78 * (1 + 2.0**-52), 0.5 - 2.0**-53]])
    p = np.append(p, 0.5)
    with jax.enable_x64(True):
        z = np.asarray(jax.jit(ndtri_lower)(jnp.asarray(p, jnp.float64)))
    mpmath.mp.dps = 40
    ref = np.array([float(mpmath.sqrt(2) * mpmath.erfinv(2 * mpmath.mpf(x) - 1)) for x in p])
    rel = np.abs(z - ref) / np.maximum(np.abs(ref), 1e-300)
    (core, kappa_core), (tail, kappa_tail) = CONTRACT.ndtri_rel_error
    assert rel[np.abs(ref) <= core].max() <= kappa_core
    assert rel[np.abs(ref) <= tail].max() <= kappa_tail
    assert np.abs(ref).max() > tail  # the reach covers the accounted tail
    assert z[-1] == 0.0


def test_the_samplers_log_is_within_an_ulp():
    """``ndtri_lower``'s own float64 log (fdlibm's), against NumPy's, over the
    uniforms' range and its own z (2^-97 to 12), and at its reduction's edges."""
    from dpmp.noise._ndtri import _log

    rng = np.random.default_rng(1)
    x = np.concatenate(
        [np.ldexp(rng.uniform(1, 2, 20_000), rng.integers(-97, 4, 20_000)), [1.0, 0.5, 2.0]]
    )
    x = np.append(x, [np.nextafter(np.sqrt(2.0), d) for d in (0.0, 2.0)])
    with jax.enable_x64(True):
        mine = np.asarray(jax.jit(_log)(jnp.asarray(x)))
    ref = np.log(x)
    assert np.all(np.abs(mine - ref) <= np.spacing(np.maximum(np.abs(ref), 1e-300)))


@pytest.mark.slow  # ~4 s on 2 cores
def test_half_uniform_reaches_2_to_the_minus_77_with_relative_resolution():
    """The sampler's uniform: crafted words give its extremes, its CDF matches
    u within binomial error on a log scale, and it is finer than a grid cell
    everywhere (the audit relies on every cell in reach being possible)."""
    from dpmp.noise._snapped import _half_uniform

    def uniform(words):
        with jax.enable_x64(True):
            u, neg = _half_uniform(tuple(jnp.asarray(words, jnp.uint32).reshape(4, -1)))
            return np.asarray(u), np.asarray(neg)

    u, neg = uniform([0, 0, 0, 1])  # every geometric bit zero: the floor, negative
    assert u[0] == 2.0**-78 * (1 + 2.0**-52) and neg[0]
    u, neg = uniform([0, 0, 1 << 20, 0])  # the last geometric bit: 2^-77
    assert u[0] == 2.0**-77 * (1 + 2.0**-52) and not neg[0]
    u, _ = uniform([2**32 - 1, 0, 2**20 - 1, 2**32 - 2])
    assert u[0] == 0.5 * (1 - 2.0**-53)
    bits = jax.random.bits(jax.random.key(5), (4, 200_000), jnp.uint32)
    u, neg = uniform(np.asarray(bits))
    assert u.max() < 0.5 and u.min() > 0
    for t in (0.5, 0.1, 1e-2, 1e-3, 1e-4):
        expected = 2 * t  # U is uniform on (0, 1/2]
        assert abs(np.mean(u <= t) - min(expected, 1)) < 5 * np.sqrt(expected / 2e5) + 1e-9
    assert abs(neg.mean() - 0.5) < 5 * 0.5 / np.sqrt(2e5)
    # every uniform is the midpoint of its cell of relative width 2^-51: its bits
    # below the 51 fraction bits are exactly 1 then 0
    mantissa = np.frombuffer(u.tobytes(), np.uint64) & np.uint64(2**52 - 1)
    assert np.all(mantissa & np.uint64(1) == 1)
    # neighbouring uniforms 2^-51 apart move z by far less than a grid cell (1/64)
    with jax.enable_x64(True):
        for u0 in (2.0**-77, 1e-20, 1e-5, 0.25):
            pair = jnp.asarray([u0, u0 * (1 + 2.0**-50)], jnp.float64)
            z = np.asarray(jax.scipy.special.ndtri(pair))
            assert abs(z[1] - z[0]) < 1e-10


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_the_written_out_key_table_and_split_are_jaxs():
    """The leaves' key words (``_leaf_key_words``: ``bits(fold_in(key, i), (4,),
    uint32)`` written out; a 128-bit key's ``fold_in`` data) and the step's
    ``_split`` are JAX's own, bit for bit, for Threefry and 128-bit keys; another
    key implementation takes JAX's functions."""
    from dpmp.noise import fresh_key
    from dpmp.noise._key128 import key128_impl
    from dpmp.noise._snapped import _key_words, _leaf_key_words, _split

    ids = jnp.asarray([0, 1, 2, 49, 1000, 2**32 - 1], jnp.uint32)
    keys = (jax.random.key(0), jax.random.key(2**31 - 1), jax.random.key(7, impl="rbg"))
    for key in keys:
        ref = jax.vmap(lambda i, key=key: jax.random.bits(jax.random.fold_in(key, i), (4,)))(ids)
        table = jax.jit(_leaf_key_words)(key, ids)
        np.testing.assert_array_equal(np.asarray(table), np.asarray(ref))
        words = jax.jit(_key_words)(key)
        np.testing.assert_array_equal(np.asarray(words), np.asarray(jax.random.bits(key, (4,))))
        for mine, theirs in zip(jax.jit(_split)(key), jax.random.split(key), strict=True):
            np.testing.assert_array_equal(jax.random.key_data(mine), jax.random.key_data(theirs))
    key = fresh_key()
    assert jax.random.key_impl(key) == key128_impl()
    ref = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(key, i)))(ids)
    np.testing.assert_array_equal(np.asarray(jax.jit(_leaf_key_words)(key, ids)), ref)
    np.testing.assert_array_equal(jax.jit(_key_words)(key), jax.random.key_data(key))


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_a_coordinates_noise_depends_on_its_index_alone():
    """The draw of a whole array equals the draw of any piece of it at the same
    indices, whatever the piece size: chunks (and mesh shards) change nothing."""
    from dpmp.noise import _snapped as noise

    key = jax.random.key(3)
    x = jnp.linspace(-3.0, 3.0, 50_000, dtype=jnp.float32)
    whole = np.asarray(dpmp.snapped_gaussian(key, x, 0.7))
    words = noise._key_words(key)
    index = jnp.arange(x.size, dtype=jnp.uint32)
    one_piece = np.asarray(jax.jit(noise._snap_values, static_argnums=3)(words, x, index, 0.7))
    np.testing.assert_array_equal(whole, one_piece)
    for chunk in (1_000, 4_096, 49_999):
        chunked = jax.jit(
            lambda w, x, chunk=chunk: noise._snap_flat(
                x, 0.7, noise._words_by_index(w), chunk, w[0]
            )
        )(words, x)
        np.testing.assert_array_equal(np.asarray(chunked), whole)
    for size in (16_384, 50_000):  # the form compiled for GPUs: no conditional
        pieces = jax.jit(
            lambda w, x, size=size: noise._snap_pieces(x, 0.7, noise._words_by_index(w), size)
        )(words, x)
        np.testing.assert_array_equal(np.asarray(pieces), whole)
    part = np.asarray(
        jax.jit(noise._snap_values, static_argnums=3)(words, x[777:2000], index[777:2000], 0.7)
    )
    np.testing.assert_array_equal(part, whole[777:2000])
    reshaped = np.asarray(dpmp.snapped_gaussian(key, x.reshape(250, 200), 0.7))
    np.testing.assert_array_equal(reshaped.reshape(-1), whole)


@pytest.mark.slow  # ~3 s on 2 cores
def test_the_draw_takes_its_pieces_from_the_backend_it_is_traced_for(monkeypatch):
    """Traced for XLA:CPU, a leaf is drawn in pieces of ``chunk_size`` (a loop), each
    inside a conditional; traced for any other backend, a leaf of up to
    ``SNAP_CHUNK`` coordinates is drawn in one piece, with no loop and no
    conditional, and the same values."""
    from dpmp.noise import _snapped as noise

    key = jax.random.key(3)
    x = jnp.linspace(-3.0, 3.0, 50_000, dtype=jnp.float32)

    def traced():  # a new function each time: jit's cache keeps the first trace
        text = str(jax.make_jaxpr(lambda k, x: dpmp.snapped_gaussian(k, x, 0.7))(key, x))
        loops = len(re.findall(r"= (?:while|scan)\[", text))  # fori_loop traces as a scan
        conds = len(re.findall(r"= cond\[", text))
        return loops, conds, jax.jit(lambda k, x: dpmp.snapped_gaussian(k, x, 0.7))(key, x)

    loops, conds, on_cpu = traced()
    assert noise.traced_for_cpu() and loops == 1 and conds == 2
    monkeypatch.setattr(noise, "traced_for_cpu", lambda: False)
    loops, conds, elsewhere = traced()
    assert loops == conds == 0
    np.testing.assert_array_equal(np.asarray(elsewhere), np.asarray(on_cpu))


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_small_leaves_drawn_together_get_their_own_leafs_noise():
    """A tree's small leaves are drawn as one vector (one program for all of them);
    each coordinate still gets exactly the noise of its own leaf's draw from
    ``fold_in(key, i)``, whatever the sizes, dtypes and order of the leaves."""
    from dpmp.noise import _snapped as noise

    key = jax.random.key(5)
    ramp = jnp.linspace(-2.0, 2.0, noise.GROUP_MAX + 3)  # one leaf past the group's size
    tree = {
        "a": ramp[:15].reshape(3, 5),
        "b": ramp,
        "c": ramp[:1],
        "d": ramp[:6].astype(jnp.bfloat16).reshape(2, 3),
        "e": ramp[:5000],
        "f": ramp[: noise.GROUP_MAX],
    }
    drawn = jax.jit(lambda k, t: noise._snap_tree(k, t, 0.9))(key, tree)
    leaves = jax.tree.leaves(tree)
    for i, (got, leaf) in enumerate(zip(jax.tree.leaves(drawn), leaves, strict=True)):
        own = noise.snapped_leaf(noise._key_words(jax.random.fold_in(key, i)), leaf, 0.9)
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(own))


def test_readers_of_same_shaped_small_leaves_compile_to_one_kernel():
    """Small leaves drawn together are read back at offsets XLA cannot fold: the
    compiled readers of six same-shaped leaves (the noise, then an elementwise
    update, fused) are one computation, which XLA:CPU compiles once, and not six
    that differ only in a constant offset (the GPT-2 shape's LoRA step compiled
    297 optimizer-update kernels so, and its non-private step 19)."""
    from dpmp.noise import _snapped as noise

    tree = [jnp.full((64, 8), float(i)) for i in range(6)]
    update = jax.jit(lambda k, t: [0.9 * x + 1.0 for x in noise._snap_tree(k, t, 1.0)])
    text = update.lower(jax.random.key(0), tree).compile().as_text()
    readers = fused_bodies(text, "f32[64,8]{1,0}")
    assert len(readers) == 6 and len(set(readers)) == 1


@pytest.mark.parametrize("size", [5_000, 100_000, 1_000_000, 16_777_216])
def test_noise_stage_temporary_memory_is_bounded_per_coordinate(size):
    """The compiled noise stage (privatizer update on a flat gradient sum) needs at
    most 8 bytes of temporary memory per noised coordinate, at every size (the
    whole-array draw needed 80): a loop of bounded pieces written back in place."""
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16")
    grads = jax.ShapeDtypeStruct((size,), jnp.float32)
    state = jax.eval_shape(priv.init, grads)
    compiled = jax.jit(priv.update).lower(grads, state).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 8 * size, f"{temp / size:.1f} bytes per coordinate"


@pytest.mark.slow  # ~6 s on 2 cores
def test_snapped_noise_does_not_depend_on_the_float32_lattice_of_the_input():
    """The release is grid * (n + round(f + r z)) with value / grid = n + f exact:
    shifting the input by a whole number of grid steps shifts every release by
    exactly that, at any magnitude (the float32 spacing of the input never shows)."""
    key = jax.random.key(11)
    grid = dpmp.snap_grid(1.0)
    x = jnp.full(10_000, 126 / 1024, jnp.float32)  # 2^-10 resolution: + 8192 stays exact
    base = np.asarray(dpmp.snapped_gaussian(key, x, 1.0), np.float64)
    for steps in (3, 2**12, 2**18):
        shifted = np.asarray(dpmp.snapped_gaussian(key, x + steps * grid, 1.0), np.float64)
        np.testing.assert_array_equal(shifted - base, steps * grid)
    assert np.all(np.round(base / grid) * grid == base)
    assert dpmp.snapped_gaussian(key, x, 0.0) is x


def test_bf16_gradient_does_not_pull_noise_down():
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16", sampler="plain")
    g = jnp.zeros(200_000, jnp.bfloat16)
    noisy, _ = priv.update(g, priv.init(g))
    assert noisy.dtype == jnp.float32
    assert len(np.unique(np.asarray(noisy))) > 100_000
    # what jax-privacy alone does with a bf16 gradient: noise rounded to bf16
    from jax_privacy import noise_addition

    jp = noise_addition.gaussian_privatizer(stddev=1.0, prng_key=jax.random.key(0))
    jp_noisy, _ = jp.update(g, jp.init(g))
    assert jp_noisy.dtype == jnp.bfloat16 and len(np.unique(np.asarray(jp_noisy))) < 2000


@pytest.mark.slow  # ~5 s on 2 cores
def test_noise_state_advances_and_is_reproducible():
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=3, policy="fp32")
    g = {"a": jnp.zeros(5), "b": jnp.zeros((2, 2))}
    s0 = priv.init(g)
    n1, s1 = priv.update(g, s0)
    n2, _ = priv.update(g, s1)
    again, _ = priv.update(g, s0)
    assert not np.allclose(n1["a"], n2["a"])
    np.testing.assert_array_equal(n1["a"], again["a"])


def test_without_a_key_the_noise_is_secret_and_fresh(monkeypatch):
    from . import _entropy

    g = jnp.zeros(8)
    a, b = (dpmp.gaussian_privatizer(stddev=1.0, policy="fp32") for _ in range(2))
    na, _ = a.update(g, a.init(g))
    nb, _ = b.update(g, b.init(g))
    assert not np.array_equal(na, nb)  # not derived from any fixed seed
    # the key is the OS entropy: the same entropy stream gives the same noise
    _entropy.install(monkeypatch, seed=1)
    c = dpmp.gaussian_privatizer(stddev=1.0, policy="fp32")
    _entropy.install(monkeypatch, seed=1)
    opt = dpmp.private_optimizer(
        optax.sgd(1.0),
        noise_multiplier=1.0,
        l2_clip_norm=1.0,
        expected_batch_size=1,
        policy="fp32",
    )
    nc, _ = c.update(g, c.init(g))
    updates, _ = opt.update(g, opt.init(g), g)
    np.testing.assert_array_equal(-updates, nc)  # sgd(1.0) of the noisy sum / 1


@pytest.mark.slow  # a training loop; test_private_optimizer_noise_scale_and_division stays
def test_zero_noise_infinite_clip_equals_mean_gradient_sgd():
    batch = classification_batch(64)
    params = jax.tree.map(jnp.asarray, mlp_init())
    ref_params = params
    lr, B = 0.1, 64
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=float("inf"), policy="fp32")
    opt = dpmp.private_optimizer(
        optax.sgd(lr),
        noise_multiplier=0.0,
        l2_clip_norm=float("inf"),
        expected_batch_size=B,
        prng_key=0,
        policy="fp32",
    )
    opt_state = opt.init(params)
    sgd = optax.sgd(lr)
    sgd_state = sgd.init(ref_params)
    for _ in range(3):
        out = g(params, batch)
        upd, opt_state = opt.update(out.grads, opt_state, params)
        params = optax.apply_updates(params, upd)
        ref_g = jax.grad(mlp_loss)(ref_params, batch)
        ref_upd, sgd_state = sgd.update(ref_g, sgd_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_upd)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert a.dtype == jnp.float32


@pytest.mark.slow  # ~4 s on 2 cores
def test_private_optimizer_noise_scale_and_division():
    """Noise std of the update is lr * noise_multiplier * C / B (statistical check)."""
    nm, C, B, lr = 1.5, 0.5, 100, 1.0
    opt = dpmp.private_optimizer(
        optax.sgd(lr),
        noise_multiplier=nm,
        l2_clip_norm=C,
        expected_batch_size=B,
        prng_key=1,
        policy="bf16",
    )
    params = jnp.zeros(400_000, jnp.float32)
    upd, _ = opt.update(jnp.zeros_like(params), opt.init(params), params)
    expect = lr * nm * C / B
    assert abs(float(jnp.std(upd)) - expect) < 5 * expect / np.sqrt(2 * params.size)
    assert upd.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [({"stddev": -1.0}, "stddev"), ({"stddev": "a"}, "stddev"), ({"policy": "x"}, "preset")],
)
def test_privatizer_bad_arguments(kwargs, match):
    args = {"stddev": 1.0, "prng_key": 0, "policy": "bf16", **kwargs}
    with pytest.raises(ValueError, match=match):
        dpmp.gaussian_privatizer(**args)


def test_private_optimizer_refuses_half_precision_master_params():
    opt = dpmp.private_optimizer(
        optax.sgd(0.1),
        noise_multiplier=1.0,
        l2_clip_norm=1.0,
        expected_batch_size=8,
        prng_key=0,
        policy="bf16",
    )
    p = jnp.zeros(3, jnp.bfloat16)
    with pytest.raises(ValueError, match="master parameters"):
        opt.update(jnp.zeros(3, jnp.float32), opt.init(p), p)
    with pytest.raises(ValueError, match="expected_batch_size"):
        dpmp.private_optimizer(
            optax.sgd(0.1),
            noise_multiplier=1.0,
            l2_clip_norm=1.0,
            expected_batch_size=0,
            prng_key=0,
            policy="bf16",
        )


@pytest.mark.parametrize("sampler", ["snapped", "plain"])
def test_privatizer_is_a_drop_in_for_jax_privacys(sampler):
    """As jax-privacy's privatizer: ``init`` takes a tree of ``jax.ShapeDtypeStruct``
    (so does ``private_optimizer.init``) and ``update`` takes ``noise_state`` by
    keyword; the state has jax-privacy's layout (key, inner) for both samplers."""
    spec = {
        "w": jax.ShapeDtypeStruct((3, 2), jnp.bfloat16),
        "b": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16", sampler=sampler)
    state = priv.init(spec)
    grads = {"w": jnp.zeros((3, 2), jnp.bfloat16), "b": jnp.zeros(2)}
    noisy, new_state = priv.update(grads, noise_state=state)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(noisy))
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    opt = dpmp.private_optimizer(
        optax.sgd(0.1),
        noise_multiplier=1.0,
        l2_clip_norm=1.0,
        expected_batch_size=4,
        policy="bf16",
        prng_key=0,
        sampler=sampler,
    )
    opt_state = opt.init({"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    updates, _ = opt.update({"w": jnp.zeros(3)}, opt_state, {"w": jnp.zeros(3)})
    assert updates["w"].shape == (3,)


@pytest.mark.slow  # two compilations of a ghost step, ~10-30 s
def test_whole_private_step_needs_at_most_1_3x_the_non_private_steps_memory():
    """A 2.9M-parameter MLP, bf16 compute, batch 64, compiled (not run): the private
    step (ghost clipping, snapped noise, Adam) against the non-private one
    (``jax.grad``, Adam), arguments + outputs + temporaries. The noise drawn whole
    made it ~3.8x; in bounded pieces it adds almost nothing (measured 1.00x)."""
    widths = (784, 1024, 1024, 1024, 10)

    def init(key):
        ks = jax.random.split(key, len(widths) - 1)
        return [
            {"w": jax.random.normal(k, (a, b)) * 0.01, "b": jnp.zeros(b)}
            for k, a, b in zip(ks, widths[:-1], widths[1:])
        ]

    def loss(params, batch):
        x = batch["x"].astype(jnp.bfloat16)
        for i, layer in enumerate(params):
            x = x @ layer["w"].astype(x.dtype) + layer["b"].astype(x.dtype)
            x = jax.nn.relu(x) if i < len(params) - 1 else x
        return optax.softmax_cross_entropy_with_integer_labels(
            x.astype(jnp.float32), batch["y"]
        ).mean()

    params = jax.eval_shape(init, jax.random.key(0))
    assert 2_800_000 < sum(p.size for p in jax.tree.leaves(params)) < 3_000_000
    batch = {
        "x": jax.ShapeDtypeStruct((64, 784), jnp.float32),
        "y": jax.ShapeDtypeStruct((64,), jnp.int32),
    }
    adam = optax.adam(1e-3)
    grad_fn = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="bf16", method="ghost")
    opt = dpmp.private_optimizer(
        adam,
        noise_multiplier=1.0,
        l2_clip_norm=1.0,
        expected_batch_size=64,
        prng_key=0,
        policy="bf16",
    )

    def nonprivate(p, s, b):
        updates, s = adam.update(jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, updates), s

    def private(p, s, b):
        updates, s = opt.update(grad_fn(p, b).grads, s, p)
        return optax.apply_updates(p, updates), s

    def total(fn, o):
        m = jax.jit(fn).lower(params, jax.eval_shape(o.init, params), batch).compile()
        m = m.memory_analysis()
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    ratio = total(private, opt) / total(nonprivate, adam)
    assert ratio <= 1.3, ratio


def _same_size_tree():
    """Leaves past ``GROUP_MAX``: five of 2^17 coordinates in five shapes (their piece
    divides them), two of 70,017 (it does not), one of 90,300 alone, one of 2^17 in
    bfloat16 (a group of its own), and two small leaves."""
    ramp = jnp.linspace(-2.0, 2.0, 1 << 17)
    five = [(512, 256), (256, 512), (1 << 17,), (2, 256, 256), (64, 2048)]
    tree = {f"five{j}": (ramp * (j + 1)).reshape(s) for j, s in enumerate(five)}
    tree |= {"two0": ramp[:70_017].reshape(3, 23_339), "two1": ramp[1:70_018].reshape(23_339, 3)}
    tree |= {"one": ramp[:90_300].reshape(300, 301), "half": ramp.astype(jnp.bfloat16)}
    return tree | {"small": ramp[:15].reshape(3, 5), "tiny": ramp[:100]}


@pytest.mark.slow  # ~10 s on 2 cores: five compiled draws and four references
def test_same_sized_leaves_drawn_together_get_their_own_leafs_noise(strict_promotion):
    """On XLA:CPU the larger leaves of one size and dtype are drawn in one loop, piece
    ``c`` of each of them in one pass; every leaf still equals ``snapped_leaf`` of it
    from ``fold_in(key, i)``, bit for bit: groups of 1, 2 and 5 leaves, sizes the
    piece divides and does not, leaves of one size in different shapes, a dtype and
    sizes mixed in one tree."""
    from dpmp.noise import _snapped as noise

    key = jax.random.key(9)
    tree = _same_size_tree()
    assert [noise._same_size_piece(g, n) for g, n in ((5, 1 << 17), (2, 70_017))] == [8192, 8192]
    drawn = jax.jit(lambda k, t: noise._snap_tree(k, t, 0.6))(key, tree)
    own = jax.jit(noise.snapped_leaf, static_argnums=2)
    for i, (got, leaf) in enumerate(
        zip(jax.tree.leaves(drawn), jax.tree.leaves(tree), strict=True)
    ):
        ref = own(noise._key_words(jax.random.fold_in(key, i)), leaf.reshape(-1), 0.6)
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        np.testing.assert_array_equal(np.asarray(got).reshape(-1), np.asarray(ref))
        assert not np.array_equal(np.asarray(got), np.asarray(leaf))


def _draws(fn, *args) -> int:
    """How many times the traced ``fn(*args)`` calls the snapped draw."""
    from dpmp.noise._snapped import snapped_normal_sample

    text = str(jax.make_jaxpr(fn)(*args))
    return len(re.findall(r"name=" + snapped_normal_sample.__name__ + r"\b", text))


def test_same_sized_leaves_share_one_draw_on_cpu_only(monkeypatch):
    """Traced for XLA:CPU, the program holds one draw for each size and dtype of the
    larger leaves (one loop, no remainder piece) and one for each dtype of the
    small ones; traced for any other backend, one for each larger leaf. The
    precision audit finds each draw, in float64."""
    from dpmp.noise import _snapped as noise

    tree = jax.eval_shape(_same_size_tree)
    fn = lambda k, t: noise._snap_tree(k, t, 1.0)  # noqa: E731
    key = jax.random.key(0)
    assert noise.traced_for_cpu() and _draws(fn, key, tree) == 4 + 1
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="fp32")
    grads = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
    report = dpmp.audit_precision(priv.update, grads, priv.init(grads), policy="fp32")
    # the privatizer lifts the bfloat16 leaf to the noise dtype: it joins the five
    assert report.counts()["noise_sample"] == 3 + 1, str(report)
    assert all(f.ok and f.out_dtype == jnp.float64 for f in report.of_kind("noise_sample"))
    monkeypatch.setattr(noise, "traced_for_cpu", lambda: False)
    # a new function: the trace of the first is cached
    assert _draws(lambda k, t: noise._snap_tree(k, t, 1.0), key, tree) == 9 + 1


def test_same_sized_leaves_need_one_piece_of_temporary_memory():
    """Sixteen leaves of 2^20 coordinates drawn together: the compiled draw's
    temporary memory is the drawn piece, [16, C] float32 with 16 C within
    ``chunk_size(16 * 2^20)``, plus no more than one leaf drawn alone needs (its
    own piece, key words and loop counters); not a copy of the leaves."""
    from dpmp.noise import _snapped as noise

    def temp(count):
        tree = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * count
        fn = jax.jit(lambda k, t: noise._snap_tree(k, t, 1.0))
        return fn.lower(jax.random.key(0), tree).compile().memory_analysis().temp_size_in_bytes

    piece = 16 * noise._same_size_piece(16, 1 << 20)
    assert piece <= noise.chunk_size(16 << 20) and piece == 1 << 21
    assert temp(16) <= 4 * piece + temp(1), (temp(16), temp(1))
