"""``dpmp generate`` (``dpmp.app.generate``): text from a finished GPT-2 run's
released parameters, checked against the checkpoint's model run on adapters
merged independently in float64 NumPy; bad input is one line, exit 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpmp.app import cli
from dpmp.app.config import load_config
from dpmp.app.release import config_dict
from dpmp.models import GPT2, generate_text, load_gpt2
from tests.test_gpt2 import WORDS, _tensors, _write


def _fake_run(tmp_path, overrides):
    """A run directory whose report.json holds the config of ``overrides`` only."""
    run = tmp_path / "run"
    run.mkdir()
    config = config_dict(load_config(None, overrides))
    (run / "report.json").write_text(json.dumps({"config": config}))
    return run


def _refused(capsys, argv, needle):
    assert cli.main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpmp generate: error: "), err
    assert needle in err, err


def test_bad_runs_are_one_line_exit_2(tmp_path, capsys):
    _refused(capsys, [str(tmp_path / "nope"), "--prompt", "a"], "no such folder")
    (tmp_path / "empty").mkdir()
    _refused(capsys, [str(tmp_path / "empty"), "--prompt", "a"], "report.json not found")
    run = _fake_run(tmp_path, [])
    _refused(capsys, [str(run), "--prompt", "a"], "needs a run of model.kind = 'gpt2'")


def test_a_run_without_parameters_or_checkpoint_folder_is_named(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(1)))
    run = _fake_run(tmp_path, ["model.kind=gpt2", f'model.checkpoint="{folder}"'])
    _refused(capsys, [str(run), "--prompt", "the"], "has neither params.npz (dpmp export) nor")
    argv = [str(run), "--prompt", "the", "--checkpoint", str(tmp_path / "moved")]
    _refused(capsys, argv, "checkpoint: no such folder")


def _merged_float64(loaded: GPT2, npz, alpha: float, rank: int):
    """The checkpoint's parameters with ``W + alpha / r * A @ B`` in float64, from the
    exported file's leaves (adapters by sorted name: ``a`` then ``b``)."""
    leaves = [npz[k] for k in sorted(npz.files) if k.startswith("leaf_")]
    kernels = sorted(
        f"h.{i}.{n}.kernel"
        for i in range(loaded.config.n_layer)
        for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert len(leaves) == 2 * len(kernels)

    def at(tree, name):
        for part in name.split("."):
            tree = tree[part]
        return tree

    params = jax_tree_copy(loaded.params)
    for j, name in enumerate(kernels):
        a, b = leaves[2 * j].astype(np.float64), leaves[2 * j + 1].astype(np.float64)
        w = np.asarray(at(loaded.params, name), np.float64) + alpha / rank * a @ b
        stem, _, leaf = name.rpartition(".")
        at(params, stem)[leaf] = w.astype(np.float32)
    return params


def jax_tree_copy(tree):
    return {k: jax_tree_copy(v) if isinstance(v, dict) else np.asarray(v) for k, v in tree.items()}


@pytest.mark.slow  # a short private LoRA run through the CLI, ~20 s
def test_generation_uses_the_trained_adapters_before_and_after_export(tmp_path, capsys):
    folder = _write(tmp_path / "ckpt", _tensors(np.random.default_rng(2)))
    rng = np.random.default_rng(3)
    lines = [" ".join(rng.choice(WORDS[2:], rng.integers(2, 7))) for _ in range(80)]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    argv = ["train", "--quiet", "--out", str(run), "--set", "model.kind=gpt2"]
    argv += ["--set", f'model.checkpoint="{folder}"', "--set", "data.dataset=text"]
    argv += ["--set", f'data.path="{tmp_path / "t.txt"}"', "--set", "data.seq_len=6"]
    argv += ["--set", "model.lora_rank=2", "--set", "model.lora_alpha=64"]
    argv += ["--set", "training.steps=3", "--set", "training.expected_batch_size=16"]
    argv += ["--set", "training.learning_rate=0.5", "--set", "privacy.delta=1e-3"]
    assert cli.main(argv) == 0
    report = json.loads((run / "report.json").read_text())
    assert report["starting_point"]["source"] == (
        f"public pre-trained GPT-2 checkpoint {folder.name} (no epsilon)"
    )
    assert str(tmp_path) not in (run / "report.json").read_text()  # no folder is published
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", "the"]) == 2  # the folder is not known
    assert "give the folder with --checkpoint DIR" in capsys.readouterr().err
    assert np.isfinite(report["test_perplexity"])
    capsys.readouterr()
    ask = [str(run), "--prompt", "the cat", "--max-new-tokens", "5", "--checkpoint", str(folder)]
    assert cli.main(["generate", *ask]) == 0
    from_checkpoint = capsys.readouterr().out
    assert cli.main(["export", str(run), "--delete-secrets"]) == 0
    capsys.readouterr()
    assert cli.main(["generate", *ask]) == 0
    assert capsys.readouterr().out == from_checkpoint  # the exported parameters alone
    loaded = load_gpt2(folder, "bf16")
    merged = _merged_float64(loaded, np.load(run / "params.npz"), alpha=64.0, rank=2)
    expected = generate_text(loaded._replace(params=merged), "the cat", max_new_tokens=5)
    assert from_checkpoint.strip() == expected
    assert from_checkpoint.startswith("the cat")
    trained = merged["h"]["0"]["attn"]["c_attn"]["kernel"]
    assert np.abs(trained - loaded.params["h"]["0"]["attn"]["c_attn"]["kernel"]).max() > 0
    _refused(capsys, [*ask, "--max-new-tokens", "7"], "at most 6 new ones")
