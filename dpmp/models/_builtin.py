"""Models the trainer can build: flax linen, flax nnx and plain JAX functions.

``build_model(config.model, data, policy)`` returns a :class:`Model`:

* ``init(key) -> params``: float32 master parameters (a pytree: nested dicts
  for linen and plain JAX, an ``nnx.State`` for nnx);
* ``loss_fn(params, batch)``: mean softmax cross-entropy of ``batch = {"x",
  "y"}``; the forward pass runs in ``policy.compute``, the logits are cast to
  ``policy.output`` and the cross-entropy is computed in float32;
* ``predict(params, x) -> logits`` (``policy.output``);
* ``metrics(params, batch) -> (losses, correct, counts)``: per example, the
  summed float32 loss, the number of correct predictions and the number of
  predictions (1 for a classifier, the real tokens of a record for a language
  model), for evaluation;
* ``framework`` and ``kind``: what was built.

Your own models (flax linen or nnx, Equinox, plain functions) become a
``Model`` through ``dpmp.models._adapters``.

``dpmp.private_grad`` hands ``loss_fn`` batches of ONE example, so no model
here uses batch statistics (no BatchNorm): each example's gradient must
depend on that example only.

Kinds:
  ``mlp``      flax linen ``Dense`` layers (``dtype=policy.compute``,
               ``param_dtype=float32``), ReLU.
  ``nnx_mlp``  the same network in flax nnx; params are the ``nnx.State`` of
               ``nnx.split`` and the loss ``nnx.merge`` s them back.
  ``linear``   a plain JAX function of a params dict: softmax regression, or a
               plain-JAX MLP when ``model.hidden`` is non-empty.
  ``vit``      a small linen vision transformer: patch embedding (a strided
               Conv), learned position embedding, ``depth`` pre-LayerNorm
               blocks of multi-head self-attention and an MLP, mean pooling,
               a linear head.
  ``lm``       a small linen causal transformer over byte tokens (text data):
               token and learned position embeddings, ``depth`` pre-LayerNorm
               blocks of causal multi-head self-attention and an MLP, a
               linear head over the vocabulary. Its loss is the mean
               next-token cross-entropy over a record's real tokens (padding
               contributes nothing); one record is one example, the privacy
               unit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpmp.app.config import ModelConfig
from dpmp.precision._policy import Policy

__all__ = [
    "Model",
    "build_model",
    "count_bytes",
    "count_params",
    "cross_entropy",
    "next_token_losses",
    "wrap_forward",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """A model as the trainer sees it (see the module docstring)."""

    kind: str
    framework: str
    name: str
    init: Callable[[Any], Any]
    loss_fn: Callable[[Any, dict], jax.Array]
    predict: Callable[[Any, jax.Array], jax.Array]
    metrics: Callable[[Any, dict], tuple[jax.Array, jax.Array, jax.Array]]
    description: str

    def summary(self, params=None) -> dict[str, Any]:
        out = {"kind": self.kind, "framework": self.framework, "name": self.name}
        out["description"] = self.description
        if params is not None:
            out["num_params"] = count_params(params)
        return out


def count_params(params) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def count_bytes(params) -> int:
    """Bytes of ``params`` (arrays or ``jax.ShapeDtypeStruct``), in their own dtypes."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy, in float32 whatever the logits' dtype."""
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def build_model(config: ModelConfig | None, data_info: Any, policy: Policy | str) -> Model:
    """Builds the configured model for data with ``data_info.input_shape`` and
    ``data_info.num_classes`` (a :class:`dpmp.data._dataset.Dataset` works).

    Raises:
      ValueError: the ViT does not fit the input (not an image, or the patch
        size does not divide its side).
    """
    config = ModelConfig() if config is None else config
    policy = Policy.parse(policy)
    input_shape = tuple(int(d) for d in data_info.input_shape)
    num_classes = int(data_info.num_classes)
    text = getattr(data_info, "task", "classify") == "next_token"
    if (config.kind == "lm") != text:
        raise ValueError(
            "model.kind = 'lm' needs a text dataset (data.dataset = 'python_docs' or 'text')"
            if not text
            else f"model.kind = {config.kind!r} classifies; text data needs model.kind = 'lm'"
        )
    builders = {
        "mlp": _linen_mlp,
        "nnx_mlp": _nnx_mlp,
        "linear": _plain,
        "vit": _vit,
        "lm": _lm,
    }
    return builders[config.kind](config, input_shape, num_classes, policy)


