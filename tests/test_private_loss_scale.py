import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dpmp

from .test_clipping import overflowing, run


def test_released_count_is_count_plus_gaussian_noise():
    ls = dpmp.PrivateDynamicLossScale(2.0**10, prng_key=0, count_noise_stddev=4.0, period=10**6)

    def step(ls, count):
        return ls.adjust_private(count)

    noised = []
    step = jax.jit(step)
    for _ in range(2000):
        ls, n = step(ls, jnp.int32(7))
        noised.append(float(n))
    noise = np.array(noised) - 7
    assert stats.kstest(noise, "norm", args=(0, 4.0)).pvalue > 1e-3
    assert stats.kstest(noise, "norm", args=(0, 5.0)).pvalue < 1e-3


def test_backs_off_on_many_overflows_and_grows_when_clean():
    ls = dpmp.PrivateDynamicLossScale(
        2.0**10, prng_key=1, count_noise_stddev=1.0, period=3, min_scale=2.0**5
    )
    adjust = jax.jit(lambda s, c: s.adjust_private(c)[0])
    down = adjust(ls, jnp.int32(50))  # 50 overflows >> threshold 3
    assert float(down.loss_scale) == 2.0**9
    up = ls
    for _ in range(3):
        up = adjust(up, jnp.int32(0))
    assert float(up.loss_scale) == 2.0**11
    for _ in range(20):
        down = adjust(down, jnp.int32(50))
    assert float(down.loss_scale) == 2.0**5  # clamped at min_scale
    assert down.loss_scale.dtype == jnp.float32


def test_static_fields_survive_jit_and_key_advances():
    ls = dpmp.PrivateDynamicLossScale(8.0, prng_key=2, count_noise_stddev=3.0, threshold=5.0)
    out = jax.jit(lambda s: s.adjust_private(0)[0])(ls)
    assert (out.count_noise_stddev, out.threshold, out.period) == (3.0, 5.0, 200)
    assert not np.array_equal(jax.random.key_data(out.prng_key), jax.random.key_data(ls.prng_key))
    assert dpmp.PrivateDynamicLossScale(8.0, prng_key=2).threshold == 24.0
    with pytest.raises(ValueError, match="count_noise_stddev"):
        dpmp.PrivateDynamicLossScale(8.0, prng_key=0, count_noise_stddev=0.0)


@pytest.mark.slow  # ~4 s on 2 cores
def test_without_a_key_the_count_noise_is_secret():
    a, b = dpmp.PrivateDynamicLossScale(8.0), dpmp.PrivateDynamicLossScale(8.0)
    assert not np.array_equal(jax.random.key_data(a.prng_key), jax.random.key_data(b.prng_key))
    # One noised count on the grid of stddev/32 matches another's with probability ~1%;
    # eight in a row, ~1e-16.
    counts = []
    for scale in (a, b):
        drawn = []
        for _ in range(8):
            scale, noised = scale.adjust_private(0)
            drawn.append(float(noised))
        counts.append(drawn)
    assert counts[0] != counts[1]


@pytest.mark.slow  # ~5 s on 2 cores
def test_private_grad_releases_a_noised_count_and_adjusts():
    params, batch = overflowing(32, 3)
    ls = dpmp.PrivateDynamicLossScale(2.0**8, prng_key=0, count_noise_stddev=0.1, threshold=0.5)
    # per-example gradients: the example's fp16 w1 gradient is what overflows
    out = run("fp16", batch, params, loss_scale=ls, method="vmap")
    assert int(out.stats.num_nonfinite) == 1
    assert abs(float(out.stats.noised_overflow_count) - 1.0) < 1.0  # 1 + N(0, 0.1^2)
    assert float(out.loss_scale.loss_scale) == 2.0**7  # backed off
    # a static scale releases nothing
    assert np.isnan(float(run("fp16", batch, params).stats.noised_overflow_count))
