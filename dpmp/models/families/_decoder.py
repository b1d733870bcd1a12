"""Llama, Qwen2 and Gemma (1) as one decoder family: plain JAX functions of a params dict.

The architecture the three publish, with the variants their ``config.json``
selects::

    x = embed_tokens[tokens]                       (Gemma: times sqrt(hidden_size))
    for each layer:
        h = input_layernorm(x)
        q, k, v = q_proj(h), k_proj(h), v_proj(h)  heads of head_dim; k, v: num_key_value_heads
        q, k = rope(q), rope(k)                    HF's rotate_half form
        x = x + o_proj(causal_attention(q, k, v))  each KV head serves heads / kv_heads queries
        h = post_attention_layernorm(x)
        x = x + down_proj(act(gate_proj(h)) * up_proj(h))   silu: SwiGLU, gelu tanh: GeGLU
    logits = norm(x) @ lm_head                     (tied: embed_tokens.T)

RMSNorm is ``x / sqrt(mean(x^2) + eps) * w``, the mean square in float32
(Gemma: ``* (1 + w)``, in float32, then cast). Rotary position embeddings
rotate the pairs ``(i, i + head_dim / 2)`` of each head by ``pos *
inv_freq[i]``, ``inv_freq[i] = rope_theta^(-2i / head_dim)``, optionally
rescaled by Llama 3's ``rope_scaling`` (``config.json`` names both as
``rope_theta`` and ``rope_scaling``, or, as ``transformers`` 5 writes it, in one
``rope_parameters``). Attention scores are ``q k / sqrt(head_dim)``,
softmax in float32. Qwen2 adds biases to ``q_proj``, ``k_proj`` and
``v_proj``; Llama's ``attention_bias`` adds them to all four projections.

The parameters are a nested dict whose paths, joined by ``.``, are the
published tensor names less the ``model.`` prefix, with ``weight`` read as
``kernel`` (linear maps, ``[in, out]``: the transpose of the stored
``[out, in]``, used as ``x @ kernel + bias``), ``scale`` (RMSNorms) or
``embedding`` (``embed_tokens``): ``layers.0.self_attn.q_proj.kernel`` is
``model.layers.0.self_attn.q_proj.weight`` transposed. They are used in the
dtype they hold (a bfloat16 checkpoint stays bfloat16) and cast to
``policy.compute`` for the forward pass. ``dpmp.models._hf_checkpoint``
reads and writes the folders.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.models._model import Model
from dpmp.models._params_file import nest
from dpmp.models.families._base import register_family
from dpmp.models.families._causal_lm import causal_lm_model
from dpmp.precision._policy import Policy

__all__ = [
    "DecoderConfig",
    "DecoderFamily",
    "decoder_config_from_json",
    "decoder_forward",
    "decoder_init",
    "decoder_model",
    "rope_inv_freq",
]

Params = dict[str, Any]

# model_type -> what its config.json leaves unsaid
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen2": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0},
    "gemma": {
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
    },
}
# model types whose extra layers (soft-capping, sliding windows, more norms) are not built yet
_NOT_YET = ("gemma2", "gemma3", "gemma3_text")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """The sizes and variants of a Llama, Qwen2 or Gemma model (its ``config.json``).

    Attributes:
      model_type: ``"llama"``, ``"qwen2"`` or ``"gemma"``.
      vocab_size: rows of the token embedding (and logits per position).
      hidden_size: the width ``D``.
      intermediate_size: the MLP's width.
      num_hidden_layers: the number of layers.
      num_attention_heads: query heads ``H``.
      num_key_value_heads: key/value heads, dividing ``H`` (grouped-query attention).
      head_dim: the width of a head (default ``hidden_size / num_attention_heads``).
      rms_norm_eps: the RMSNorms' epsilon.
      rope_theta: the rotary embedding's base.
      rope_scaling: None, or Llama 3's ``{"rope_type": "llama3", "factor",
        "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``.
      max_position_embeddings: the longest sequence.
      tie_word_embeddings: the head is ``embed_tokens`` transposed (no ``lm_head``).
      attention_bias: ``q_proj``, ``k_proj`` and ``v_proj`` have biases.
      o_proj_bias: ``o_proj`` has a bias.
      hidden_act: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
      scale_embedding: the embedding is multiplied by ``sqrt(hidden_size)``,
        rounded to the compute dtype (Gemma).
      norm_offset: the RMSNorms scale by ``1 + weight`` (Gemma).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    hidden_act: str = "silu"
    scale_embedding: bool = False
    norm_offset: bool = False

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported; "
                f"allowed: {', '.join(map(repr, _ACTIVATIONS))}"
            )
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
            raise ValueError(f"rms_norm_eps: must be in (0, 1), got {eps!r}")
        _check_rope_scaling(self.rope_scaling)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of every parameter, names as paths joined by ``.``."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        linear = {"self_attn.q_proj": (d, q), "self_attn.k_proj": (d, kv)}
        linear |= {"self_attn.v_proj": (d, kv), "self_attn.o_proj": (q, d)}
        linear |= {"mlp.gate_proj": (d, f), "mlp.up_proj": (d, f), "mlp.down_proj": (f, d)}
        biased = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
        biased = biased if self.attention_bias else set()
        biased |= {"self_attn.o_proj"} if self.o_proj_bias else set()
        out = {"embed_tokens.embedding": (self.vocab_size, d)}
        for i in range(self.num_hidden_layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"layers.{i}.{norm}.scale"] = (d,)
            for name, (fan_in, fan_out) in linear.items():
                out[f"layers.{i}.{name}.kernel"] = (fan_in, fan_out)
                if name in biased:
                    out[f"layers.{i}.{name}.bias"] = (fan_out,)
        out["norm.scale"] = (d,)
        if not self.tie_word_embeddings:
            out["lm_head.kernel"] = (d, self.vocab_size)
        return out

    @property
    def n_positions(self) -> int:
        """The longest sequence, ``max_position_embeddings`` (as ``GPT2Config`` names it)."""
        return self.max_position_embeddings

    def to_json(self) -> dict[str, Any]:
        """The ``config.json`` keys that ``decoder_config_from_json`` reads back."""
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for derived in ("scale_embedding", "norm_offset", "o_proj_bias"):
            del raw[derived]
        if self.o_proj_bias:  # Llama's attention_bias: all four projections
            raw["attention_bias"] = True
        raw["hidden_activation"] = self.hidden_act  # Gemma reads this one
        raw["architectures"] = [_ARCHITECTURES[self.model_type]]
        return raw


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma": "GemmaForCausalLM",
}


