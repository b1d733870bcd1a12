"""GPT-2 checkpoint folders: loading, logits against a float64 NumPy GPT-2, round
trips, bad input, the loss and generation. Every checkpoint is a tiny random one
written here with ``safetensors.numpy.save_file``."""

from __future__ import annotations

import json
import math

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from dpmp.data._dataset import DataError
from dpmp.models._generate import generate, generate_text
from dpmp.models._gpt2_checkpoint import encode_text, load_gpt2, save_gpt2
from dpmp.models._lora import adapted

SIZES = {"vocab_size": 12, "n_positions": 8, "n_embd": 8, "n_layer": 2, "n_head": 2}
WORDS = ["[UNK]", "<pad>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def _tensors(rng, *, vocab=12, positions=8, d=8, layers=2) -> dict[str, np.ndarray]:
    """GPT-2's tensors by GPT-2's names, random (biases and LayerNorms too)."""

    def w(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"wte.weight": w(vocab, d, scale=1.0), "wpe.weight": w(positions, d)}
    for i in range(layers):
        h = f"h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[h + ln + ".weight"] = 1 + w(d, scale=0.1)
            out[h + ln + ".bias"] = w(d, scale=0.1)
        for name, shape in {
            "attn.c_attn": (d, 3 * d),
            "attn.c_proj": (d, d),
            "mlp.c_fc": (d, 4 * d),
            "mlp.c_proj": (4 * d, d),
        }.items():
            out[h + name + ".weight"] = w(*shape)
            out[h + name + ".bias"] = w(shape[1], scale=0.1)
    out["ln_f.weight"], out["ln_f.bias"] = 1 + w(d, scale=0.1), w(d, scale=0.1)
    return out


def _write(folder, tensors, *, config=None, words=WORDS, prefix="", buffers=False):
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": "gpt2", "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    (folder / "config.json").write_text(json.dumps(raw | SIZES | (config or {})))
    stored = {prefix + k: v for k, v in tensors.items()}
    if buffers:  # what a library's state dict carries besides the weights
        for i in range(SIZES["n_layer"]):
            stored[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
            stored[f"{prefix}h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
        stored["lm_head.weight"] = tensors["wte.weight"]
    save_file(stored, str(folder / "model.safetensors"))
    if words is not None:
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(folder / "tokenizer.json"))
    return folder


def _reference(t: dict[str, np.ndarray], tokens: np.ndarray, heads=2, eps=1e-5) -> np.ndarray:
    """GPT-2's logits [T, vocab] of one sequence, float64 NumPy."""
    t = {k: v.astype(np.float64) for k, v in t.items()}

    def ln(x, name):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[name + ".weight"] + t[name + ".bias"]

    def conv1d(x, name):
        return x @ t[name + ".weight"] + t[name + ".bias"]

    n, layers = len(tokens), sum(k.endswith("ln_1.weight") for k in t)
    x = t["wte.weight"][tokens] + t["wpe.weight"][:n]
    for i in range(layers):
        h = f"h.{i}."
        q, k, v = np.split(conv1d(ln(x, h + "ln_1"), h + "attn.c_attn"), 3, axis=-1)
        d = q.shape[-1] // heads
        heads_out = []
        for j in range(heads):
            s = q[:, j * d : (j + 1) * d] @ k[:, j * d : (j + 1) * d].T / math.sqrt(d)
            s = np.where(np.tril(np.ones((n, n))) > 0, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            heads_out.append(p / p.sum(-1, keepdims=True) @ v[:, j * d : (j + 1) * d])
        x = x + conv1d(np.concatenate(heads_out, -1), h + "attn.c_proj")
        y = conv1d(ln(x, h + "ln_2"), h + "mlp.c_fc")
        y = 0.5 * y * (1 + np.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y**3)))
        x = x + conv1d(y, h + "mlp.c_proj")
    return ln(x, "ln_f") @ t["wte.weight"].T


TOKENS = np.array([[2, 3, 4, 5, 6, 7, 11, 0], [9, 8, 2, 1, 1, 1, 1, 1]], np.int32)


@pytest.mark.slow  # ~4 s on 2 cores
@pytest.mark.parametrize("prefix,buffers", [("", False), ("transformer.", True)])
def test_logits_equal_a_float64_numpy_gpt2_under_f32(tmp_path, prefix, buffers):
    tensors = _tensors(np.random.default_rng(0))
    loaded = load_gpt2(_write(tmp_path, tensors, prefix=prefix, buffers=buffers), "f32")
    got = np.asarray(loaded.model.predict(loaded.params, TOKENS))
    want = np.stack([_reference(tensors, row) for row in TOKENS])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert loaded.params["h"]["0"]["attn"]["c_attn"]["kernel"].dtype == np.float32


@pytest.mark.slow  # ~5 s on 2 cores
def test_a_bf16_checkpoint_stays_bf16_and_computes_in_the_policy(tmp_path):
    tensors = _tensors(np.random.default_rng(1))
    half = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    loaded = load_gpt2(_write(tmp_path, half), "bf16")
    leaves = jax.tree.leaves(loaded.params)
    assert {leaf.dtype for leaf in leaves} == {np.dtype(ml_dtypes.bfloat16)}
    got = np.asarray(loaded.model.predict(loaded.params, TOKENS), np.float64)
    # the reference from the same (rounded) weights: what is left is bf16 compute
    rounded = {k: v.astype(np.float32) for k, v in half.items()}
    want = np.stack([_reference(rounded, row) for row in TOKENS])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=0.05 * scale)
    assert np.abs(got - want).max() > 0  # it did compute in bf16
    f32 = load_gpt2(tmp_path, "f32")  # the same bf16 weights, f32 compute: tight
    np.testing.assert_allclose(f32.model.predict(f32.params, TOKENS), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_save_and_load_round_trip_the_logits_and_dtypes(tmp_path, dtype):
    tensors = {k: v.astype(dtype) for k, v in _tensors(np.random.default_rng(2)).items()}
    first = load_gpt2(_write(tmp_path / "a", tensors))
    save_gpt2(tmp_path / "b", first.params, first.config, first.tokenizer)
    second = load_gpt2(tmp_path / "b")
    assert second.config == first.config
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert a.dtype == b.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        first.model.predict(first.params, TOKENS), second.model.predict(second.params, TOKENS)
    )
    assert encode_text(second.tokenizer, "the cat sat").tolist() == [2, 3, 4]


