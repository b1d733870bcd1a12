"""Ghost rules are registered per layer family: a new family is one rule and one
registration, and ``private_grad(method="ghost")`` and ``dpmp train`` use it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp.clipping import ghost
from dpmp.clipping._rounding import sum_of_squares, wide
from dpmp.clipping.ghost import _rule
from dpmp.clipping.ghost._dense import DenseRule, dot_operands
from tests._reference import (
    classification_batch,
    clipped_sum_f64,
    flat,
    mlp_init,
    mlp_loss,
    per_example_grads_f64,
)

N, CLIP = 24, 0.5


@pytest.fixture
def registry(monkeypatch):
    """The rule registry, restored after the test (the test registers in a copy)."""
    monkeypatch.setattr(_rule, "RULES", _rule.RULES.copy())
    return _rule


def _tempered_init():
    params = mlp_init()
    rng = np.random.default_rng(3)
    params["t"] = (1.0 + rng.uniform(size=params["b1"].shape)).astype(np.float32)
    return params


def _tempered_loss(params, batch):
    """The MLP with a learned temperature per hidden unit: a parameter DIVIDES a layer's
    values, which no built-in rule takes."""
    h = jnp.tanh((batch["x"] @ params["w1"] + params["b1"]) / params["t"])
    logits = (h @ params["w2"] + params["b2"]).astype(jnp.promote_types(h.dtype, jnp.float32))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def _close_to_f64(out, loss, params, batch):
    ref, norms = clipped_sum_f64(per_example_grads_f64(loss, params, batch), CLIP)
    assert int(out.stats.num_clipped) == int((norms > CLIP).sum()) > N // 2
    assert np.linalg.norm(flat(out.grads) - ref) <= 1e-5 * np.linalg.norm(ref)
    np.testing.assert_allclose(float(out.stats.norm_max), norms.max(), rtol=1e-5)


@pytest.mark.slow  # ~8 s on 2 cores
def test_a_new_family_is_one_rule_and_one_registration(registry):
    """A divisor has no rule: ghost clipping refuses the model. Registered as a family
    whose per-example gradient is formed, the same model runs under ghost clipping
    and its clipped sum equals the float64 per-example reference (and the vmap path)."""
    params, batch = _tempered_init(), classification_batch(N)
    with pytest.raises(ValueError, match="'div', for which ghost clipping has no rule"):
        dpmp.private_grad(_tempered_loss, l2_clip_norm=CLIP, policy="f32", method="ghost")(
            params, batch
        )

    registry.register_rule(ghost.PerExampleRule(("div",), kind="divisor", described="divisor"))
    g = dpmp.private_grad(_tempered_loss, l2_clip_norm=CLIP, policy="f32", method="ghost")
    out = jax.jit(g)(params, batch)
    assert {"param": "['t']", "layer": "divisor", "rule": "per-example"} in (
        g.explain(params, batch)["layers"]
    )
    _close_to_f64(out, _tempered_loss, params, batch)
    v = dpmp.private_grad(_tempered_loss, l2_clip_norm=CLIP, policy="f32", method="vmap")
    ref = flat(jax.jit(v)(params, batch).grads)
    assert np.linalg.norm(flat(out.grads) - ref) <= 1e-5 * np.linalg.norm(ref)


class _FormedOuterRule(DenseRule):
    """A toy ghost norm for dense layers: per example, ``x_i^T g_i`` formed from the
    stored values and its sum of squares certified; the magnitude ``sum_t |x_t| |g_t|``
    as the floor against cancellation needs. The clipped sum takes the driver's
    default route (the vjp of the layer, weighted)."""

    norm = "toy-outer"
    clipped_sum = None

    def __init__(self):
        self.calls = 0

    def mode(self, eqn, pos):
        return "ghost"  # every dense layer, whatever its shape

    def sq_norms(self, eqn, pos, a, g, dtype, wide_dtype):
        self.calls += 1

        def one(a_, g_):
            am, gm = dot_operands(eqn, pos, a_, g_)
            kn = am.T @ gm
            with wide(wide_dtype):
                sq = sum_of_squares(kn, kn.size, dtype, wide_dtype).astype(dtype)
            m = jnp.sum(jnp.linalg.norm(am, axis=1) * jnp.linalg.norm(gm, axis=1))
            return sq, m

        return jax.vmap(one)(a, g)


@pytest.mark.slow  # ~5 s on 2 cores
def test_a_registered_rule_replaces_a_built_in_one(registry):
    """A toy dense rule, registered over the built-in one, takes the norm of every
    dense layer of the MLP (``explain`` names it, the driver calls it) and gives the
    float64 per-example reference's clipped sum."""
    toy = _FormedOuterRule()
    with pytest.raises(ValueError, match="already registered"):
        registry.register_rule(toy)
    registry.register_rule(toy, replace=True)
    params, batch = mlp_init(), classification_batch(N)
    g = dpmp.private_grad(mlp_loss, l2_clip_norm=CLIP, policy="f32", method="ghost")
    rules = {row["param"]: row["rule"] for row in g.explain(params, batch)["layers"]}
    assert rules == {
        "['w1']": "toy-outer",
        "['w2']": "toy-outer",
        "['b1']": "per-example",
        "['b2']": "per-example",
    }
    out = jax.jit(g)(params, batch)
    assert toy.calls == 2  # one per dense layer, traced once
    _close_to_f64(out, mlp_loss, params, batch)


