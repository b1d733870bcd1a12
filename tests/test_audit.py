"""Precision audit: broken steps written in plain jax / jax-privacy are caught at
the right site and dtype; their float32 versions audit clean; dpmp's own steps
audit clean with every kind of site present."""

import json
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax_privacy import clipping as jp_clipping
from jax_privacy import noise_addition as jp_noise

import dpmp
from dpmp.audit._numeric import NumericReport, fp_sum_sensitivity, numeric_audit
from dpmp.audit._precision import (
    KINDS,
    Finding,
    PrecisionAuditError,
    PrecisionReport,
    audit_precision,
)
from tests._devices import run_on_host_devices

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
B = 8


def mlp_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def mlp(dtype=F32, b=B):
    k = jax.random.split(jax.random.key(0), 5)
    p = {
        "w1": jax.random.normal(k[0], (6, 5), dtype),
        "b1": jnp.zeros((5,), dtype),
        "w2": jax.random.normal(k[1], (5, 3), dtype),
    }
    batch = (jax.random.normal(k[2], (b, 6), dtype), jax.random.normal(k[3], (b, 3), dtype))
    return p, batch


def per_example_grads(p, batch):
    return jax.vmap(jax.grad(mlp_loss), in_axes=(None, 0))(
        p, jax.tree.map(lambda x: x[:, None], batch)
    )


def clip_f32(grads, c=1.0):
    """Per-example clipping in float32 (correct)."""
    grads = jax.tree.map(lambda g: g.astype(F32), grads)
    sq = sum(jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim))) for g in jax.tree.leaves(grads))
    factor = jnp.minimum(1.0, c / jnp.sqrt(sq))
    return jax.tree.map(lambda g: g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), grads)


def violations(report, kind):
    return [f for f in report.findings if f.kind == kind and not f.ok]


def assert_clean_with(report, *kinds):
    assert report.ok, str(report)
    for kind in kinds:
        assert report.of_kind(kind), f"no {kind} site found:\n{report}"


# ---- (a) bf16 sum of per-example gradients ---------------------------------------
@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_a_jax_privacy_bf16_sum_is_caught_and_f32_is_clean():
    p, batch = mlp(BF16)
    g = jp_clipping.clipped_grad(mlp_loss, l2_clip_norm=1.0, batch_argnums=1)
    report = audit_precision(g, p, batch, policy="fp32,param=bf16")
    bad = violations(report, "batch_reduction")
    assert bad and all(f.out_dtype == BF16 for f in bad), str(report)
    # the bf16 norm and the clip factor applied in bf16 are caught too
    assert any(f.out_dtype == BF16 for f in violations(report, "norm"))

    p32, batch32 = mlp(F32)
    assert_clean_with(audit_precision(g, p32, batch32, policy="fp32"), "batch_reduction", "norm")


@pytest.mark.parametrize("acc", [BF16, F32])
def test_a_manual_vmap_sum(acc):
    p, batch = mlp(F32)

    def summed(p, batch):
        clipped = clip_f32(per_example_grads(p, batch))
        return jax.tree.map(lambda g: jax.lax.reduce_sum(g.astype(acc), (0,)), clipped)

    report = audit_precision(summed, p, batch, policy="fp32")
    sums = report.of_kind("batch_reduction")
    assert len(sums) == 3, str(report)
    assert all(f.primitive == "reduce_sum" and f.out_dtype == acc for f in sums)
    assert all(f.ok == (acc == F32) for f in sums)


@pytest.mark.slow  # ~3 s on 2 cores
def test_a_non_private_batch_gradient_is_a_dot_general_over_examples():
    p, batch = mlp(BF16)
    report = audit_precision(jax.grad(mlp_loss), p, batch, policy="fp32,param=bf16")
    dots = [f for f in report.of_kind("batch_reduction") if f.primitive == "dot_general"]
    assert dots and all(not f.ok and f.out_dtype == BF16 for f in dots), str(report)