def _check_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported; allowed: 'llama3'")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling: no {missing[0]!r} (rope_type 'llama3')")


def decoder_config_from_json(raw: dict[str, Any]) -> DecoderConfig:
    """The ``DecoderConfig`` of a parsed ``config.json``; keys it does not use are
    not read.

    Raises:
      ValueError: an unsupported ``model_type``, ``rope_type``, activation or
        option (sliding windows, MLP biases), or a size missing or invalid (named).
    """
    kind = raw.get("model_type")
    if kind in _NOT_YET:
        raise ValueError(
            f"model_type {kind!r} is not supported yet (its soft-capping, sliding windows "
            "and extra norms are not built); supported: 'gemma' (Gemma 1)"
        )
    if kind not in _DEFAULTS:
        raise ValueError(
            f"model_type {kind!r} is not supported; allowed: {', '.join(map(repr, _DEFAULTS))}"
        )
    raw = _DEFAULTS[kind] | {k: v for k, v in raw.items() if v is not None}
    for flag in ("use_sliding_window", "mlp_bias", "use_bidirectional_attention"):
        if raw.get(flag):
            raise ValueError(f"{flag}: true is not supported")
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    missing = [k for k in (*sizes, "num_attention_heads") if k not in raw]
    if missing:
        raise ValueError(f"no {missing[0]!r}")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim")
    if head_dim is None and isinstance(heads, int) and heads > 0:
        head_dim = raw["hidden_size"] // heads
    theta, scaling = _rope_config(raw)
    gemma = kind == "gemma"
    return DecoderConfig(
        model_type=kind,
        **{k: raw[k] for k in sizes},
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        attention_bias=kind == "qwen2" or bool(raw.get("attention_bias")),
        o_proj_bias=kind != "qwen2" and bool(raw.get("attention_bias")),
        hidden_act=_gemma_act(raw) if gemma else raw["hidden_act"],
        scale_embedding=gemma,
        norm_offset=gemma,
    )


