"""``scatter_linear``: Tramer and Boneh's linear model on ScatterNet features.

"Differentially Private Learning Needs Better Features (or Much More Data)",
ICLR 2021, repository ``ftramer/Handcrafted-DP``, ``models.py``,
``ScatterLinear`` with ``input_norm="GroupNorm"``: ::

    GroupNorm, 27 groups, no scale or bias   7x7x81 -> 7x7x81   (each example alone)
    dense 10                                 3,969  -> 10

39,700 parameters for the 7 x 7 x 81 scattering features of 28 x 28 grey
images (``data.features = "scattering"``). GroupNorm normalises each example
by the mean and variance of its own channels in each group of 3 (the
scattering channels in kymatio's order), so no example's output reads
another's. Flax linen, NHWC, the forward pass in ``policy.compute``,
parameters float32 initialised as PyTorch initialises ``Linear``.
"""

from __future__ import annotations

import functools
import math

from dpmp.models._model import Model
from dpmp.models.families._base import Architecture, register_family
from dpmp.models.families._cnn import linen_model, torch_uniform
from dpmp.precision._policy import Policy

__all__ = ["GROUPS", "ScatterLinearFamily", "group_norm"]

GROUPS = 27  # the paper's GroupNorm groups of the 81 scattering channels


def group_norm(input_shape: tuple[int, ...], family: str, compute):
    """A maker of the paper's GroupNorm (27 groups, no affine) for scattering
    features ``[h, w, 81 c]``, to call inside a linen module; a ``ValueError``
    tells to map the images first."""
    import flax.linen as nn

    if len(input_shape) != 3 or input_shape[-1] % GROUPS:
        raise ValueError(
            f"model.kind = {family!r} takes scattering features [h, w, 81 c] (set "
            f'data.features = "scattering"), got examples of shape {input_shape}'
        )
    return functools.partial(
        nn.GroupNorm,
        num_groups=GROUPS,
        epsilon=1e-5,
        use_bias=False,
        use_scale=False,
        dtype=compute,
    )


class ScatterLinearFamily:
    name = "scatter_linear"
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
        import flax.linen as nn
        import jax.numpy as jnp

        norm = group_norm(input_shape, self.name, policy.compute)
        init = torch_uniform(math.prod(input_shape))
        compute = policy.compute

        class ScatterLinear(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = norm()(x).reshape((x.shape[0], -1))
                return nn.Dense(
                    num_classes,
                    dtype=compute,
                    param_dtype=jnp.float32,
                    kernel_init=init,
                    bias_init=init,
                )(x)

        return linen_model(
            ScatterLinear(),
            self.name,
            "ScatterNet + linear",
            input_shape,
            policy,
            f"flax linen GroupNorm ({GROUPS} groups) + linear on scattering features "
            f"{'x'.join(map(str, input_shape))} (Tramer & Boneh, ICLR 2021)",
        )


register_family(ScatterLinearFamily())
