"""``nnx_mlp``: the ``mlp`` network in flax nnx; its params are the ``nnx.State``
of ``nnx.split`` and the loss ``nnx.merge`` s them back."""

from __future__ import annotations

import jax.numpy as jnp

from dpmp.models._model import Model, wrap_forward
from dpmp.models.families._base import Architecture, register_family
from dpmp.precision._policy import Policy


class NnxMLPFamily:
    name = "nnx_mlp"
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
        from flax import nnx

        widths = architecture.widths(input_shape, num_classes)
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
            kind=self.name,
            framework="flax.nnx",
            name=f"nnx MLP {text}",
            init=init,
            loss_fn=loss_fn,
            predict=predict,
            metrics=metrics,
            description=f"flax nnx MLP {text} (nnx.split/merge; params are an nnx.State), ReLU",
        )


register_family(NnxMLPFamily())