# ---- (b) running sum across microbatches in a scan --------------------------------
@pytest.mark.parametrize("carry_dtype", [BF16, F32])
def test_b_scan_running_sum(carry_dtype):
    p, batch = mlp(F32, b=8)

    def summed(p, batch):
        mbs = jax.tree.map(lambda x: x.reshape((4, 2) + x.shape[1:]), batch)

        def body(acc, mb):
            s = jax.tree.map(lambda g: g.sum(0), clip_f32(per_example_grads(p, mb)))
            return jax.tree.map(lambda a, g: a + g.astype(carry_dtype), acc, s), None

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, carry_dtype), p)
        return jax.lax.scan(body, zeros, mbs)[0]

    report = audit_precision(summed, p, batch, policy="fp32")
    carried = [f for f in report.of_kind("batch_reduction") if f.primitive == "scan+add"]
    assert len(carried) == 3, str(report)
    assert all(f.acc_dtype == carry_dtype and f.ok == (carry_dtype == F32) for f in carried)
    assert all(":carry[" in f.location for f in carried)
    # the per-microbatch sums inside the body are found too, in float32
    inner = [f for f in report.of_kind("batch_reduction") if f.primitive == "reduce_sum"]
    assert inner and all(f.ok for f in inner)


def test_b_jax_privacy_microbatches_while_loop():
    p, batch = mlp(F32)
    g = jp_clipping.clipped_grad(mlp_loss, l2_clip_norm=1.0, batch_argnums=1, microbatch_size=4)
    report = audit_precision(g, p, batch, policy="fp32")
    assert_clean_with(report, "batch_reduction", "norm")
    assert any(f.primitive == "while+add" for f in report.of_kind("batch_reduction"))


# ---- (c) noise drawn in bf16; (d) noise added then cast back to bf16 -----------------
@pytest.mark.parametrize("noise_dtype", [BF16, F32])
def test_c_noise_drawn_in_bf16(noise_dtype):
    p, batch = mlp(F32)
    g = jp_clipping.clipped_grad(mlp_loss, l2_clip_norm=1.0, batch_argnums=1)

    def noisy_sum(p, batch, key):
        s = g(p, batch)
        keys = jax.random.split(key, 3)
        leaves, tree = jax.tree.flatten(s)
        noise = [jax.random.normal(k, x.shape, noise_dtype) for k, x in zip(keys, leaves)]
        return jax.tree.unflatten(tree, [x + n.astype(F32) for x, n in zip(leaves, noise)])

    report = audit_precision(noisy_sum, p, batch, jax.random.key(1), policy="fp32")
    samples = report.of_kind("noise_sample")
    assert len(samples) == 3 and all(f.primitive == "erf_inv" for f in samples), str(report)
    assert all(f.out_dtype == noise_dtype and f.ok == (noise_dtype == F32) for f in samples)
    assert len(report.of_kind("noise_add")) == 3
    assert report.ok == (noise_dtype == F32)


@pytest.mark.parametrize("grad_dtype", [BF16, F32])
def test_d_jax_privacy_privatizer_casts_noisy_sum_back(grad_dtype):
    p, batch = mlp(F32)
    g = jp_clipping.clipped_grad(mlp_loss, l2_clip_norm=1.0, batch_argnums=1)
    priv = jp_noise.gaussian_privatizer(stddev=1.0, prng_key=jax.random.key(0), dtype=F32)
    state = priv.init(p)

    def step(p, batch, state):
        s = jax.tree.map(lambda x: x.astype(grad_dtype), g(p, batch))
        return priv.update(s, state)

    report = audit_precision(step, p, batch, state, policy="fp32")
    assert all(f.ok and f.out_dtype == F32 for f in report.of_kind("noise_sample"))
    adds = report.of_kind("noise_add")
    casts = [f for f in adds if f.primitive == "convert_element_type"]
    if grad_dtype == BF16:
        assert len(casts) == 3 and not any(f.ok for f in casts), str(report)
        assert all(f.in_dtype == F32 and f.out_dtype == BF16 for f in casts)
        assert all("after the noise addition at" in f.message for f in casts)
    else:
        assert not casts
        assert_clean_with(report, "noise_sample", "noise_add", "batch_reduction")