def wrap_forward(forward: Callable, policy: Policy, loss: Callable | None = None):
    """``(loss_fn, predict, metrics)`` around ``forward(params, x) -> outputs``.

    ``x`` is cast to ``policy.compute`` and the outputs to ``policy.output``;
    ``loss(outputs, labels)`` gives per-example losses (default
    ``cross_entropy``), averaged in float32 by ``loss_fn``.
    """
    loss = cross_entropy if loss is None else loss

    def predict(params, x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):  # token ids stay integers
            x = x.astype(policy.compute)
        return forward(params, x).astype(policy.output)

    def example_losses(outputs, labels):
        losses = jnp.asarray(loss(outputs, labels))
        if losses.shape != labels.shape:
            raise ValueError(
                f"loss: must return one loss per example, shape {labels.shape}, got {losses.shape}"
            )
        return losses.astype(jnp.float32)

    def loss_fn(params, batch):
        return example_losses(predict(params, batch["x"]), batch["y"]).mean()

    def metrics(params, batch):
        outputs = predict(params, batch["x"])
        correct = (jnp.argmax(outputs, -1) == batch["y"]).astype(jnp.int32)
        return example_losses(outputs, batch["y"]), correct, jnp.ones_like(correct)

    return loss_fn, predict, metrics


def _widths(config: ModelConfig, input_shape, num_classes) -> list[int]:
    return [math.prod(input_shape), *config.hidden, num_classes]


# ---- flax linen MLP ------------------------------------------------------------


def _linen_mlp(config, input_shape, num_classes, policy) -> Model:
    import flax.linen as nn

    hidden = tuple(config.hidden)
    compute = policy.compute

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x.reshape((x.shape[0], -1))
            for width in hidden:
                x = nn.relu(nn.Dense(width, dtype=compute, param_dtype=jnp.float32)(x))
            return nn.Dense(num_classes, dtype=compute, param_dtype=jnp.float32)(x)

    module = MLP()

    def init(key):
        return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

    loss_fn, predict, metrics = wrap_forward(lambda p, x: module.apply({"params": p}, x), policy)
    widths = "-".join(map(str, _widths(config, input_shape, num_classes)))
    return Model(
        kind="mlp",
        framework="flax.linen",
        name=f"linen MLP {widths}",
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=f"flax linen MLP {widths}, ReLU",
    )


# ---- flax nnx MLP --------------------------------------------------------------


def _nnx_mlp(config, input_shape, num_classes, policy) -> Model:
    from flax import nnx

    widths = _widths(config, input_shape, num_classes)
    compute = policy.compute

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.layers = nnx.List(
                [
                    nnx.Linear(a, b, dtype=compute, param_dtype=jnp.float32, rngs=rngs)
                    for a, b in zip(widths[:-1], widths[1:])
                ]
            )

        def __call__(self, x):
            x = x.reshape((x.shape[0], -1))
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))))

    def init(key):
        _, state = nnx.split(MLP(nnx.Rngs(params=key)))
        return state

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    loss_fn, predict, metrics = wrap_forward(forward, policy)
    text = "-".join(map(str, widths))
    return Model(
        kind="nnx_mlp",
        framework="flax.nnx",
        name=f"nnx MLP {text}",
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=f"flax nnx MLP {text} (nnx.split/merge; params are an nnx.State), ReLU",
    )


# ---- plain JAX -------------------------------------------------------------------


def _plain(config, input_shape, num_classes, policy) -> Model:
    widths = _widths(config, input_shape, num_classes)
    n_layers = len(widths) - 1

    def init(key):
        params = {}
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            key, sub = jax.random.split(key)
            # LeCun normal for ReLU layers' inputs, as flax's Dense default.
            w = jax.random.normal(sub, (a, b), jnp.float32) / jnp.sqrt(jnp.float32(a))
            params[f"layer_{i}"] = {"w": w, "b": jnp.zeros((b,), jnp.float32)}
        return params

    def forward(params, x):
        h = x.reshape((x.shape[0], -1))
        for i in range(n_layers):
            layer = params[f"layer_{i}"]
            h = h @ layer["w"].astype(h.dtype) + layer["b"].astype(h.dtype)
            if i < n_layers - 1:
                h = jax.nn.relu(h)
        return h

    loss_fn, predict, metrics = wrap_forward(forward, policy)
    text = "-".join(map(str, widths))
    if config.hidden:
        name, description = f"plain-JAX MLP {text}", f"plain JAX MLP {text}, ReLU (params dict)"
    else:
        name, description = f"linear {text}", f"plain JAX softmax regression {text}"
    return Model(
        kind="linear",
        framework="jax",
        name=name,
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=description,
    )


def _block(compute, heads: int, mlp: int):
    """A pre-LayerNorm transformer block (linen): self-attention with an optional
    mask, then an MLP of width ``mlp``, each with a residual connection."""
    import flax.linen as nn

    f32 = jnp.float32

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            y = nn.LayerNorm(dtype=compute, param_dtype=f32)(x)
            y = nn.MultiHeadDotProductAttention(
                num_heads=heads, dtype=compute, param_dtype=f32, deterministic=True
            )(y, y, mask=mask)
            x = x + y
            y = nn.LayerNorm(dtype=compute, param_dtype=f32)(x)
            y = nn.Dense(mlp, dtype=compute, param_dtype=f32)(y)
            y = nn.Dense(x.shape[-1], dtype=compute, param_dtype=f32)(nn.gelu(y))
            return x + y

    return Block


