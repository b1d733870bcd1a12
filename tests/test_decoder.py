"""Llama, Qwen2 and Gemma checkpoint folders: logits against a float64 NumPy
reference (``tests/_decoder_reference.py``), grouped-query attention against the
same model with its key/value heads repeated, round trips through
``save_decoder`` (sharded and not, bfloat16 kept), and bad input named in one
line. Every checkpoint is a tiny random one written here with
``safetensors.numpy.save_file`` in the published layout."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dpmp.data._dataset import DataError
from dpmp.models._hf_checkpoint import load_decoder, save_decoder
from tests._decoder_reference import decoder_logits

SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
SIZES |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
# head_dim 8, theta 1e4: wavelengths 6.3, 63, 628, 6283 positions; with these
# bounds (64 / 4 = 16 and 64 / 1 = 64) one is kept, one interpolated, two divided
LLAMA3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
CONFIGS = {
    "llama": SIZES
    | {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1e4}
    | {"rope_scaling": LLAMA3, "tie_word_embeddings": False},
    "qwen2": SIZES
    | {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6}
    | {"tie_word_embeddings": False},
    # Gemma's head_dim (16) is not hidden_size / heads (8), as in the published ones
    "gemma": SIZES
    | {"model_type": "gemma", "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}
    | {"head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1e4},
}
TOKENS = np.array(
    [[3, 17, 5, 63, 0, 22, 9, 41, 8, 8, 2, 30], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
)
U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of float32 and bfloat16
# Every logit ends a chain of about 20 roundings in sequence (2 layers of norm,
# projections, rotation, softmax, weighted sum, MLP, residual; then norm and
# head), each a sum of at most 64 terms of magnitude O(1) (weights ~ 1/sqrt(fan
# in)): float32 is within 20 * 64 * u of the largest logit. bfloat16 compute
# rounds each of the ~20 stages' outputs once (its dots accumulate in float32):
# within 20 * u.
F32_TOL, BF16_TOL = 20 * 64 * U32, 20 * U16


def _tensors(cfg: dict, rng, dtype=np.float32) -> dict[str, np.ndarray]:
    """A random checkpoint's tensors by their published names, ``[out, in]``."""
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gemma = cfg["model_type"] == "gemma"

    def w(*shape, scale=None):
        scale = 1 / np.sqrt(shape[-1]) if scale is None else scale
        return (scale * rng.standard_normal(shape)).astype(dtype)

    def norm():  # Gemma stores w of the scale 1 + w
        return (w(d, scale=0.1) + (0 if gemma else 1)).astype(dtype)

    out = {"model.embed_tokens.weight": w(cfg["vocab_size"], d, scale=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "post_attention_layernorm.weight"] = norm()
        for name, shape in {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d)}.items():
            out[p + "self_attn." + name + ".weight"] = w(*shape)
            if cfg["model_type"] == "qwen2":
                out[p + "self_attn." + name + ".bias"] = w(shape[0], scale=0.1)
        out[p + "self_attn.o_proj.weight"] = w(d, q)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = w(f, d), w(f, d)
        out[p + "mlp.down_proj.weight"] = w(d, f)
    out["model.norm.weight"] = norm()
    if not cfg.get("tie_word_embeddings", gemma):
        out["lm_head.weight"] = w(cfg["vocab_size"], d)
    return out


def _write(folder, cfg: dict, tensors: dict, *, prefix=True):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    stored = {(k if prefix else k.removeprefix("model.")): v for k, v in tensors.items()}
    save_file(stored, str(folder / "model.safetensors"))
    return folder


def _reference(tensors, cfg):
    return np.stack([decoder_logits(tensors, cfg, row) for row in TOKENS])


def _close(got, want, tol):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


# qwen2 goes through shards, gemma is stored in bfloat16, llama without the prefix
CASES = {"llama": (None, np.float32), "qwen2": (3000, np.float32), "gemma": (None, "bf16")}


