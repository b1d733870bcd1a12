"""The dense MLP (784 inputs, ReLU layers, 10 classes) that the donation and banded-MF
benchmarks compile from shapes alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def mlp_loss(params, batch):
    """Mean cross-entropy of the MLP whose layers are ``params["w{i}"]``, ``["b{i}"]``."""
    h = batch["x"]
    layers = len(params) // 2
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def mlp_shapes(hidden, batch: int):
    """The float32 parameters' and a batch's shapes (``jax.ShapeDtypeStruct``)."""
    widths = (784, *hidden, 10)
    params = {}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        params[f"w{i}"] = jax.ShapeDtypeStruct((a, b), jnp.float32)
        params[f"b{i}"] = jax.ShapeDtypeStruct((b,), jnp.float32)
    data = {
        "x": jax.ShapeDtypeStruct((batch, 784), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch,), jnp.int32),
    }
    return params, data
