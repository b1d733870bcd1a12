"""``vit``: a small flax linen vision transformer on images ``[h, w, c]``.

Patch embedding (a strided Conv), learned position embedding, ``depth``
pre-LayerNorm blocks of multi-head self-attention and an MLP of width
``2 * dim``, mean pooling over the tokens of one example, a linear head.
"""

from __future__ import annotations

import jax.numpy as jnp

from dpmp.models._model import Model, wrap_forward
from dpmp.models.families._base import Architecture, register_family
from dpmp.models.families._blocks import transformer_block
from dpmp.precision._policy import Policy


class ViTFamily:
    name = "vit"
    task = "classify"
    sizes = ("dim", "depth")
    checkpoint = None

    def build(
        self,
        architecture: Architecture,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        import flax.linen as nn

        if len(input_shape) != 3:
            raise ValueError(
                f"model.kind = 'vit' needs image inputs [h, w, c], got examples of shape "
                f"{input_shape}; use an .npz x of shape [n, h, w] or [n, h, w, c]"
            )
        h, w, _ = input_shape
        p = architecture.patch
        if h % p or w % p:
            raise ValueError(f"model.patch: {p} must divide the image size {h}x{w}")
        num_tokens = (h // p) * (w // p)
        dim, depth, heads = architecture.dim, architecture.depth, architecture.heads
        compute, f32 = policy.compute, jnp.float32

        Block = transformer_block(compute, heads, mlp=2 * dim)

        class ViT(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.Conv(
                    dim, (p, p), strides=(p, p), padding="VALID", dtype=compute, param_dtype=f32
                )(x)
                x = x.reshape((x.shape[0], num_tokens, dim))
                pos = self.param(
                    "pos_embedding", nn.initializers.normal(0.02), (1, num_tokens, dim)
                )
                x = x + pos.astype(x.dtype)
                for _ in range(depth):
                    x = Block()(x, None)
                x = nn.LayerNorm(dtype=compute, param_dtype=f32)(x)
                x = x.mean(axis=1)  # over tokens, within one example
                return nn.Dense(num_classes, dtype=compute, param_dtype=f32)(x)

        module = ViT()

        def init(key):
            return module.init(key, jnp.zeros((1, *input_shape), jnp.float32))["params"]

        def forward(params, x):
            return module.apply({"params": params}, x)

        loss_fn, predict, metrics = wrap_forward(forward, policy)
        return Model(
            kind=self.name,
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


register_family(ViTFamily())