def _exp_loss(params, batch):
    """A parameter read through ``exp`` (one input) before it meets the data."""
    logits = batch["x"] @ jnp.exp(params["w1"])[:, :4]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


@pytest.mark.slow  # ~4 s on 2 cores
def test_a_rule_for_a_one_input_primitive_is_refused_in_one_line(registry):
    """A rule registered for ``exp`` cannot take a layer's input from the other
    operand: ghost clipping refuses the model in one line (an IndexError before), and
    ``auto`` clips it per example, as the float64 reference does."""
    registry.register_rule(ghost.PerExampleRule(("exp",), kind="exp", described="exp"))
    params, batch = {"w1": mlp_init()["w1"] * 0.1}, classification_batch(N)
    with pytest.raises(ValueError, match="'exp', a primitive of 1 inputs; ghost rules are for two"):
        dpmp.private_grad(_exp_loss, l2_clip_norm=CLIP, policy="f32", method="ghost")(params, batch)
    auto = dpmp.private_grad(_exp_loss, l2_clip_norm=CLIP, policy="f32", method="auto")
    assert auto.explain(params, batch)["method"] == "vmap"
    ref, _ = clipped_sum_f64(per_example_grads_f64(_exp_loss, params, batch), CLIP)
    got = flat(jax.jit(auto)(params, batch).grads)
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)


def test_a_rule_lacking_what_the_driver_reads_is_refused(registry):
    class Partial:
        primitives = ("exp",)
        described = "partial"

    with pytest.raises(
        TypeError, match="ghost rule: Partial lacks norm, operand_grad, clipped_sum, half_operands"
    ):
        registry.register_rule(Partial())
    assert registry.rule_for("exp") is None


def test_the_built_in_families_are_registered():
    """Each layer family is one rule under each of its primitives, and the message
    naming what is supported names each family once (added ones too)."""
    rules = ghost.registered_rules()
    assert {"dot_general", "conv_general_dilated", "gather", "add", "sub", "mul"} <= set(rules)
    assert rules["add"] is rules["sub"]
    for primitive, rule in rules.items():
        assert primitive in rule.primitives
    named = _rule.supported().split(", ")
    assert sorted(named) == sorted({r.described for r in rules.values()})
    assert {"dense/einsum", "convolution", "embedding", "bias", "norm scale"} <= set(named)


TOY_MODEL = """
import jax
import jax.numpy as jnp
import numpy as np


def tempered(input_shape, num_classes):
    \"\"\"Softmax regression with a learned temperature per class: a parameter that
    DIVIDES the logits, which no built-in ghost rule takes.\"\"\"
    d = int(np.prod(input_shape))

    def init(key):
        w = 0.01 * jax.random.normal(key, (d, num_classes), jnp.float32)
        return {"w": w, "t": jnp.ones((num_classes,), jnp.float32)}

    def apply(params, x):
        h = x.reshape(x.shape[0], -1).astype(params["w"].dtype) @ params["w"]
        return h / params["t"]

    return init, apply


def exponential(input_shape, num_classes):
    \"\"\"Softmax regression on exp(w): a parameter read by a one-input primitive.\"\"\"
    d = int(np.prod(input_shape))

    def init(key):
        return {"w": 0.01 * jax.random.normal(key, (d, num_classes), jnp.float32)}

    def apply(params, x):
        return x.reshape(x.shape[0], -1).astype(params["w"].dtype) @ jnp.exp(params["w"])

    return init, apply
"""


@pytest.mark.slow  # a 2-step run through dpmp train (~15 s)
def test_a_rule_registered_after_a_config_trains_through_dpmp_train(
    registry, tmp_path, monkeypatch, capsys
):
    """A toy rule for a layer the built-ins do not take (``div``), registered after
    the first config, trains the user's model through ``dpmp train`` under ghost
    clipping and is reported as itself; a rule for a one-input primitive (``exp``)
    is refused in one line, exit status 2."""
    from dpmp.app import cli
    from dpmp.app.config import load_config

    (tmp_path / "toy_ghost_models.py").write_text(TOY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    load_config(None)
    registry.register_rule(ghost.PerExampleRule(("div",), kind="divisor", described="divisor"))
    registry.register_rule(ghost.PerExampleRule(("exp",), kind="exp", described="exp"))

    def train(factory, out):
        argv = ["train", "--quiet", "--out", str(out)]
        for item in (f"model.kind=toy_ghost_models:{factory}", "privacy.clip_method=ghost"):
            argv += ["--set", item]
        return cli.main([*argv, "--set", "training.steps=2"])

    assert train("tempered", tmp_path / "run") == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["clipping"]["method"] == "ghost" and report["steps"] == 2
    assert {"param": "['t']", "layer": "divisor", "rule": "per-example"} in (
        report["clipping"]["layers"]
    )
    assert report["audit"]["ok"] is True and report["audit"]["missing"] == []
    capsys.readouterr()
    assert train("exponential", tmp_path / "exp") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'exp', a primitive of 1 inputs" in err, err
