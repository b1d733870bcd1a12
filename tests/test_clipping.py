import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dpmp

from ._reference import (
    classification_batch,
    clipped_sum_f64,
    flat,
    mlp_init,
    mlp_loss,
    per_example_grads_f64,
)

POLICIES = {"bf16": "bf16", "fp16": "fp16"}
# relative error of a half-precision per-example gradient vs float64 (stated tolerances)
HALF_RTOL = {"bf16": 3e-2, "fp16": 4e-3}


def run(policy, batch, params=None, clip=1.0, **kw):
    params = mlp_init() if params is None else params
    loss_scale = kw.pop("loss_scale", dpmp.NoOpLossScale())
    pad = kw.pop("is_padding_example", None)
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=clip, policy=policy, **kw)
    return jax.jit(g)(params, batch, loss_scale=loss_scale, is_padding_example=pad)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
@pytest.mark.parametrize("policy", ["bf16", "fp16", "fp32"])
def test_clipped_sum_matches_float64_reference(policy):
    batch = classification_batch(64)
    out = run(policy, batch, clip=0.5, loss_scale=dpmp.StaticLossScale(2.0**8))
    ref, norms = clipped_sum_f64(per_example_grads_f64(mlp_loss, mlp_init(), batch), 0.5)
    got = flat(out.grads)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out.grads))
    rtol = HALF_RTOL.get(policy, 1e-5)
    assert np.linalg.norm(got - ref) <= rtol * np.linalg.norm(ref)
    assert int(out.stats.num_clipped) == int((norms > 0.5).sum())
    np.testing.assert_allclose(float(out.stats.norm_max), norms.max(), rtol=rtol)


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_every_clipped_per_example_gradient_within_bound(policy):
    """Each example alone (a batch of one): its clipped gradient has norm <= C (1 + 2^-20)."""
    batch = classification_batch(512, scale=4.0)
    params = mlp_init()
    C = 0.25
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=C, policy=policy)

    def single(x, y):
        return g(
            params, {"x": x[None], "y": y[None]}, loss_scale=dpmp.StaticLossScale(2.0**4)
        ).grads

    per = jax.jit(jax.vmap(single))(batch["x"], batch["y"])
    leaves = jax.tree.leaves(per)
    flat_g = np.concatenate([np.reshape(np.asarray(x, np.float64), (512, -1)) for x in leaves], 1)
    norms = np.linalg.norm(flat_g, axis=1)
    assert norms.max() <= C * (1 + 2**-20)
    # and they are clipped copies of the float64 gradients (direction preserved)
    ref = per_example_grads_f64(mlp_loss, params, batch)
    ref_flat = np.concatenate([np.reshape(x, (512, -1)) for x in jax.tree.leaves(ref)], 1)
    ref_norms = np.linalg.norm(ref_flat, axis=1)
    ref_clipped = ref_flat * np.minimum(1, C / ref_norms)[:, None]
    err = np.linalg.norm(flat_g - ref_clipped, axis=1) / np.linalg.norm(ref_clipped, axis=1)
    assert err.max() < HALF_RTOL[policy] * 2
    assert (ref_norms > C).mean() > 0.5  # clipping was active


@pytest.mark.parametrize("policy", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_neighbour_sensitivity_with_microbatches(policy):
    """1,024 examples in microbatches of 32, C = 1: removing any one example (making it
    padding) moves the pre-noise sum by at most C (1 + 1e-5) in L2."""
    n, C = 1024, 1.0
    batch = classification_batch(n, scale=4.0)
    params = mlp_init()
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=C, policy=policy, microbatch_size=32)
    ls = dpmp.StaticLossScale(2.0**6)

    def total(pad):
        return jnp.concatenate(
            [
                x.ravel()
                for x in jax.tree.leaves(
                    g(params, batch, loss_scale=ls, is_padding_example=pad).grads
                )
            ]
        )

    full = jax.jit(total)(jnp.zeros(n, bool))
    removed = jax.jit(lambda idx: jax.lax.map(lambda i: total(jnp.arange(n) == i), idx))(
        jnp.arange(n)
    )
    dist = np.linalg.norm(np.asarray(removed, np.float64) - np.asarray(full, np.float64), axis=1)
    assert dist.max() <= C * (1 + 1e-5), dist.max()
    assert dist.max() > 0.99 * C  # clipped examples really do move it by ~C


