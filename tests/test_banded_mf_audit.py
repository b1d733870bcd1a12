"""Audits of banded matrix factorization's correlated stream: the precision audit
sees its stages (ring buffers, the float64 release query, the decoding) and flags
them held in half precision; a one-step audit of neighbouring streams (no release
impossible under the neighbour, the decoding a function of the releases alone)."""

import math

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


# ---- a one-step audit of the correlated stream ----------------------------------------
def _float64(words) -> np.ndarray:
    """Float64 values from their bits, as ``bitcast_convert_type`` to uint32 gives them."""
    return np.ascontiguousarray(words, np.uint32).view(np.float64)[..., 0]


def _recorded_stream(monkeypatch, runs, *, stddev, key):
    """The stream (one jitted update) on each of ``runs`` (a list of float32 vectors,
    one a step): per run, its outputs ``x`` and what its stages saw: the queries
    ``a_t`` it formed and the releases ``y_t`` it decoded (float64, exact)."""
    seen = {"banded_mf_query": [], "banded_mf_decode": []}

    def recording(name):
        real = getattr(_banded_mf, name)

        def stage(v, r, v_weight, weights):
            out = real(v, r, v_weight, weights)
            # the query stage's output, the decoding's input (the release)
            # as its bits: a callback's arrays are float32 outside x64 mode
            shown = jax.lax.bitcast_convert_type(
                out if name == "banded_mf_query" else v, jnp.uint32
            )
            jax.debug.callback(lambda a: seen[name].append(_float64(a)), shown)
            return out

        monkeypatch.setattr(_banded_mf, name, stage)

    for name in seen:
        recording(name)
    priv = _strategy().privatizer(stddev=stddev, prng_key=key, policy="bf16")
    update = jax.jit(priv.update)
    results = []
    for sums in runs:
        state, xs = priv.init(sums[0]), []
        for g in sums:
            x, state = update(g, state)
            xs.append(np.asarray(x))
        jax.effects_barrier()
        results.append((np.stack(xs), *(np.stack(seen[name][-len(sums) :]) for name in seen)))
    monkeypatch.undo()
    return results


def _decoded(strategy, ys):
    """``x`` from the releases ``ys`` and the public coefficients alone, in numpy: the
    stream's decoding (float64 combination over the ring's slots in order, kept
    outputs and ``x_t`` in float32)."""
    c, d = np.asarray(strategy.coefs, np.float64), strategy.column_scales()
    m = strategy.bands - 1
    ring = np.zeros((m, ys.shape[1]), np.float32)
    out = []
    for t, y in enumerate(ys):
        weights = np.zeros(m)
        for j in range(1, m + 1):
            weights[(t - j) % m] = -c[j]
        acc = 1.0 * y
        for k in range(m):
            acc = acc + weights[k] * ring[k].astype(np.float64)
        u = acc / c[0]
        out.append((u * d[t]).astype(np.float32))
        ring[t % m] = u.astype(np.float32)
    return np.stack(out)


def test_neighbouring_streams_release_nothing_impossible_under_the_other(monkeypatch):
    """A crafted record (clipped gradient C e_0) sampled at step s: the two
    neighbours' queries differ only at steps [s, s + b), by at most the accounted
    sensitivity; every release of either is a value the snapped draw can make
    under the other (on its grid, within its reach); and x is a function of the
    releases alone (post-processing), bit for bit."""
    from dpmp.audit._privacy import _outside
    from dpmp.noise import snap_grid
    from dpmp.noise._snapped import snap_extremes

    strategy, clip, sigma, s, batch = _strategy(), 1.0, 1.0, 2, 32
    stddev = sigma * clip * strategy.sensitivity_factor(batch)
    rng = np.random.default_rng(5)
    # sums on a 2^-10 grid, so that the record's clipped gradient adds to them
    # exactly (the clipped sum's own rounding is its stage's bound, not the
    # stream's), each within the batch's B C
    without = [
        np.round(rng.standard_normal(64) * 512).astype(np.float32) / 1024 for _ in range(STEPS)
    ]
    with_record = [g.copy() for g in without]
    with_record[s][0] += np.float32(clip)
    assert with_record[s][0] - without[s][0] == clip
    assert max(np.linalg.norm(g) for g in with_record) <= batch * clip
    (x_in, a_in, y_in), (x_out, a_out, y_out) = _recorded_stream(
        monkeypatch, [with_record, without], stddev=stddev, key=3
    )

    moved = np.abs(a_in - a_out).max(axis=1) > 0
    assert moved.tolist() == [s <= t < s + BANDS for t in range(STEPS)]
    # over all steps and coordinates: column s of C' times C, within the float64
    # rounding of both neighbours' queries (2 sqrt(b) E), so within the accounted factor
    shift = np.linalg.norm(a_in - a_out)
    exact = clip * np.linalg.norm(strategy.matrix()[:, s])
    assert abs(shift - exact) <= 2 * math.sqrt(BANDS) * clip * strategy.rounding_bound(batch)
    assert shift <= clip * strategy.sensitivity_factor(batch)
    assert np.array_equal(y_in[~moved], y_out[~moved])  # the same key, the same releases

    grid = snap_grid(stddev)
    with jax.enable_x64(True):
        reach = {
            name: [np.asarray(e, np.float64) for e in snap_extremes(jnp.asarray(a), stddev)]
            for name, a in (("in", a_in), ("out", a_out))
        }
    for ys, other in ((y_in, "out"), (y_out, "in")):
        for t in range(STEPS):
            rng_t = (reach[other][0][t], reach[other][1][t])
            assert not _outside(ys[t], rng_t, grid).any()
    # the audit can fail: the query plus the same noise unsnapped (noise added to the
    # gradient in floats) is off the grid
    unsnapped = a_in[s] + (y_out[s] - a_out[s]) + grid / 3
    assert _outside(unsnapped, (reach["out"][0][s], reach["out"][1][s]), grid).all()

    for ys, xs in ((y_in, x_in), (y_out, x_out)):
        np.testing.assert_array_equal(_decoded(strategy, ys), xs)
