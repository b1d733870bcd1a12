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
from dpmp.clipping.ghost._conv import ConvRule
from tests._devices import run_on_host_devices
from tests._hlo import fused_bodies
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


@pytest.mark.slow  # ~10 s on 2 cores
@pytest.mark.parametrize(
    "kind",
    # convolutions and attention (~8-10 s each) are in the slow suite
    [
        k if k in ("dense_seq", "embedding") else pytest.param(k, marks=pytest.mark.slow)
        for k in sorted(LINEN)
    ],
)
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


@pytest.mark.slow  # ~12 s on 2 cores
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


@pytest.mark.slow  # ~8 s on 2 cores
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


@pytest.mark.slow  # ~4 s on 2 cores
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


class _ReluMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (256, 256, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def test_the_float64_sums_blocks_of_one_width_are_weighted_by_one_kernel():
    """A dense layer's float64 clipped sum is formed a block of output columns at a
    time (at most max(B T, 128) wide); each block's weighting reads its columns at an
    offset XLA cannot fold, so the 8 blocks of a 1024-wide layer compile to two
    kernels (the first block's, which waits on no other, and the seven others'), not
    8 that differ in a constant offset."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(16, 1024)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)}

    def loss(p, b):
        return jnp.mean(jnp.tanh(b["x"] @ p["w"]) ** 2)

    g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method="ghost")
    text = jax.jit(lambda p, b: g(p, b).grads).lower(params, batch).compile().as_text()
    weightings = fused_bodies(text, "f64[4,128]{1,0}")
    assert len(weightings) == 8 and len(set(weightings)) == 2


@pytest.mark.slow  # ~8 s on 2 cores
@pytest.mark.parametrize("accumulation,most", [("policy", 1.1), ("float64", 1.6)])
def test_ghost_step_needs_the_non_private_steps_memory_on_dense_layers(accumulation, most):
    """Compiled temp memory of the float32 ghost step of a ReLU MLP: within 10% of
    the non-private step's when the sums accumulate in float32 (each dense layer's
    x_i and g_i are zeroed where dropped, weighted and contracted in place, and freed
    layer by layer from the output back; weighting inside a ``cond`` per layer, whose
    branches cannot overwrite their operands, needed 1.27x here). Accumulated in
    float64 (the default) a layer's x_i are copied to float64 and its sum is formed
    a block of columns at a time: 1.53x (2.78x with the whole layer's float64 sum
    and float64 squares of x_i kept for the norms)."""
    model = _ReluMLP()
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(128, 196)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 10, size=128), jnp.int32),
    }
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]

    def loss(p, b):
        logits = model.apply({"params": p}, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    def temp_bytes(fn):
        compiled = jax.jit(fn).lower(params, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ghost = dpmp.private_grad(
        loss, l2_clip_norm=1.0, policy="f32", method="ghost", accumulation=accumulation
    )
    nonprivate = temp_bytes(jax.grad(loss))
    private = temp_bytes(lambda p, b: ghost(p, b).grads)
    assert private <= most * nonprivate, (private, nonprivate)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_a_wide_layers_float64_sum_in_ten_blocks_is_float64_clipping():
    """``w2`` with 1,200 outputs over 12 examples: its float64 clipped sum is taken
    in ten blocks of at most 128 columns; the result is float64 per-example
    clipping's."""
    params, batch = mlp_init(d_out=1200), classification_batch(12, d_out=1200)
    ref = per_example_grads_f64(mlp_loss, params, batch)
    clip = float(np.median(clipped_sum_f64(ref, 1.0)[1]))
    want, _ = clipped_sum_f64(ref, clip)
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=clip, policy="f32", method="ghost")
    rules = {r["param"]: r["rule"] for r in g.explain(params, batch)["layers"]}
    assert rules["['w2']"] == "gram", rules
    assert str(jax.make_jaxpr(g)(params, batch)).count("dynamic_update_slice") >= 10
    got = _flat(jax.jit(g)(params, batch).grads)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
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


@pytest.mark.parametrize(
    ("model", "policy"),
    [
        ("mlp", "fp16"),
        pytest.param("conv", "bf16", marks=pytest.mark.slow),
        # the other pairings repeat the same check: the slow suite runs them
        pytest.param("mlp", "bf16", marks=pytest.mark.slow),
        pytest.param("conv", "fp16", marks=pytest.mark.slow),
    ],
)
def test_ghost_half_precision_per_example_bound_and_neighbours(model, policy):
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


