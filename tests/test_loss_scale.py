import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp


def reference_sequence(finite_seq, scale, period, factor, lo, hi):
    """The dynamic loss-scale algorithm in plain Python floats (float64)."""
    counter, out = 0, []
    for finite in finite_seq:
        if finite:
            counter += 1
            if counter == period:
                scale, counter = min(scale * factor, hi), 0
        else:
            scale, counter = max(scale / factor, lo), 0
        out.append((scale, counter))
    return out


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("period,factor", [(1, 2.0), (3, 2.0), (5, 4.0)])
def test_adjust_sequence_matches_reference(jit, period, factor):
    rng = np.random.default_rng(period)
    finite_seq = rng.random(200) < 0.8
    finite_seq[:40] = True  # run into max_scale
    finite_seq[100:130] = False  # run into min_scale
    ls = dpmp.DynamicLossScale(
        2.0**4, period=period, factor=factor, min_scale=1.0, max_scale=2.0**10
    )
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    expected = reference_sequence(finite_seq, 2.0**4, period, factor, 1.0, 2.0**10)
    for finite, (exp_scale, exp_counter) in zip(finite_seq, expected):
        ls = adjust(ls, jnp.asarray(finite))
        assert ls.loss_scale.dtype == jnp.float32
        assert float(ls.loss_scale) == exp_scale
        assert int(ls.counter) == exp_counter
        assert 1.0 <= float(ls.loss_scale) <= 2.0**10
    # clamps were reached at both ends
    scales = [s for s, _ in expected]
    assert max(scales) == 2.0**10 and min(scales) == 1.0


def test_fp16_initial_scale_lives_in_f32():
    ls = dpmp.DynamicLossScale(jnp.float16(2**15), period=1)
    assert ls.loss_scale.dtype == jnp.float32
    grown = jax.jit(lambda s: s.adjust(True))(ls)
    # 2**16 is not representable in float16 (max 65504); in float32 it is exact.
    assert grown.loss_scale.dtype == jnp.float32 and float(grown.loss_scale) == 2.0**16
    assert dpmp.StaticLossScale(np.float16(1024)).loss_scale.dtype == jnp.float32


def test_static_fields_survive_jit_vmap_and_tree_map():
    ls = dpmp.DynamicLossScale(8.0, period=7, factor=3.0, min_scale=0.5, max_scale=100.0)
    fields = ("period", "factor", "min_scale", "max_scale")
    expect = (7, 3.0, 0.5, 100.0)
    through_jit = jax.jit(lambda s: s)(ls)
    assert tuple(getattr(through_jit, f) for f in fields) == expect
    batched = jax.vmap(lambda f: ls.adjust(f))(jnp.array([True, False, False]))
    assert tuple(getattr(batched, f) for f in fields) == expect
    np.testing.assert_array_equal(batched.loss_scale, np.float32([8.0, 8.0 / 3, 8.0 / 3]))
    mapped = jax.tree.map(lambda x: x, ls)
    assert tuple(getattr(mapped, f) for f in fields) == expect
    # min_scale still enforced after a trip through jit
    low = jax.jit(lambda s: s.adjust(False).adjust(False).adjust(False))(through_jit)
    assert float(low.loss_scale) == 0.5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"loss_scale": 0.0}, "loss_scale"),
        ({"loss_scale": float("inf")}, "loss_scale"),
        ({"loss_scale": np.float16(np.inf)}, "loss_scale"),  # what 2**17 becomes in fp16
        ({"loss_scale": 2.0, "period": 0}, "period"),
        ({"loss_scale": 2.0, "period": 1.5}, "period"),
        ({"loss_scale": 2.0, "factor": 1.0}, "factor"),
        ({"loss_scale": 2.0, "min_scale": 4.0, "max_scale": 2.0}, "min_scale"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpmp.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("cls", [dpmp.StaticLossScale, dpmp.DynamicLossScale])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_scale_unscale_dtypes_and_values(cls, dtype):
    ls = cls(2.0**15)
    loss = jnp.asarray(3.0, dtype)
    scaled = ls.scale(loss)
    # scaled in at least float32: 3 * 2**15 would overflow float16
    assert scaled.dtype == jnp.float32 and float(scaled) == 3.0 * 2**15
    g = {"w": jnp.asarray([2.0**14, 3.0 * 2**13], dtype), "i": jnp.arange(2)}
    un = ls.unscale(g)
    assert un["w"].dtype == jnp.float32 and un["i"].dtype == g["i"].dtype
    np.testing.assert_array_equal(un["w"], np.asarray(g["w"], np.float64) / 2**15)


def test_noop_loss_scale():
    ls = dpmp.NoOpLossScale()
    assert float(ls.loss_scale) == 1.0 and ls.loss_scale.dtype == jnp.float32
    assert ls.adjust(False) is ls
    x = jnp.ones(2, jnp.bfloat16)
    assert ls.unscale(x).dtype == jnp.float32
    assert jax.jit(lambda s: s)(ls) == ls


def test_all_finite_and_select_tree():
    good = {"a": jnp.ones(3, jnp.float16), "n": jnp.arange(2)}
    bad = {"a": jnp.array([1.0, jnp.inf, 0.0], jnp.float16), "n": jnp.arange(2)}
    nan = {"a": jnp.array([jnp.nan], jnp.bfloat16)}
    assert bool(dpmp.all_finite(good)) and not bool(dpmp.all_finite(bad))
    assert not bool(jax.jit(dpmp.all_finite)(nan))
    assert bool(dpmp.all_finite({"n": jnp.arange(3)}))
    picked = dpmp.select_tree(jnp.array(False), bad, good)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), picked, good))
    with pytest.raises(ValueError, match="structure"):
        dpmp.select_tree(jnp.array(True), good, nan)
    with pytest.raises(ValueError, match="boolean scalar"):
        dpmp.select_tree(jnp.array([True, False]), good, good)
