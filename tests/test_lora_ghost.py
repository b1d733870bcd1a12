"""Ghost clipping through LoRA: the adapters are ordinary dense layers beside the
frozen weights (``x W + s (x A) B``), so their per-example norms come from those
layers' inputs and output gradients, never from a per-example gradient of ``W``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmp
from dpmp.models._lora import lora_model
from dpmp.models._model import Model

B, T, V, D, R = 4, 3, 11, 16, 8


class TinyLM(nn.Module):
    """Embedding, causal self-attention and a head: T (K + N) < K N for the adapters
    (the Gram form) at rank 8 over 3 tokens."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(V, D, dtype=self.dtype)(ids)
        mask = nn.make_causal_mask(ids)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, dtype=self.dtype)(h, h, mask=mask)
        h = nn.relu(nn.Dense(D, dtype=self.dtype)(h))
        return nn.Dense(V, dtype=self.dtype)(h)


def _lora(dtype=jnp.float32):
    module = TinyLM(dtype=dtype)
    ids = np.random.default_rng(0).integers(0, V, size=(B, T)).astype(np.int32)
    base = module.init(jax.random.key(0), ids[:1])["params"]

    def loss_fn(p, batch):
        logits = module.apply({"params": p}, batch["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    model = Model("lm", "linen", "tiny", None, loss_fn, None, None, "tiny")
    lora = lora_model(model, base, rank=R, alpha=4.0)
    adapters = lora.init(jax.random.key(1))
    # B starts at zero; give it values so that every adapter has a gradient
    adapters = jax.tree.map(
        lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size)).reshape(a.shape), adapters
    )
    y = np.roll(ids, -1, axis=1)
    return lora, adapters, base, {"x": ids, "y": y}


def _alone(grad_fn, params, batch, base):
    """Per example, ``norm_max`` of the batch with every other example padding."""
    out = []
    for i in range(B):
        pad = np.arange(B) != i
        out.append(float(grad_fn(params, batch, base, is_padding_example=pad).stats.norm_max))
    return np.asarray(out)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_auto_takes_ghost_clipping_for_the_adapters():
    lora, adapters, base, batch = _lora()
    g = dpmp.private_grad(lora.loss_fn, l2_clip_norm=1.0, policy="f32", method="auto")
    info = g.explain(adapters, batch, base)
    assert info["method"] == "ghost", info["reason"]
    assert len(info["layers"]) == len(jax.tree.leaves(adapters))
    assert {row["layer"] for row in info["layers"]} == {"dense"}
    assert {row["rule"] for row in info["layers"]} == {"gram"}  # norms from x_i and g_i


