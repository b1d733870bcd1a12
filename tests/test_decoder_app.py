"""Runs from Llama, Qwen2 and Gemma checkpoint folders through the command line
(``model.kind = "llama" | "qwen2" | "gemma"``, ``model.checkpoint``): the family
loads its folder (``CheckpointFamily.load``), trains privately and reports
epsilon; a folder of another family's ``model_type`` is one line, exit 2, and
nothing is written. The folders are tiny random checkpoints written by
``save_decoder``."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dpmp.app import cli
from dpmp.models import generate, generate_text
from dpmp.models._hf_checkpoint import GenerationDefaults, load_decoder, save_decoder
from dpmp.models._params_file import nest
from dpmp.models.families import FAMILIES, CheckpointFamily, family_reading
from dpmp.models.families._decoder import decoder_config_from_json, decoder_init
from tests.test_decoder import CONFIGS
from tests.test_gpt2 import WORDS
from tests.test_published import _text

# one layer of width 16: the smallest model with every part of each family
TINY = {"vocab_size": 16, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1}
TINY |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}


def _checkpoint(folder, family: str):
    """A random tiny ``family`` checkpoint with a word-level tokenizer of ``WORDS``."""
    config = decoder_config_from_json(CONFIGS[family] | TINY)
    params = decoder_init(config, jax.random.key(0))
    return save_decoder(folder, params, config, _tokenizer())


def _tokenizer():
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _argv(tmp_path, kind, checkpoint, *extra):
    return [
        "train", "--quiet", "--out", str(tmp_path / "run"),
        "--set", f"model.kind={kind}", "--set", f'model.checkpoint="{checkpoint}"',
        "--set", "data.dataset=text", "--set", f'data.path="{_text(tmp_path)}"',
        "--set", "data.seq_len=6", "--set", "training.steps=2",
        "--set", "training.expected_batch_size=8", "--set", "training.eval_every=0",
        "--set", "privacy.target_epsilon=8", "--set", "privacy.noise_multiplier=5.0",
        "--set", "model.lora_rank=2", *extra,
    ]  # fmt: skip


@pytest.mark.slow  # a short private LoRA run through the CLI: compiling its step, ~20 s
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_a_checkpoint_trains_privately_through_the_cli(tmp_path, capsys, family):
    folder = _checkpoint(tmp_path / "ckpt", family)
    assert cli.main(_argv(tmp_path, family, folder)) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    text = json.dumps(report)
    assert '"epsilon"' in text
    # the epsilon released is within the target
    eps = [v for k, v in _items(report) if k == "epsilon" and isinstance(v, int | float)]
    assert eps and 0 < min(eps) and max(eps) <= 8 * (1 + 1e-9)
    assert str(tmp_path) not in text  # the report names no private folder
    title = FAMILIES.get(family).checkpoint.removeprefix("a ").removesuffix(" folder")
    assert report["starting_point"]["source"] == (
        f"public pre-trained {title} {folder.name} (no epsilon)"
    )
    capsys.readouterr()
    # generation reads the trained adapters over the family's own checkpoint
    ask = [str(tmp_path / "run"), "--prompt", "the cat", "--checkpoint", str(folder)]
    assert cli.main(["generate", *ask, "--max-new-tokens", "3"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["the", "cat"] and len(words) <= 5 and set(words) <= set(WORDS)


def _items(tree):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield k, v
            yield from _items(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _items(v)


@pytest.mark.parametrize("kind, stored", [("llama", "qwen2"), ("gpt2", "gemma")])
def test_a_folder_of_another_model_type_is_one_line(tmp_path, capsys, kind, stored):
    folder = _checkpoint(tmp_path / "ckpt", stored)
    assert cli.main(_argv(tmp_path, kind, folder)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpmp train: error: "), err
    assert f"model_type {stored!r} is not supported" in err, err
    assert f"model.kind = {stored!r} reads it" in err, err
    assert not (tmp_path / "run").exists()


def test_the_family_refuses_another_model_type_itself(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", "qwen2")
    with pytest.raises(ValueError, match="model_type 'qwen2'; model.kind = 'llama' reads 'llama'"):
        FAMILIES.get("llama").load(folder, "f32")


def test_each_checkpoint_family_reads_what_it_declares(tmp_path):
    """Every family read from a checkpoint is a ``CheckpointFamily`` and is the one
    ``family_reading`` names for each ``model_type`` it declares."""
    readers = [f for f in FAMILIES if f.checkpoint is not None]
    assert readers
    for family in readers:
        assert isinstance(family, CheckpointFamily)
        for model_type in family.model_types:
            assert family_reading(model_type) is family
    assert family_reading("no such model_type") is None


def test_the_family_loads_what_load_decoder_loads(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", "gemma")
    got, want = FAMILIES.get("gemma").load(folder, "f32"), load_decoder(folder, "f32")
    assert got.config == want.config and got.config.n_positions == 128
    assert jax.tree.all(jax.tree.map(lambda a, b: (a == b).all(), got.params, want.params))


def test_generation_stops_at_the_checkpoints_end_of_sequence_token(tmp_path):
    """``generate`` ends at the first generated stop token, which it keeps; text
    generation stops at the checkpoint's end-of-sequence tokens."""
    config = decoder_config_from_json(CONFIGS["llama"] | TINY)
    rng = np.random.default_rng(0)  # weights of N(0, 1): a varied greedy continuation
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in config.shapes().items()}
    loaded = load_decoder(save_decoder(tmp_path / "ckpt", nest(params), config, _tokenizer()))
    prompt = loaded.tokenizer.encode("the cat").ids
    n, new = len(prompt), 4
    free = generate(loaded.model, loaded.params, prompt, max_new_tokens=new)
    for k in range(new):
        stop = int(free[n + k])
        first = n + list(free[n:]).index(stop)
        got = generate(loaded.model, loaded.params, prompt, max_new_tokens=new, stop_tokens=[stop])
        np.testing.assert_array_equal(got, free[: first + 1])
    assert generate_text(loaded, "the cat", max_new_tokens=new) == loaded.tokenizer.decode(
        [int(i) for i in free]
    )
    # the checkpoint's own eos (read from generation_config.json: test_decoder.py)
    eos = loaded._replace(generation=GenerationDefaults(eos_token_ids=(int(free[n]),)))
    want = loaded.tokenizer.decode([int(i) for i in free[: n + 1]])
    assert generate_text(eos, "the cat", max_new_tokens=new) == want


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_checkpoint_loads_reading_its_config_json_once(tmp_path, monkeypatch, kind):
    """``load_checkpoint`` hands the folder to the family, whose ``load`` reads
    ``config.json``; nothing reads it again on the way to a model."""
    import builtins
    import io
    from pathlib import Path

    from dpmp.app.published import load_checkpoint
    from tests.test_gpt2 import _tensors, _write

    if kind == "gpt2":
        folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(0)))
    else:
        folder = _checkpoint(tmp_path / "ckpt", kind)
    reads = []

    def counting(real):
        def opened(file, *args, **kwargs):
            if isinstance(file, str | Path) and Path(file) == folder / "config.json":
                reads.append(file)
            return real(file, *args, **kwargs)

        return opened

    # pathlib's read_text and read_bytes open through io.open; json.load takes a file
    monkeypatch.setattr(io, "open", counting(io.open))
    monkeypatch.setattr(builtins, "open", counting(builtins.open))
    loaded = load_checkpoint(kind, folder, "f32")
    assert loaded.params is not None and len(reads) == 1
