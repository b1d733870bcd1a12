"""Ghost clipping: the same clipped sum as per-example gradients, without forming them."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dpmp
from tests._devices import run_on_host_devices
from tests._reference import (
    classification_batch,
    clipped_sum_f64,
    mlp_init,
    mlp_loss,
    per_example_grads_f64,
)

B = 24


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


class DenseSeq(nn.Module):
    """Dense layers on sequences: Gram form (few tokens) and outer form (many tokens)."""

    @nn.compact
    def __call__(self, x, ids):
        h = nn.Dense(32)(x)  # x [b, 3, 8]: T=3, T(K+N) < KN -> Gram
        h = nn.relu(nn.Dense(4)(h))  # K=32, N=4: T(K+N) < KN -> Gram
        h = nn.Dense(3)(h)  # K=4, N=3: KN < T(K+N) -> per-example gradient
        return h.reshape((h.shape[0], -1))


class Conv(nn.Module):
    @nn.compact
    def __call__(self, x, ids):
        img = x.reshape((x.shape[0], 6, 4, 1))
        h = nn.relu(nn.Conv(5, (3, 3))(img))
        h = nn.Conv(3, (2, 2), strides=(2, 2), padding="VALID")(h)
        # 6 positions, 27 inputs, 16 outputs: T(K+N) < KN -> Gram form on image patches
        h = nn.Conv(16, (3, 3))(h)
        return h.reshape((h.shape[0], -1))


class Embedding(nn.Module):
    @nn.compact
    def __call__(self, x, ids):
        small = nn.Embed(7, 4)(ids)  # T^2 <= V D: Gram with an equality mask
        big = nn.Embed(1000, 6)(ids)  # materialised rows
        return jnp.concatenate([small, big], -1).reshape((ids.shape[0], -1))


class NormsAttention(nn.Module):
    @nn.compact
    def __call__(self, x, ids):
        h = nn.LayerNorm()(x)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.RMSNorm()(h)
        return nn.Dense(4)(h).mean(1)


LINEN = {"dense_seq": DenseSeq, "conv": Conv, "embedding": Embedding, "norm_attn": NormsAttention}


def _linen_problem(kind, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, 3, 8)).astype(np.float32)
    ids = rng.integers(0, 7, size=(B, 5)).astype(np.int32)
    ids[0, 0] = 6  # repeated ids within an example exercise the equality mask
    y = rng.integers(0, 4, size=B).astype(np.int32)
    model = LINEN[kind]()
    params = model.init(jax.random.key(seed), x[:1], ids[:1])["params"]

    def loss(p, b):
        feats = model.apply({"params": p}, b["x"], b["ids"])
        head = jax.random.normal(jax.random.key(7), (feats.shape[-1], 4))  # fixed projection
        logits = feats @ head
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return loss, params, {"x": x, "ids": ids, "y": y}


def _both(loss, params, batch, *, clip, policy="f32", **kw):
    pad = np.zeros(B, bool)
    pad[[3, 17]] = True
    out = {}
    for method in ("vmap", "ghost"):
        g = dpmp.private_grad(loss, l2_clip_norm=clip, policy=policy, method=method, **kw)
        out[method] = jax.jit(g)(params, batch, is_padding_example=pad)
    return out["vmap"], out["ghost"]


@pytest.mark.parametrize("kind", sorted(LINEN))
def test_ghost_equals_vmap_on_linen_layers(kind):
    loss, params, batch = _linen_problem(kind)
    v, g = _both(loss, params, batch, clip=0.05)
    assert int(v.stats.num_clipped) > B // 2  # clipping is active
    ref = _flat(v.grads)
    assert np.linalg.norm(_flat(g.grads) - ref) <= 1e-5 * np.linalg.norm(ref)
    np.testing.assert_allclose(float(g.stats.norm_max), float(v.stats.norm_max), rtol=1e-5)
    assert int(g.stats.num_examples) == int(v.stats.num_examples) == B - 2
    assert int(g.stats.num_clipped) == int(v.stats.num_clipped)
    # every parameter leaf was handled by a ghost rule, none by a fallback
    info = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method="auto").explain(
        params, batch
    )
    assert info["method"] == "ghost", info["reason"]
    assert len(info["layers"]) == len(jax.tree.leaves(params))


def test_ghost_rules_cover_the_layer_kinds():
    rules = set()
    for kind in LINEN:
        loss, params, batch = _linen_problem(kind)
        info = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method="ghost").explain(
            params, batch
        )
        rules |= {(row["layer"], row["rule"]) for row in info["layers"]}
    assert rules == {
        ("dense", "gram"),
        ("dense", "per-example"),
        ("conv", "per-example"),
        ("conv", "patch-gram"),
        ("embedding", "id-gram"),
        ("bias", "per-example"),
        ("scale", "per-example"),
    }


def test_ghost_equals_vmap_on_an_nnx_model():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 3, (3,), rngs=rngs)
            self.norm = nnx.LayerNorm(3, rngs=rngs)
            self.out = nnx.Linear(3 * 8, 4, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.norm(self.conv(x[..., None])))
            return self.out(h.reshape((h.shape[0], -1)))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def loss(st, b):
        logits = nnx.merge(graphdef, st)(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(B, 8)).astype(np.float32),
        "y": rng.integers(0, 4, size=B).astype(np.int32),
    }
    v, g = _both(loss, state, batch, clip=0.1)
    ref = _flat(v.grads)
    assert np.linalg.norm(_flat(g.grads) - ref) <= 1e-5 * np.linalg.norm(ref)


def test_ghost_equals_vmap_with_an_overflowed_example():
    """A non-finite activation (an inf input feature) drops the example under both methods."""
    batch = classification_batch(B, scale=3.0)
    batch["x"][5, 2] = np.inf
    params = mlp_init()
    v, g = _both(mlp_loss, params, batch, clip=0.5)
    assert int(v.stats.num_nonfinite) == int(g.stats.num_nonfinite) == 1
    got, ref = _flat(g.grads), _flat(v.grads)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)
    # and equal to the same batch with that example marked as padding
    pad = np.zeros(B, bool)
    pad[[3, 5, 17]] = True
    clean = dict(batch, x=np.where(np.isfinite(batch["x"]), batch["x"], 0.0))
    gp = dpmp.private_grad(mlp_loss, l2_clip_norm=0.5, policy="f32", method="ghost")
    padded = jax.jit(gp)(params, clean, is_padding_example=pad)
    np.testing.assert_allclose(got, _flat(padded.grads), rtol=1e-6, atol=1e-7)


def test_ghost_equals_vmap_with_an_overflow_inside_a_per_example_layer():
    """An inf pixel overflows the convolutions, whose per-example kernel gradients are
    formed inside the backward pass: both methods drop exactly that example."""
    loss, params, batch = _linen_problem("conv")
    batch["x"][9, 1, 2] = np.inf
    v, g = _both(loss, params, batch, clip=0.05)
    assert int(v.stats.num_nonfinite) == int(g.stats.num_nonfinite) == 1
    got, ref = _flat(g.grads), _flat(v.grads)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)


def _conv_problem(n):
    loss, params, _ = _linen_problem("conv")
    rng = np.random.default_rng(1)
    batch = {
        "x": rng.normal(size=(n, 3, 8)).astype(np.float32) * 4,
        "ids": rng.integers(0, 7, size=(n, 5)).astype(np.int32),
        "y": rng.integers(0, 4, size=n).astype(np.int32),
    }
    return loss, params, batch


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ["mlp", "conv"])
def test_ghost_half_precision_per_example_bound_and_neighbours(policy, model):
    """Mixed precision inside: each example's clipped contribution has norm <= C (1 + 1e-5),
    measured by removing every example in turn (loss scale 2^6, microbatches of 32)."""
    if model == "mlp":  # Gram-norm dense layers, per-example biases
        n, C = 256, 1.0
        loss, params, batch = mlp_loss, mlp_init(), classification_batch(256, scale=4.0)
        first = "w1"
    else:  # per-example convolution kernels, a patch-Gram convolution
        n, C = 96, 0.05
        loss, params, batch = _conv_problem(n)
        first = "Conv_0"
    g = dpmp.private_grad(loss, l2_clip_norm=C, policy=policy, method="ghost", microbatch_size=32)
    ls = dpmp.StaticLossScale(2.0**6)

    def total(pad):
        out = g(params, batch, loss_scale=ls, is_padding_example=pad)
        return jnp.concatenate([x.ravel() for x in jax.tree.leaves(out.grads)])

    full = jax.jit(total)(jnp.zeros(n, bool))
    removed = jax.jit(lambda idx: jax.lax.map(lambda i: total(jnp.arange(n) == i), idx))(
        jnp.arange(n)
    )
    dist = np.linalg.norm(np.asarray(removed, np.float64) - np.asarray(full, np.float64), axis=1)
    assert dist.max() <= C * (1 + 1e-5), dist.max()
    assert dist.max() > 0.99 * C
    # the sum is float32 and close to the per-example (vmap) result in the same policy
    v = dpmp.private_grad(loss, l2_clip_norm=C, policy=policy, method="vmap")
    ref = _flat(jax.jit(lambda: v(params, batch, loss_scale=ls).grads[first])())
    out = jax.jit(lambda: g(params, batch, loss_scale=ls).grads[first])()
    assert {x.dtype for x in jax.tree.leaves(out)} == {jnp.dtype(jnp.float32)}
    got = _flat(out)
    assert np.linalg.norm(got - ref) <= 2e-2 * np.linalg.norm(ref)


def test_ghost_loss_scale_is_removed_before_the_norm():
    batch = classification_batch(64)
    params = mlp_init()
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=0.5, policy="f32", method="ghost")
    outs = [
        _flat(jax.jit(g)(params, batch, loss_scale=dpmp.StaticLossScale(s)).grads)
        for s in (1.0, 2.0**8, 2.0**15)
    ]
    for o in outs[1:]:
        assert np.linalg.norm(o - outs[0]) <= 1e-6 * np.linalg.norm(outs[0])


def test_auto_falls_back_on_tied_weights_and_ghost_refuses():
    def tied(p, b):
        h = jnp.tanh(b["x"] @ p["w"])
        logits = h @ p["w"].T @ p["v"]  # w used twice: per-layer norms would be wrong
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    params = {"w": jnp.ones((16, 16)) / 16, "v": jnp.ones((16, 4)) / 4}
    batch = classification_batch(8)
    auto = dpmp.private_grad(tied, l2_clip_norm=1.0, policy="f32", method="auto")
    info = auto.explain(params, batch)
    assert info["method"] == "vmap" and "['w']" in info["reason"] and "2 times" in info["reason"]
    out = jax.jit(auto)(params, batch)
    vm = jax.jit(dpmp.private_grad(tied, l2_clip_norm=1.0, policy="f32"))(params, batch)
    np.testing.assert_array_equal(_flat(out.grads), _flat(vm.grads))
    assert auto.resolved_method == "vmap"
    ghost = dpmp.private_grad(tied, l2_clip_norm=1.0, policy="f32", method="ghost")
    with pytest.raises(ValueError, match=r"method='ghost': parameter \['w'\]"):
        ghost(params, batch)


def test_auto_chooses_ghost_and_reports_it():
    auto = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy="bf16", method="auto")
    batch = classification_batch(8)
    assert auto.resolved_method is None
    jax.jit(auto)(mlp_init(), batch)
    assert auto.resolved_method == "ghost"
    rows = auto.explain(mlp_init(), batch)["layers"]
    assert {r["param"] for r in rows} == {"['w1']", "['b1']", "['w2']", "['b2']"}


def test_audit_understands_the_ghost_path():
    """The bf16 ghost step audits clean (norms and the example sum in float32); the same
    step with unsafe bf16 norms and sums is caught at both."""
    batch = classification_batch(32)
    params = mlp_init()
    unsafe = "bf16,clip=bf16,accumulate=bf16,unsafe=true"
    for policy, ok in (("bf16", True), (unsafe, False)):
        g = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy=policy, method="ghost")
        report = dpmp.audit_precision(
            lambda p, b, g=g: g(p, b, loss_scale=dpmp.StaticLossScale(2.0**4)).grads,
            params,
            batch,
            policy=policy,
        )
        kinds = {f.kind for f in report.findings}
        assert {"norm", "batch_reduction"} <= kinds, kinds
        assert report.ok is ok, report
        if not ok:
            assert {f.kind for f in report.findings if not f.ok} == {"norm", "batch_reduction"}


_SHARDED = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import dpmp
    from tests._reference import (
        classification_batch, clipped_sum_f64, flat, mlp_init, mlp_loss, per_example_grads_f64
    )

    assert jax.device_count() == 4, jax.devices()
    params, batch = mlp_init(), classification_batch(32)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    out = {"f64": clipped_sum_f64(per_example_grads_f64(mlp_loss, params, batch), 5.0)[0].tolist()}
    for method in ("vmap", "ghost"):
        for policy in ("fp32", "bf16"):
            g = dpmp.private_grad(mlp_loss, l2_clip_norm=5.0, policy=policy, method=method)
            out[f"{method}_{policy}_one"] = flat(jax.jit(g)(params, batch).grads).tolist()
            for mark in (True, False):  # the caller marks the params varying, or not
                def local(p, b, g=g, mark=mark):
                    p = jax.lax.pcast(p, "d", to="varying") if mark else p
                    s = g(p, b)
                    return jax.lax.psum((s.grads, s.stats.num_clipped), "d")
                f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
                grads, clipped = jax.jit(f)(params, batch)
                out[f"{method}_{policy}_{mark}"] = flat(grads).tolist()
                out[f"{method}_{policy}_{mark}_clipped"] = int(clipped)
    print("JSON" + json.dumps(out))
    """
)