# ---- flax linen ViT ----------------------------------------------------------------


def _vit(config, input_shape, num_classes, policy) -> Model:
    import flax.linen as nn

    if len(input_shape) != 3:
        raise ValueError(
            f"model.kind = 'vit' needs image inputs [h, w, c], got examples of shape "
            f"{input_shape}; use an .npz x of shape [n, h, w] or [n, h, w, c]"
        )
    h, w, _ = input_shape
    p = config.patch
    if h % p or w % p:
        raise ValueError(f"model.patch: {p} must divide the image size {h}x{w}")
    num_tokens = (h // p) * (w // p)
    dim, depth, heads = config.dim, config.depth, config.heads
    compute, f32 = policy.compute, jnp.float32

    Block = _block(compute, heads, mlp=2 * dim)

    class ViT(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(
                dim, (p, p), strides=(p, p), padding="VALID", dtype=compute, param_dtype=f32
            )(x)
            x = x.reshape((x.shape[0], num_tokens, dim))
            pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, num_tokens, dim))
            x = x + pos.astype(x.dtype)
            for _ in range(depth):
                x = Block()(x, None)
            x = nn.LayerNorm(dtype=compute, param_dtype=f32)(x)
            x = x.mean(axis=1)  # over tokens, within one example
            return nn.Dense(num_classes, dtype=compute, param_dtype=f32)(x)

    module = ViT()

    def init(key):
        return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

    loss_fn, predict, metrics = wrap_forward(
        lambda prm, x: module.apply({"params": prm}, x), policy
    )
    return Model(
        kind="vit",
        framework="flax.linen",
        name=f"ViT patch {p} dim {dim} depth {depth} heads {heads}",
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=(
            f"flax linen ViT: {p}x{p} patches ({num_tokens} tokens), dim {dim}, {depth} "
            f"pre-LN blocks with {heads}-head attention and MLP {2 * dim}, mean pooling"
        ),
    )


# ---- flax linen causal language model -------------------------------------------------


def next_token_losses(logits: jax.Array, tokens: jax.Array, pad: int):
    """Per record: the summed float32 cross-entropy of predicting ``tokens[:, 1:]``
    from ``logits[:, :-1]``, the correct predictions and the number of real
    (non-``pad``) targets."""
    targets = tokens[:, 1:]
    real = targets != pad
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), targets
    )
    correct = (jnp.argmax(logits[:, :-1], -1) == targets) & real
    return (
        jnp.where(real, ce, 0.0).sum(-1),
        correct.sum(-1, dtype=jnp.int32),
        real.sum(-1, dtype=jnp.int32),
    )


def _lm(config, input_shape, num_classes, policy) -> Model:
    import flax.linen as nn

    from dpmp.data._dataset import PAD

    (length,) = input_shape
    vocab, dim, depth, heads = num_classes, config.dim, config.depth, config.heads
    compute, f32 = policy.compute, jnp.float32

    Block = _block(compute, heads, mlp=4 * dim)

    class CausalLM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, dim, dtype=compute, param_dtype=f32)(tokens)
            pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, length, dim))
            x = x + pos[:, : tokens.shape[1]].astype(x.dtype)
            mask = nn.make_causal_mask(tokens)
            for _ in range(depth):
                x = Block()(x, mask)
            x = nn.LayerNorm(dtype=compute, param_dtype=f32)(x)
            return nn.Dense(vocab, dtype=compute, param_dtype=f32)(x)

    module = CausalLM()

    def init(key):
        return module.init(key, jnp.zeros((1, length), jnp.int32))["params"]

    def predict(params, tokens):
        return module.apply({"params": params}, jnp.asarray(tokens)).astype(policy.output)

    def loss_fn(params, batch):
        loss, _, count = next_token_losses(predict(params, batch["x"]), batch["x"], PAD)
        return (loss / jnp.maximum(count, 1).astype(jnp.float32)).mean()

    def metrics(params, batch):
        return next_token_losses(predict(params, batch["x"]), batch["x"], PAD)

    return Model(
        kind="lm",
        framework="flax.linen",
        name=f"causal LM dim {dim} depth {depth} heads {heads}",
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=(
            f"flax linen causal transformer over {vocab} byte tokens, context {length - 1}: "
            f"dim {dim}, {depth} pre-LN blocks with {heads}-head causal attention and MLP "
            f"{4 * dim}, learned positions"
        ),
    )