# ---- (e) bf16 psum across 4 devices (subprocess: the device count is fixed at start) --
_MULTI_DEVICE = textwrap.dedent(
    """
    import json, functools
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jax_privacy import clipping
    from dpmp.audit._precision import audit_precision

    assert jax.device_count() == 4, jax.devices()
    def loss(p, b):
        x, y = b
        return jnp.mean((jnp.tanh(x @ p["w"]) - y) ** 2)
    p = {"w": jnp.ones((6, 3))}
    batch = (jnp.ones((16, 6)), jnp.ones((16, 3)))
    g = clipping.clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=1)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    out = {}
    for name, dt in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        def local(p, b, dt=dt):
            s = g(jax.lax.pcast(p, "d", to="varying"), b)
            return jax.tree.map(lambda x: jax.lax.psum(x.astype(dt), "d"), s)
        f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
        out["shard_map_" + name] = audit_precision(f, p, batch, policy="fp32").to_dict()
        def pm(p, b, dt=dt):
            s = g(p, b)
            return jax.tree.map(lambda x: jax.lax.psum(x.astype(dt), "i"), s)
        bp = jax.tree.map(lambda x: x.reshape((4, 4) + x.shape[1:]), batch)
        f = jax.pmap(pm, axis_name="i", in_axes=(None, 0))
        out["pmap_" + name] = audit_precision(
            f, p, bp, policy="fp32", batch_size=16, batch_argnums=1
        ).to_dict()
    # grads of replicated params inside shard_map are psum'd by jax itself, inside
    # the per-example computation: examples of different devices get mixed.
    f = jax.shard_map(lambda p, b: g(p, b), mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    out["implicit"] = audit_precision(f, p, batch, policy="fp32").to_dict()
    print("JSON" + json.dumps(out))
    """
)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_e_psum_across_devices_in_subprocess(tmp_path):
    reports = run_on_host_devices(tmp_path, "multi_device_audit.py", _MULTI_DEVICE, timeout=120)
    for mode in ("shard_map", "pmap"):
        bad, good = reports[f"{mode}_bf16"], reports[f"{mode}_f32"]
        reduces = [f for f in bad["findings"] if f["kind"] == "all_reduce"]
        assert len(reduces) == 1 and not reduces[0]["ok"], bad
        assert reduces[0]["out_dtype"] == "bf16" and reduces[0]["primitive"].startswith("psum")
        assert not bad["ok"]
        assert good["ok"] and good["counts"]["all_reduce"] == 1, good
        assert good["counts"]["batch_reduction"] >= 1 and good["counts"]["norm"] >= 1
    implicit = reports["implicit"]
    assert not implicit["ok"]
    assert any(
        "PER-EXAMPLE" in f["message"] for f in implicit["findings"] if f["kind"] == "all_reduce"
    )


# ---- (f) norms in fp16 -----------------------------------------------------------
@pytest.mark.parametrize("norm_dtype", [F16, F32])
def test_f_norm_in_fp16(norm_dtype):
    p, batch = mlp(F32)

    def summed(p, batch):
        grads = per_example_grads(p, batch)
        leaves = jax.tree.leaves(grads)
        sq = sum(
            jnp.sum(jnp.square(g.astype(norm_dtype)), axis=(1, 2) if g.ndim == 3 else 1)
            for g in leaves
        )
        norm = jnp.sqrt(sq).astype(F32)
        factor = jnp.minimum(1.0, 1.0 / norm)
        return jax.tree.map(
            lambda g: jnp.sum(g * factor.reshape((-1,) + (1,) * (g.ndim - 1)), 0), grads
        )

    report = audit_precision(summed, p, batch, policy="fp32")
    norms = report.of_kind("norm")
    sums = [f for f in norms if f.primitive == "reduce_sum"]
    assert len(sums) == 3 and any(f.primitive == "sqrt" for f in norms), str(report)
    assert all(f.in_dtype == norm_dtype and f.ok == (norm_dtype == F32) for f in sums)
    assert report.ok == (norm_dtype == F32)
    assert all(f.ok for f in report.of_kind("batch_reduction"))