@pytest.mark.slow  # two methods compiled in float64, ~15 s
def test_lora_ghost_norms_equal_per_example_norms_in_float64():
    with jax.enable_x64(True):
        lora, adapters, base, batch = _lora(jnp.float64)
        adapters = jax.tree.map(lambda a: a.astype(jnp.float64), adapters)
        base = jax.tree.map(lambda a: a.astype(jnp.float64), base)
        policy = "param=f64,compute=f64,output=f64,grad=f64,clip=f64,accumulate=f64,noise=f64"
        norms, sums = {}, {}
        for method in ("vmap", "ghost"):
            g = jax.jit(
                dpmp.private_grad(lora.loss_fn, l2_clip_norm=0.05, policy=policy, method=method)
            )
            norms[method] = _alone(g, adapters, batch, base)
            sums[method] = g(adapters, batch, base)
        np.testing.assert_allclose(norms["ghost"], norms["vmap"], rtol=1e-10)
        assert int(sums["vmap"].stats.num_clipped) == B  # the clipping is active
        for a, b in zip(jax.tree.leaves(sums["ghost"].grads), jax.tree.leaves(sums["vmap"].grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)


def _exact_norms(x, v, a, b, s):
    """Per example, float64 ``||[s x^T (v B^T), s (x A)^T v]||`` of ``y = x W + s (x A) B``."""
    x, v, a, b = (np.asarray(t, np.float64) for t in (x, v, a, b))
    ga = s * np.einsum("btk,btn->bkn", x, v @ b.T)
    gb = s * np.einsum("btr,btn->brn", x @ a, v)
    return np.sqrt((ga**2).sum((1, 2)) + (gb**2).sum((1, 2)))


@pytest.mark.fast_cases("f32")  # all cases: ~6 s on 2 cores
@pytest.mark.parametrize("policy", ["f32", "bf16"])
def test_the_certified_bound_holds_on_cancelling_tokens(policy):
    """Example 0: three equal tokens whose output gradients (h, -h, e) nearly cancel,
    |h| / |e| from 1 to 10^5; the norm of every example is at least its float64 norm
    from the layer's stored inputs and output gradients."""
    k, n, r, s = 16, 16, 8, 0.5
    rng = np.random.default_rng(3)
    w = rng.normal(size=(k, n)).astype(np.float32)
    adapter = {"a": rng.normal(size=(k, r)) / 4, "b": rng.normal(size=(r, n)) / 4}
    adapter = jax.tree.map(lambda t: jnp.asarray(t, jnp.float32), adapter)
    dtype = dpmp.Policy.parse(policy).compute

    def loss_fn(p, batch):  # linear in y: the output gradients are exactly v
        y = batch["x"].astype(dtype) @ p["dense"]["kernel"].astype(dtype)
        return jnp.sum(y.astype(jnp.float32) * batch["v"])

    model = Model("lm", "jax", "linear", None, loss_fn, None, None, "linear")
    lora = lora_model(model, {"dense": {"kernel": w}}, rank=r, alpha=s * r)
    params = {"dense/kernel": adapter}
    g = dpmp.private_grad(lora.loss_fn, l2_clip_norm=1.0, policy=policy, method="ghost")
    like = {"x": np.zeros((1, 3, k), np.float32), "v": np.zeros((1, 3, n), np.float32)}
    assert {row["rule"] for row in g.explain(params, like, lora.frozen)["layers"]} == {"gram"}
    g = jax.jit(g)
    for mag in np.logspace(0, 5, 6):
        x = rng.normal(size=(B, 3, k)) * 0.3
        v = rng.normal(size=(B, 3, n)) * 0.3
        x[0] = rng.normal(size=k)  # one activation on every token
        h, e = rng.normal(size=(2, n))
        v[0] = np.stack([h * mag, -h * mag, e])
        batch = {"x": x.astype(np.float32), "v": v.astype(np.float32)}
        got = _alone(g, params, batch, lora.frozen)
        # what the layers store: x and A, B in the compute dtype, v as given
        stored = (x, v, adapter["a"], adapter["b"])  # in the compute dtype
        exact = _exact_norms(*(np.asarray(jnp.asarray(t, dtype), np.float64) for t in stored), s)
        assert np.isfinite(got).all()
        tol = 1e-5 if policy == "f32" else 2.0**-7  # the rounding of g = s v B^T itself
        assert (got >= exact * (1 - tol)).all(), (mag, got / exact)


def _two_dense_layers(dtype):
    """A LoRA model of two dense layers over 3 tokens, computed in ``dtype``, its
    adapters (``B`` not zero) and a batch of ``B`` examples."""
    rng = np.random.default_rng(4)
    base = {
        "hidden": {"kernel": rng.normal(size=(D, 8)).astype(np.float32) / 4},
        "out": {"kernel": rng.normal(size=(8, 2)).astype(np.float32) / 3},
    }

    def loss_fn(p, batch):
        h = jnp.tanh(batch["x"].astype(dtype) @ p["hidden"]["kernel"].astype(dtype))
        y = (h @ p["out"]["kernel"].astype(dtype)).astype(jnp.float32)
        return jnp.mean((y - batch["y"]) ** 2)

    model = Model("lm", "jax", "two dense", None, loss_fn, None, None, "two dense")
    lora = lora_model(model, base, rank=2, alpha=4.0)
    adapters = jax.tree.map(
        lambda a: a + 0.3 * jnp.cos(jnp.arange(a.size)).reshape(a.shape),
        lora.init(jax.random.key(1)),
    )
    batch = {
        "x": rng.normal(size=(B, T, D)).astype(np.float32),
        "y": rng.normal(size=(B, T, 2)).astype(np.float32),
    }
    return lora, adapters, lora.frozen, batch


@pytest.mark.slow  # ~9 s on 2 cores
@pytest.mark.parametrize("method", ["auto", pytest.param("vmap", marks=pytest.mark.slow)])
def test_lora_inside_shard_map_clips_as_without_a_mesh(method):
    """On a mesh (here of one device) the adapters and the batch vary over its axis
    and the frozen base is replicated: the base is traced with the types it is
    evaluated on, so the same dense layers take the low-rank path (``auto`` still
    takes ghost clipping) and the clipped sum is the one of no mesh. Each sum is the
    float64 sum of the same clipped contributions rounded once to float32: they
    differ by at most one rounding each, ``2 u`` times the sum of the contributions'
    norms, at most ``k B`` for ``k`` kept examples of norm ``B = C (1 + 16 u)``, and
    by the float64 sums' own error, ``gamma_(B (T + 1))`` of float64's ``u`` each."""
    from dpmp.step._mesh import DataParallelMesh

    lora, adapters, base, batch = _two_dense_layers(jnp.bfloat16)
    clip = 0.05
    g = dpmp.private_grad(lora.loss_fn, l2_clip_norm=clip, policy="bf16", method=method)
    pad = np.arange(B) == B - 1
    plain = jax.jit(g)(adapters, batch, base, is_padding_example=pad)
    expected = "vmap" if method == "vmap" else "ghost"
    assert g.resolved_method == expected
    mesh = DataParallelMesh(jax.devices()[:1])
    grads, stats = jax.jit(mesh.summed(g, frozen=1))(
        adapters, batch, pad, dpmp.NoOpLossScale(), base
    )
    assert g.resolved_method == expected
    assert int(stats.num_examples) == int(plain.stats.num_examples) == B - 1
    assert int(stats.num_clipped) == int(plain.stats.num_clipped) == B - 1  # clipping active
    u = 2.0**-24
    terms = B * (T + 1)
    f64 = terms * 2.0**-53 / (1 - terms * 2.0**-53)
    bound = (2 * u + 2 * f64) * (B - 1) * clip * (1 + 16 * u)
    diff = np.sqrt(
        sum(
            np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain.grads), strict=True)
        )
    )
    assert diff <= bound, (diff, bound)