@pytest.mark.slow  # ~9 s; the audit tests catch a bf16 sum in the default suite
def test_bf16_running_sum_fails_the_neighbour_test():
    """The control: the same clipped vectors summed in bf16 across microbatches
    (what a bf16 accumulator does) violate the bound. Measured on these records
    (XLA:CPU, jaxlib 0.10.2): removing one moves the bf16 sum by up to 1.036 C (median
    1.011 C), where the float64-accumulated sum stays within C (1 + 1e-5) above; see
    Casacuberta et al. 2022, "Widespread underestimation of sensitivity in
    differentially private libraries", for the same effect across DP libraries."""
    rng = np.random.default_rng(0)
    n, d, mb = 1024, 256, 32
    v = rng.normal(size=(n, d))
    v = v / np.linalg.norm(v, axis=1, keepdims=True)  # norm exactly C = 1

    def bf16_running_sum(x):
        def body(acc, chunk):
            return (acc + chunk.astype(jnp.bfloat16).sum(0).astype(jnp.bfloat16)), None

        return jax.lax.scan(body, jnp.zeros(d, jnp.bfloat16), x.reshape(n // mb, mb, d))[0]

    x = jnp.asarray(v, jnp.float32)
    full = np.asarray(bf16_running_sum(x), np.float64)
    worst = max(
        np.linalg.norm(np.asarray(bf16_running_sum(x.at[i].set(0.0)), np.float64) - full)
        for i in range(0, n, 16)
    )
    assert worst > 1.0 + 1e-5


@pytest.mark.fast_cases("fp16")  # all cases: ~8 s on 2 cores
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_loss_scale_invariance(policy):
    """Scales 1, 2^8 and 2^15 give the same clipped sum within fp32 rounding when
    nothing overflows (inputs of unit scale keep fp16 gradients * 2^15 below 65504)."""
    batch = classification_batch(128, scale=1.0)
    results = [
        run(policy, batch, loss_scale=dpmp.StaticLossScale(s)) for s in (1.0, 2.0**8, 2.0**15)
    ]
    assert all(int(r.stats.num_nonfinite) == 0 for r in results)
    outs = [flat(r.grads) for r in results]
    for o in outs[1:]:
        assert np.linalg.norm(o - outs[0]) <= 1e-6 * np.linalg.norm(outs[0])


def test_scale_removed_before_the_norm():
    """Clipping sees the unscaled norm: with S = 2^10 the number clipped is that of S = 1
    (clipping with the scale inside would clip every example, at C / S)."""
    batch = classification_batch(128, scale=1.0)
    _, norms = clipped_sum_f64(per_example_grads_f64(mlp_loss, mlp_init(), batch), 1.0)
    C = float(np.median(norms))
    a = run("fp16", batch, clip=C, loss_scale=dpmp.StaticLossScale(1.0))
    b = run("fp16", batch, clip=C, loss_scale=dpmp.StaticLossScale(2.0**10))
    assert int(a.stats.num_clipped) == int(b.stats.num_clipped)
    assert abs(int(b.stats.num_clipped) - 64) <= 2
    assert float(b.stats.loss_scale) == 2.0**10


def overflowing(n, idx):
    """Params and a batch in which example ``idx`` has a w1 gradient of ~3000 x the
    others (through an input feature whose weights are zero, so the forward pass is
    unaffected): times a loss scale of 2^8 it overflows float16."""
    params = mlp_init()
    params["w1"][0, :] = 0.0
    batch = classification_batch(n, scale=1.0)
    batch["x"][:, 0] = 0.0
    batch["x"][idx, 0] = 3000.0
    return params, batch


@pytest.mark.slow  # ~8 s on 2 cores
def test_overflow_injection_fp16():
    """An example whose scaled fp16 gradient overflows contributes exactly zero, is
    counted, the sum stays finite, and the others' contributions are unchanged.
    (Per-example gradients: ghost clipping forms this w1 gradient in float32, where
    it does not overflow; tests/test_ghost.py covers its own overflow events.)"""
    params, batch = overflowing(64, 5)
    ls = dpmp.StaticLossScale(2.0**8)
    # in float32 the same example is finite: the overflow is a half-precision event
    assert int(run("fp32", batch, params, loss_scale=ls).stats.num_nonfinite) == 0
    out = run("fp16", batch, params, loss_scale=ls, microbatch_size=16, method="vmap")
    assert int(out.stats.num_nonfinite) == 1
    assert np.isfinite(flat(out.grads)).all()
    # identical to the same batch with that example marked as padding
    ref = run(
        "fp16",
        batch,
        params,
        loss_scale=ls,
        microbatch_size=16,
        is_padding_example=np.arange(64) == 5,
        method="vmap",
    )
    np.testing.assert_array_equal(flat(out.grads), flat(ref.grads))
    assert int(ref.stats.num_nonfinite) == 0 and int(ref.stats.num_examples) == 63
    # and equal to the float64 clipped sum of the other 63
    keep = (np.arange(64) != 5).astype(np.float64)
    ref64, _ = clipped_sum_f64(per_example_grads_f64(mlp_loss, params, batch), 1.0, keep)
    assert np.linalg.norm(flat(out.grads) - ref64) <= HALF_RTOL["fp16"] * np.linalg.norm(ref64)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_jax_privacy_nan_safe_leaves_a_partial_vector():
    """Why dpmp zeroes whole examples: jax-privacy 2.0's nan_safe keeps the finite part."""
    from jax_privacy import clipping as jp

    params = {"a": jnp.ones(2, jnp.float16), "b": jnp.ones(2, jnp.float16)}

    def loss(p, x):
        return jnp.sum(p["a"] * x[0, :2] * 2.0**14) + jnp.sum(p["b"] * x[0, 2:])

    x = jnp.array([[8.0, 8.0, 0.6, 0.8]], jnp.float16)  # a-grad overflows, b-grad finite
    jp_sum = jp.clipped_grad(loss, l2_clip_norm=1.0, nan_safe=True, dtype=jnp.float32)(params, x)
    assert float(jnp.linalg.norm(jp_sum["b"])) > 0.9  # a norm-~1 vector survives
    ours = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="fp16", method="vmap")(params, x)
    assert int(ours.stats.num_nonfinite) == 1
    assert all(float(jnp.abs(v).max()) == 0.0 for v in jax.tree.leaves(ours.grads))


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_padding_contributes_zero_and_is_not_counted():
    batch = classification_batch(32)
    pad = np.arange(32) >= 20
    out = run("bf16", batch, is_padding_example=pad)
    only = run("bf16", {k: v[:20] for k, v in batch.items()})
    np.testing.assert_allclose(flat(out.grads), flat(only.grads), rtol=1e-6, atol=1e-7)
    assert int(out.stats.num_examples) == 20


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_bf16_policy_sum_and_noisy_gradient_are_fp32():
    batch = classification_batch(32)
    out = run("bf16", batch)
    assert {x.dtype for x in jax.tree.leaves(out.grads)} == {np.dtype("float32")}
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16")
    noisy, _ = priv.update(out.grads, priv.init(out.grads))
    assert {x.dtype for x in jax.tree.leaves(noisy)} == {np.dtype("float32")}


def test_per_example_gradients_are_in_the_grad_dtype():
    batch = classification_batch(8)
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy="bf16", method="vmap")
    jaxpr = jax.make_jaxpr(lambda p, b: g(p, b))(mlp_init(), batch)
    text = str(jaxpr)
    # the vmapped weight gradient of w1 is a bf16 [8,16,32] array, and the only float32
    # [8,16,32] values are the fused cast feeding the norm and the weighted sum
    assert "bf16[8,16,32]" in text


