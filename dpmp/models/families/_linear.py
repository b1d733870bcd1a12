"""``linear``: a plain JAX function of a params dict: softmax regression, or a
plain-JAX MLP (ReLU) when ``architecture.hidden`` is non-empty."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpmp.models._model import Model, wrap_forward
from dpmp.models.families._base import Architecture, register_family
from dpmp.precision._policy import Policy


class LinearFamily:
    name = "linear"
    task = "classify"
    sizes = ()
    checkpoint = None

    def build(
        self,
        architecture: Architecture,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        widths = architecture.widths(input_shape, num_classes)
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
        if architecture.hidden:
            name, description = f"plain-JAX MLP {text}", f"plain JAX MLP {text}, ReLU (params dict)"
        else:
            name, description = f"linear {text}", f"plain JAX softmax regression {text}"
        return Model(
            kind=self.name,
            framework="jax",
            name=name,
            init=init,
            loss_fn=loss_fn,
            predict=predict,
            metrics=metrics,
            description=description,
        )


register_family(LinearFamily())
