"""``lm``: a small flax linen causal transformer over tokens (text data).

Token and learned position embeddings, ``depth`` pre-LayerNorm blocks of
causal multi-head self-attention and an MLP of width ``4 * dim``, a linear
head over the vocabulary. Its loss is the mean next-token cross-entropy over
a record's real tokens (padding contributes nothing); one record is one
example, the privacy unit. On byte tokens the targets are the record's next
bytes (``PAD`` marks the padding); on the token ids of a ``tokenizer.json``
they are the per-token labels ``y`` (``-1`` marks the padding).
"""

from __future__ import annotations

import jax.numpy as jnp

from dpmp.data._text import PAD
from dpmp.models._model import Model, next_token_losses, token_losses
from dpmp.models.families._base import Architecture, register_family
from dpmp.models.families._blocks import transformer_block
from dpmp.precision._policy import Policy


class LMFamily:
    name = "lm"
    task = "next_token"
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

        (length,) = input_shape
        vocab, dim = num_classes, architecture.dim
        depth, heads = architecture.depth, architecture.heads
        compute, f32 = policy.compute, jnp.float32

        Block = transformer_block(compute, heads, mlp=4 * dim)

        class CausalLM(nn.Module):
            @nn.compact
            def __call__(self, tokens):
                x = nn.Embed(vocab, dim, dtype=compute, param_dtype=f32)(tokens)
                pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, length, dim))
                x = x + pos[:, : tokens.shape[1]].astype(x.dtype)
                mask = nn.make_causal_mask(tokens)
                for _ in range(depth):
                    x = Block()(x, mask)
                x = nn.LayerNorm(dtype=compute, param_dtype=f32)(x)
                return nn.Dense(vocab, dtype=compute, param_dtype=f32)(x)

        module = CausalLM()

        def init(key):
            return module.init(key, jnp.zeros((1, length), jnp.int32))["params"]

        def predict(params, tokens):
            return module.apply({"params": params}, jnp.asarray(tokens)).astype(policy.output)

        def metrics(params, batch):
            if jnp.ndim(batch.get("y", 0)) == 2:  # token ids with per-token labels
                return token_losses(predict(params, batch["x"]), batch["y"])
            return next_token_losses(predict(params, batch["x"]), batch["x"], PAD)

        def loss_fn(params, batch):
            loss, _, count = metrics(params, batch)
            return (loss / jnp.maximum(count, 1).astype(jnp.float32)).mean()

        return Model(
            kind=self.name,
            framework="flax.linen",
            name=f"causal LM dim {dim} depth {depth} heads {heads}",
            init=init,
            loss_fn=loss_fn,
            predict=predict,
            metrics=metrics,
            description=(
                f"flax linen causal transformer over {vocab} tokens, context {length - 1}: "
                f"dim {dim}, {depth} pre-LN blocks with {heads}-head causal attention and MLP "
                f"{4 * dim}, learned positions"
            ),
        )


register_family(LMFamily())