def test_sensitivity_and_repr():
    import dp_accounting

    g = dpmp.private_grad(mlp_loss, l2_clip_norm=0.7, policy="bf16")
    assert g.l2_norm_bound == 0.7
    assert g.method == "auto" and "bf16" in repr(g)  # ghost where it can: the default
    with pytest.raises(ValueError, match="batch_size is required"):
        g.sensitivity()
    with pytest.raises(ValueError, match="explain"):  # ghost rows are read from shapes
        g.sensitivity(batch_size=256)
    assert g.explain(mlp_init(), classification_batch(4))["method"] == "ghost"
    s = g.sensitivity(batch_size=256)
    # C (1 + 16 u) for the clip factor, 2 u n C for the rounding to float32
    u = 2.0**-24
    assert 0.7 * (1 + 16 * u + 2 * 256 * u) < s < 0.7 * (1 + 16 * u + 2 * 256 * u + 1e-9)
    assert g.sensitivity(dp_accounting.NeighboringRelation.REPLACE_ONE, batch_size=256) == 2 * s
    assert g.sensitivity(dp_accounting.NeighboringRelation.REPLACE_SPECIAL, batch_size=256) == s
    assert g.sensitivity(batch_size=256, parts=8) > s  # float32 partial sums added up
    for bad in (0, -1, 2.5, True, "256"):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            g.sensitivity(batch_size=bad)
    with pytest.raises(ValueError, match="parts must be a positive integer"):
        g.sensitivity(batch_size=256, parts=0)
    # per-example gradients need no shapes
    assert dpmp.private_grad(mlp_loss, l2_clip_norm=0.7, policy="bf16", method="vmap").sensitivity(
        batch_size=256
    ) == pytest.approx(s, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"l2_clip_norm": 0.0}, "l2_clip_norm"),
        ({"l2_clip_norm": -1.0}, "l2_clip_norm"),
        ({"method": "ghostly"}, "method.*allowed"),
        ({"microbatch_size": 0}, "microbatch_size"),
        ({"batch_argnums": 0}, "batch_argnums"),
        ({"policy": "bf16,accumulate=bf16"}, "accumulate"),
        # a sum cannot be formed narrower than what it adds up: the setting would do nothing
        (
            {"policy": "bf16,accumulate=bf16,unsafe=true"},
            "accumulate=bf16 is not at least as wide as clip=f32",
        ),
        ({"policy": "fp32,clip=bf16,accumulate=f16,unsafe=true"}, "formed in f32"),
        ({"accumulation": "float32"}, "accumulation.*allowed: float64, policy"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"l2_clip_norm": 1.0, "policy": "bf16", **kwargs}
    with pytest.raises(ValueError, match=match):
        dpmp.private_grad(mlp_loss, **args)