def test_ghost_and_vmap_inside_shard_map(tmp_path):
    """On 4 devices, each clipping its quarter of the batch, the psum of the clipped
    sums is the clipped sum of the whole batch (float64 reference), whether or not
    the caller marked the replicated params as varying: dpmp never lets JAX
    all-reduce per-example gradients before they are clipped."""
    out = run_on_host_devices(tmp_path, "sharded.py", _SHARDED)
    ref = np.asarray(out["f64"])
    per_example = per_example_grads_f64(mlp_loss, mlp_init(), classification_batch(32))
    _, norms = clipped_sum_f64(per_example, 5.0)
    assert 0 < (norms > 5.0).sum() < 32  # clipping is active for some, not all
    for method in ("vmap", "ghost"):
        for mark in (True, False):
            got = np.asarray(out[f"{method}_fp32_{mark}"])
            assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref), (method, mark)
            assert out[f"{method}_fp32_{mark}_clipped"] == (norms > 5.0).sum()
            # bf16: the same per-example work as on one device, summed in another order.
            one = np.asarray(out[f"{method}_bf16_one"])
            got = np.asarray(out[f"{method}_bf16_{mark}"])
            assert np.linalg.norm(got - one) <= 1e-5 * np.linalg.norm(one), (method, mark)
