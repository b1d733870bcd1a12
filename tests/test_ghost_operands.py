"""Ghost contractions on half-precision operands: where they are read, and the bound."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp.clipping.ghost._operands import (
    HALF_ACCUMULATION_U,
    accumulation_roundoff,
    half_operands,
    operands,
)
from tests import test_ghost
from tests.test_ghost import ADV_B, ADV_T, _adv_dense, _adv_embed, _crafted


def _dots(policy, problem, kind):
    """(operand dtypes, result dtype, HIGHEST) of every dot_general of the ghost step."""
    loss, params, batches = _crafted(problem, [1.0])
    batch = jax.tree.map(lambda x: x[0], batches)
    g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy=policy, method="ghost")
    with operands(kind):
        text = jax.jit(lambda p, b: g(p, b).grads).lower(params, batch).as_text()
    out = []
    for line in re.findall(r"stablehlo.dot_general.*", text):
        types = re.findall(r"tensor<[0-9x]*x?(\w+)>", line.split(":")[-1])
        out.append((types[0], types[1], types[-1], "HIGHEST" in line))
    return text, out


def test_half_operands_are_read_only_where_both_are_one_half_dtype():
    f32, bf16, f16, i32 = (jnp.dtype(d) for d in ("float32", "bfloat16", "float16", "int32"))
    with operands("half"):
        assert half_operands(bf16, bf16, f32) == bf16
        assert half_operands(i32, f16, f32) == f16  # embedding ids and fp16 output gradients
        assert half_operands(bf16, f32, f32) is None  # a float32 output gradient
        assert half_operands(bf16, f16, f32) is None
        assert half_operands(bf16, bf16, jnp.float64) is None  # only a float32 clip dtype
    with operands("float32"):
        assert half_operands(bf16, bf16, f32) is None
        assert half_operands(bf16, bf16, f32, anywhere=True) == bf16
    with operands("auto"):  # the device's choice: float32 on CPU, where bf16 is emulated
        assert (half_operands(bf16, bf16, f32) is None) == (jax.default_backend() == "cpu")
    with pytest.raises(ValueError, match="operands: unknown 'bf16'; allowed: auto, half"):
        operands("bf16").__enter__()
    assert accumulation_roundoff(f32, f32) == 2.0**-24
    assert accumulation_roundoff(bf16, f32) == HALF_ACCUMULATION_U == 2.0**-22


def test_bf16_gram_reads_bf16_and_the_float32_step_is_unchanged():
    """Under bf16 the two Gram matrices read bf16 with float32 results (no HIGHEST);
    the row dot products and the clip-weighted sum stay float32/float64 at HIGHEST.
    Under fp32 the lowered step is the same text with half operands switched off."""
    _, dots = _dots("bf16", _adv_dense(), "half")
    assert dots[:2] == [("bf16", "bf16", "f32", False)] * 2, dots
    assert all(d[0] in ("f32", "f64") and d[3] for d in dots[2:]), dots
    _, dots = _dots("bf16", _adv_dense(), "float32")
    assert all(d[0] in ("f32", "f64") and d[3] for d in dots), dots
    on, _ = _dots("fp32", _adv_dense(), "half")
    off, _ = _dots("fp32", _adv_dense(), "float32")
    assert on == off


def _summed_g(v, policy, scale):
    """The float32 output gradients the clipped sum reads, in float64: ``v`` cast to the
    compute dtype, scaled in float32, rounded to the compute dtype (the cotangent of the
    layer's output), divided by the scale in float32."""
    dtype = dpmp.Policy.parse(policy).compute
    v_c = np.asarray(jnp.asarray(v).astype(dtype), np.float32)
    g_s = np.asarray(jnp.asarray(np.float32(scale) * v_c).astype(dtype), np.float32)
    return (g_s * (np.float32(1) / np.float32(scale))).astype(np.float64)


def _exact_norms(kind, batch, policy, scale):
    """Per example, the float64 norm of the gradient the clipped sum reads."""
    dtype = dpmp.Policy.parse(policy).compute
    if kind == "dense":
        x = np.asarray(jnp.asarray(batch["x"]).astype(dtype), np.float64)
        g = _summed_g(batch["v"], policy, scale)
        return np.linalg.norm(np.einsum("btk,btn->bkn", x, g), axis=(1, 2))
    sq = 0.0
    for name, vocab in (("gram", 40), ("rows", 2)):
        g = _summed_g(batch[name], policy, scale)
        rows = np.zeros((ADV_B, vocab, g.shape[-1]))
        for b in range(ADV_B):
            np.add.at(rows[b], batch["ids"][b], g[b])
        sq = sq + np.sum(np.square(rows), axis=(1, 2))
    return np.sqrt(sq)


def _cancelling_trials(kind, policy, rng):
    """Crafted (a, a, a) / (h, -h, e) examples and random near-cancelling ones, their
    magnitudes over 24 decades (6 in fp16, whose range is narrower)."""
    problem = {"dense": _adv_dense, "embed": _adv_embed}[kind]()
    top = 3 if policy == "fp16" else 12
    _, params, crafted = _crafted(problem, np.logspace(-1, top / 2, 6))
    trials = [jax.tree.map(lambda x, i=i: x[i], crafted) for i in range(6)]
    for _ in range(10):
        b = problem[2](rng, rng.normal(size=8), np.zeros((ADV_T, 8)))
        mag = 10.0 ** rng.uniform(-top, top)
        for name in [k for k in b if k not in ("x", "ids")]:
            v = b[name]
            signs = rng.choice([-1.0, 1.0], size=v.shape[:2] + (1,))
            signs[:, -1] = -signs[:, :-1].sum(1)
            v = signs * v[:, :1] + v * 10.0 ** rng.uniform(-8, 0)
            b[name] = (v * mag).astype(np.float32)
        if "x" in b:
            b["x"] = (b["x"][:, :1] + b["x"] * 10.0 ** rng.uniform(-8, 0)).astype(np.float32)
        trials.append(b)
    return problem[0], params, trials


@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["dense", "embed"])
def test_certified_norm_is_never_below_the_float64_norm(kind, policy, scale):
    """Every certified ghost norm (each example alone) is at least the float64 norm of
    the gradient the clipped sum reads, on cancelling tokens and huge or tiny norms,
    with a loss scale whose inverse rounds (3) or not (1); and finite where it is."""
    rng = np.random.default_rng(11)
    loss, params, trials = _cancelling_trials(kind, policy, rng)
    g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy=policy, method="ghost")
    ls = dpmp.StaticLossScale(scale)

    def norms(b):
        def one(i):
            return g(params, b, loss_scale=ls, is_padding_example=jnp.arange(ADV_B) != i)

        return jax.lax.map(lambda i: one(i).stats.norm_max, jnp.arange(ADV_B))

    batches = jax.tree.map(lambda *xs: np.stack(xs), *trials)
    with operands("half"):
        got = np.asarray(jax.jit(lambda bs: jax.lax.map(norms, bs))(batches), np.float64)
    exact = np.stack([_exact_norms(kind, b, policy, scale) for b in trials])
    assert np.isfinite(exact).all() and np.isfinite(got).all()
    assert (got >= exact * (1 - 2.0**-22)).all(), np.min(got / exact)
    # not vacuous: the cancelling examples are there, and ordinary tokens stay close
    assert np.max(got[exact > 0] / exact[exact > 0]) > 10
    np.testing.assert_allclose(got[:6, 1:], exact[:6, 1:], rtol=1e-3)  # ordinary examples


# all cases: ~20 s on 2 cores
@pytest.mark.fast_cases("dense-bf16", "dense-fp16", "conv-fp16", "conv_per_example-fp16")
@pytest.mark.parametrize("policy", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", sorted(test_ghost.ADVERSARIAL))
def test_cancelling_tokens_bound_holds_on_half_operands(kind, policy):
    """tests/test_ghost.py's crafted cancelling examples (the example alone and its
    removal from the sum within C (1 + 1e-5), no NaN), with half operands read."""
    with operands("half"):
        test_ghost.test_ghost_bound_holds_on_cancelling_tokens(kind, policy)
