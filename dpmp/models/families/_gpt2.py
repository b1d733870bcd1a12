"""GPT-2 (Radford et al. 2019) as plain JAX functions of a params dict.

The architecture of the published GPT-2 checkpoints: token and learned
position embeddings, ``n_layer`` pre-LayerNorm blocks, a final LayerNorm and
a head tied to the token embedding::

    x = wte[tokens] + wpe[:T]
    for each block:
        x = x + c_proj(causal_attention(c_attn(LN_1(x))))     heads of n_embd / n_head
        x = x + c_proj(gelu_new(c_fc(LN_2(x))))              MLP of width 4 n_embd
    logits = LN_f(x) @ wte.T

``gelu_new`` is GELU's tanh form, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715
x^3)))``; every linear map is ``x @ kernel + bias`` (GPT-2's Conv1D
orientation, ``kernel`` of shape ``[in, out]``). The parameters are a nested
dict whose paths, joined by ``.``, are GPT-2's own tensor names with
``weight`` read as ``kernel`` (linear maps), ``scale`` (LayerNorms) or
``embedding`` (``wte``, ``wpe``): ``h.0.attn.c_attn.kernel`` is
``h.0.attn.c_attn.weight``. The weight matrices are leaves named ``kernel``,
the ones LoRA adapts.

The parameters are used in whatever dtype they hold (a bfloat16 checkpoint
stays bfloat16) and cast to ``policy.compute`` for the forward pass; the
LayerNorm statistics and the attention softmax are computed in float32.
``dpmp.models._gpt2_checkpoint`` reads and writes the checkpoint folders.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.models._model import Model
from dpmp.models._params_file import nest
from dpmp.models.families._base import Architecture, register_family
from dpmp.models.families._causal_lm import causal_lm_model
from dpmp.precision._policy import Policy

__all__ = ["GPT2Config", "GPT2Family", "gpt2_forward", "gpt2_init", "gpt2_model"]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """The sizes of a GPT-2 model (the keys of its ``config.json``).

    Attributes:
      vocab_size: rows of the token embedding (and logits per position).
      n_positions: the longest sequence (rows of the position embedding).
      n_embd: the width; a multiple of ``n_head``.
      n_layer: the number of blocks.
      n_head: attention heads per block.
      layer_norm_epsilon: the LayerNorms' epsilon.
    """

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
            raise ValueError(f"layer_norm_epsilon: must be in (0, 1), got {eps!r}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of every parameter, names as paths joined by ``.``."""
        d, out = self.n_embd, {}
        out["wte.embedding"] = (self.vocab_size, d)
        out["wpe.embedding"] = (self.n_positions, d)
        linear = {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d)}
        linear |= {"mlp.c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}
        for i in range(self.n_layer):
            for ln in ("ln_1", "ln_2"):
                out[f"h.{i}.{ln}.scale"] = out[f"h.{i}.{ln}.bias"] = (d,)
            for name, (fan_in, fan_out) in linear.items():
                out[f"h.{i}.{name}.kernel"] = (fan_in, fan_out)
                out[f"h.{i}.{name}.bias"] = (fan_out,)
        out["ln_f.scale"] = out["ln_f.bias"] = (d,)
        return out


def gpt2_init(config: GPT2Config, key: jax.Array) -> Params:
    """Fresh float32 parameters as GPT-2 initialises them: weights and embeddings
    N(0, 0.02^2) (the position embedding 0.01^2, the residual projections
    0.02^2 / (2 n_layer)), biases 0, LayerNorm scales 1."""
    shapes = config.shapes()
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
    residual = 0.02 / math.sqrt(2 * config.n_layer)

    def one(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.endswith(".bias"):
            return jnp.zeros(shape, jnp.float32)
        if name.endswith(".scale"):
            return jnp.ones(shape, jnp.float32)
        std = 0.01 if name == "wpe.embedding" else 0.02
        std = residual if name.endswith("c_proj.kernel") else std
        return std * jax.random.normal(keys[name], shape, jnp.float32)

    return nest({name: one(name, shape) for name, shape in shapes.items()})


def _layer_norm(p: Params, x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + jnp.float32(eps))
    y = y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype)


def _linear(p: Params, x: jax.Array) -> jax.Array:
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)


