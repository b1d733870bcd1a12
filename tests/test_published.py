"""Runs from a GPT-2 checkpoint folder (``model.kind = "gpt2"``,
``dpmp.app.published``): the config keys, and every bad input refused by
``dpmp train`` in one line, exit 2, before anything is written. The folders are
tiny random checkpoints written by ``tests.test_gpt2``'s helpers."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from dpmp.app import cli
from dpmp.app.config import Config, ConfigError, load_config
from dpmp.app.published import start_from_checkpoint
from tests.test_gpt2 import WORDS, _break, _tensors, _write


def _text(tmp_path, n=60):
    rng = np.random.default_rng(1)
    lines = [" ".join(rng.choice(WORDS[2:], rng.integers(2, 7))) for _ in range(n)]
    path = tmp_path / "text.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def _argv(tmp_path, checkpoint, *extra):
    return [
        "train", "--quiet", "--out", str(tmp_path / "run"),
        "--set", "model.kind=gpt2", "--set", f'model.checkpoint="{checkpoint}"',
        "--set", "data.dataset=text", "--set", f'data.path="{_text(tmp_path)}"',
        "--set", "data.seq_len=6", "--set", "model.lora_rank=2", *extra,
    ]  # fmt: skip


def _refused(tmp_path, capsys, argv, needle):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpmp train: error: "), err
    assert needle in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, write, needle",
    [
        (lambda t: _break(t, "h.1.mlp.c_fc.bias"), {}, "missing tensor 'h.1.mlp.c_fc.bias'"),
        (
            lambda t: _break(t, "h.0.attn.extra", np.zeros(3, np.float32)),
            {},
            "unexpected tensor 'h.0.attn.extra'",
        ),
        (
            lambda t: _break(t, "h.0.attn.c_attn.weight", np.zeros((8, 8), np.float32)),
            {},
            "tensor 'h.0.attn.c_attn.weight' has shape (8, 8), expected (8, 24)",
        ),
        (None, {"config": {"model_type": "llama"}}, "model_type 'llama' is not supported"),
        (
            None,
            {"words": WORDS + [f"w{i}" for i in range(5)]},
            "15 tokens, more than the model's vocab_size 12",
        ),
    ],
)
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(tmp_path, capsys, change, write, needle):
    tensors = _tensors(np.random.default_rng(2))
    folder = _write(tmp_path / "ckpt", change(tensors) if change else tensors, **write)
    _refused(tmp_path, capsys, _argv(tmp_path, folder), needle)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_a_missing_file_is_named(tmp_path, capsys, missing):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(3)))
    (folder / missing).unlink()
    _refused(tmp_path, capsys, _argv(tmp_path, folder), f"{missing} not found")


def test_a_missing_folder_or_a_file_is_refused(tmp_path, capsys):
    _refused(
        tmp_path, capsys, _argv(tmp_path, tmp_path / "nope"), "model.checkpoint: no such folder"
    )
    _refused(tmp_path, capsys, _argv(tmp_path, _text(tmp_path)), "text.txt' is not a folder")


def test_records_longer_than_n_positions_are_refused_before_tracing(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(4)))
    argv = _argv(tmp_path, folder, "--set", "data.seq_len=9")
    _refused(tmp_path, capsys, argv, "data.seq_len: 9 tokens per record, more than the "
             "checkpoint's n_positions 8")  # fmt: skip


def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(5)))
    other = _write(tmp_path / "other", _tensors(np.random.default_rng(5)), words=WORDS[::-1])
    argv = _argv(tmp_path, folder, "--set", f'data.tokenizer="{other / "tokenizer.json"}"')
    _refused(tmp_path, capsys, argv, "has another vocabulary than the checkpoint's")


def test_a_checkpoint_without_tokenizer_needs_data_tokenizer(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(6)), words=None)
    _refused(tmp_path, capsys, _argv(tmp_path, folder), "has no tokenizer.json; set data.tokenizer")


def test_the_data_is_text(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(7)))
    argv = _argv(tmp_path, folder, "--set", "data.dataset=digits")
    at = next(i for i, a in enumerate(argv) if a.startswith("data.path="))
    del argv[at - 1 : at + 1]  # the digits read no file (a path for them is refused)
    _refused(tmp_path, capsys, argv, "data.dataset: model.kind = 'gpt2' trains on text")


def test_the_data_is_encoded_by_the_checkpoint_tokenizer_or_an_equal_copy(tmp_path):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(8)))
    copy = shutil.copy(folder / "tokenizer.json", tmp_path / "copy.json")
    text = _text(tmp_path)
    base = ["model.kind=gpt2", f'model.checkpoint="{folder}"', "data.dataset=text"]
    base += [f'data.path="{text}"', "data.seq_len=6"]
    ids = {w: i for i, w in enumerate(WORDS)}
    first = text.read_text().splitlines()[0].split()
    for extra in ([], [f'data.tokenizer="{copy}"']):
        start = start_from_checkpoint(
            load_config(None, base + extra), model=None, init_params=None, data=None
        )
        rows = [list(r[:2]) for r in np.concatenate([start.data.x_train, start.data.x_test])]
        assert [ids[w] for w in first[:2]] in rows  # some record starts with its words
        assert start.source == f"public pre-trained GPT-2 checkpoint {folder.name} (no epsilon)"
        assert start.init_params["wte"]["embedding"].shape == (12, 8)


def test_model_given_with_a_checkpoint_kind_is_refused(tmp_path):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(9)))
    config = load_config(None, ["model.kind=gpt2", f'model.checkpoint="{folder}"'])
    with pytest.raises(ConfigError, match="builds the model and its starting parameters"):
        start_from_checkpoint(config, model=object(), init_params=None, data=None)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model.kind=gpt2"], "model.checkpoint: required when model.kind = 'gpt2'"),
        (['model.checkpoint="x"'], "model.checkpoint: read only when model.kind is 'gpt2'"),
        (["model.kind=gpt2", "model.checkpoint=3"], "model.checkpoint: must be the path"),
    ],
)
def test_the_config_keys(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, overrides)
    ok = load_config(None, ["model.kind=gpt2", 'model.checkpoint="some/folder"'])
    assert Config.from_dict(json.loads(json.dumps(ok.to_dict()))) == ok


def test_data_tokenizer_of_a_folder_without_one_must_fit_the_embedding(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(10)), words=None)
    words = WORDS + [f"w{i}" for i in range(5)]  # 15 tokens, 12 rows
    big = _write(tmp_path / "big", _tensors(np.random.default_rng(10)), words=words)
    argv = _argv(tmp_path, folder, "--set", f'data.tokenizer="{big / "tokenizer.json"}"')
    _refused(tmp_path, capsys, argv, "has 15 tokens, more than the checkpoint's vocab_size 12")
