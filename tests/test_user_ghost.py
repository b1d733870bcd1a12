"""User-level ghost norms (``dpmp.clipping._users``): ghost clipping of a user's loss
takes the Gram form over all of the user's records' rows, so its norms are those
of the user's SUMMED gradient. Checked in float64 against per-user gradients
summed from per-record ones (no ghost and no ``private_grad`` in the
reference), for dense, attention, LoRA and tied-embedding layers; the crafted
user and padding under ghost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp.clipping._users import RECORD_MASK, UNIT_REASON, user_private_grad

F64 = "param=f64,compute=f64,output=f64,grad=f64,clip=f64,accumulate=f64,noise=f64"
U32 = 2.0**-24
# Ghost norms in float64 carry a certified bound of about (K + N + (kT)^2) u64
# relative (a few hundred rows here: below 1e-11); the sums read them through the
# clip factor. Both then agree with the reference far inside these.
NORM_RTOL, SUM_RTOL, SUM_ATOL = 1e-10, 1e-9, 1e-12


def _per_user_f64(loss_fn, params, batch, real, *rest):
    """float64: each user's gradient, the sum of its real records' gradients
    (``[users, ...]`` leaves), from per-record gradients of ``loss_fn``."""
    users, k = real.shape
    flat = {name: v.reshape(users * k, 1, *v.shape[2:]) for name, v in batch.items()}
    grads = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, *[None] * len(rest))))(
        params, flat, *rest
    )
    keep = real.astype(np.float64)
    return [
        np.einsum("uk,uk...->u...", keep, np.asarray(g).reshape(users, k, *g.shape[1:]))
        for g in jax.tree.leaves(grads)
    ]


def _norms(per_user):
    return np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, 1) for g in per_user))


def _clip_between(norms):
    """A clip norm between the two middle norms: some users clipped, some not."""
    u = np.sort(norms[norms > 0])
    return float(u[len(u) // 2 - 1] + u[len(u) // 2]) / 2


def _jit(g):
    return jax.jit(lambda p, b, pad, *rest: g(p, b, *rest, is_padding_example=pad))


def _used_norms(loss_fn, params, batch, users, rest, norms, method="ghost"):
    """Per user, the norm the clip factor used, in float64: alone in the batch (the
    others padding) and clipped to ``c`` below its norm, a user contributes ``g_u c
    / n_u``, so ``n_u = c ||g_u|| / ||contribution||`` (``g_u``, ``norms``: the
    reference's)."""
    c = float(norms.min()) / 2
    step = _jit(user_private_grad(loss_fn, l2_clip_norm=c, policy=F64, method=method))
    got = []
    for u in range(users):
        out = step(params, batch, np.arange(users) != u, *rest)
        size = np.sqrt(sum(np.sum(np.asarray(g) ** 2) for g in jax.tree.leaves(out.grads)))
        got.append(c * norms[u] / size)
    return np.asarray(got)


def _check(loss_fn, params, batch, real, rest=(), *, rules, inner32=False):
    """Ghost per-user norms and clipped sums against the float64 reference;
    ``rules``: norm rules ``explain`` must list. ``inner32``: the model computes
    some stages in float32 (layer norms, softmax), which XLA rounds differently in
    each batching, so agreement is then within ``64 u32`` relative (a few float32
    stages, each a sum of a few dozen terms). Returns ``explain``'s answer."""
    users = real.shape[0]
    full = {**batch, RECORD_MASK: real}
    per_user = _per_user_f64(loss_fn, params, batch, real, *rest)
    norms = _norms(per_user)
    clip = _clip_between(norms)
    ghost = user_private_grad(loss_fn, l2_clip_norm=clip, policy=F64, method="ghost")
    info = ghost.explain(params, full, *rest)
    assert info["method"] == "ghost" and info["unit"] == "user"
    assert info["reason"].startswith(UNIT_REASON)
    used = {row["rule"] for row in info["layers"]}
    assert set(rules) <= used, used
    got = _used_norms(loss_fn, params, full, users, rest, norms)
    out = _jit(ghost)(params, full, np.zeros(users, bool), *rest)
    factor = np.minimum(1.0, clip / norms)
    want = [np.einsum("u,u...->...", factor, g) for g in per_user]
    rtol, atol = (64 * U32, users * clip * 64 * U32) if inner32 else (NORM_RTOL, SUM_ATOL)
    np.testing.assert_allclose(got, norms, rtol=rtol)
    for a, b in zip(jax.tree.leaves(out.grads), want, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0 if inner32 else SUM_RTOL, atol=atol)
    assert 0 < int(out.stats.num_clipped) < users
    return info


def _real(rng, users, k):
    """Real-record masks: every user has one record, some fewer than ``k``."""
    real = rng.random((users, k)) < 0.7
    real[:, 0] = True
    return real


# ---- dense: the Gram form over a user's k x T rows --------------------------------


def _dense_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])  # [B, T, 32]
    return jnp.mean(jnp.square((h @ p["w2"])[..., 0] - b["y"]))