def _rope_config(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a ``config.json``, in either form
    ``transformers`` writes: ``rope_parameters`` (version 5: ``rope_type`` and
    ``rope_theta`` in one object) or ``rope_scaling`` beside ``rope_theta``
    (before); the object's ``rope_theta`` first, as ``transformers`` reads it.
    ``rope_type`` ``"default"`` is no scaling."""
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling")
    if scaling is None:
        scaling = {}
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_parameters: must be an object, got {scaling!r}")
    theta = scaling.get("rope_theta", raw["rope_theta"])
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ValueError(f"rope_theta: must be a positive number, got {theta!r}")
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1:
        raise ValueError(f"partial_rotary_factor: {partial!r} is not supported; allowed: 1")
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return float(theta), None
    return float(theta), scaling


def _gemma_act(raw: dict[str, Any]) -> str:
    """Gemma's activation: ``hidden_activation`` where given, else ``hidden_act``,
    whose legacy ``"gelu"`` (the published Gemma 1 configs) means the tanh
    approximation, as ``transformers`` reads it."""
    act = raw.get("hidden_activation") or raw["hidden_act"]
    return "gelu_pytorch_tanh" if act == "gelu" else act


def rope_inv_freq(config: DecoderConfig) -> np.ndarray:
    """The rotary frequencies ``[head_dim / 2]`` (float64), with Llama 3's scaling:
    wavelengths longer than ``original / low_freq_factor`` divided by ``factor``,
    shorter than ``original / high_freq_factor`` kept, those between interpolated."""
    hd = config.head_dim
    inv = 1.0 / config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    s = config.rope_scaling
    if s is None:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled)


def decoder_init(config: DecoderConfig, key: jax.Array) -> Params:
    """Fresh float32 parameters: weights and embeddings N(0, 0.02^2), biases 0,
    RMSNorm scales 1 (Gemma's offset form: 0, so that ``1 + w`` is 1)."""
    shapes = config.shapes()
    keys = dict(zip(shapes, jax.random.split(key, len(shapes))))

    def one(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.endswith(".bias") or (name.endswith(".scale") and config.norm_offset):
            return jnp.zeros(shape, jnp.float32)
        if name.endswith(".scale"):
            return jnp.ones(shape, jnp.float32)
        return 0.02 * jax.random.normal(keys[name], shape, jnp.float32)

    return nest({name: one(name, shape) for name, shape in shapes.items()})


def _rms_norm(config: DecoderConfig, w: jax.Array, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    ms = jnp.square(x32).mean(-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(ms + jnp.float32(config.rms_norm_eps))
    if config.norm_offset:  # Gemma: y (1 + w) in float32, then cast; as y + y w, a
        # product with the parameter alone, the form ghost clipping's scale rule reads
        return (y + y * w.astype(jnp.float32)).astype(x.dtype)
    return y.astype(x.dtype) * w.astype(x.dtype)


def _linear(p: Params, x: jax.Array) -> jax.Array:
    y = x @ p["kernel"].astype(x.dtype)
    return y + p["bias"].astype(x.dtype) if "bias" in p else y


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x [B, T, heads, hd]`` rotated: ``x cos + rotate_half(x) sin``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attention(config: DecoderConfig, p: Params, x: jax.Array, cos, sin) -> jax.Array:
    """Causal grouped-query self-attention of ``x [B, T, D]``."""
    b, t, _ = x.shape
    h, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = _rope(_linear(p["q_proj"], x).reshape(b, t, h, hd), cos, sin)
    k = _rope(_linear(p["k_proj"], x).reshape(b, t, kv, hd), cos, sin)
    v = _linear(p["v_proj"], x).reshape(b, t, kv, hd)
    q = q.reshape(b, t, kv, h // kv, hd)  # query head j uses KV head j // (h // kv)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k).astype(jnp.float32)
    scores = scores / jnp.float32(math.sqrt(hd))
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bgrqk,bkgd->bqgrd", weights, v).reshape(b, t, h * hd)
    return _linear(p["o_proj"], out)


def _mlp(config: DecoderConfig, p: Params, x: jax.Array) -> jax.Array:
    gate = _linear(p["gate_proj"], x)
    if config.hidden_act == "silu":
        gate = jax.nn.silu(gate)
    else:
        gate = jax.nn.gelu(gate, approximate=True)
    return _linear(p["down_proj"], gate * _linear(p["up_proj"], x))


def decoder_forward(config: DecoderConfig, params: Params, tokens: jax.Array, compute) -> jax.Array:
    """Logits ``[B, T, vocab_size]`` in ``compute`` of ``tokens [B, T]`` (int).

    Raises:
      ValueError: ``T`` is longer than ``config.max_position_embeddings``.
    """
    t = tokens.shape[-1]
    if t > config.max_position_embeddings:
        raise ValueError(
            f"tokens: {t} positions; the model has max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    embedding = params["embed_tokens"]["embedding"].astype(compute)
    x = jnp.take(embedding, tokens, axis=0)
    if config.scale_embedding:  # the normalizer rounded to the compute dtype, as HF does
        x = x * jnp.asarray(math.sqrt(config.hidden_size), compute)
    inv_freq = jnp.asarray(rope_inv_freq(config), jnp.float32)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, hd]
    cos, sin = jnp.cos(angles).astype(compute), jnp.sin(angles).astype(compute)
    for i in range(config.num_hidden_layers):
        layer = params["layers"][str(i)]
        h = _rms_norm(config, layer["input_layernorm"]["scale"], x)
        x = x + _attention(config, layer["self_attn"], h, cos, sin)
        h = _rms_norm(config, layer["post_attention_layernorm"]["scale"], x)
        x = x + _mlp(config, layer["mlp"], h)
    x = _rms_norm(config, params["norm"]["scale"], x)
    if config.tie_word_embeddings:
        return x @ embedding.T
    return x @ params["lm_head"]["kernel"].astype(compute)


def decoder_model(
    config: DecoderConfig, policy: Policy | str = "f32", *, pad_id: int | None = None
) -> Model:
    """The decoder of ``config`` as a ``dpmp.models.Model``, with the batch and loss
    conventions of ``dpmp.models.families._causal_lm``: ``x`` token ids
    ``[B, T]``, ``y`` per-token labels of the same shape (negative: ignored) or
    anything else (then the targets are ``x[:, 1:]`` less ``pad_id``); a
    record's loss is its mean cross-entropy over its targets.

    ``init(key)`` draws fresh float32 parameters (``decoder_init``); to start
    from a checkpoint, pass its parameters as ``init_params``.
    """
    policy = Policy.parse(policy)
    c = config
    mlp = "SwiGLU" if c.hidden_act == "silu" else "GeGLU"
    head = "tied to the token embedding" if c.tie_word_embeddings else "untied"
    return causal_lm_model(
        lambda params, tokens, compute: decoder_forward(config, params, tokens, compute),
        lambda key: decoder_init(config, key),
        policy,
        pad_id,
        kind=c.model_type,
        name=f"{c.model_type} {c.num_hidden_layers} layers width {c.hidden_size}",
        description=(
            f"{c.model_type}: vocabulary {c.vocab_size}, width {c.hidden_size}, "
            f"{c.num_hidden_layers} pre-RMSNorm layers with {c.num_attention_heads}-head causal "
            f"attention ({c.num_key_value_heads} key/value heads of {c.head_dim}, rotary "
            f"positions) and {mlp} MLP {c.intermediate_size}, head {head}"
        ),
    )


class DecoderFamily:
    """``model.kind = "llama"``, ``"qwen2"`` or ``"gemma"``: a decoder read from its
    Hugging Face checkpoint folder (``model.checkpoint``;
    ``dpmp.models._hf_checkpoint``) whose ``config.json`` ``model_type`` is the
    family's name, sizes and parameters included; the ``[model]`` sizes are not read.

    Args:
      name: the ``model_type`` it reads, and its ``model.kind``.
      title: the family's name in prose (``"Llama"``).
    """

    task = "next_token"
    sizes = ()

    def __init__(self, name: str, title: str):
        self.name = name
        self.model_types = (name,)
        self.checkpoint = f"a {title} checkpoint folder"

    def build(
        self,
        architecture: Any,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        """Refused: its sizes are its checkpoint's (``load``)."""
        del architecture, input_shape, num_classes, policy
        raise ValueError(
            f"model.kind = {self.name!r} is read from {self.checkpoint} (model.checkpoint), "
            "not built from the [model] sizes"
        )

    def load(self, folder: Path, policy: Policy):
        """``load_decoder(folder, policy)``: a ``Decoder`` (model, params in the
        stored dtype, tokenizer or None, ``DecoderConfig``).

        Raises:
          DataError: as ``load_decoder``, or the folder's ``model_type`` is another.
        """
        from dpmp.data._dataset import DataError
        from dpmp.models._hf_checkpoint import CONFIG, load_decoder, read_decoder_config

        config = read_decoder_config(folder)  # read once: load_decoder is handed it
        if config.model_type not in self.model_types:
            raise DataError(
                f"{Path(folder) / CONFIG}: model_type {config.model_type!r}; "
                f"model.kind = {self.name!r} reads {', '.join(map(repr, self.model_types))}"
            )
        return load_decoder(folder, policy, config=config)


for _name, _title in (("llama", "Llama"), ("qwen2", "Qwen2"), ("gemma", "Gemma")):
    register_family(DecoderFamily(_name, _title))
