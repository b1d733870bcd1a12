"""What the trainer needs of a model, and the losses the built-in families share.

A ``Model`` is a frozen record of functions:

* ``init(key) -> params``: float32 master parameters (a pytree: nested dicts
  for linen and plain JAX, an ``nnx.State`` for nnx);
* ``loss_fn(params, batch)``: the mean loss of ``batch = {"x", "y"}``; the
  forward pass runs in ``policy.compute``, the outputs are cast to
  ``policy.output`` and the loss is computed in float32;
* ``predict(params, x) -> outputs`` (``policy.output``);
* ``metrics(params, batch) -> (losses, correct, counts)``: per example, the
  summed float32 loss, the number of correct predictions and the number of
  predictions (1 for a classifier, the real tokens of a record for a language
  model), for evaluation;
* ``kind``, ``framework``, ``name`` and ``description``: what was built;
* ``frozen``: arrays the three functions read but training never changes (a
  LoRA model's base), or None. A model with frozen arrays takes them as an
  optional last argument, ``loss_fn(params, batch, frozen)``,
  ``predict(params, x, frozen)``, ``metrics(params, batch, frozen)``: a
  compiled function passes ``model.frozen`` there (``frozen_args``), so that
  they are an argument of the program, in their own dtype, never constants
  folded into it. Called without it, the functions read ``model.frozen``
  themselves (convenient outside ``jax.jit``).

The built-in families (``dpmp.models.families``) and the adapters of your
own models (``dpmp.models._adapters``) make one. ``dpmp.private_grad`` hands
``loss_fn`` batches of ONE example, so no model may use batch statistics (no
BatchNorm): each example's gradient must depend on that example only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpmp.precision._policy import Policy

__all__ = [
    "Model",
    "count_bytes",
    "count_params",
    "cross_entropy",
    "next_token_losses",
    "token_cross_entropy",
    "token_losses",
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
    frozen: Any = None

    def frozen_args(self) -> tuple:
        """``(frozen,)``, the last argument a compiled function passes to ``loss_fn``,
        ``predict`` and ``metrics``; ``()`` for a model without frozen arrays."""
        return () if self.frozen is None else (self.frozen,)

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


def wrap_forward(forward: Callable, policy: Policy, loss: Callable | None = None):
    """``(loss_fn, predict, metrics)`` around ``forward(params, x) -> outputs``.

    Floating ``x`` is cast to ``policy.compute`` and the outputs to
    ``policy.output``; ``loss(outputs, labels)`` gives per-example losses
    ``[B]``, averaged in float32 by ``loss_fn``. Its default is
    ``cross_entropy`` for class labels ``[B]`` and ``token_cross_entropy`` for
    per-token labels ``[B, T]`` (outputs: logits ``[B, T, V]``). ``metrics``
    of per-token labels are ``token_losses`` (the held-out loss per token,
    whatever loss trains).
    """

    def predict(params, x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):  # token ids stay integers
            x = x.astype(policy.compute)
        return forward(params, x).astype(policy.output)

    def example_losses(outputs, labels):
        default = token_cross_entropy if labels.ndim == 2 else cross_entropy
        losses = jnp.asarray((default if loss is None else loss)(outputs, labels))
        if losses.shape != labels.shape[:1]:
            raise ValueError(
                f"loss: must return one loss per example, shape {labels.shape[:1]}, got "
                f"{losses.shape}"
            )
        return losses.astype(jnp.float32)

    def loss_fn(params, batch):
        return example_losses(predict(params, batch["x"]), batch["y"]).mean()

    def metrics(params, batch):
        outputs = predict(params, batch["x"])
        if batch["y"].ndim == 2:
            return token_losses(outputs, batch["y"])
        correct = (jnp.argmax(outputs, -1) == batch["y"]).astype(jnp.int32)
        return example_losses(outputs, batch["y"]), correct, jnp.ones_like(correct)

    return loss_fn, predict, metrics


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


def token_losses(logits: jax.Array, labels: jax.Array):
    """Per record: the summed float32 cross-entropy of ``logits [B, T, V]`` at the
    per-token ``labels [B, T]`` (``-1``: no label, nothing counted), the correct
    predictions and the number of labelled positions."""
    real = labels >= 0
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"per-token labels {labels.shape} need logits [B, T, vocab], got {logits.shape}"
        )
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(real, labels, 0)
    )
    correct = (jnp.argmax(logits, -1) == labels) & real
    return (
        jnp.where(real, ce, 0.0).sum(-1),
        correct.sum(-1, dtype=jnp.int32),
        real.sum(-1, dtype=jnp.int32),
    )


def token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per record ``[B]``: the mean float32 cross-entropy over its labelled positions
    (``labels >= 0``; 0 for a record with none), the default per-token loss."""
    loss, _, count = token_losses(logits, labels)
    return loss / jnp.maximum(count, 1).astype(jnp.float32)
