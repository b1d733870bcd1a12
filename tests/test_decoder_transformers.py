"""Llama, Qwen2 and Gemma checkpoints written by ``transformers`` itself, read by
``load_decoder``: dpmp's logits equal ``transformers``' own on the same tokens.

Each checkpoint is a random tiny model of ``transformers``' own config class
(``LlamaConfig``, ``Qwen2Config``, ``GemmaConfig``), saved by ``save_pretrained``
in float32 or bfloat16, once as ``model.safetensors`` and once in shards with
``model.safetensors.index.json``; its ``config.json`` is the form ``transformers``
5 writes (``rope_parameters``). The other way, a folder ``save_decoder`` writes
is read by ``transformers`` with the same logits. Skipped where ``transformers``
and ``torch`` are not installed (the ``hf`` extra).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dpmp.models._hf_checkpoint import load_decoder, save_decoder  # noqa: E402

SIZES = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
SIZES |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
# head_dim 16, theta 5e5: wavelengths 6.3, 32, 163, ... positions; with the bounds
# 64 / 4 = 16 and 64 / 1 = 64 one is kept, one interpolated, the others divided
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# name -> (config class, its arguments beyond SIZES)
CONFIGS = {
    "llama": ("LlamaConfig", {"rope_scaling": LLAMA3, "rope_theta": 5e5, "rms_norm_eps": 1e-5}),
    # Llama's attention_bias: biases on all four projections; a tied head
    "llama-tied": ("LlamaConfig", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1e6, "tie_word_embeddings": False}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True, "rms_norm_eps": 1e-5}),
    # Gemma's head_dim (32) is not hidden_size / heads (16), as in the published ones
    "gemma": ("GemmaConfig", {"head_dim": 32}),
    "gemma-untied": ("GemmaConfig", {"head_dim": 32, "tie_word_embeddings": False}),
}
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
CASES = [f"{name}-{dtype}" for name in CONFIGS for dtype in DTYPES]
# positions: 16 tokens; the second row right-padded after 11 (its attention mask 0)
TOKENS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 16))
MASK = np.ones_like(TOKENS)
MASK[1, 11:] = 0

U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of float32 and bfloat16
# float32: the 1e-4 of the largest logit. Each logit ends a chain of
# about 20 roundings (tests/test_decoder.py), each of a sum of at most 96
# terms; with terms of random sign their rounding errors add up as sqrt(96),
# about 20 * 10 * U32 = 1.2e-5 for each implementation, so two float32
# implementations of one formula agree within 1e-4 with room, and a wrong
# formula does not (a rotary base of 1e4 for Qwen2's 1e6 moves them by 0.1).
F32_TOL = 1e-4
# bfloat16: dpmp's and transformers' bfloat16 forwards each round the output of
# each of the ~20 stages once (dots accumulate in float32): each is within
# 20 * U16 = 0.078 of the largest logit from the float64 forward of the same
# stored weights (transformers' own, in float64), the reference of both.
BF16_TOL = 20 * U16


def _hf_model(case: str):
    """``transformers``' model of ``case`` with random weights in its dtype: norm
    scales 1 + N(0, 0.1^2) (Gemma stores w of 1 + w: N(0, 0.1^2)), biases
    N(0, 0.1^2), embeddings N(0, 1), linear weights N(0, 1 / fan_in)."""
    name, dtype = case.rsplit("-", 1)
    cls, extra = CONFIGS[name]
    config = getattr(transformers, cls)(**SIZES, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gemma = cls == "GemmaConfig"
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    with torch.no_grad():
        for key, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            if "norm" in key:
                p.copy_(0.1 * z + (0.0 if gemma else 1.0))
            elif key.endswith(".bias"):
                p.copy_(0.1 * z)
            elif "embed_tokens" in key:
                p.copy_(z)
            else:
                p.copy_(z / p.shape[-1] ** 0.5)
    return model.to(getattr(torch, DTYPES[dtype])).eval()


def _hf_logits(model, mask=None) -> np.ndarray:
    with torch.no_grad():
        mask = None if mask is None else torch.tensor(mask)
        out = model(input_ids=torch.tensor(TOKENS), attention_mask=mask).logits
    return out.to(torch.float64).numpy()


def _relative(got, want) -> float:
    """``max |got - want| / max |want|`` at the positions the mask keeps."""
    keep = MASK.astype(bool)
    got, want = np.asarray(got, np.float64)[keep], np.asarray(want, np.float64)[keep]
    return float(np.abs(got - want).max() / np.abs(want).max())


def _shards(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("*.safetensors"))


@pytest.mark.fast_cases("llama-f32", "qwen2-bf16", "gemma-f32")
@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers_on_the_folders_it_saves(tmp_path, case):
    model = _hf_model(case)
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    model.save_pretrained(one, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
    assert _shards(one) == ["model.safetensors"]
    assert len(_shards(sharded)) >= 2 and (sharded / "model.safetensors.index.json").is_file()
    bf16 = case.endswith("-bf16")
    first = load_decoder(one, "bf16" if bf16 else "f32")
    second = load_decoder(sharded, "bf16" if bf16 else "f32")
    assert first.config == second.config
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params), strict=True):
        assert a.dtype == np.dtype(str(model.dtype).removeprefix("torch."))
        np.testing.assert_array_equal(a, b)
    hf = model.generation_config
    assert first.generation.bos_token_id == hf.bos_token_id
    assert first.generation.eos_token_ids == tuple(np.atleast_1d(hf.eos_token_id or []))

    got = jax.jit(first.model.predict)(first.params, TOKENS)  # right padding needs no mask
    want = _hf_logits(model, MASK)
    if not bf16:
        assert _relative(got, want) <= F32_TOL, _relative(got, want)
        return
    exact = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(one, dtype=torch.float64))
    assert _relative(want, exact) <= BF16_TOL  # transformers' own bfloat16, for scale
    assert _relative(got, exact) <= BF16_TOL, _relative(got, exact)


@pytest.mark.fast_cases("llama")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_reads_the_folders_save_decoder_writes(tmp_path, name):
    """``save_decoder``'s ``config.json`` (rotary base and scaling as
    ``rope_theta`` and ``rope_scaling``), names and generation defaults read by
    ``transformers`` give its logits of the original model."""
    model = _hf_model(f"{name}-f32")
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    loaded = load_decoder(tmp_path / "hf")
    out = tmp_path / "dpmp"
    save_decoder(
        out, loaded.params, loaded.config, shard_bytes=40_000, generation=loaded.generation
    )
    assert json.loads((out / "generation_config.json").read_text()) == {
        k: v
        for k, v in json.loads((tmp_path / "hf" / "generation_config.json").read_text()).items()
        if k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_length")
    }
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert _relative(_hf_logits(again), _hf_logits(model)) <= F32_TOL