def test_the_weight_matrices_are_kernels_lora_adapts(tmp_path):
    loaded = load_gpt2(_write(tmp_path, _tensors(np.random.default_rng(3))))
    names = set(adapted(loaded.params))
    assert names == {
        f"h/{i}/{m}/kernel"
        for i in range(2)
        for m in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj")
    }


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_the_loss_is_the_mean_next_token_cross_entropy_of_a_record(tmp_path):
    tensors = _tensors(np.random.default_rng(4))
    loaded = load_gpt2(_write(tmp_path, tensors))
    assert loaded.model.summary()["kind"] == "gpt2"
    loss_fn = jax.jit(loaded.model.loss_fn)

    def reference(row, targets):  # targets[t] predicted at t - 1; negative: none
        logits = _reference(tensors, row)[:-1]
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        real = targets[1:] >= 0
        ce = -logp[np.arange(len(row) - 1), np.maximum(targets[1:], 0)]
        return ce[real].sum() / max(real.sum(), 1)

    # tokens with the tokenizer's <pad> (id 1) ignored as targets
    pad_targets = np.where(TOKENS == 1, -1, TOKENS)
    want = np.mean([reference(r, t) for r, t in zip(TOKENS, pad_targets)])
    batch = {"x": TOKENS, "y": np.array([7, 3])}
    np.testing.assert_allclose(loss_fn(loaded.params, batch), want, rtol=1e-5)
    # per-token labels: y[:, t] is what position t predicts; a prompt's labels -1
    labels = np.full_like(TOKENS, -1)
    labels[:, 3:-1] = TOKENS[:, 4:]
    want = np.mean([reference(r, np.concatenate([[-1], t[:-1]])) for r, t in zip(TOKENS, labels)])
    batch = {"x": TOKENS, "y": labels}
    np.testing.assert_allclose(loss_fn(loaded.params, batch), want, rtol=1e-5)
    grads = jax.jit(jax.grad(loaded.model.loss_fn))(loaded.params, batch)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))


def _break(tensors, name, value=None):
    out = dict(tensors)
    if value is None:
        del out[name]
    else:
        out[name] = value
    return out


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: _break(t, "h.1.mlp.c_fc.bias"), "missing tensor 'h.1.mlp.c_fc.bias'"),
        (
            lambda t: _break(t, "h.0.attn.extra", np.zeros(3, np.float32)),
            "unexpected tensor 'h.0.attn.extra'",
        ),
        (
            lambda t: _break(t, "h.0.attn.c_attn.weight", np.zeros((8, 8), np.float32)),
            "tensor 'h.0.attn.c_attn.weight' has shape (8, 8), expected (8, 24)",
        ),
        (
            lambda t: _break(t, "wte.weight", np.zeros((12, 8), np.int32)),
            "tensor 'wte.weight' is int32, not floating",
        ),
    ],
)
def test_a_bad_tensor_is_named(tmp_path, change, message):
    tensors = change(_tensors(np.random.default_rng(5)))
    with pytest.raises(DataError, match=".*".join(map(_escape, message.split("'")))):
        load_gpt2(_write(tmp_path, tensors))