@pytest.mark.slow  # ~4 s on 2 cores
def test_f_jax_privacy_fp16_grads_norm_is_caught():
    p, batch = mlp(F16)
    g = jp_clipping.clipped_grad(mlp_loss, l2_clip_norm=1.0, batch_argnums=1)
    report = audit_precision(g, p, batch, policy="fp32,param=f16")
    assert any(f.in_dtype == F16 for f in violations(report, "norm")), str(report)


# ---- sub-jaxprs: custom_vjp, remat, cond -------------------------------------------
def test_custom_vjp_remat_and_cond_are_followed():
    @jax.custom_vjp
    def act(x):
        return jnp.tanh(x)

    act.defvjp(lambda x: (jnp.tanh(x), x), lambda x, ct: (ct * (1 - jnp.tanh(x) ** 2),))

    @jax.checkpoint
    def loss(p, batch):
        x, y = batch
        h = act(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - y) ** 2)

    p, batch = mlp(F32)
    g = jp_clipping.clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=1)

    def step(p, batch, flag):
        s = jax.lax.cond(flag, lambda: g(p, batch), lambda: jax.tree.map(jnp.zeros_like, p))
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, s)

    report = audit_precision(step, p, batch, True, policy="fp32")
    assert_clean_with(report, "batch_reduction", "norm", "update")
    assert any("cond[" in f.location for f in report.findings)


# ---- dpmp's own steps --------------------------------------------------------------
needs_private = pytest.mark.skipif(
    not (hasattr(dpmp, "private_grad") and hasattr(dpmp, "gaussian_privatizer")),
    reason="dpmp.private_grad / dpmp.gaussian_privatizer not available yet",
)


def dpmp_step(policy, *, microbatch_size=None, sizes=(6, 5, 3), batch_size=B, opt=None):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    d_in, d_h, d_out = sizes

    def loss(p, b):
        h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
        logits = (h @ p["w2"]).astype(F32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))

    g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy=policy, microbatch_size=microbatch_size)
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy=policy)
    opt = opt or optax.adam(1e-3)
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def local(p, b):
        # params are replicated: mark them varying so that jax does not psum
        # their per-example gradients across devices before clipping
        s = g(jax.lax.pcast(p, "d", to="varying"), b).grads
        return jax.lax.psum(s, "d")

    summed = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())

    def step(p, b, noise_state, opt_state):
        noisy, noise_state = priv.update(summed(p, b), noise_state)
        updates, opt_state = opt.update(jax.tree.map(lambda x: x / batch_size, noisy), opt_state, p)
        return optax.apply_updates(p, updates), noise_state, opt_state

    k = jax.random.split(jax.random.key(0), 3)
    p = {
        "w1": 0.1 * jax.random.normal(k[0], (d_in, d_h)),
        "b1": jnp.zeros((d_h,)),
        "w2": 0.1 * jax.random.normal(k[1], (d_h, d_out)),
    }
    b = {"x": jax.random.normal(k[2], (batch_size, d_in)), "y": jnp.zeros((batch_size,), jnp.int32)}
    return step, (p, b, priv.init(p), opt.init(p))


@needs_private
@pytest.mark.parametrize(
    "policy,microbatch_size", [("bf16", None), ("fp16", None), ("bf16", 4), ("fp32", None)]
)
def test_dpmp_step_audits_clean_with_every_kind(policy, microbatch_size):
    step, args = dpmp_step(policy, microbatch_size=microbatch_size)
    report = audit_precision(step, *args, policy=policy, expect=KINDS)
    assert report.ok, str(report)
    assert all(report.counts()[k] >= 1 for k in KINDS)
    # the per-example gradients really are half precision: the audit sees the
    # clip factor applied to them after they are cast up (to float64, where the
    # clipped sum accumulates)
    if policy != "fp32":
        clip_sites = [f for f in report.of_kind("norm") if f.message.startswith("clip factor")]
        assert clip_sites and all(f.out_dtype in (F32, jnp.float64) for f in clip_sites)


@needs_private
def test_dpmp_step_under_a_stricter_policy_fails():
    # a step built for f32 accumulation, audited against f64 requirements
    step, args = dpmp_step("bf16")
    strict = dpmp.Policy.parse("bf16,accumulate=f64,clip=f64,noise=f64")
    report = audit_precision(step, *args, policy=strict)
    assert not report.ok
    assert {f.kind for f in report.violations} >= {"batch_reduction", "norm", "noise_add"}