def test_call_errors_name_the_problem():
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy="bf16", microbatch_size=5)
    batch = classification_batch(8)
    with pytest.raises(ValueError, match="microbatch_size"):
        g(mlp_init(), batch)
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy="bf16")
    with pytest.raises(ValueError, match="is_padding_example"):
        g(mlp_init(), batch, is_padding_example=np.zeros(3, bool))
    with pytest.raises(ValueError, match="DynamicLossScale"):
        g(mlp_init(), batch, loss_scale=dpmp.DynamicLossScale(2.0**8))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_batch_leaves_without_a_batch_axis_are_named(method):
    """A scalar in the batch (optax's per-example tools raise a ValueError for it too) and
    leaves of different lengths are ValueErrors that name the leaves, not IndexErrors."""

    def loss(p, b):
        return mlp_loss(p, b) + jnp.sum(b["extra"]).astype(jnp.float32)

    g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="f32", method=method)
    batch = classification_batch(8)
    with pytest.raises(ValueError, match=r"batch argument 1\['extra'\] is a scalar"):
        g(mlp_init(), dict(batch, extra=np.float32(1.0)))
    with pytest.raises(ValueError, match=r"5 \(argument 1\['extra'\]\), 8 \(argument 1\['x'\]\)"):
        g(mlp_init(), dict(batch, extra=np.ones(5, np.float32)))