def test_dense_user_ghost_norms_equal_summed_gradients_in_float64():
    """w1 is 24 x 32 over k T = 8 rows: K N > kT (K + N), the Gram form."""
    users, k, t = 5, 4, 2
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        params = {
            "w1": jnp.asarray(rng.normal(size=(24, 32)) / 5),
            "b1": jnp.asarray(rng.normal(size=32)),
            "w2": jnp.asarray(rng.normal(size=(32, 1))),
        }
        batch = {"x": rng.normal(size=(users, k, t, 24)), "y": rng.normal(size=(users, k, t))}
        info = _check(_dense_loss, params, batch, _real(rng, users, k), rules=["gram"])
    by_leaf = {row["param"]: row["rule"] for row in info["layers"]}
    assert by_leaf["['w1']"] == "gram", by_leaf


# ---- attention, LoRA and tied embeddings -------------------------------------------

V, D = 40, 24  # vocabulary, width: K N > kT (K + N) for kT = 8 rows (the Gram form)


def _attention_params(rng):
    def w(*shape):
        return {"kernel": jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]))}

    return {"wte": {"embedding": jnp.asarray(rng.normal(size=(V, D)))}} | {
        name: w(D, D) for name in ("q", "k", "v", "o")
    }


def _attention_loss(p, b):
    """A causal self-attention layer between an embedding and a head tied to it,
    everything in the params' dtype: ids [B, T] -> W[ids] -> attention -> h W^T."""
    h = jnp.take(p["wte"]["embedding"], b["x"], axis=0)  # [B, T, D]
    q, k, v = (h @ p[name]["kernel"] for name in ("q", "k", "v"))
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    t = b["x"].shape[-1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
    h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), v) @ p["o"]["kernel"]
    logits = jnp.tanh(h) @ p["wte"]["embedding"].T
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, b["y"][..., None], -1))


def _tokens(rng, users, k, t, vocab, labels=True):
    x = rng.integers(0, vocab, size=(users, k, t)).astype(np.int32)
    if labels:
        return {"x": x, "y": rng.integers(0, vocab, size=(users, k, t)).astype(np.int32)}
    return {"x": x, "y": np.zeros((users, k), np.int32)}  # next tokens are the targets


def _rules_of(info, name):
    return {row["rule"] for row in info["layers"] if name in row["param"]}


@pytest.mark.slow  # ~10 s on 2 busy cores
def test_attention_and_tied_embedding_user_ghost_norms_equal_summed_gradients_in_float64():
    """Attention projections (the Gram form over a user's k T = 8 rows) and a table
    tied between the embedding and the head (the id-gram, the head's Gram form and
    their cross term)."""
    users, k, t = 4, 2, 4
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        params = _attention_params(rng)
        batch = _tokens(rng, users, k, t, V)
        real = np.ones((users, k), bool)
        real[1, 1] = False  # a user with one record
        info = _check(_attention_loss, params, batch, real, rules=["gram"])
    for name in ("q", "k", "v", "o"):
        assert _rules_of(info, f"['{name}']") == {"gram"}, info["layers"]
    assert _rules_of(info, "wte") - {"per-example"}, info["layers"]


@pytest.mark.slow  # ~25 s on 2 busy cores
def test_lora_user_ghost_norms_equal_summed_gradients_in_float64():
    """Rank-16 adapters on the attention projections, the base frozen (an argument of
    the step): each 24 x 16 adapter takes the Gram form over k T = 6 rows."""
    from dpmp.models._lora import lora_model
    from dpmp.models._model import Model

    users, k, t = 4, 2, 3
    rng = np.random.default_rng(2)
    with jax.enable_x64(True):
        base = _attention_params(rng)
        model = Model("lm", "plain", "attention", None, _attention_loss, None, None, "tiny")
        lora = lora_model(model, base, rank=16, alpha=4.0)
        adapters = jax.tree.map(  # B starts at zero: give every adapter a gradient
            lambda a: (
                jnp.asarray(a, jnp.float64) + 0.05 * jnp.cos(jnp.arange(a.size)).reshape(a.shape)
            ),
            lora.init(jax.random.key(1)),
        )
        batch = _tokens(rng, users, k, t, V)
        real = np.ones((users, k), bool)
        real[2, 1] = False
        info = _check(lora.loss_fn, adapters, batch, real, (base,), rules=["gram"])
    assert [row["rule"] for row in info["layers"]] == ["gram"] * len(jax.tree.leaves(adapters))


