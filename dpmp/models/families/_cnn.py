"""``cnn``: Tramer and Boneh's end-to-end CNN for 28 x 28 grey images (tanh).

"Differentially Private Learning Needs Better Features (or Much More Data)",
ICLR 2021, repository ``ftramer/Handcrafted-DP``, ``models.py``,
``MNIST_CNN`` with one input channel: ::

    conv 16 filters 8x8, stride 2, padding 2   28x28x1  -> 13x13x16   tanh
    max pool 2x2, stride 1                              -> 12x12x16
    conv 32 filters 4x4, stride 2, no padding           -> 5x5x32     tanh
    max pool 2x2, stride 1                              -> 4x4x32
    dense 32                                     512    -> 32         tanh
    dense 10                                            -> 10

26,010 parameters for 28 x 28 x 1 inputs: (8*8*1 + 1) * 16 + (4*4*16 + 1) * 32
+ (512 + 1) * 32 + (32 + 1) * 10. Flax linen, NHWC (the paper's PyTorch model
is NCHW: the same function up to the order of the dense layer's inputs), the
forward pass in ``policy.compute``, float32 parameters initialised as
PyTorch initialises them (uniform in +-1/sqrt(fan_in), weights and biases),
as the paper's runs were. No layer reads another example (no BatchNorm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from dpmp.models._model import Model, wrap_forward
from dpmp.models.families._base import Architecture, register_family
from dpmp.precision._policy import Policy

__all__ = ["CNNFamily", "Conv", "tanh_cnn", "torch_uniform"]

# (filters, kernel, stride, padding) of a convolution, or "M": 2x2 max pool, stride 1.
Conv = tuple[int, int, int, int]
END_TO_END: tuple[Conv | str, ...] = ((16, 8, 2, 2), "M", (32, 4, 2, 0), "M")


def torch_uniform(fan_in: int):
    """PyTorch's default initialiser of a layer's weights and biases (``Conv2d``,
    ``Linear``): uniform in ``+-1 / sqrt(fan_in)``."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def tanh_cnn(layers: Sequence[Conv | str], hidden: int, num_classes: int, compute, norm=None):
    """A linen module: ``norm()`` (a module maker, or None), the ``layers`` (tanh after each
    convolution), flatten, dense ``hidden`` + tanh, dense ``num_classes``; computed in
    ``compute``, parameters float32 initialised as PyTorch does."""
    import flax.linen as nn

    f32 = jnp.float32

    class TanhCNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            if norm is not None:
                x = norm()(x)
            for layer in layers:
                if layer == "M":
                    x = nn.max_pool(x, (2, 2), strides=(1, 1), padding="VALID")
                    continue
                filters, k, stride, pad = layer
                init = torch_uniform(k * k * x.shape[-1])
                x = nn.Conv(
                    filters,
                    (k, k),
                    strides=(stride, stride),
                    padding=((pad, pad), (pad, pad)),
                    dtype=compute,
                    param_dtype=f32,
                    kernel_init=init,
                    bias_init=init,
                )(x)
                x = jnp.tanh(x)
            x = x.reshape((x.shape[0], -1))
            for width in (hidden, num_classes):
                init = torch_uniform(x.shape[-1])
                dense = nn.Dense(
                    width, dtype=compute, param_dtype=f32, kernel_init=init, bias_init=init
                )
                x = dense(x) if width == num_classes else jnp.tanh(dense(x))
            return x

    return TanhCNN()


def linen_model(module, family: str, name: str, input_shape, policy: Policy, description: str):
    """The ``Model`` of a linen ``module`` on examples of ``input_shape``."""

    def init(key):
        return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

    def forward(params, x):
        return module.apply({"params": params}, x)

    loss_fn, predict, metrics = wrap_forward(forward, policy)
    return Model(
        kind=family,
        framework="flax.linen",
        name=name,
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=description,
    )


class CNNFamily:
    name = "cnn"
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
        if len(input_shape) != 3 or min(input_shape[:2]) < 16:
            raise ValueError(
                f"model.kind = 'cnn' needs images [h, w, c] of at least 16x16 (it was made for "
                f"28x28x1), got examples of shape {input_shape}"
            )
        module = tanh_cnn(END_TO_END, 32, num_classes, policy.compute)
        return linen_model(
            module,
            self.name,
            "Tramer-Boneh CNN",
            input_shape,
            policy,
            "flax linen CNN of Tramer & Boneh (ICLR 2021): conv 16 8x8/2, max pool 2/1, "
            "conv 32 4x4/2, max pool 2/1, dense 32, tanh",
        )


register_family(CNNFamily())