@pytest.mark.slow  # ~4 s on 2 cores
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


def test_a_parameter_beside_a_constant_is_planned_not_a_crash():
    """``1 + w`` (Gemma's norm offset) hands the planner an equation whose other
    input is a literal, not a variable: it is planned (or refused) like any other
    use, never a TypeError, and the clipped sum is vmap's."""

    def offset(p, b):
        h = jnp.tanh(b["x"] @ p["w"]) * (1.0 + p["s"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["v"], b["y"]).mean()

    params = {"w": jnp.ones((16, 16)) / 16, "s": jnp.zeros((16,)), "v": jnp.ones((16, 4)) / 4}
    batch = classification_batch(8)
    auto = dpmp.private_grad(offset, l2_clip_norm=1.0, policy="f32", method="auto")
    assert auto.explain(params, batch)["method"] in ("ghost", "vmap")
    out = jax.jit(auto)(params, batch)
    vm = jax.jit(dpmp.private_grad(offset, l2_clip_norm=1.0, policy="f32"))(params, batch)
    # float32 sums of 8 clipped gradients in two orders: a few ulps of their size
    np.testing.assert_allclose(_flat(out.grads), _flat(vm.grads), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~4 s on 2 cores
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


@pytest.mark.slow  # 4 forced host devices in a subprocess: ~12 s
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


# ---- adversarial inputs: tokens whose gradients cancel inside one example ----------
#
# Each problem is a layer whose ghost rule sums over several tokens (or patches, or
# ids) of one example, with a linear loss sum_t <y_t, v_t>, so that the layer's
# output gradients are exactly v. Example 0 is crafted: equal activations a on
# three tokens and output gradients (h, -h, e), so its true gradient is a e^T
# while the Gram terms are |a|^2 |h|^2. Unbounded, the Gram form reported 6.79 for
# a true norm of 10, and one such example moved the float32 sum by 4.5 C or made
# it NaN.

ADV_B, ADV_T = 8, 3


def _adv_dense():
    k, n = 8, 8  # T (K + N) < K N: the Gram rule

    def loss(p, b):
        y = b["x"].astype(p["w"].dtype) @ p["w"]
        return jnp.sum(y.astype(jnp.float32) * b["v"])

    def batch(rng, a, v0):
        x = rng.normal(size=(ADV_B, ADV_T, k)) * 0.3
        v = rng.normal(size=(ADV_B, ADV_T, n)) * 0.3
        x[0], v[0] = a, v0
        return {"x": x.astype(np.float32), "v": v.astype(np.float32)}

    params = {"w": np.random.default_rng(0).normal(size=(k, n)).astype(np.float32)}
    return loss, params, batch, k, n


def _adv_embed():
    # Two tables: T^2 <= V D takes the id-Gram rule, T^2 > V D the scatter-added rows.
    def loss(p, b):
        out = 0.0
        for name in ("gram", "rows"):
            rows = p[name][b["ids"]]
            out = out + jnp.sum(rows.astype(jnp.float32) * b[name])
        return out

    def batch(rng, a, v0):
        ids = rng.integers(0, 2, size=(ADV_B, ADV_T))
        ids[0] = 0  # one row takes all three tokens: (h, -0.6 h + w, -0.4 h - w + e) sum to e
        h, w, e = v0[0, :2], v0[0, 2:4] * 0.3, v0[2, :2]
        v = {name: rng.normal(size=(ADV_B, ADV_T, 2)) * 0.3 for name in ("gram", "rows")}
        for name in v:
            v[name][0] = np.stack([h, -0.6 * h + w, -0.4 * h - w + e]) * np.linalg.norm(a)
        return {"ids": ids.astype(np.int32), **{k: x.astype(np.float32) for k, x in v.items()}}

    params = {
        "gram": np.ones((40, 2), np.float32),  # 9 <= 80: id-Gram
        "rows": np.ones((2, 2), np.float32),  # 9 > 4: rows
    }
    return loss, params, batch, None, 2


def _adv_conv(cout=16):
    # 2x2 kernel on a 2x4 image: 3 patches of 16 inputs -> patch-Gram (16 outputs) or,
    # with 2 outputs (K N <= T (K + N)), the per-example kernel gradient
    cin = 4

    def loss(p, b):
        y = lax_conv(b["x"].astype(p["w"].dtype), p["w"])
        return jnp.sum(y.astype(jnp.float32) * b["v"])

    def batch(rng, a, v0):
        x = rng.normal(size=(ADV_B, 2, 4, cin)) * 0.3
        v = rng.normal(size=(ADV_B, 1, 3, cout)) * 0.3
        x[0] = a[:cin] / 2  # a constant image: every patch equal, |patch| = |a|
        v[0, 0] = v0[:, :cout] if v0.shape[1] >= cout else np.pad(v0, ((0, 0), (0, cout - 8)))
        return {"x": x.astype(np.float32), "v": v.astype(np.float32)}

    params = {"w": np.random.default_rng(0).normal(size=(2, 2, cin, cout)).astype(np.float32)}
    return loss, params, batch, 2 * 2 * cin, cout


def lax_conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


ADVERSARIAL = {
    "dense": _adv_dense,
    "embed": _adv_embed,
    "conv": _adv_conv,
    "conv_per_example": lambda: _adv_conv(cout=2),
}


def _crafted(problem, mags, seed=0):
    """One batch per magnitude |h| / |e|; example 0 has tokens (a, a, a) and gradients
    (h, -h, e) with |a| = 1 and |e| = 10."""
    loss, params, make, _, _ = problem
    rng = np.random.default_rng(seed)
    out = []
    for mag in mags:
        a = rng.normal(size=8)
        a /= np.linalg.norm(a)
        h, e = rng.normal(size=(2, 8))
        v0 = np.stack(
            [h * mag / np.linalg.norm(h), -h * mag / np.linalg.norm(h), e * 10 / np.linalg.norm(e)]
        )
        out.append(make(rng, a, v0))
    return loss, params, jax.tree.map(lambda *xs: np.stack(xs), *out)


def _with_and_without_example_0(loss, params, batches, *, clip, policy):
    """Per batch: the clipped sums with all examples, without example 0 and of example 0
    alone (float64 numpy), its certified norm, and the overflow count."""
    g = dpmp.private_grad(loss, l2_clip_norm=clip, policy=policy, method="ghost")
    first = jnp.arange(ADV_B) == 0

    def one(b):
        def total(pad):
            out = g(params, b, is_padding_example=pad)
            return jnp.concatenate([x.ravel() for x in jax.tree.leaves(out.grads)]), out.stats

        full, stats = total(jnp.zeros(ADV_B, bool))
        without, _ = total(first)
        alone, alone_stats = total(~first)
        return full, without, alone, alone_stats.norm_max, stats.num_nonfinite

    out = jax.jit(lambda bs: jax.lax.map(one, bs))(batches)
    full, without, alone, norm0, nonfinite = (np.asarray(x, np.float64) for x in out)
    return full, without, alone, norm0, nonfinite


# all cases: ~30 s on 2 cores
@pytest.mark.fast_cases(
    *(f"{k}-{p}" for k in ("dense", "conv_per_example") for p in ("bf16", "fp16", "fp32"))
)
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", sorted(ADVERSARIAL))
def test_ghost_bound_holds_on_cancelling_tokens(kind, policy):
    """Over |h| / |e| from 0.1 to 10^6: no NaN sum, the crafted example alone has norm
    <= C (1 + 1e-5), and removing it moves the sum by at most C (1 + 1e-5).
    (The unbounded Gram form failed all three.)"""
    C = 1.0
    problem = ADVERSARIAL[kind]()
    info = dpmp.private_grad(problem[0], l2_clip_norm=C, policy=policy, method="ghost").explain(
        problem[1], jax.tree.map(lambda x: x[0], _crafted(problem, [1.0])[2])
    )
    want = {
        "dense": {"gram"},
        "embed": {"id-gram"},
        "conv": {"patch-gram"},
        "conv_per_example": {"per-example"},
    }[kind]
    assert {r["rule"] for r in info["layers"]} == want, info
    mags = np.logspace(-1, 6, 36)
    loss, params, batches = _crafted(problem, mags)
    full, without, alone, _, nonfinite = _with_and_without_example_0(
        loss, params, batches, clip=C, policy=policy
    )
    assert np.isfinite(full).all() and np.isfinite(without).all()
    dist = np.linalg.norm(full - without, axis=1)
    own = np.linalg.norm(alone, axis=1)
    assert own.max() <= C * (1 + 1e-5), own.max()
    assert dist.max() <= C * (1 + 1e-5), dist.max()
    # Not vacuous: without cancellation (small |h|) the example is clipped to about C.
    assert own[:4].min() > 0.99 * C, own[:4]
    if policy != "fp16":  # fp16 overflows at the largest |h| (counted, contributes zero)
        assert nonfinite.max() == 0


@pytest.mark.fast_cases("dense", "conv_per_example")  # all cases: ~10 s on 2 cores
@pytest.mark.parametrize("kind", sorted(ADVERSARIAL))
def test_sum_rounding_reads_rows_and_cancellation_from_the_plan(kind):
    """A ghost layer over T = 3 rows adds 3 rows per example to its contraction, whose
    rounding is bounded by 64 times the clipped norm (the floor of ``_certified``,
    over the rounding of the magnitude it reads); a formed per-example gradient adds
    one row of its own norm. Removing the cancelling example moves the sum by at most
    ``sensitivity`` (float64 accumulation: C (1 + 2 B u + 16 u); float32: Higham's
    bound, with K = 64)."""
    C = 1.0
    problem = ADVERSARIAL[kind]()
    loss, params, batches = _crafted(problem, [1e3])
    g = dpmp.private_grad(loss, l2_clip_norm=C, policy="fp32", method="ghost")
    with pytest.raises(ValueError, match="explain"):
        g.sensitivity(batch_size=ADV_B)
    g.explain(params, jax.tree.map(lambda x: x[0], batches))
    bound = g.sensitivity_bound(batch_size=ADV_B)
    if kind == "conv_per_example":
        assert (bound["rows"], bound["cancellation"]) == (1, 1.0)
    else:
        assert bound["rows"] == ADV_T and 64.0 < bound["cancellation"] < 64.01
    u = 2.0**-24
    assert g.sensitivity(batch_size=ADV_B) == pytest.approx(1 + (16 + 2 * ADV_B) * u, rel=1e-9)
    f32 = dpmp.private_grad(
        loss, l2_clip_norm=C, policy="fp32", method="ghost", accumulation="policy"
    )
    f32.explain(params, jax.tree.map(lambda x: x[0], batches))
    rows = ADV_B * (bound["rows"] + 1)  # per coordinate, at most
    higham = rows * u / (1 - rows * u) * bound["cancellation"]
    assert f32.sensitivity(batch_size=ADV_B) == pytest.approx(
        1 + 16 * u + bound["cancellation"] * u + 2 * ADV_B * higham, rel=1e-6
    )
    full, without, _, _, _ = _with_and_without_example_0(
        loss, params, batches, clip=C, policy="fp32"
    )
    assert np.linalg.norm(full - without, axis=1).max() <= g.sensitivity(batch_size=ADV_B)


def _exact_sq_norm_dense(b, i, dtype):
    """||A_i^T V_i||_F^2 in float64 from the values the step sees (cast to ``dtype``)."""
    x = np.asarray(jnp.asarray(b["x"][i]).astype(dtype), np.float64)
    v = np.asarray(jnp.asarray(b["v"][i]).astype(dtype), np.float64)
    return np.sum(np.square(x.T @ v))


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_ghost_norm_is_never_below_the_exact_norm_in_a_random_search(policy):
    """Random cancelling examples (tokens with near-equal activations and output
    gradients of random signs summing to nearly zero, magnitudes over 12 decades):
    every certified ghost norm is at least the float64 norm (1 - 1e-5), and an
    ordinary example's is within 1e-3 of it."""
    loss, params, _, k, n = _adv_dense()
    rng = np.random.default_rng(7)
    trials = []
    for _ in range(48):
        scale = 10.0 ** rng.uniform(-6, 6)
        a = rng.normal(size=k)
        x = a + rng.normal(size=(ADV_B, ADV_T, k)) * 10.0 ** rng.uniform(-8, 0)
        h = rng.normal(size=n) * scale
        signs = rng.choice([-1.0, 1.0], size=(ADV_B, ADV_T, 1))
        signs[..., -1, :] = -signs[..., :-1, :].sum(-2)  # token signs sum to zero
        v = signs * h + rng.normal(size=(ADV_B, ADV_T, n)) * 10.0 ** rng.uniform(-8, 0)
        trials.append({"x": x.astype(np.float32), "v": v.astype(np.float32)})
    trials.append(  # ordinary examples, for the other side of the check
        {
            k_: rng.normal(size=(ADV_B, ADV_T, d)).astype(np.float32)
            for k_, d in (("x", k), ("v", n))
        }
    )
    batches = jax.tree.map(lambda *xs: np.stack(xs), *trials)
    dtype = dpmp.Policy.parse(policy).compute
    g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy=policy, method="ghost")

    def norms(b):  # each example alone: its certified norm
        def one(i):
            pad = jnp.arange(ADV_B) != i
            return g(params, b, is_padding_example=pad).stats.norm_max

        return jax.lax.map(one, jnp.arange(ADV_B))

    got = np.asarray(jax.jit(lambda bs: jax.lax.map(norms, bs))(batches), np.float64)
    exact = np.sqrt([[_exact_sq_norm_dense(b, i, dtype) for i in range(ADV_B)] for b in trials])
    assert np.isfinite(got).all()
    assert (got >= exact * (1 - 1e-5)).all(), np.min(got / exact)
    np.testing.assert_allclose(got[-1], exact[-1], rtol=1e-3)


def test_gram_rule_is_not_used_where_its_rounding_bound_is_loose():
    """(T^2 + K + N) u above 5% (float32: T above ~900) forms the per-example gradient."""

    def loss(p, b):
        return jnp.sum((b["x"] @ p["w"]) * b["v"])

    params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    rules = {}
    for t in (64, 900, 1000):
        batch = {
            "x": jax.ShapeDtypeStruct((2, t, 4096), jnp.float32),
            "v": jax.ShapeDtypeStruct((2, t, 4096), jnp.float32),
        }
        g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method="ghost")
        (row,) = g.explain(params, batch)["layers"]
        rules[t] = row["rule"]
    assert rules == {64: "gram", 900: "gram", 1000: "per-example"}


