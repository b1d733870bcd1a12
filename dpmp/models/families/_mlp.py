"""``mlp``: a flax linen MLP: ``Dense`` layers (``dtype=policy.compute``,
``param_dtype=float32``) of ``architecture.hidden`` widths, ReLU."""

from __future__ import annotations

import jax.numpy as jnp

from dpmp.models._model import Model, wrap_forward
from dpmp.models.families._base import Architecture, register_family
from dpmp.precision._policy import Policy


class MLPFamily:
    name = "mlp"
    task = "classify"
    sizes = ("hidden",)
    checkpoint = None

    def build(
        self,
        architecture: Architecture,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        import flax.linen as nn

        hidden = tuple(architecture.hidden)
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

        def forward(params, x):
            return module.apply({"params": params}, x)

        loss_fn, predict, metrics = wrap_forward(forward, policy)
        widths = "-".join(map(str, architecture.widths(input_shape, num_classes)))
        return Model(
            kind=self.name,
            framework="flax.linen",
            name=f"linen MLP {widths}",
            init=init,
            loss_fn=loss_fn,
            predict=predict,
            metrics=metrics,
            description=f"flax linen MLP {widths}, ReLU",
        )


register_family(MLPFamily())