@pytest.mark.slow  # ~5 s; test_trainer checks the run says it is not private
def test_nonprivate_dynamic_scale_is_an_explicit_diagnostic():
    with pytest.warns(UserWarning, match="not accounted|NOT"):
        g = dpmp.private_grad(
            mlp_loss,
            l2_clip_norm=1.0,
            policy="fp16",
            allow_nonprivate_loss_scale=True,
            method="vmap",  # the fp16 per-example w1 gradient is what overflows
        )
    params, batch = overflowing(16, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = g(params, batch, loss_scale=dpmp.DynamicLossScale(2.0**8))
    assert float(out.loss_scale.loss_scale) == 2.0**7  # backed off on the exact count


# ---- flax linen, flax nnx, plain functions -------------------------------------------


class LinenMLP(nn.Module):
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(32, dtype=self.dtype)(x))
        return nn.Dense(4, dtype=self.dtype)(h)


def xent(logits, y):
    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_flax_linen(policy):
    batch = classification_batch(32)
    pol = dpmp.Policy.parse(policy)
    model = LinenMLP(dtype=pol.compute)
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]

    def loss(p, b):
        return xent(model.apply({"params": p}, b["x"]), b["y"])

    out = jax.jit(dpmp.private_grad(loss, l2_clip_norm=1.0, policy=pol))(params, batch)
    # reference: the same model in float64
    with jax.enable_x64(True):
        m64 = LinenMLP(dtype=jnp.float64)
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
        per = jax.vmap(
            lambda x, y: jax.grad(lambda p: xent(m64.apply({"params": p}, x[None]), y[None]))(p64)
        )(jnp.asarray(batch["x"], jnp.float64), jnp.asarray(batch["y"]))
        per = jax.tree.map(np.asarray, per)
    ref, _ = clipped_sum_f64(per, 1.0)
    assert np.linalg.norm(flat(out.grads) - ref) <= HALF_RTOL[policy] * np.linalg.norm(ref)


@pytest.mark.slow  # ~7 s on 2 cores
def test_flax_nnx():
    batch = classification_batch(32)
    model = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(32, 4, rngs=nnx.Rngs(1))
    )
    graphdef, state = nnx.split(model)

    def loss(st, b):
        return xent(nnx.merge(graphdef, st)(b["x"]), b["y"])

    out = jax.jit(dpmp.private_grad(loss, l2_clip_norm=1.0, policy="bf16"))(state, batch)
    ref_fp32 = jax.jit(dpmp.private_grad(loss, l2_clip_norm=1.0, policy="fp32"))(state, batch)
    assert jax.tree.structure(out.grads) == jax.tree.structure(state)
    a, b = flat(out.grads), flat(ref_fp32.grads)
    assert np.linalg.norm(a - b) <= HALF_RTOL["bf16"] * np.linalg.norm(b)


@pytest.mark.slow  # ~5 s on 2 cores
def test_plain_function_with_separate_batch_args():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 3)).astype(np.float32), rng.normal(size=24).astype(np.float32)
    w = np.ones(3, np.float32)

    def loss(w, temperature, x, y):
        return jnp.mean((x @ w - y) ** 2) * temperature

    g = dpmp.private_grad(loss, l2_clip_norm=2.0, policy="fp32", batch_argnums=(2, 3))
    out = g(jnp.asarray(w), 0.5, x, y)
    per = 0.5 * 2 * (x @ w - y)[:, None] * x
    norms = np.linalg.norm(per, axis=1)
    ref = (per * np.minimum(1, 2.0 / norms)[:, None]).sum(0)
    np.testing.assert_allclose(out.grads, ref, rtol=1e-5)


# ---- the sensitivity of the sum as computed -----------------------------------------

CRAFTED_N, CRAFTED_D = 512, 64


def _linear_loss(w, batch):
    """Per-example gradient ``x_i (x) ones(w.shape[1])``: exact in every dtype."""
    return jnp.sum(batch["x"] @ w)


