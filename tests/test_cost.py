"""The modelled cost behind method="auto": the method per device, and the reason."""

import jax
import jax.numpy as jnp
import pytest

import dpmp
from dpmp.clipping._cost import modelled_choice
from dpmp.clipping.ghost import plan_ghost
from dpmp.clipping.ghost._operands import operands


def _loss(p, b):
    return jnp.sum((b["x"] @ p["w"]).astype(jnp.float32) * b["v"])


def _plan(tokens, k=256, n=256, dtype=jnp.bfloat16):
    params = {"w": jax.ShapeDtypeStruct((k, n), dtype)}
    example = {
        "x": jax.ShapeDtypeStruct((tokens, k), dtype),
        "v": jax.ShapeDtypeStruct((tokens, n), jnp.float32),
    }
    return plan_ghost(lambda p, o, e: _loss(p, e), params, {}, (example,))


def _choice(plan, platform, batch=32, **kw):
    with operands("float32" if platform == "cpu" else "half"):
        return modelled_choice(
            plan,
            batch,
            grad_dtype=jnp.bfloat16,
            clip_dtype=jnp.float32,
            acc_dtype=jnp.float64,
            platform=platform,
            memory=kw.pop("memory", 0),
        )


def test_a_transformer_layer_takes_ghost_on_gpu_and_cpu():
    """128 tokens, 256 -> 1024 (the byte LM's MLP layer of benchmarks/transformers.py;
    on an H100 its ghost gradient took 1.6 ms over the non-private one, vmap's 2.7 ms;
    on 2 CPU cores ghost clipping was the faster too)."""
    plan = _plan(128, 256, 1024)
    method, reason = _choice(plan, "gpu")
    assert method == "ghost"
    assert "on gpu" in reason and "vmap's per-example products in bf16" in reason, reason
    method, reason = _choice(plan, "cpu")
    assert method == "ghost"
    assert "on cpu" in reason and "emulated" in reason and "per-example products" in reason


def test_a_single_example_takes_vmap_on_gpu():
    """With one example the ghost layer's fixed extra operations (kernel launches) cost
    more on a GPU than its one per-example product."""
    method, reason = _choice(_plan(128, 256, 1024), "gpu", batch=1)
    assert method == "vmap"
    assert "ghost's extra operations per layer" in reason, reason


def test_one_token_layers_take_ghost_everywhere():
    """An MLP layer (one token): per-example gradients write K N numbers per example,
    ghost clipping K + N (on an H200 the bf16 MLP's ghost step took 0.39x vmap's)."""
    plan = _plan(1, 1024, 1024)
    for platform in ("cpu", "gpu", "tpu"):
        method, reason = _choice(plan, platform, batch=256)
        assert method == "ghost", (platform, reason)
        assert "per-example gradients in memory" in reason


def test_per_example_gradients_too_large_for_the_device_take_ghost():
    plan = _plan(128, 256, 1024)
    assert _choice(plan, "gpu", batch=1, memory=2**32)[0] == "vmap"  # 0.5 MiB of 4 GiB
    assert _choice(plan, "gpu", batch=1, memory=2**20)[0] == "ghost"  # 0.5 MiB of 1 MiB
    method, reason = _choice(plan, "gpu", batch=1024, memory=2**32)  # 0.5 GiB of 4
    assert reason.startswith("modelled cost"), reason
    method, reason = _choice(plan, "gpu", batch=1024, memory=2**30)
    assert method == "ghost"
    assert "0.5 GiB" in reason and "quarter of the device's 1 GiB" in reason


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's choice")
def test_auto_says_why_it_chose_ghost_on_this_cpu():
    batch = {
        "x": jax.ShapeDtypeStruct((8, 16, 32), jnp.float32),
        "v": jax.ShapeDtypeStruct((8, 16, 32), jnp.float32),
    }
    g = dpmp.private_grad(_loss, l2_clip_norm=1.0, policy="bf16", method="auto")
    info = g.explain({"w": jax.ShapeDtypeStruct((32, 32), jnp.float32)}, batch)
    assert info["method"] == "ghost"
    assert info["reason"].startswith("ghost: modelled cost on cpu: ghost clipping ")


def test_a_tied_table_counts_once_in_the_per_example_memory():
    """An embedding table that is also the output projection: one gradient per example."""
    v, d, t = 1000, 64, 8

    def loss(p, e):
        h = jnp.take(p["wte"], e["x"], axis=0)
        return jnp.sum((h @ p["wte"].T).astype(jnp.float32))

    params = {"wte": jax.ShapeDtypeStruct((v, d), jnp.float32)}
    example = {"x": jax.ShapeDtypeStruct((t,), jnp.int32)}
    plan = plan_ghost(lambda p, o, e: loss(p, e), params, {}, (example,))
    assert len(plan.taps) == 2
    method, reason = _choice(plan, "gpu", batch=4096, memory=2**30)  # bf16: 0.49 GiB
    assert method == "ghost" and "0.488 GiB" in reason, reason
