"""The transformer block the ViT and the language model share."""

from __future__ import annotations

import jax.numpy as jnp


def transformer_block(compute, heads: int, mlp: int):
    """A pre-LayerNorm transformer block (a linen module class): self-attention
    with an optional mask, then an MLP of width ``mlp``, each with a residual
    connection; computed in ``compute``, parameters in float32."""
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
