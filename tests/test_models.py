"""Model kinds: each loss works with dpmp.private_grad, in the policy's dtypes."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp.models import Architecture, build_model
from dpmp.models._model import count_params

DIGITS = types.SimpleNamespace(input_shape=(8, 8, 1), num_classes=10)
SMALL_VIT = dict(patch=4, dim=16, depth=1, heads=2)


def _batch(n=4, shape=(8, 8, 1)):
    x = jax.random.normal(jax.random.key(1), (n, *shape), jnp.float32)
    return {"x": x, "y": jnp.arange(n, dtype=jnp.int32) % 10}


@pytest.mark.slow  # ~8 s on 2 cores
@pytest.mark.parametrize(
    "kind, extra, framework",
    [
        ("mlp", {}, "flax.linen"),
        ("nnx_mlp", {}, "flax.nnx"),
        ("linear", {}, "jax"),
        ("linear", {"hidden": ()}, "jax"),
        pytest.param("vit", SMALL_VIT, "flax.linen", marks=pytest.mark.slow),
    ],
)
def test_kind_with_private_grad(kind, extra, framework):
    model = build_model(kind, DIGITS, "bf16", Architecture(**{"hidden": (16,), **extra}))
    assert model.framework == framework and model.kind == kind
    params = jax.jit(model.init)(jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    g = dpmp.private_grad(model.loss_fn, l2_clip_norm=1.0, policy="bf16")
    pad = jnp.array([False, False, False, True])
    out = jax.jit(g)(params, _batch(), is_padding_example=pad)
    assert jax.tree.structure(out.grads) == jax.tree.structure(params)
    for leaf in jax.tree.leaves(out.grads):
        assert leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all())
    assert int(out.stats.num_examples) == 3
    assert float(out.stats.norm_max) > 0
    norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(out.grads)))
    assert float(norm) <= 3.0 * (1 + 1e-5)  # three real examples, each clipped to 1
    logits = jax.jit(model.predict)(params, _batch()["x"])
    assert logits.shape == (4, 10) and logits.dtype == jnp.float32


@pytest.mark.slow  # ~4 s on 2 cores
def test_loss_runs_in_the_compute_dtype():
    model = build_model("mlp", DIGITS, "bf16", Architecture(hidden=(8,)))
    params = model.init(jax.random.key(0))
    jaxpr = jax.make_jaxpr(model.loss_fn)(params, _batch())
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in dots)
    assert jaxpr.out_avals[0].dtype == jnp.float32


def test_nnx_params_are_an_nnx_state():
    from flax import nnx

    model = build_model("nnx_mlp", DIGITS, "fp32", Architecture(hidden=(8,)))
    params = model.init(jax.random.key(0))
    assert isinstance(params, nnx.State)
    assert count_params(params) == 64 * 8 + 8 + 8 * 10 + 10


@pytest.mark.slow  # ~4 s on 2 cores
def test_linear_matches_a_numpy_reference():
    model = build_model("linear", DIGITS, "fp32", Architecture(hidden=()))
    params = model.init(jax.random.key(0))
    batch = _batch()
    w, b = np.asarray(params["layer_0"]["w"]), np.asarray(params["layer_0"]["b"])
    logits = np.asarray(batch["x"]).reshape(4, -1) @ w + b
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
    logp -= logits.max(1, keepdims=True)
    want = -logp[np.arange(4), np.asarray(batch["y"])].mean()
    np.testing.assert_allclose(float(model.loss_fn(params, batch)), want, rtol=1e-5)
    assert model.name.startswith("linear")
    mlp = build_model("linear", DIGITS, "fp32", Architecture(hidden=(8,)))
    assert mlp.name.startswith("plain-JAX MLP")


def test_vit_shapes_and_validation():
    model = build_model("vit", DIGITS, "bf16", Architecture(**SMALL_VIT))
    params = jax.eval_shape(model.init, jax.random.key(0))
    assert params["pos_embedding"].shape == (1, 4, 16)  # (8 / 4)^2 tokens
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    logits = jax.eval_shape(model.predict, params, _batch(2)["x"])
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    with pytest.raises(ValueError, match="model.patch: 3 must divide"):
        build_model("vit", DIGITS, "fp32", Architecture(patch=3, dim=16, heads=2))
    flat = types.SimpleNamespace(input_shape=(64,), num_classes=10)
    with pytest.raises(ValueError, match="needs image inputs"):
        build_model("vit", flat, "fp32")


@pytest.mark.slow
def test_vit_example_does_not_see_the_batch():
    model = build_model("vit", DIGITS, "fp32", Architecture(**SMALL_VIT))
    params = jax.jit(model.init)(jax.random.key(0))
    predict = jax.jit(model.predict)
    # one example's logits do not depend on the rest of the batch (no batch statistics)
    x = _batch(3)["x"]
    alone = predict(params, x[:1])
    together = predict(params, x)
    assert together.shape == (3, 10)
    together = together[:1]
    np.testing.assert_allclose(alone, together, rtol=1e-5, atol=1e-6)


# ---- the causal language model -----------------------------------------------------


def _lm_model(policy="fp32", seq_len=12):
    from dpmp.data._text import VOCAB

    info = type("Text", (), {"input_shape": (seq_len + 1,), "num_classes": VOCAB})()
    info.task = "next_token"
    return build_model("lm", info, policy, Architecture(dim=16, depth=1, heads=2))


def _records(seq_len=12):
    from dpmp.data._text import encode_records

    return encode_records(["hello world, hello", "abc", "private record"], seq_len)


@pytest.mark.slow  # ~9 s on 2 cores
def test_lm_loss_is_the_masked_next_token_cross_entropy_float64():
    from dpmp.data._text import PAD

    model = _lm_model()
    params = jax.jit(model.init)(jax.random.key(0))
    tokens, counts = _records()
    logits = np.asarray(jax.jit(model.predict)(params, tokens), np.float64)
    per_record = []
    for row, logit, n in zip(tokens, logits, counts):
        z = logit[:-1] - logit[:-1].max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        ce = -logp[np.arange(len(row) - 1), row[1:]]
        real = row[1:] != PAD
        assert real.sum() == n
        per_record.append(ce[real].mean())
    batch = {"x": tokens, "y": counts}
    loss = float(jax.jit(model.loss_fn)(params, batch))
    assert loss == pytest.approx(np.mean(per_record), rel=1e-5)
    loss_sum, correct, count = jax.jit(model.metrics)(params, batch)
    assert np.asarray(count).tolist() == counts.tolist()
    np.testing.assert_allclose(np.asarray(loss_sum) / counts, per_record, rtol=1e-5)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_lm_padding_contributes_nothing_and_attention_is_causal():
    from dpmp.data._text import PAD, encode_records

    model = _lm_model(seq_len=12)
    params = jax.jit(model.init)(jax.random.key(1))
    grad = jax.jit(jax.value_and_grad(model.loss_fn))
    # the same record with 9 and with 3 padding positions: same loss, same gradient
    long, _ = encode_records(["abc"], 12)
    short, _ = encode_records(["abc"], 6)
    (a, ga), (b, gb) = grad(params, {"x": long}), grad(params, {"x": short})
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    # causality: a later token never changes an earlier position's logits
    tokens, counts = _records()
    later = tokens.copy()
    later[0, 8] = (later[0, 8] + 1) % 256
    predict = jax.jit(model.predict)
    a, b = predict(params, tokens[:1]), predict(params, later[:1])
    np.testing.assert_array_equal(np.asarray(a)[0, :8], np.asarray(b)[0, :8])
    assert not np.array_equal(np.asarray(a)[0, 8:], np.asarray(b)[0, 8:])
    assert PAD not in tokens[0, 1 : 1 + counts[0]]


def test_lm_needs_text_and_text_needs_the_lm():

    digits = type("Digits", (), {"input_shape": (8, 8, 1), "num_classes": 10})()
    with pytest.raises(ValueError, match="needs a text dataset"):
        build_model("lm", digits, "fp32")
    text = type("Text", (), {"input_shape": (13,), "num_classes": 258, "task": "next_token"})()
    with pytest.raises(ValueError, match="text data needs model.kind = 'lm'"):
        build_model("mlp", text, "fp32")
