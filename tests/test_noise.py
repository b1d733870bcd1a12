import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import dpmp

from ._reference import classification_batch, mlp_init, mlp_loss

N_DRAWS = 10_000_000


@pytest.fixture(scope="module")
def draws():
    sigma = 2.5
    priv = dpmp.gaussian_privatizer(stddev=sigma, prng_key=7, policy="bf16")
    zeros = jnp.zeros(N_DRAWS, jnp.float32)
    noisy, _ = jax.jit(priv.update)(zeros, priv.init(zeros))
    assert noisy.dtype == jnp.float32
    return np.asarray(noisy, np.float64), sigma


def test_tail_probability_matches_gaussian(draws):
    z, sigma = draws
    p4 = 2 * stats.norm.sf(4.0)  # 6.334e-5
    observed = np.mean(np.abs(z / sigma) > 4.0)
    mc_sd = np.sqrt(p4 * (1 - p4) / N_DRAWS)
    assert abs(observed - p4) < 4 * mc_sd, (observed, p4, mc_sd)
    assert np.abs(z / sigma).max() > 5.0  # a tail bf16 noise (max ~2.9 sigma) never has


def test_empirical_sigma_and_ks(draws):
    z, sigma = draws
    se = sigma / np.sqrt(2 * N_DRAWS)
    assert abs(z.std() - sigma) < 5 * se
    assert abs(z.mean()) < 5 * sigma / np.sqrt(N_DRAWS)
    sub = z[:1_000_000]
    assert stats.kstest(sub, "norm", args=(0, sigma)).pvalue > 1e-3
    # the same test rejects a sigma 2% off
    assert stats.kstest(sub, "norm", args=(0, 1.02 * sigma)).pvalue < 1e-6


def test_bf16_gradient_does_not_pull_noise_down():
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16")
    g = jnp.zeros(200_000, jnp.bfloat16)
    noisy, _ = priv.update(g, priv.init(g))
    assert noisy.dtype == jnp.float32
    assert len(np.unique(np.asarray(noisy))) > 100_000
    # what jax-privacy alone does with a bf16 gradient: noise rounded to bf16
    from jax_privacy import noise_addition

    jp = noise_addition.gaussian_privatizer(stddev=1.0, prng_key=jax.random.key(0))
    jp_noisy, _ = jp.update(g, jp.init(g))
    assert jp_noisy.dtype == jnp.bfloat16 and len(np.unique(np.asarray(jp_noisy))) < 2000


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
