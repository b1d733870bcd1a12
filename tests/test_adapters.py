"""Your own model: flax linen, flax nnx, Equinox and (init, apply) become a trainer Model.

Each form of the same softmax regression gives the loss a float64 numpy
computation gives from its own weights; the compute dtype reaches the matmul;
batch statistics are refused; ``package.module:factory`` loads with errors
that say what to fix.
"""

import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmp.app.config import ConfigError, ModelConfig
from dpmp.app.inputs import load_factory, model_from_config
from dpmp.models._adapters import as_model, model_signature
from dpmp.precision._policy import Policy

IN, K = 6, 3


class LinenLinear(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(K)(x.reshape((x.shape[0], -1)))


class NnxLinear(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(IN, K, rngs=rngs)

    def __call__(self, x):
        return self.dense(x.reshape((x.shape[0], -1)))


def plain_init(key):
    return {"w": jax.random.normal(key, (IN, K)) * 0.3, "b": jnp.full((K,), 0.1)}


def plain_apply(params, x):
    return x.reshape((x.shape[0], -1)) @ params["w"] + params["b"]


FORMS = {
    "linen": lambda: LinenLinear(),
    "nnx": lambda: NnxLinear(nnx.Rngs(1)),
    "equinox": lambda: eqx.nn.Linear(IN, K, key=jax.random.key(2)),
    "functions": lambda: (plain_init, plain_apply),
}


def _weights(params):
    """(W [IN, K], b [K]) of a softmax regression's params, whatever their layout."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
    (w,) = [x for x in leaves if x.ndim == 2]
    (b,) = [x for x in leaves if x.ndim == 1]
    return (w if w.shape == (IN, K) else w.T), b


def _reference_loss(params, x, y):
    w, b = _weights(params)
    logits = x.reshape(len(x), -1).astype(np.float64) @ w + b
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -logp[np.arange(len(y)), y].mean()


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(5, IN)).astype(np.float32), "y": np.array([0, 1, 2, 1, 0])}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_gives_the_float64_loss_of_its_own_weights(form, batch):
    model = as_model(FORMS[form](), (IN,), K, "fp32")
    params = jax.jit(model.init)(jax.random.key(0))
    got = float(model.loss_fn(params, batch))
    assert got == pytest.approx(_reference_loss(params, batch["x"], batch["y"]), rel=1e-5)
    losses, correct, counts = model.metrics(params, batch)
    assert losses.shape == correct.shape == (5,) and (np.asarray(counts) == 1).all()


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_computes_in_the_policy_compute_dtype(form, batch):
    model = as_model(FORMS[form](), (IN,), K, "bf16")
    params = jax.jit(model.init)(jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    jaxpr = jax.make_jaxpr(model.loss_fn)(params, batch)
    dots = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert model.predict(params, batch["x"]).dtype == Policy.parse("bf16").output


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def test_a_user_loss_is_used_per_example(batch):
    def squared_margin(outputs, labels):
        return jnp.sum(outputs.astype(jnp.float32) ** 2, -1) + labels

    model = as_model(FORMS["functions"](), (IN,), K, "fp32", loss=squared_margin)
    params = model.init(jax.random.key(0))
    w, b = _weights(params)
    expected = (((batch["x"] @ w + b) ** 2).sum(-1) + batch["y"]).mean()
    assert float(model.loss_fn(params, batch)) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="one loss per example"):
        bad = as_model(FORMS["functions"](), (IN,), K, "fp32", loss=lambda o, y: o.sum())
        bad.loss_fn(params, batch)


def test_batch_statistics_are_refused():
    class WithBatchNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(nn.Dense(K)(x))

    with pytest.raises(ValueError, match="batch_stats.*LayerNorm"):
        as_model(WithBatchNorm(), (IN,), K, "fp32")

    class NnxBatchNorm(nnx.Module):
        def __init__(self):
            self.norm = nnx.BatchNorm(IN, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(x)

    with pytest.raises(ValueError, match="BatchStat"):
        as_model(NnxBatchNorm(), (IN,), K, "fp32")

    class EqxWithBatchNorm(eqx.Module):
        norm: eqx.nn.BatchNorm
        linear: eqx.nn.Linear

        def __call__(self, x):
            return self.linear(x)

    hidden = EqxWithBatchNorm(
        eqx.nn.BatchNorm(IN, axis_name="batch", mode="batch"),
        eqx.nn.Linear(IN, K, key=jax.random.key(0)),
    )
    with pytest.raises(ValueError, match="Equinox module holds a BatchNorm"):
        as_model(hidden, (IN,), K, "fp32")


def test_other_objects_are_refused_with_the_forms_named():
    with pytest.raises(TypeError, match="linen or nnx module, an Equinox module"):
        as_model(object(), (IN,), K, "fp32")


def test_factory_errors_say_what_to_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="cannot import 'no_such_mod'.*PYTHONPATH"):
        load_factory("no_such_mod:make")
    (tmp_path / "user_models_ok.py").write_text(
        "import flax.linen as nn\n"
        "def make(input_shape, num_classes):\n"
        "    return nn.Dense(num_classes)\n"
        "def broken(input_shape, num_classes):\n"
        "    return 'not a model'\n"
        "def no_arguments():\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="has no function 'missing'"):
        load_factory("user_models_ok:missing")
    # a wrong signature is one line naming it, not a TypeError traceback from the call
    with pytest.raises(ConfigError, match=r"no_arguments takes \(\); a model factory takes"):
        load_factory("user_models_ok:no_arguments")
    info = type("Info", (), {"input_shape": (IN,), "num_classes": K})()
    model = model_from_config(ModelConfig(kind="user_models_ok:make"), info, "fp32")
    assert model.kind == "user_models_ok:make" and model.framework == "flax.linen"
    with pytest.raises(ConfigError, match="user_models_ok:broken returned an unusable model"):
        model_from_config(ModelConfig(kind="user_models_ok:broken"), info, "fp32")
    sys.modules.pop("user_models_ok", None)


def test_model_signature_sees_names_and_shapes_not_values():
    a = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    assert model_signature(a) == model_signature(jax.tree.map(jnp.ones_like, a))
    assert model_signature(a) != model_signature({"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)})
    assert model_signature(a) != model_signature({"v": jnp.zeros((2, 3)), "b": jnp.zeros(3)})


def test_linen_dropout_is_said_to_be_off_or_refused():
    """The trainer passes no dropout randomness: dropout layers are off, and the
    model's name and description say so; one that asks for a 'dropout' stream is
    refused in one sentence."""

    class WithDropout(nn.Module):
        train: bool = False

        @nn.compact
        def __call__(self, x):
            x = nn.Dropout(0.5, deterministic=not self.train)(nn.Dense(8)(x))
            return nn.Dense(K)(x)

    model = as_model(WithDropout(), (IN,), K, "fp32")
    assert model.name.endswith("(dropout off)")
    assert "dropout off (Dropout_0" in model.description
    assert "dropout" not in as_model(LinenLinear(), (IN,), K, "fp32").name
    with pytest.raises(ValueError, match="Dropout_0 asks for a 'dropout' random stream"):
        as_model(WithDropout(train=True), (IN,), K, "fp32")


class _NnxDropout(nnx.Module):
    def __init__(self, rngs, *, holds_rngs: bool):
        self.dense = nnx.Linear(IN, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs if holds_rngs else None)
        self.head = nnx.Linear(8, K, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(self.dense(x)))


class _EqxDropout(eqx.Module):
    dense: eqx.nn.Linear
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.dense, self.drop = eqx.nn.Linear(IN, 8, key=k1), eqx.nn.Dropout(0.5)
        self.head = eqx.nn.Linear(8, K, key=k2)

    def __call__(self, x, key=None):
        return self.head(self.drop(self.dense(x), key=key))


@pytest.mark.parametrize("holds_rngs", [True, False])
def test_nnx_dropout_is_switched_off_and_said_to_be(holds_rngs):
    """An nnx.Dropout holding rngs applied one stored mask at every step (no word of
    it); without rngs the model failed. Now it is deterministic and named."""
    module = _NnxDropout(nnx.Rngs(0), holds_rngs=holds_rngs)
    model = as_model(module, (IN,), K, "fp32")
    assert model.name.endswith("(dropout off)") and "dropout off (drop:" in model.description
    x = jax.random.normal(jax.random.key(1), (5, IN))
    params = model.init(jax.random.key(0))
    plain = module.head(module.dense(x))  # the reference: the layers without dropout
    np.testing.assert_allclose(model.predict(params, x), plain, rtol=1e-6, atol=1e-6)
    assert module.drop.deterministic is False  # the user's module is not changed


def test_equinox_dropout_is_switched_off_and_said_to_be():
    """eqx.nn.Dropout called with no key raised "Dropout requires a key"; the model
    is now used in inference mode, and its description says so."""
    module = _EqxDropout(jax.random.key(0))
    model = as_model(module, (IN,), K, "fp32")
    assert model.name.endswith("(dropout off)") and "dropout off (drop:" in model.description
    x = jax.random.normal(jax.random.key(1), (5, IN))
    plain = jax.vmap(lambda v: module.head(module.dense(v)))(x)
    np.testing.assert_allclose(model.predict(model.init(None), x), plain, rtol=1e-6, atol=1e-6)
    assert (
        "dropout"
        not in as_model(eqx.nn.Linear(IN, K, key=jax.random.key(0)), (IN,), K, "fp32").name
    )