@pytest.mark.usefixtures("strict_promotion")
@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_equal_the_float64_reference_and_survive_save_and_load(tmp_path, family):
    cfg, (shard_bytes, dtype) = CONFIGS[family], CASES[family]
    dtype = ml_dtypes.bfloat16 if dtype == "bf16" else dtype
    tensors = _tensors(cfg, np.random.default_rng(0), dtype)
    first = load_decoder(_write(tmp_path / "a", cfg, tensors, prefix=family != "llama"), "f32")
    assert {leaf.dtype for leaf in jax.tree.leaves(first.params)} == {np.dtype(dtype)}
    got = jax.jit(first.model.predict)(first.params, TOKENS)
    assert got.dtype == np.float32 and got.shape == (*TOKENS.shape, cfg["vocab_size"])
    want = _reference(tensors, cfg)  # from the stored (rounded) weights
    _close(got, want, F32_TOL)

    save_decoder(tmp_path / "b", first.params, first.config, shard_bytes=shard_bytes)
    shards = sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    assert (len(shards) > 1) == (shard_bytes is not None), shards
    second = load_decoder(tmp_path / "b", "f32")
    assert second.config == first.config
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.jit(second.model.predict)(second.params, TOKENS), got)


def _published(folder) -> dict[str, tuple]:
    from safetensors import safe_open

    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="numpy") as f:
            out |= {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    return out


def test_save_writes_the_published_names_shapes_and_index(tmp_path):
    cfg = CONFIGS["qwen2"]
    tensors = _tensors(cfg, np.random.default_rng(1))
    loaded = load_decoder(_write(tmp_path / "a", cfg, tensors))
    save_decoder(tmp_path / "b", loaded.params, loaded.config, shard_bytes=4000)
    assert _published(tmp_path / "b") == _published(tmp_path / "a")
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    for name, file in index["weight_map"].items():
        assert name in _published_file(tmp_path / "b" / file)
    raw = json.loads((tmp_path / "b" / "config.json").read_text())
    assert raw["model_type"] == "qwen2" and raw["num_key_value_heads"] == 2


def _published_file(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return set(f.keys())


@pytest.mark.fast_cases("gemma")
@pytest.mark.parametrize("family", list(CONFIGS))
def test_bf16_compute_is_within_bf16_rounding_of_the_reference(tmp_path, family):
    cfg = CONFIGS[family]
    tensors = _tensors(cfg, np.random.default_rng(2), ml_dtypes.bfloat16)
    loaded = load_decoder(_write(tmp_path, cfg, tensors), "bf16")
    got = jax.jit(loaded.model.predict)(loaded.params, TOKENS)
    assert got.dtype == np.float32  # the policy's output; computed in bfloat16
    want = _reference(tensors, cfg)
    _close(got, want, BF16_TOL)
    assert np.abs(np.asarray(got, np.float64) - want).max() > F32_TOL * np.abs(want).max()


def test_grouped_query_attention_equals_its_heads_repeated(tmp_path):
    """Two key/value heads for four query heads: query head j reads head j // 2,
    the model with k_proj, v_proj repeated to four heads (MHA)."""
    cfg = CONFIGS["llama"]
    tensors = _tensors(cfg, np.random.default_rng(3))
    gqa = load_decoder(_write(tmp_path / "gqa", cfg, tensors))
    full, hd = dict(tensors), cfg["hidden_size"] // cfg["num_attention_heads"]
    for i in range(cfg["num_hidden_layers"]):
        for m in ("k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{m}.weight"
            heads = tensors[name].reshape(cfg["num_key_value_heads"], hd, -1)
            full[name] = np.repeat(heads, 2, axis=0).reshape(-1, cfg["hidden_size"])
    mha_cfg = cfg | {"num_key_value_heads": cfg["num_attention_heads"]}
    mha = load_decoder(_write(tmp_path / "mha", mha_cfg, full))
    want = np.asarray(jax.jit(mha.model.predict)(mha.params, TOKENS), np.float64)
    _close(jax.jit(gqa.model.predict)(gqa.params, TOKENS), want, F32_TOL)


def test_a_tied_models_stored_head_is_not_read(tmp_path):
    cfg = CONFIGS["gemma"]
    tensors = _tensors(cfg, np.random.default_rng(4))
    stored = tensors | {"lm_head.weight": np.zeros((3, 3), np.float32)}  # any shape
    loaded = load_decoder(_write(tmp_path, cfg, stored))
    assert "lm_head" not in loaded.params


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


BAD_TENSORS = {
    "missing": (
        _drop("model.layers.1.mlp.up_proj.weight"),
        "missing tensor 'model.layers.1.mlp.up_proj.weight'",
    ),
    "unexpected": (
        lambda t: t | {"model.layers.0.extra.weight": np.zeros(3, np.float32)},
        "unexpected tensor 'model.layers.0.extra.weight'",
    ),
    "mis-shaped": (
        lambda t: t | {"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)},
        "'model.layers.0.self_attn.k_proj.weight' has shape (8, 32), expected (16, 32)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_a_bad_tensor_is_named_with_its_file(tmp_path, case):
    change, words = BAD_TENSORS[case]
    cfg = CONFIGS["llama"]
    _write(tmp_path, cfg, change(_tensors(cfg, np.random.default_rng(5))))
    with pytest.raises(DataError) as e:
        load_decoder(tmp_path)
    message = str(e.value)
    assert words in message
    assert "model.safetensors" in message and "\n" not in message


BAD_CONFIGS = {
    "unknown model_type": ({"model_type": "mamba"}, "model_type 'mamba' is not supported"),
    "gemma2": ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported yet"),
    "rope_type": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "rope_type 'yarn' is not supported",
    ),
    "heads": ({"num_key_value_heads": 3}, "num_key_value_heads (3)"),
    "partial rotary": (
        {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
        "partial_rotary_factor: 0.5 is not supported",
    ),
    "bidirectional": (
        {"use_bidirectional_attention": True},
        "use_bidirectional_attention: true is not supported",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_config_is_one_line_naming_it(tmp_path, case):
    change, words = BAD_CONFIGS[case]
    cfg = CONFIGS["llama"] | change
    _write(tmp_path, cfg, _tensors(CONFIGS["llama"], np.random.default_rng(6)))
    with pytest.raises(DataError) as e:
        load_decoder(tmp_path)
    assert words in str(e.value) and "config.json" in str(e.value)
    assert "\n" not in str(e.value)
    if case == "unknown model_type":
        assert all(k in str(e.value) for k in ("'llama'", "'qwen2'", "'gemma'"))


def _v5(cfg: dict) -> dict:
    """``cfg`` as ``transformers`` 5 writes it: the rotary base and scaling in one
    ``rope_parameters`` object (``rope_type`` ``"default"`` without scaling),
    Gemma's activation as its legacy ``hidden_act`` ``"gelu"`` alone."""
    out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling")}
    out.pop("hidden_activation", None)
    rope = cfg.get("rope_scaling") or {"rope_type": "default"}
    return out | {"rope_parameters": rope | {"rope_theta": cfg.get("rope_theta", 1e4)}}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_rope_parameters_form_is_read_as_rope_theta_and_rope_scaling(family):
    """Both forms of ``config.json`` give one ``DecoderConfig``; the base is not
    left at its default (Qwen2's is 1e6)."""
    from dpmp.models.families._decoder import decoder_config_from_json

    legacy, v5 = (
        decoder_config_from_json(CONFIGS[family]),
        decoder_config_from_json(_v5(CONFIGS[family])),
    )
    assert v5 == legacy and v5.rope_theta == CONFIGS[family]["rope_theta"]
    assert (v5.rope_scaling is None) == ("rope_scaling" not in CONFIGS[family])
    assert v5.hidden_act == ("gelu_pytorch_tanh" if family == "gemma" else "silu")


def _sharded(tmp_path):
    cfg = CONFIGS["qwen2"]
    loaded = load_decoder(_write(tmp_path / "a", cfg, _tensors(cfg, np.random.default_rng(9))))
    folder = save_decoder(tmp_path / "b", loaded.params, loaded.config, shard_bytes=9000)
    return folder, json.loads((folder / "model.safetensors.index.json").read_text())


def _relist(folder, index, name, file):
    """The index with ``name`` listed in ``file`` (None: not listed)."""
    weight_map = dict(index["weight_map"])
    weight_map.pop(name, None)
    weight_map |= {} if file is None else {name: file}
    text = json.dumps(index | {"weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)


def test_the_shard_index_is_checked_against_the_shards(tmp_path):
    """A tensor the index lists in another shard than its own, a tensor it does
    not list, one it lists in a shard that does not hold it: each one line
    naming the tensor and the files."""
    folder, index = _sharded(tmp_path)
    files = sorted(set(index["weight_map"].values()))
    # a tensor of a shard of several, so that the shard stays listed without it
    name, own = next(
        (k, f)
        for k, f in index["weight_map"].items()
        if list(index["weight_map"].values()).count(f) > 1
    )
    other = next(f for f in files if f != own)
    unlisted = (f"{own}: holds tensor {name!r}; ", "does not list it")
    for listed, words in ((other, (f"tensor {name!r}", other)), (None, unlisted)):
        _relist(folder, index, name, listed)
        with pytest.raises(DataError) as e:
            load_decoder(folder)
        message = str(e.value)
        assert "model.safetensors.index.json" in message and "\n" not in message, message
        assert all(word in message for word in words), message
    _relist(folder, index, "model.extra.weight", own)
    with pytest.raises(DataError, match=f"lists tensor 'model.extra.weight' in {own}, which"):
        load_decoder(folder)
    _relist(folder, index, "model.extra.weight", None)
    load_decoder(folder)  # the index as written again


def test_generation_defaults_are_read_and_written(tmp_path):
    from dpmp.models._hf_checkpoint import GenerationDefaults

    cfg = CONFIGS["llama"]
    folder = _write(tmp_path / "a", cfg, _tensors(cfg, np.random.default_rng(10)))
    assert load_decoder(folder).generation == GenerationDefaults()  # no file: all None
    raw = {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0, "max_length": 40}
    (folder / "generation_config.json").write_text(json.dumps(raw | {"do_sample": True}))
    loaded = load_decoder(folder)
    assert loaded.generation == GenerationDefaults(
        bos_token_id=1, eos_token_ids=(2, 7), pad_token_id=0, max_length=40
    )
    save_decoder(tmp_path / "b", loaded.params, loaded.config, generation=loaded.generation)
    assert json.loads((tmp_path / "b" / "generation_config.json").read_text()) == raw
    assert load_decoder(tmp_path / "b").generation == loaded.generation
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "</s>"]}))
    with pytest.raises(DataError, match="eos_token_id must be an integer >= 0, got '</s>'"):
        load_decoder(folder)


def test_a_family_load_reads_config_json_once(tmp_path, monkeypatch):
    from dpmp.models import _hf_checkpoint
    from dpmp.models.families import FAMILIES

    cfg = CONFIGS["gemma"]
    folder = _write(tmp_path, cfg, _tensors(cfg, np.random.default_rng(11)))
    read, real = [], _hf_checkpoint._read_json
    monkeypatch.setattr(_hf_checkpoint, "_read_json", lambda p: read.append(p.name) or real(p))
    FAMILIES.get("gemma").load(folder, "f32")
    assert read.count("config.json") == 1, read
    load_decoder(folder)
    assert read.count("config.json") == 2, read


@pytest.mark.slow  # ~6 s on 2 cores: the gradient's compilation
def test_the_loss_and_gradients_of_a_loaded_model(tmp_path):
    """The Model's loss is the mean next-token cross-entropy of the reference's
    logits; its gradients are finite and have the parameters' structure."""
    cfg = CONFIGS["qwen2"]
    tensors = _tensors(cfg, np.random.default_rng(7))
    loaded = load_decoder(_write(tmp_path, cfg, tensors))
    logits = _reference(tensors, cfg)[:, :-1]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = TOKENS[:, 1:]
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    want = ce.mean(-1).mean()
    value_and_grad = jax.jit(jax.value_and_grad(loaded.model.loss_fn))
    value, grads = value_and_grad(loaded.params, {"x": TOKENS})
    np.testing.assert_allclose(value, want, rtol=F32_TOL * 10)
    assert jax.tree.structure(grads) == jax.tree.structure(loaded.params)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


@pytest.mark.slow  # ~10 s on 2 cores: two clipped-gradient compilations
def test_ghost_clipping_reads_every_layer_of_a_tied_gemma():
    """Gemma's tied head and 1 + w norms: ghost clipping's clipped sum equals the
    per-example (vmap) one within float32 rounding (F32_TOL of its norm)."""
    import dpmp
    from dpmp.models.families._decoder import decoder_config_from_json, decoder_init, decoder_model

    config = decoder_config_from_json(CONFIGS["gemma"] | {"num_hidden_layers": 1})
    rng = np.random.default_rng(8)
    params = jax.tree.map(
        lambda a: np.asarray(a) + rng.normal(0, 0.3, a.shape).astype(np.float32),
        decoder_init(config, jax.random.key(0)),
    )
    batch = {"x": TOKENS[:, :6], "y": np.zeros(2, np.int32)}
    loss = decoder_model(config, "f32").loss_fn
    sums = []
    for method in ("ghost", "vmap"):
        g = dpmp.private_grad(loss, l2_clip_norm=0.5, policy="f32", method=method)
        if method == "ghost":
            rules = {r["param"]: r["rule"] for r in g.explain(params, batch)["layers"]}
            assert len(rules) == len(jax.tree.leaves(params)), rules  # none left out
        leaves = jax.tree.leaves(jax.jit(g)(params, batch).grads)
        sums.append(np.concatenate([np.ravel(leaf) for leaf in leaves]))
    ghost, vmap = sums
    assert np.linalg.norm(ghost - vmap) <= F32_TOL * np.linalg.norm(vmap)
