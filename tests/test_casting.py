import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp

from .conftest import ALL_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_cast_tree_floating_leaves_only(dtype):
    tree = {
        "w": jnp.ones((3, 2), jnp.float32),
        "b": np.zeros((2,), np.float64),
        "labels": jnp.arange(4),
        "mask": jnp.array([True, False]),
        "key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(1),
        "step": 3,
        "name": None,
    }
    out = dpmp.cast_tree(tree, dtype)
    assert out["w"].dtype == np.dtype(dtype) and out["b"].dtype == np.dtype(dtype)
    assert out["labels"].dtype == tree["labels"].dtype
    assert out["mask"].dtype == jnp.bool_
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    assert out["raw_key"].dtype == jnp.uint32
    np.testing.assert_array_equal(out["raw_key"], tree["raw_key"])
    assert out["step"] == 3 and out["name"] is None
    # values are rounded the way a direct cast rounds them
    np.testing.assert_array_equal(
        np.asarray(out["w"], np.float64), np.asarray(tree["w"].astype(dtype), np.float64)
    )


def test_cast_tree_no_op_when_dtype_matches():
    x = jnp.ones((2,), jnp.bfloat16)
    assert dpmp.cast_tree(x, "bf16") is x
    jaxpr = jax.make_jaxpr(lambda t: dpmp.cast_tree(t, jnp.float32))(jnp.ones(3))
    assert not jaxpr.jaxpr.eqns


def test_cast_tree_rejects_bad_dtype():
    with pytest.raises(ValueError, match="allowed"):
        dpmp.cast_tree(jnp.ones(2), "bfloat")


def test_cast_tree_on_flax_nnx_state():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    half = dpmp.cast_tree(state, jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(half)} == {jnp.dtype(jnp.bfloat16)}
    y = nnx.merge(graphdef, half)(jnp.ones((1, 3), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16


def test_cast_function_inputs_and_return():
    seen = {}

    def f(x, n):
        seen["x"], seen["n"] = x.dtype, n.dtype
        return x * 2

    g = dpmp.cast_function(f, jnp.bfloat16, return_dtype=jnp.float32)
    out = g(jnp.ones(3), jnp.arange(3))
    assert seen == {"x": jnp.bfloat16, "n": jnp.arange(3).dtype}
    assert out.dtype == jnp.float32
    assert dpmp.cast_function(f, "f16")(jnp.ones(3), jnp.arange(3)).dtype == jnp.float16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_force_full_precision_sum_matches_float64(dtype):
    rng = np.random.default_rng(0)
    x64 = rng.uniform(0, 40, size=8192)
    x = jnp.asarray(x64, dtype)
    ref = np.sum(np.asarray(x, np.float64))  # exact sum of the half-precision inputs
    full = dpmp.force_full_precision(jnp.sum)(x)
    assert full.dtype == jnp.float32
    assert abs(float(full) - ref) <= 1e-6 * ref
    naive = jnp.sum(x)  # rounded to (or overflowing) the half dtype
    assert naive.dtype == np.dtype(dtype)
    assert not np.isfinite(float(naive)) or abs(float(naive) - ref) > abs(float(full) - ref)
    back = dpmp.force_full_precision(jnp.sum, return_dtype=dtype)(x)
    assert back.dtype == np.dtype(dtype)


def test_force_full_precision_softmax_in_f32():
    logits = jnp.array([[10.0, 11.0, 30.0]], jnp.float16)
    out = dpmp.force_full_precision(jax.nn.log_softmax)(logits)
    ref = jax.nn.log_softmax(np.asarray(logits, np.float64))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6)