@pytest.mark.slow  # ~5 s on 2 cores
@needs_private
def test_audit_of_a_mid_size_model_takes_seconds():
    step, args = dpmp_step("bf16", sizes=(784, 1024, 10), batch_size=256)
    t0 = time.perf_counter()
    report = audit_precision(step, *args, policy="bf16", expect=KINDS)
    elapsed = time.perf_counter() - t0
    assert report.ok, str(report)
    assert elapsed < 10, elapsed


def test_mlp_784_1024x3_jax_privacy_audit_takes_seconds():
    sizes = (784, 1024, 1024, 1024, 10)
    k = jax.random.split(jax.random.key(0), len(sizes))
    p = [(jnp.zeros((a, b), BF16), jnp.zeros((b,), BF16)) for a, b in zip(sizes[:-1], sizes[1:])]

    def loss(p, batch):
        x, y = batch
        for w, b in p[:-1]:
            x = jax.nn.relu(x @ w + b)
        w, b = p[-1]
        logits = (x @ w + b).astype(F32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

    g = jp_clipping.clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=1, dtype=F32)
    batch = (jnp.zeros((256, 784), BF16), jnp.zeros((256,), jnp.int32))
    del k
    t0 = time.perf_counter()
    report = audit_precision(g, p, batch, policy="bf16,param=bf16")
    elapsed = time.perf_counter() - t0
    assert report.ok, str(report)
    assert len(report.of_kind("batch_reduction")) == 8
    assert elapsed < 10, elapsed


# ---- the report ----------------------------------------------------------------------
def test_report_table_json_and_raise():
    p, batch = mlp(BF16)
    g = jp_clipping.clipped_grad(mlp_loss, l2_clip_norm=1.0, batch_argnums=1)
    report = audit_precision(g, p, batch, policy=dpmp.Policy.bf16(), expect=("noise_add",))
    assert isinstance(report, PrecisionReport) and not report.ok
    assert report.missing == ("noise_add",)
    text = str(report)
    assert text.splitlines()[0].startswith("precision audit of")
    assert "FAIL" in text and "batch_reduction" in text and "missing: noise_add" in text
    header = [line for line in text.splitlines() if line.startswith("ok ")][0]
    assert header.split()[:7] == ["ok", "kind", "primitive", "in", "acc", "out", "need"]
    d = json.loads(report.to_json())
    assert d == report.to_dict()
    assert d["ok"] is False and d["policy"] == str(dpmp.Policy.bf16())
    assert d["counts"]["batch_reduction"] == len(report.of_kind("batch_reduction"))
    assert {f["kind"] for f in d["findings"]} <= set(KINDS)
    f0 = d["findings"][0]
    assert set(f0) >= {
        "kind",
        "primitive",
        "in_dtype",
        "acc_dtype",
        "out_dtype",
        "location",
        "ok",
        "message",
    }
    assert isinstance(report.findings[0], Finding)
    with pytest.raises(PrecisionAuditError, match="batch_reduction"):
        report.raise_if_failed()
    locs = [f.location for f in report.violations]
    assert any("jax_privacy/clipping.py:" in loc or "optax/" in loc for loc in locs), locs


def test_the_checked_policy_line_says_what_it_raised_from_the_given_one():
    p, batch = mlp(F32)
    given = "fp32,noise=bf16,unsafe=true"
    checked = str(audit_precision(mlp_loss, p, batch, policy=given)).splitlines()[1]
    assert checked.startswith("checked against: param=f32,") and "noise=f32" in checked
    assert "unsafe=true" not in checked  # float32 clip, accumulate and noise are safe
    assert checked.endswith("the policy given asks for noise=bf16 (unsafe), held to float32 here")
    same = str(audit_precision(mlp_loss, p, batch, policy="bf16")).splitlines()[1]
    assert (
        same == f"checked against: {dpmp.Policy.bf16()} (clip, accumulate, noise: float32 or wider)"
    )