# ---- per-example convolution kernel gradients, one kernel offset at a time ----------

# (lhs shape per example, kernel shape, conv keyword arguments): each is small enough
# per example (K N <= T (K + N)) that the kernel's per-example gradient is formed.
_CONVS = {
    "same_3x3": ((6, 5, 2), (3, 3, 2, 3), dict(window_strides=(1, 1), padding="SAME")),
    "nchw_strided_dilated": (
        (2, 9, 7),
        (3, 2, 3, 2),  # OIHW
        dict(
            window_strides=(2, 1),
            padding=((1, 0), (2, 1)),
            rhs_dilation=(2, 1),
            dimension_numbers=("NCHW", "OIHW", "NCHW"),
        ),
    ),
    "transposed_1d": (
        (7, 2),
        (3, 2, 3),
        dict(window_strides=(1,), padding=((2, 1),), lhs_dilation=(2,)),
    ),
    "cropped": ((8, 6, 2), (2, 2, 2, 2), dict(window_strides=(1, 2), padding=((-1, 1), (0, 0)))),
    "patchify": ((8, 8, 3), (4, 4, 3, 2), dict(window_strides=(4, 4), padding="VALID")),
    # 8 input features x 3 > _ROW_FEATURES: one kernel offset at a time (the others,
    # with 2-3 features, take a row of offsets at once)
    "many_features": ((5, 4, 8), (3, 3, 8, 2), dict(window_strides=(1, 1), padding="SAME")),
    # one input feature: one kernel offset at a time
    "one_feature": ((6, 5, 1), (3, 3, 1, 2), dict(window_strides=(1, 1), padding="SAME")),
}


