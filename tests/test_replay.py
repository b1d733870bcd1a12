"""The replay of a per-example function: the same values, no batch axis of 1 in reductions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmp.clipping import _replay as replay


def _unit_axis_model(x):
    """Reductions, broadcasts and size-1 broadcasting on a batch of one, as a layer
    norm and a softmax trace them."""
    m = jnp.mean(x, axis=-1, keepdims=True)  # reduce_sum, then a broadcast
    v = jnp.max(x - m, axis=1, keepdims=True)  # implicit size-1 broadcasting in sub
    return jnp.sum(jax.nn.softmax(x * v, axis=-1) * jnp.tanh(x))


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_replay_keeps_size_one_axes_out_of_reductions():
    """The replay (ghost's forward and the per-example gradients of the vmap path)
    emits reductions on squeezed operands (XLA:CPU runs them ~15x faster) and
    computes the same values and gradients as the function itself."""
    x = jax.random.normal(jax.random.key(0), (5, 1, 6, 4), jnp.float32)

    def batched(fn):
        return jax.vmap(jax.value_and_grad(fn))

    want = batched(_unit_axis_model)(x)
    got = batched(replay.replayed(_unit_axis_model))(x)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)

    reductions = ("reduce_sum", "reduce_max", "reduce_min")

    def unit_reductions(fn):
        eqns = jax.make_jaxpr(batched(fn))(x).jaxpr.eqns
        return [e for e in eqns if e.primitive.name in reductions and 1 in e.invars[0].aval.shape]

    assert unit_reductions(_unit_axis_model)  # traced as it is, it reduces over (B, 1, ...)
    assert not unit_reductions(replay.replayed(_unit_axis_model))


def test_replay_keeps_weak_types():
    """A Python scalar stays weakly typed: a bf16 product with it stays bf16, as in
    the function itself (traced as a strong float32 it would be computed in float32)."""

    def f(x, t):
        return jnp.sum(jnp.tanh(x * t))

    x = jax.random.normal(jax.random.key(0), (4, 3), jnp.bfloat16)
    want = jax.vmap(lambda xi: f(xi, 2.5))(x)
    got = jax.vmap(lambda xi: replay.replayed(f)(xi, 2.5))(x)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert replay.aval(2.5).weak_type and not replay.aval(x).weak_type


def test_replay_keeps_the_source_info():
    """Replayed equations keep their name stack and traceback (through the public
    ``jax.extend.source_info_util``): the precision audit tells a backward pass's
    equations by the ``transpose(...)`` JAX adds to it, and reports user locations."""

    def f(x):
        with jax.named_scope("layer"):
            return jnp.sum(jnp.tanh(x) * x)

    x = jnp.ones((3,), jnp.float32)
    eqns = jax.make_jaxpr(jax.grad(replay.replayed(f)))(x).jaxpr.eqns
    stacks = [str(e.source_info.name_stack) for e in eqns]
    assert any("layer" in s and "transpose(" not in s for s in stacks), stacks
    assert any("layer" in s and "transpose(" in s for s in stacks), stacks
    where = [jax.extend.source_info_util.summarize(e.source_info) for e in eqns]
    assert any("test_replay.py" in w for w in where), where