@pytest.mark.slow  # three families, two methods each, compiled in float64: ~30 s
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_decoder_lora_ghost_norms_equal_per_example_norms_in_float64(family):
    """LoRA on every projection of a Llama, Qwen2 or Gemma decoder (GQA, rotary, tied
    or untied head, Qwen2's biases): auto takes ghost clipping for every adapter, and
    its per-example norms and clipped sum equal per-example (vmap) gradients', both in
    float64."""
    from dpmp.models.families._decoder import decoder_config_from_json, decoder_init
    from dpmp.models.families._decoder import decoder_model as build
    from tests.test_decoder import CONFIGS, TOKENS

    config = decoder_config_from_json(CONFIGS[family] | {"num_hidden_layers": 1})
    policy = "param=f64,compute=f64,output=f64,grad=f64,clip=f64,accumulate=f64,noise=f64"
    with jax.enable_x64(True):
        base = jax.tree.map(
            lambda a: jnp.asarray(a, jnp.float64), decoder_init(config, jax.random.key(0))
        )
        lora = lora_model(build(config, policy), base, rank=R, alpha=4.0)
        adapters = jax.tree.map(
            lambda a: (a + 0.05 * jnp.cos(jnp.arange(a.size)).reshape(a.shape)).astype(jnp.float64),
            lora.init(jax.random.key(1)),
        )
        batch = {"x": np.asarray(TOKENS[:B, :6] % config.vocab_size, np.int32)}
        batch["x"] = np.concatenate([batch["x"]] * (B // len(batch["x"]) + 1))[:B]
        batch["y"] = np.zeros(B, np.int32)  # next tokens are the targets
        auto = dpmp.private_grad(lora.loss_fn, l2_clip_norm=0.05, policy=policy, method="auto")
        info = auto.explain(adapters, batch, base)
        assert info["method"] == "ghost", info["reason"]
        assert len(info["layers"]) == len(jax.tree.leaves(adapters))
        norms, sums = {}, {}
        for method in ("vmap", "ghost"):
            g = jax.jit(
                dpmp.private_grad(lora.loss_fn, l2_clip_norm=0.05, policy=policy, method=method)
            )
            norms[method] = _alone(g, adapters, batch, base)
            sums[method] = g(adapters, batch, base)
        assert (norms["vmap"] > 0.05).all()  # every example is clipped
        np.testing.assert_allclose(norms["ghost"], norms["vmap"], rtol=1e-10)
        for a, b in zip(jax.tree.leaves(sums["ghost"].grads), jax.tree.leaves(sums["vmap"].grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)