def _escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported; allowed: 'gpt2'"),
        ({"architectures": ["BertModel"]}, "architecture 'BertModel' is not supported"),
        ({"activation_function": "relu"}, "activation_function 'relu'"),
        ({"n_head": 3}, "n_embd (8) must be divisible by n_head (3)"),
    ],
)
def test_a_config_of_another_model_is_refused(tmp_path, config, message):
    tensors = _tensors(np.random.default_rng(6))
    with pytest.raises(DataError, match=_escape(message)):
        load_gpt2(_write(tmp_path, tensors, config=config))


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    words = WORDS + [f"w{i}" for i in range(5)]  # 15 tokens, 12 rows
    with pytest.raises(DataError, match="15 tokens, more than the model's vocab_size 12"):
        load_gpt2(_write(tmp_path, _tensors(np.random.default_rng(7)), words=words))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(DataError, match="config.json not found"):
        load_gpt2(tmp_path)
    _write(tmp_path, _tensors(np.random.default_rng(8)))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(DataError, match="model.safetensors not found"):
        load_gpt2(tmp_path)


def test_a_folder_of_pytorch_weights_alone_says_how_to_convert_them(tmp_path):
    """A folder holding only pytorch_model.bin was refused with no hint."""
    _write(tmp_path, _tensors(np.random.default_rng(8)))
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")  # never read
    with pytest.raises(DataError) as e:
        load_gpt2(tmp_path)
    assert str(e.value) == (
        f"checkpoint: {tmp_path / 'model.safetensors'} not found, only pytorch_model.bin "
        "(PyTorch's pickle format, not read); convert it with transformers: "
        "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, "
        "safe_serialization=True) writes model.safetensors"
    )


def test_greedy_generation_follows_the_numpy_argmax(tmp_path):
    tensors = _tensors(np.random.default_rng(9))
    loaded = load_gpt2(_write(tmp_path, tensors))
    prompt = [2, 3]
    out = generate(loaded.model, loaded.params, prompt, max_new_tokens=5)
    want = list(prompt)
    for _ in range(5):
        want.append(int(np.argmax(_reference(tensors, np.array(want))[-1])))
    assert out.tolist() == want
    text = generate_text(loaded, "the cat", max_new_tokens=5)
    assert text == loaded.tokenizer.decode(want)


def test_sampling_uses_the_key_and_stays_in_the_vocabulary(tmp_path):
    loaded = load_gpt2(_write(tmp_path, _tensors(np.random.default_rng(10))))
    kw = {"max_new_tokens": 6, "temperature": 1.0}
    a = generate(loaded.model, loaded.params, [2], key=jax.random.key(0), **kw)
    b = generate(loaded.model, loaded.params, [2], key=jax.random.key(0), **kw)
    draws = {
        tuple(generate(loaded.model, loaded.params, [2], key=jax.random.key(s), **kw))
        for s in range(4)
    }
    assert a.tolist() == b.tolist() and len(draws) > 1
    assert a.min() >= 0 and a.max() < 12 and a[0] == 2
    with pytest.raises(ValueError, match="key: sampling"):
        generate(loaded.model, loaded.params, [2], max_new_tokens=2, temperature=1.0)
    with pytest.raises(ValueError, match="n_positions 8"):
        generate(loaded.model, loaded.params, [2, 3], max_new_tokens=7)


@pytest.mark.slow  # two private steps of LoRA through dpmp.train, ~30 s
def test_private_lora_on_a_loaded_checkpoint_through_train(tmp_path):
    from dpmp.app.config import load_config
    from dpmp.app.trainer import train
    from dpmp.data._dataset import Dataset
    from dpmp.models import save_params_file

    loaded = load_gpt2(_write(tmp_path / "ckpt", _tensors(np.random.default_rng(11))), "bf16")
    rng = np.random.default_rng(12)
    x = np.full((120, 8), 1, np.int32)  # <pad> after each record
    for i in range(120):
        ids = encode_text(loaded.tokenizer, " ".join(rng.choice(WORDS[2:], rng.integers(2, 9))))
        x[i, : len(ids)] = ids[:8]
    y = (x != 1).sum(1).astype(np.int32)
    data = Dataset(
        x_train=x[:100], y_train=y[:100], x_test=x[100:], y_test=y[100:], num_classes=12,
        input_shape=(8,), description="tiny records", task="next_token",
    )  # fmt: skip
    base = save_params_file(tmp_path / "base.safetensors", loaded.params)
    config = load_config(
        None, ["training.steps=2", "training.expected_batch_size=16", "model.lora_rank=2"]
    )
    report = train(
        config, out_dir=tmp_path / "run", model=loaded.model, init_params=base, data=data,
        progress=False,
    )  # fmt: skip
    assert report["starting_point"]["source"] == f"init_params read from {base.name}"
    assert np.isfinite(report["test_perplexity"])