def _conv_loss(kw):
    dn = kw.get("dimension_numbers")

    def conv(x, w):
        nd = x.ndim - 2
        dims = dn or lax_dims(nd)
        rest = {k: v for k, v in kw.items() if k != "dimension_numbers"}
        return jax.lax.conv_general_dilated(x, w, dimension_numbers=dims, **rest)

    def loss(p, b):  # linear in w: the output gradient is b["v"]
        y = conv(b["x"].astype(p["w"].dtype), p["w"])
        return jnp.sum(y.astype(jnp.float32) * b["v"])

    return conv, loss


def lax_dims(nd):
    return {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC")}[nd]


def _linear_reference_f64(layer, w_shape, x, v):
    """Per-example parameter gradients in float64 from the FORWARD layer alone: the
    loss is linear in w, so entry j of example i's gradient is its loss at w = e_j."""
    with jax.enable_x64(True):
        basis = jnp.eye(int(np.prod(w_shape)), dtype=jnp.float64).reshape((-1, *w_shape))
        x64, v64 = (jnp.asarray(a[:, 0], jnp.float64) for a in (x, v))  # the batch of n
        out = jax.vmap(lambda e: jnp.sum(layer(x64, e) * v64, axis=tuple(range(1, v64.ndim))))(
            basis
        )
        return np.asarray(out).T  # [examples, K N]


def _check_per_example_route(layer, loss, w_shape, x_shape, kind, seed, rule="per-example"):
    """``private_grad(method="ghost")`` takes ``layer``'s norm by ``rule`` (by default it
    forms the per-example gradient), and its norms, clipped count and clipped sum match
    float64."""
    rng = np.random.default_rng(seed)
    n = 12
    x = rng.normal(size=(n, 1, *x_shape)).astype(np.float32)  # one input per example
    y_shape = jax.eval_shape(layer, x[0], jnp.zeros(w_shape, jnp.float32)).shape
    v = rng.normal(size=(n, *y_shape)).astype(np.float32)
    params = {"w": rng.normal(size=w_shape).astype(np.float32)}
    batch = {"x": x, "v": v}
    ref = _linear_reference_f64(layer, w_shape, x, v)  # the loss of a batch of one
    norms = np.linalg.norm(ref, axis=1)
    clip = float(np.median(norms))
    g = dpmp.private_grad(loss, l2_clip_norm=clip, policy="f32", method="ghost")
    (row,) = g.explain(params, batch)["layers"]
    assert (row["layer"], row["rule"]) == (kind, rule), row
    out = jax.jit(g)(params, batch)
    want = clipped_sum_f64({"w": ref.reshape((n, *w_shape))}, clip)[0]
    got = _flat(out.grads)
    # a Gram norm is certified: never below the exact one, above it by its rounding
    # bound (about (K + N + 2 T) u relative), which clips a little harder
    rtol = 1e-5 if rule == "per-example" else 2e-4
    assert np.linalg.norm(got - want) <= rtol * np.linalg.norm(want)
    np.testing.assert_allclose(float(out.stats.norm_max), norms.max(), rtol=rtol)
    if rule != "per-example":
        assert float(out.stats.norm_max) >= norms.max()
    assert int(out.stats.num_clipped) == int((norms > clip).sum())


@pytest.mark.fast_cases("transposed_1d")  # all cases: ~21 s on 2 cores
@pytest.mark.parametrize("case", sorted(_CONVS))
def test_per_example_conv_kernel_gradient_matches_float64(case):
    """Padding (also negative), strides, kernel and input dilation, other layouts: the
    per-example kernel gradients (norms and clipped sum) match a float64 reference."""
    x_shape, w_shape, kw = _CONVS[case]
    conv, loss = _conv_loss(kw)

    def loss_ex(p, b):
        return jax.vmap(lambda x_, v_: loss(p, {"x": x_, "v": v_}))(b["x"], b["v"]).mean()

    _check_per_example_route(conv, loss_ex, w_shape, x_shape, "conv", seed=3)


# all cases: ~16 s on 2 cores
@pytest.mark.fast_cases("cropped", "one_feature", "transposed_1d", "many_features")
@pytest.mark.parametrize("case", sorted(_CONVS))
def test_patch_gram_conv_norm_matches_float64(case, monkeypatch):
    """The same geometries with the norm from image patches (the rule's choice forced):
    the patches are the slices each kernel offset reads, in any order."""
    monkeypatch.setattr(ConvRule, "mode", lambda self, eqn, pos: "ghost")
    x_shape, w_shape, kw = _CONVS[case]
    conv, loss = _conv_loss(kw)

    def loss_ex(p, b):
        return jax.vmap(lambda x_, v_: loss(p, {"x": x_, "v": v_}))(b["x"], b["v"]).mean()

    _check_per_example_route(conv, loss_ex, w_shape, x_shape, "conv", seed=3, rule="patch-gram")


# (activation shape per example, parameter shape, layer): dense layers whose parameter
# gradient is formed per example (K N <= T (K + N)), the parameter on either side.
_DENSES = {
    "tokens": ((6, 4), (4, 3), lambda x, w: x @ w),
    "heads_in": ((5, 2, 3), (2, 3, 4), lambda x, w: jnp.einsum("...thd,hdn->...tn", x, w)),
    "heads_out": ((7, 4), (4, 2, 2), lambda x, w: jnp.einsum("...tk,khd->...thd", x, w)),
    "param_first": ((6, 4), (3, 4), lambda x, w: jnp.einsum("nk,...tk->...nt", w, x)),
}


@pytest.mark.parametrize("case", sorted(_DENSES))
def test_per_example_dense_gradient_matches_float64(case):
    """Several tokens, several contracting or free dims, the parameter as either operand:
    the per-example gradients (norms and clipped sum) match a float64 reference."""
    x_shape, w_shape, layer = _DENSES[case]

    def loss(p, b):
        return jnp.sum(layer(b["x"], p["w"]) * b["v"])

    _check_per_example_route(layer, loss, w_shape, x_shape, "dense", seed=4)


# A parameter used through a static slice (GPT-2's positions ``wpe[:T]``): each case a
# loss of x [1, T, 8] (and ids [1, T]) and the parameters' shapes; the layer sees the
# slice, whose rows are a window of the parameter.
_T = 4
_SLICED = {
    # a positional-embedding-like bias: per-example route on the [T, 8] view
    "bias": (
        lambda p, b: jnp.sum(jnp.tanh(b["x"] + p["pos"][:_T]) @ b["head"]),
        {"pos": (10, 8)},
        ("bias", "per-example"),
    ),
    # a dense kernel, a window of rows and columns: Gram route (T (K + N) < K N)
    "dense": (
        lambda p, b: jnp.sum(jnp.tanh(b["x"] @ p["w"][2:10, 1:17]) ** 2),
        {"w": (12, 20)},
        ("dense", "gram"),
    ),
    # every other row, picked by lax.dynamic_slice with literal starts, then strided
    "strided": (
        lambda p, b: jnp.sum(
            jnp.tanh(b["x"] @ jax.lax.dynamic_slice(p["w"], (1, 0), (16, 3))[::2]) ** 2
        ),
        {"w": (20, 3)},
        ("dense", "per-example"),
    ),
    # an embedding table of which only the first rows are looked up
    "embedding": (
        lambda p, b: jnp.sum(jnp.tanh(jnp.take(p["table"][:6], b["ids"], axis=0)) @ b["head"]),
        {"table": (9, 8)},
        ("embedding", "id-gram"),
    ),
}


def _clip_between(per_example):
    """A clip norm halfway between two middle distinct norms: no example sits at it."""
    u = np.unique(clipped_sum_f64(per_example, 1.0)[1])
    return float(u[len(u) // 2 - 1] + u[len(u) // 2]) / 2


def _sliced_problem(case, n=16, seed=5):
    loss, shapes, _ = _SLICED[case]
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    head = rng.normal(size=(8, 3)).astype(np.float32)
    batch = {
        "x": rng.normal(size=(n, _T, 8)).astype(np.float32),
        "y": rng.integers(0, 6, size=(n, _T)).astype(np.int32),  # the ids
    }

    def example_loss(p, b):  # the reference's batch is {"x", "y"}
        return loss(p, {"x": b["x"], "ids": b["y"], "head": jnp.asarray(head, b["x"].dtype)})

    return example_loss, params, batch


@pytest.mark.slow  # ~4 s on 2 cores
@pytest.mark.parametrize("case", sorted(_SLICED))
def test_ghost_through_a_static_slice_matches_float64_per_example_clipping(case):
    """Ghost clipping of a parameter the layer sees through a static slice: the norms,
    the clipped count and the clipped sum of float64 per-example clipping; the sum is
    exactly zero outside the window; explain() names the layer, its rule and the slice."""
    loss, params, batch = _sliced_problem(case)
    ref_grads = per_example_grads_f64(loss, params, batch)
    clip = _clip_between(ref_grads)
    want, norms = clipped_sum_f64(ref_grads, clip)
    g = dpmp.private_grad(loss, l2_clip_norm=clip, policy="f32", method="ghost")
    (row,) = g.explain(params, batch)["layers"]
    layer, rule = _SLICED[case][2]
    assert row["layer"].startswith(f"{layer} (slice [") and row["rule"] == rule, row
    out = jax.jit(g)(params, batch)
    (name,) = params
    got = np.asarray(out.grads[name], np.float64)
    rtol = 1e-5 if rule == "per-example" else 2e-4  # a Gram norm's certified rounding
    assert np.linalg.norm(got.ravel() - want) <= rtol * np.linalg.norm(want)
    np.testing.assert_allclose(float(out.stats.norm_max), norms.max(), rtol=rtol)
    assert float(out.stats.norm_max) >= norms.max() * (1 - 1e-6)
    assert int(out.stats.num_clipped) == int((norms > clip).sum()) > 0
    outside = np.all(ref_grads[name] == 0, axis=0)  # never touched by any example
    assert outside.any() and not outside.all()
    assert np.all(got[outside] == 0.0)
    vm = jax.jit(dpmp.private_grad(loss, l2_clip_norm=clip, policy="f32", method="vmap"))
    ref = np.asarray(vm(params, batch).grads[name], np.float64)
    assert np.linalg.norm(got - ref) <= rtol * np.linalg.norm(ref)


@pytest.mark.parametrize(
    "loss, message",
    [
        # two windows of one parameter, and a window and a direct use: each use's norm
        # alone is not the parameter's
        (lambda p, b: jnp.sum(b["x"] + p["pos"][:_T]) + jnp.sum(b["x"] * p["pos"][_T : 2 * _T]),
         "used 2 times"),
        (lambda p, b: jnp.sum(jnp.tanh(b["x"] + p["pos"][:_T])) + jnp.sum(p["pos"] ** 2),
         "used 2 times"),
        # a slice of a broadcast: the view repeats the parameter's entries
        (lambda p, b: jnp.sum(jnp.tanh(b["x"] + jnp.broadcast_to(p["pos"], (2, 10, 8))[1, :_T])),
         "sliced after 'broadcast_in_dim'"),
    ],
)  # fmt: skip
def test_a_slice_with_another_use_falls_back_and_ghost_refuses(loss, message):
    params = {"pos": np.random.default_rng(0).normal(size=(10, 8)).astype(np.float32)}
    batch = {"x": np.ones((4, _T, 8), np.float32), "y": np.zeros(4, np.int32)}
    auto = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method="auto")
    info = auto.explain(params, batch)
    assert info["method"] == "vmap" and "['pos']" in info["reason"], info["reason"]
    assert message in info["reason"]
    ghost = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method="ghost")
    with pytest.raises(ValueError, match=r"method='ghost': parameter \['pos'\]"):
        ghost(params, batch)


@pytest.mark.slow  # a whole tiny GPT-2, ~15 s; the sliced bias has its small cases above
def test_gpt2_positions_take_a_ghost_norm_through_their_slice():
    """A tiny GPT-2 reading 6 of its 10 positions: the learned positions wpe[:6] no
    longer stop ghost clipping (nor does its tied token embedding, see
    tests/test_ghost_tied.py). With the token embedding frozen, ghost clipping of every
    other parameter matches float64 per-example clipping, and wpe's rows past the
    sequence get exactly zero."""
    from dpmp.models.families._gpt2 import GPT2Config, gpt2_init, gpt2_model

    config = GPT2Config(vocab_size=12, n_positions=10, n_embd=8, n_layer=1, n_head=2)
    params = jax.tree.map(np.asarray, gpt2_init(config, jax.random.key(3)))
    rng = np.random.default_rng(6)
    for k in ("wpe", "h"):  # random enough that clipping bites on every layer
        params[k] = jax.tree.map(
            lambda a: a + rng.normal(0, 0.3, a.shape).astype(a.dtype), params[k]
        )
    batch = {"x": rng.integers(0, 12, size=(12, 6)).astype(np.int32), "y": np.zeros(12, np.int32)}
    model = gpt2_model(config, "f32")
    auto = dpmp.private_grad(model.loss_fn, l2_clip_norm=1.0, policy="f32", method="auto")
    reason = auto.explain(params, batch)["reason"]
    assert "times" not in reason and "wpe" not in reason, reason

    wte = params.pop("wte")
    model64 = gpt2_model(config, "param=f64,compute=f64,output=f64")

    def frozen(p, b, table):
        return model.loss_fn({**p, "wte": table}, b)

    with jax.enable_x64(True):  # per-example gradients in float64 (the tokens stay ints)
        p64, wte64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, wte))

        def one(x, y):
            b = {"x": x[None], "y": y[None]}
            return jax.grad(lambda p: model64.loss_fn({**p, "wte": wte64}, b))(p64)

        ref_grads = jax.tree.map(np.asarray, jax.vmap(one)(batch["x"], batch["y"]))
    clip = _clip_between(ref_grads)
    want, norms = clipped_sum_f64(ref_grads, clip)
    g = dpmp.private_grad(frozen, l2_clip_norm=clip, policy="f32", method="ghost")
    rows = {r["param"]: r for r in g.explain(params, batch, wte)["layers"]}
    assert rows["['wpe']['embedding']"]["layer"] == "bias (slice [6, 8] of [10, 8])"
    out = jax.jit(g)(params, batch, wte)
    got = _flat(out.grads)
    assert np.linalg.norm(got - want) <= 2e-4 * np.linalg.norm(want)
    np.testing.assert_allclose(float(out.stats.norm_max), norms.max(), rtol=2e-4)
    assert int(out.stats.num_clipped) == int((norms > clip).sum()) > 0
    assert np.all(np.asarray(out.grads["wpe"]["embedding"])[6:] == 0.0)
