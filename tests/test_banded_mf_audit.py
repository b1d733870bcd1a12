"""Audits of banded matrix factorization's correlated stream: the precision audit
sees its stages (ring buffers, the float64 release query, the decoding) and flags
them held in half precision."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmp
from dpmp.audit import audit_precision
from dpmp.noise import _banded_mf
from dpmp.noise._banded_mf import STREAM_STAGES, BandedMF

STEPS, BANDS, BATCH = 8, 3, 8
LEAVES = 3  # w1, b1, w2


def _strategy():
    coefs = np.array([1.0, 0.5, 0.375])
    coefs = (coefs / np.linalg.norm(coefs)).astype(np.float32)
    return BandedMF(steps=STEPS, coefs=tuple(float(c) for c in coefs))


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    logits = (h @ p["w2"]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))


def _banded_step(policy="bf16"):
    """A private step whose noise is the banded stream: ``(step, example args)``."""
    g = dpmp.private_grad(_loss, l2_clip_norm=1.0, policy=policy)
    priv = _strategy().privatizer(stddev=1.0, prng_key=0, policy=policy)
    opt = optax.sgd(0.1)

    def step(p, b, noise_state, opt_state):
        noisy, noise_state = priv.update(g(p, b).grads, noise_state)
        updates, opt_state = opt.update(jax.tree.map(lambda x: x / BATCH, noisy), opt_state, p)
        return optax.apply_updates(p, updates), noise_state, opt_state

    k = jax.random.split(jax.random.key(0), 3)
    p = {
        "w1": 0.1 * jax.random.normal(k[0], (6, 5)),
        "b1": jnp.zeros((5,)),
        "w2": 0.1 * jax.random.normal(k[1], (5, 3)),
    }
    b = {"x": jax.random.normal(k[2], (BATCH, 6)), "y": jnp.zeros((BATCH,), jnp.int32)}
    return step, (p, b, priv.init(p), opt.init(p))


def _stage_sites(report):
    """``{(jit name, "ring" | "result"): [findings]}`` of the stream's stages."""
    sites = {}
    for f in report.findings:
        if f.primitive in {s.jit_name for s in STREAM_STAGES}:
            part = "ring" if f.out_dtype is None else "result"
            sites.setdefault((f.primitive, part), []).append(f)
    return sites


@pytest.mark.parametrize("policy", ["bf16", "fp16"])
def test_the_banded_step_audits_clean_with_its_stages(policy):
    step, args = _banded_step(policy)
    report = audit_precision(step, *args, policy=policy, expect=dpmp.audit.KINDS[:2])
    assert report.ok, str(report)
    sites = _stage_sites(report)
    for stage in STREAM_STAGES:  # a ring and a result site per parameter leaf
        ring, result = sites[(stage.jit_name, "ring")], sites[(stage.jit_name, "result")]
        assert len(ring) == len(result) == LEAVES and all(f.kind == stage.kind for f in ring)
        assert {f.in_dtype for f in ring} == {np.dtype(np.float32)}
    # the release query is formed in float64, as its rounding bound assumes
    query = sites[("banded_mf_query", "result")]
    assert all(f.out_dtype == np.float64 and f.required == np.float64 for f in query)


@pytest.mark.parametrize("half", [jnp.bfloat16, jnp.float16])
def test_half_precision_ring_buffers_are_flagged(half):
    """The same step with both rings held in half precision: every ring site fails."""
    step, (p, b, noise_state, opt_state) = _banded_step()
    narrow = noise_state._replace(
        sums=jax.tree.map(lambda r: r.astype(half), noise_state.sums),
        outputs=jax.tree.map(lambda r: r.astype(half), noise_state.outputs),
    )
    report = audit_precision(step, p, b, narrow, opt_state, policy="bf16")
    assert not report.ok
    sites = _stage_sites(report)
    for stage in STREAM_STAGES:
        ring = sites[(stage.jit_name, "ring")]
        assert len(ring) == LEAVES and not any(f.ok for f in ring), str(report)
        assert all(f.in_dtype == np.dtype(half) for f in ring)
        assert all(f.ok for f in sites[(stage.jit_name, "result")])


def test_a_float32_release_query_is_flagged(monkeypatch):
    """A stream that forms a_t in float32 (a test-only stage of the same name): its
    rounding is no longer within the float64 bound the noise is drawn for."""

    def banded_mf_query(v, r, v_weight, weights):
        acc = v_weight.astype(jnp.float32) * v.astype(jnp.float32)
        for k in range(r.shape[0]):
            acc = acc + weights[k].astype(jnp.float32) * r[k].astype(jnp.float32)
        return acc

    monkeypatch.setattr(_banded_mf, "banded_mf_query", jax.jit(banded_mf_query))
    step, args = _banded_step()
    report = audit_precision(step, *args, policy="bf16")
    sites = _stage_sites(report)
    query = sites[("banded_mf_query", "result")]
    assert len(query) == LEAVES and not any(f.ok for f in query), str(report)
    assert {f.out_dtype for f in query} == {np.dtype(np.float32)}
    failed = {(f.primitive, f.out_dtype is None) for f in report.violations}
    assert failed == {("banded_mf_query", False)}, str(report)
