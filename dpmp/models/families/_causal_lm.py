"""The ``Model`` of a causal language model read from a checkpoint (GPT-2, the
Llama/Qwen2/Gemma decoder): one batch and loss convention for every such family.

The batch is ``x``: token ids ``[B, T]``, and either ``y``: per-token labels of
the same shape (``y[:, t]`` is the token position ``t`` predicts, from the
tokens up to ``t``; negative labels are ignored) or anything else (a record's
token count), when the targets are ``x[:, 1:]`` less those equal to
``pad_id``. The loss of a record, one example, is its mean cross-entropy over
the targets it has; a record with none contributes 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.models._model import Model, next_token_losses, token_losses
from dpmp.precision._policy import Policy

__all__ = ["causal_lm_model", "record_losses"]


def record_losses(logits: jax.Array, batch: dict, pad_id: int | None):
    """``(losses, correct, counts)`` per record: at the per-token labels ``y`` if the
    batch has them (the shape of ``x``), else of predicting ``x[:, 1:]`` less
    ``pad_id``."""
    x, y = jnp.asarray(batch["x"]), batch.get("y")
    if y is not None and jnp.shape(y) == x.shape:
        return token_losses(logits, jnp.asarray(y))
    return next_token_losses(logits, x, -1 if pad_id is None else pad_id)


def causal_lm_model(
    forward: Callable[[Any, jax.Array, Any], jax.Array],
    init: Callable[[jax.Array], Any],
    policy: Policy,
    pad_id: int | None,
    *,
    kind: str,
    name: str,
    description: str,
) -> Model:
    """A ``Model`` whose logits are ``forward(params, tokens, policy.compute)`` in
    ``policy.output``, with the batch and loss convention of the module docstring;
    ``init(key)`` draws fresh parameters."""

    def predict(params, tokens):
        return forward(params, jnp.asarray(tokens), policy.compute).astype(policy.output)

    def metrics(params, batch):
        return record_losses(predict(params, batch["x"]), batch, pad_id)

    def loss_fn(params, batch):
        loss, _, count = metrics(params, batch)
        return (loss / jnp.maximum(count, 1).astype(jnp.float32)).mean()

    return Model(
        kind=kind,
        framework="jax",
        name=name,
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=description,
    )