def _crafted_records():
    """512 float32 records of ``_linear_loss`` (weights [64, 2], so |grad_i| = sqrt(2)
    |x_i|) and the index of the one to remove.

    128 records of norm 0.71 C take a running sum to 8 in every coordinate, one more
    takes it just above 8; the target (clipped to C) takes it below 8; then 190 records
    of -0.99 2^-21 are below half an ulp of 8.001, and round away there, but above half
    an ulp of 7.9, and round to a whole one there. A float32 sum that adds the records
    in order (``_in_order_float32_moved``; XLA:CPU's contraction on some machines) moves
    by ``190 2^-21`` more per coordinate when the target is removed: by more than C."""
    x = np.zeros((CRAFTED_N, CRAFTED_D), np.float32)
    x[:128] = 1 / 16
    x[128] = 2.0**-10
    target = 129
    x[target] = -1 / 8
    x[132::2] = -0.99 * 2.0**-21
    return x, target


def _crafted_clipped(x):
    """``_linear_loss``'s per-example gradients of the records, clipped to C = 1, in
    float64: ``[n, 2 d]``, row-major as ``flat`` reads the weights' gradient."""
    grads = np.repeat(x.astype(np.float64), 2, axis=1)  # x_i (x) ones(2)
    norms = np.maximum(np.linalg.norm(grads, axis=1), 1e-300)
    return grads * np.minimum(1.0, 1.0 / norms)[:, None]


def _in_order_float32_moved(x, target):
    """The change, in L2, of a float32 sum of the records' clipped gradients (rounded
    to float32) added one record at a time in order, when the target is removed
    (numpy's IEEE float32 additions: the same bits on every machine)."""
    clipped = _crafted_clipped(x).astype(np.float32)
    full, removed = (np.zeros(clipped.shape[1], np.float32) for _ in range(2))
    for i, row in enumerate(clipped):
        full = full + row
        removed = removed + (np.zeros_like(row) if i == target else row)
    return float(np.linalg.norm(full.astype(np.float64) - removed))


def test_the_crafted_records_move_an_in_order_float32_sum_by_more_than_c():
    """What the records are crafted for: added in order in float32, removing the
    target moves the sum by ``sqrt(128) 190 2^-21`` beyond C, as ``_crafted_records``
    says, within the rounding of the target's addition (half an ulp of 7.9, 2^-22, per
    coordinate; the other additions are exact or round a whole small record away).
    The exact sum moves by C, so a float64 sum rounded once to float32 moves by C
    within those two roundings (half an ulp of 8 and of 7.9 per coordinate)."""
    x, target = _crafted_records()
    coordinates = 2 * CRAFTED_D
    excess = np.sqrt(coordinates) * 190 * 2.0**-21
    in_order = _in_order_float32_moved(x, target)
    assert abs(in_order - (1 + excess)) <= np.sqrt(coordinates) * 2.0**-22
    assert in_order > 1.001
    clipped = _crafted_clipped(x)
    keep = np.arange(CRAFTED_N) != target
    once = clipped.sum(0).astype(np.float32) - clipped[keep].sum(0).astype(np.float32)
    once_moved = np.linalg.norm(once.astype(np.float64))
    assert abs(once_moved - 1) <= np.sqrt(coordinates) * (2.0**-21 + 2.0**-22)


@pytest.mark.parametrize("accumulation", ["float64", "policy"])
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_removing_a_crafted_record_moves_the_sum_by_at_most_its_sensitivity(method, accumulation):
    """Removing the target moves the clipped sum by C (the sensitivity dpmp claimed
    before it counted rounding) within the rounding ``g.sensitivity(batch_size=512)``
    allows, whatever order the compiled sum adds in: 1 + 6.2e-5 with float64
    accumulation, Higham's 1.06 with float32 ("policy"). Float32 additions in the
    order the records are crafted against move it by 1.001 C
    (``_in_order_float32_moved``): beyond the float64 accumulation's sensitivity,
    within float32's, which holds for every order."""
    x, target = _crafted_records()
    w = jnp.zeros((CRAFTED_D, 2), jnp.float32)
    g = dpmp.private_grad(
        _linear_loss, l2_clip_norm=1.0, policy="fp32", method=method, accumulation=accumulation
    )
    total = jax.jit(lambda pad: g(w, {"x": x}, is_padding_example=pad).grads)
    full = flat(total(jnp.zeros(CRAFTED_N, bool)))
    removed = flat(total(jnp.arange(CRAFTED_N) == target))
    moved = np.linalg.norm(full - removed)
    assert g.resolved_method == method
    sensitivity = g.sensitivity(batch_size=CRAFTED_N)
    assert abs(moved - 1.0) <= sensitivity - 1.0, (moved, sensitivity)
    in_order = _in_order_float32_moved(x, target)
    if accumulation == "float64":  # the one rounding to float32: 2 u n C, and 16 u C
        assert sensitivity == pytest.approx(1 + (16 + 2 * CRAFTED_N) * 2.0**-24, rel=1e-9)
        assert in_order > sensitivity  # float32 accumulation would break this bound
    else:
        assert in_order <= sensitivity