@pytest.mark.slow  # GPT-2 compiled in float64: ~30 s on 2 cores
def test_gpt2_user_ghost_norms_equal_summed_gradients():
    """dpmp's GPT-2, every parameter trained (attention, MLP, layer norms, the token
    table tied to the head) in float64 but for its layer norms and softmax."""
    from dpmp.models.families._gpt2 import GPT2Config, gpt2_init, gpt2_model

    users, k, t = 4, 2, 4
    config = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2)
    rng = np.random.default_rng(3)
    with jax.enable_x64(True):
        # GPT-2's N(0, 0.02^2) weights, scaled so that every layer's gradient matters
        params = jax.tree.map(
            lambda a: 10 * jnp.asarray(a, jnp.float64), gpt2_init(config, jax.random.key(0))
        )
        batch = _tokens(rng, users, k, t, 64, labels=False)
        real = np.ones((users, k), bool)
        real[1, 1] = False
        model = gpt2_model(config, F64)
        info = _check(model.loss_fn, params, batch, real, rules=["gram"], inner32=True)
    assert "gram" in _rules_of(info, "c_attn"), info["layers"]
    assert _rules_of(info, "wte") - {"per-example"}, info["layers"]


# ---- the crafted user and padding, under ghost ------------------------------------


def test_a_crafted_user_moves_the_ghost_sum_by_at_most_the_sensitivity():
    """A user whose k records all push one way through a Gram-form layer (32 x 32
    over k = 8 rows): with ghost norms it moves the clipped sum by at most the
    accounted sensitivity (about C); each record alone, at record level, by k C."""
    k, clip, dim = 8, 1.0, 32
    rng = np.random.default_rng(4)
    w = jnp.zeros((dim, dim), jnp.float32)
    out_dir = jnp.asarray(rng.normal(size=dim) / np.sqrt(dim), jnp.float32)
    out_dir = out_dir / jnp.linalg.norm(out_dir)

    def loss(p, b):  # each record's gradient is -x v^T: norm |x|, one direction
        return -jnp.mean((b["x"] @ p) @ out_dir)

    direction = rng.normal(size=dim)
    x = np.empty((2, k, dim), np.float32)
    x[0] = 3.0 * clip * direction / np.linalg.norm(direction)
    x[1] = rng.normal(size=(k, dim))  # another user
    batch = {"x": x, RECORD_MASK: np.ones((2, k), bool)}
    g = user_private_grad(loss, l2_clip_norm=clip, policy="fp32", method="ghost")
    assert {row["rule"] for row in g.explain(w, batch)["layers"]} == {"gram"}
    step = _jit(g)
    with_user = step(w, batch, np.array([False, False]))
    without = step(w, batch, np.array([True, False]))
    moved = float(jnp.linalg.norm(with_user.grads - without.grads))
    # Clipped to C by a certified norm: above the exact one by at most the Gram bound,
    # (K + N + 2T) u relative for aligned rows (ghost._gram.gram), less 16 u for the
    # clip factor's rounding and a few u for the sum's.
    least = clip * (1 - (dim + dim + 2 * k + 16 + 8) * U32)
    assert least < moved <= g.sensitivity_bound(batch_size=2)["sensitivity"]
    record_level = dpmp.private_grad(loss, l2_clip_norm=clip, policy="fp32", method="ghost")
    alone = jax.jit(record_level)(w, {"x": x[0]})  # each record a unit
    assert float(jnp.linalg.norm(alone.grads)) > k * clip * (1 - 16 * U32)


def test_padding_users_and_records_contribute_exactly_zero_under_ghost():
    """Whatever a padding user or a padding record holds, the clipped sum and the
    statistics are the same, bit for bit (ghost: the tied attention model in
    float32, Gram, id-gram and tied rules)."""
    users, k, t = 5, 2, 4
    rng = np.random.default_rng(5)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), _attention_params(rng))
    batch = _tokens(rng, users, k, t, V)
    real = np.ones((users, k), bool)
    real[0, 1] = real[3, 1] = False
    pad = np.zeros(users, bool)
    pad[-1] = True
    g = user_private_grad(_attention_loss, l2_clip_norm=0.5, policy="fp32", method="ghost")
    rules = {row["rule"] for row in g.explain(params, {**batch, RECORD_MASK: real})["layers"]}
    assert "gram" in rules and rules - {"gram", "per-example"}, rules
    step = _jit(g)
    first = step(params, {**batch, RECORD_MASK: real}, pad)
    other = {name: v.copy() for name, v in batch.items()}
    for v in other.values():  # new contents at every padding record and user
        fresh = rng.integers(0, V, size=v.shape).astype(v.dtype)
        v[~real | pad[:, None]] = fresh[~real | pad[:, None]]
    assert any((other[n] != batch[n]).any() for n in batch)
    second = step(params, {**other, RECORD_MASK: real}, pad)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(first.stats.num_examples) == users - 1