def _attention(p: Params, x: jax.Array, heads: int) -> jax.Array:
    """Causal multi-head self-attention of ``x [B, T, D]``."""
    b, t, d = x.shape
    q, k, v = jnp.split(_linear(p["c_attn"], x), 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    scores = scores / jnp.float32(math.sqrt(d // heads))
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return _linear(p["c_proj"], out)


def gpt2_forward(config: GPT2Config, params: Params, tokens: jax.Array, compute) -> jax.Array:
    """Logits ``[B, T, vocab_size]`` in ``compute`` of ``tokens [B, T]`` (int).

    Raises:
      ValueError: ``T`` is longer than ``config.n_positions``.
    """
    t = tokens.shape[-1]
    if t > config.n_positions:
        raise ValueError(f"tokens: {t} positions; the model has n_positions {config.n_positions}")
    eps = config.layer_norm_epsilon
    wte = params["wte"]["embedding"].astype(compute)
    x = jnp.take(wte, tokens, axis=0) + params["wpe"]["embedding"][:t].astype(compute)
    for i in range(config.n_layer):
        block = params["h"][str(i)]
        x = x + _attention(block["attn"], _layer_norm(block["ln_1"], x, eps), config.n_head)
        y = _linear(block["mlp"]["c_fc"], _layer_norm(block["ln_2"], x, eps))
        x = x + _linear(block["mlp"]["c_proj"], jax.nn.gelu(y, approximate=True))
    return _layer_norm(params["ln_f"], x, eps) @ wte.T


def gpt2_model(
    config: GPT2Config, policy: Policy | str = "f32", *, pad_id: int | None = None
) -> Model:
    """The GPT-2 of ``config`` as a ``dpmp.models.Model``.

    ``init(key)`` draws fresh float32 parameters (``gpt2_init``); to start from a
    checkpoint, pass its parameters as ``init_params``. The batch is ``x``:
    token ids ``[B, T]``, and either ``y``: per-token labels of the same shape
    (``y[:, t]`` is the token position ``t`` predicts, from the tokens up to
    ``t``; negative labels are ignored) or anything else (a record's token
    count), when the targets are ``x[:, 1:]`` less those equal to ``pad_id``.
    The loss of a record, one example, is its mean cross-entropy over the
    targets it has; a record with none contributes 0.
    """
    policy = Policy.parse(policy)
    c = config
    return causal_lm_model(
        lambda params, tokens, compute: gpt2_forward(config, params, tokens, compute),
        lambda key: gpt2_init(config, key),
        policy,
        pad_id,
        kind="gpt2",
        name=f"GPT-2 {c.n_layer} layers width {c.n_embd} heads {c.n_head}",
        description=(
            f"GPT-2: vocabulary {c.vocab_size}, context {c.n_positions}, width {c.n_embd}, "
            f"{c.n_layer} pre-LN block{'s' * (c.n_layer != 1)} with {c.n_head}-head causal "
            "attention and gelu_new "
            f"MLP {4 * c.n_embd}, head tied to the token embedding"
        ),
    )


class GPT2Family:
    """``model.kind = "gpt2"``: a GPT-2 read from its published checkpoint folder
    (``model.checkpoint``; ``dpmp.models._gpt2_checkpoint``), sizes and
    parameters included; the ``[model]`` sizes are not read."""

    name = "gpt2"
    task = "next_token"
    sizes = ()
    checkpoint = "a GPT-2 checkpoint folder"
    model_types = ("gpt2",)

    def load(self, folder: Path, policy: Policy):
        """``dpmp.models.load_gpt2(folder, policy)``: a ``GPT2`` (model, params in
        the stored dtype, tokenizer or None, ``GPT2Config``)."""
        from dpmp.models._gpt2_checkpoint import load_gpt2  # reads this module

        return load_gpt2(folder, policy)

    def build(
        self,
        architecture: Architecture,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        """Refused: its sizes are its checkpoint's (``dpmp.models.load_gpt2``)."""
        del architecture, input_shape, num_classes, policy
        raise ValueError(
            f"model.kind = {self.name!r} is read from {self.checkpoint} (model.checkpoint, "
            "dpmp.models.load_gpt2), not built from the [model] sizes"
        )


register_family(GPT2Family())
