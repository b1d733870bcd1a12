"""Llama, Qwen2 and Gemma (1) logits in float64 NumPy, from the published formulas.

Written from the papers and Hugging Face's modelling code as published
(``modeling_llama.py``, ``modeling_qwen2.py``, ``modeling_gemma.py``), not from
dpmp's JAX code: it reads the tensors by their published names, in the
published ``[out, in]`` orientation (``y = x @ W.T + b``), and the raw
``config.json`` dict.
"""

from __future__ import annotations

import math

import numpy as np


def _inv_freq(cfg: dict, head_dim: int) -> np.ndarray:
    """RoPE frequencies ``theta^(-2i/d)``; Llama 3's ``rope_scaling`` divides the low
    frequencies by ``factor`` and interpolates the middle band smoothly."""
    theta = cfg.get("rope_theta", 10000.0)
    inv = np.array([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)])
    s = cfg.get("rope_scaling")
    if not s:
        return inv
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        old = s["original_max_position_embeddings"]
        if wavelen < old / s["high_freq_factor"]:
            out.append(f)
        elif wavelen > old / s["low_freq_factor"]:
            out.append(f / s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.array(out)


def _rotate(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """One head ``x [T, d]`` rotated pairwise: ``(x_i, x_{i+d/2})`` by ``pos * inv_i``."""
    half = x.shape[-1] // 2
    angle = pos[:, None] * inv[None, :]
    c, s = np.cos(angle), np.sin(angle)
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _act(name: str, y: np.ndarray) -> np.ndarray:
    if name == "silu":
        return y / (1 + np.exp(-y))
    return 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))


def decoder_logits(tensors: dict[str, np.ndarray], cfg: dict, tokens) -> np.ndarray:
    """Logits ``[T, vocab]`` of one sequence ``tokens``; ``tensors`` by published names
    (``model.``-prefixed), ``cfg`` the ``config.json`` dict."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    gemma = cfg["model_type"] == "gemma"
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or d // heads
    eps = cfg.get("rms_norm_eps", 1e-6)
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh") if gemma else cfg["hidden_act"]
    tied = cfg.get("tie_word_embeddings", gemma)

    def norm(x, name):
        w = t[name + ".weight"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * ((1 + w) if gemma else w)

    def lin(x, name):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if name + ".bias" in t else y

    n = len(tokens)
    pos, inv = np.arange(n, dtype=np.float64), _inv_freq(cfg, hd)
    x = t["model.embed_tokens.weight"][np.asarray(tokens)]
    if gemma:
        x = x * math.sqrt(d)
    mask = np.tril(np.ones((n, n))) > 0
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm")
        q, k, v = (lin(h, p + "self_attn." + m) for m in ("q_proj", "k_proj", "v_proj"))
        outs = []
        for j in range(heads):
            g = j // (heads // kv_heads)  # the key/value head query head j shares
            qj = _rotate(q[:, j * hd : (j + 1) * hd], pos, inv)
            kj = _rotate(k[:, g * hd : (g + 1) * hd], pos, inv)
            s = np.where(mask, qj @ kj.T / math.sqrt(hd), -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            outs.append(e / e.sum(-1, keepdims=True) @ v[:, g * hd : (g + 1) * hd])
        x = x + lin(np.concatenate(outs, -1), p + "self_attn.o_proj")
        h = norm(x, p + "post_attention_layernorm")
        gate = _act(act, lin(h, p + "mlp.gate_proj"))
        x = x + lin(gate * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    x = norm(x, "model.norm")
    head = t["model.embed_tokens.weight"] if tied else t["lm_head.weight"]
    return x @ head.T