def test_argument_validation():
    p, batch = mlp(F32)
    with pytest.raises(ValueError, match="allowed"):
        audit_precision(mlp_loss, p, batch, expect=("bogus",))
    with pytest.raises(ValueError, match="overlap"):
        audit_precision(mlp_loss, p, batch, batch_argnums=0)
    with pytest.raises(ValueError, match="unknown"):
        audit_precision(mlp_loss, p, batch, policy="fp8")
    report = audit_precision(mlp_loss, p, batch)
    assert report.batch_size == B and report.ok and report.policy == dpmp.Policy()


# ---- numeric audit ------------------------------------------------------------------
def test_fp_sum_sensitivity_formulas():
    b = fp_sum_sensitivity(1024, 1.0, "float32")
    assert b["k"] == 24 and b["u"] == 2.0**-24
    assert b["sequential"] == pytest.approx(1024**2 / 2**23)
    lg = 10 * 2.0**-24
    assert b["pairwise"] == pytest.approx(2 * lg / (1 - lg) * 1024)
    assert fp_sum_sensitivity(256, 2.0, BF16)["k"] == 8
    assert fp_sum_sensitivity(256, 2.0, "f16")["k"] == 11
    assert fp_sum_sensitivity(256, 1.0, "f64")["k"] == 53
    # bf16: the excess dwarfs the clip norm itself
    assert fp_sum_sensitivity(256, 1.0, BF16)["sequential"] == 512.0


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_numeric_audit_f32_vs_bf16():
    k = jax.random.split(jax.random.key(3), 4)
    p = {"w1": jax.random.normal(k[0], (6, 16)), "w2": jax.random.normal(k[1], (16, 3))}
    batch = (jax.random.normal(k[2], (32, 6)), jax.random.normal(k[3], (32, 3)))

    def loss(p, b):
        x, y = b
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    c = 0.1
    ref = jp_clipping.clipped_grad(loss, l2_clip_norm=c, batch_argnums=1)
    good = numeric_audit(ref, p, batch, l2_clip_norm=c, policy="fp32")
    assert isinstance(good, NumericReport) and good.ok, str(good)
    assert good.reference_dtype == "f64" and good.accumulate_dtype == "f32"
    assert good.rel_error < 1e-5 and good.max_clipped_norm_ratio <= 1 + 4.8e-7
    assert good.examples_checked == 32

    def bf16_sum(p, b):
        cast = lambda t: jax.tree.map(lambda x: x.astype(BF16), t)  # noqa: E731
        return ref(cast(p), cast(b))

    bad = numeric_audit(bf16_sum, p, batch, l2_clip_norm=c, reference_fn=ref, max_examples=16)
    assert not bad.ok and bad.accumulate_dtype == "bf16"
    assert bad.max_clipped_norm_ratio > 1.001  # bf16 clip factor lets norms exceed C
    assert bad.rel_error > 100 * good.rel_error
    assert bad.sensitivity["k"] == 8
    assert json.loads(bad.to_json())["accumulate_dtype"] == "bf16"
    assert "max |clip(g_i)| / C" in str(bad)


@pytest.mark.slow  # ~3 s on 2 cores
@needs_private
def test_numeric_audit_of_dpmp_private_grad():
    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w"]) - b["y"]) ** 2)

    k = jax.random.split(jax.random.key(4), 3)
    p = {"w": jax.random.normal(k[0], (6, 3))}
    batch = {"x": jax.random.normal(k[1], (16, 6)), "y": jax.random.normal(k[2], (16, 3))}
    g = dpmp.private_grad(loss, l2_clip_norm=0.5, policy="bf16")
    ref = dpmp.private_grad(
        loss,
        l2_clip_norm=0.5,
        policy=dpmp.Policy(
            **{
                r: "f64"
                for r in ("param", "compute", "output", "grad", "clip", "accumulate", "noise")
            }
        ),
    )
    report = numeric_audit(
        lambda p, b: g(p, b).grads,
        p,
        batch,
        l2_clip_norm=0.5,
        policy="bf16",
        reference_fn=lambda p, b: ref(p, b).grads,
    )
    assert report.ok, str(report)
    assert report.reference_dtype == "f64"
    assert report.max_clipped_norm_ratio <= 1 + 4.8e-7