@pytest.mark.parametrize("accumulation", ["float64", "policy"])
@pytest.mark.parametrize("method", ["vmap", "ghost"])
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_clipped_sum_is_within_its_stated_rounding_of_a_float64_sum(policy, method, accumulation):
    """Records of norm at most C / 2 (never clipped) over six orders of magnitude, some
    of them padding: the sum equals the float64 numpy sum of the per-example gradients
    (the records rounded to the compute dtype) within the rounding that
    ``sensitivity_bound`` states for it (accumulation plus the final rounding)."""
    n, d, width = 256, 32, 3
    rng = np.random.default_rng(0)
    scale = 10.0 ** rng.uniform(-6, 0, size=(n, 1))
    x = rng.normal(size=(n, d)) * scale
    x = x / np.maximum(1.0, 2 * np.sqrt(width) * np.linalg.norm(x, axis=1, keepdims=True))
    x = x.astype(np.float32)
    pad = rng.random(n) < 0.1
    g = dpmp.private_grad(
        _linear_loss, l2_clip_norm=1.0, policy=policy, method=method, accumulation=accumulation
    )
    w = jnp.zeros((d, width), jnp.float32)
    out = jax.jit(g)(w, {"x": x}, is_padding_example=pad)
    assert int(out.stats.num_clipped) == 0 and g.resolved_method == method
    got = flat(out.grads)
    rounded = np.asarray(jnp.asarray(x, dpmp.Policy.parse(policy).compute), np.float64)
    ref = np.repeat(rounded[~pad].sum(0)[:, None], width, axis=1).ravel()
    bound = g.sensitivity_bound(batch_size=n)
    stated = bound["accumulation_error"] + bound["rounding_error"]
    assert np.linalg.norm(got - ref) <= stated, (np.linalg.norm(got - ref), stated)
    if accumulation == "float64":  # per coordinate: the exact sum, correctly rounded
        magnitude = np.repeat(np.abs(rounded[~pad]).sum(0)[:, None], width, axis=1).ravel()
        slack = 2 * n * 2.0**-53 * magnitude  # the float64 accumulation
        assert (np.abs(got - ref) <= 2.0**-24 * np.abs(ref) + slack).all()


@pytest.mark.slow  # ~6 s on 2 cores
@pytest.mark.parametrize("microbatch_size", [None, 37])
def test_float64_sums_read_the_examples_in_chunks_with_a_remainder(monkeypatch, microbatch_size):
    """Per-example gradients are reduced in float64 a chunk of examples at a time (2
    here: 74 examples are 37 chunks, a microbatch of 37 is 18 and a remainder of one):
    the same clipped sum and the same statistics as the float64 reference."""
    from dpmp.clipping import _chunks as clipping_lib

    monkeypatch.setattr(clipping_lib, "_CHUNK_BYTES", 1)
    batch = classification_batch(74)
    out = run("fp32", batch, clip=0.5, method="vmap", microbatch_size=microbatch_size)
    ref, norms = clipped_sum_f64(per_example_grads_f64(mlp_loss, mlp_init(), batch), 0.5)
    assert np.linalg.norm(flat(out.grads) - ref) <= 1e-6 * np.linalg.norm(ref)
    assert int(out.stats.num_clipped) == int((norms > 0.5).sum())
    np.testing.assert_allclose(float(out.stats.norm_max), norms.max(), rtol=1e-6)
    np.testing.assert_allclose(float(out.stats.norm_median), np.median(norms), rtol=1e-6)
