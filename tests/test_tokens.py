"""Tokenized text and per-token labels: one record one example, -1 is no loss.

References are independent: NumPy float64 cross-entropy, the records' own
token ids, and a padded batch whose padding rows are changed.
"""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import dpmp
from dpmp.app import cli
from dpmp.app.config import ConfigError, load_config
from dpmp.app.trainer.batches import gather
from dpmp.app.trainer.evaluate import evaluator
from dpmp.data import DataError, PoissonSampler
from dpmp.data._tokenizer import load_tokenizer, vocab_size
from dpmp.data._tokens import IGNORE, encode_token_records
from dpmp.data.sources import load_dataset
from dpmp.models._adapters import as_model
from dpmp.models._model import token_cross_entropy, token_losses


def _word_tokenizer(folder, words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


class TinyLM(nn.Module):
    """A causal LM of the user's: embedding, a causal running mean, a head."""

    vocab: int

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(self.vocab, 8)(tokens)
        h = jnp.cumsum(h, axis=1) / jnp.arange(1, tokens.shape[1] + 1, dtype=h.dtype)[:, None]
        return nn.Dense(self.vocab)(jnp.tanh(h))


def _np_token_ce(logits, labels):
    """Per record: mean float64 cross-entropy over the labelled positions."""
    z = np.asarray(logits, np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    out = []
    for lp, lab in zip(logp, labels, strict=True):
        picked = [-lp[t, k] for t, k in enumerate(lab) if k >= 0]
        out.append(np.mean(picked) if picked else 0.0)
    return np.array(out)


def test_per_record_loss_is_the_numpy_float64_mean_over_labelled_tokens(strict_promotion):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 6, 5)).astype(np.float32) * 3
    labels = rng.integers(0, 5, (4, 6)).astype(np.int32)
    labels[0, 3:] = IGNORE
    labels[2, :] = IGNORE  # a record with nothing to predict: loss 0
    got = np.asarray(token_cross_entropy(jnp.asarray(logits), jnp.asarray(labels)))
    np.testing.assert_allclose(got, _np_token_ce(logits, labels), rtol=1e-5, atol=1e-6)
    summed, correct, count = token_losses(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_array_equal(count, (labels >= 0).sum(1))
    hits = (logits.argmax(-1) == labels) & (labels >= 0)
    np.testing.assert_array_equal(correct, hits.sum(1))


@pytest.fixture(scope="module")
def tiny_lm():
    """A user's TinyLM over 6 tokens, records of 5, as the trainer sees it, and its params."""
    model = as_model(TinyLM(6), (5,), 6, "fp32", input_dtype=jnp.int32)
    return model, jax.jit(model.init)(jax.random.key(0))


@pytest.mark.slow  # ~4 s on 2 cores
def test_ignored_positions_contribute_nothing(tiny_lm, strict_promotion):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 7, 6)).astype(np.float32)
    labels = rng.integers(0, 6, (3, 7)).astype(np.int32)
    labels[:, 4:] = IGNORE
    changed = logits.copy()
    changed[:, 4:] = rng.normal(size=(3, 3, 6)) * 100  # other scores where no label is
    base = token_cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_array_equal(base, token_cross_entropy(jnp.asarray(changed), labels))
    # through a user's causal LM: other tokens in the padding change neither loss nor gradient
    model, params = tiny_lm
    x = rng.integers(0, 6, (3, 5)).astype(np.int32)
    x2 = x.copy()
    x2[:, 3:] = (x[:, 3:] + 1) % 6  # after the last labelled position (2)
    labels = labels[:, :5].copy()
    labels[:, 3:] = IGNORE
    one, two = ({"x": jnp.asarray(v), "y": jnp.asarray(labels)} for v in (x, x2))
    value_and_grad = jax.jit(jax.value_and_grad(model.loss_fn))
    l1, g1 = value_and_grad(params, one)
    l2, g2 = value_and_grad(params, two)
    assert float(l1) == float(l2)
    jax.tree.map(np.testing.assert_array_equal, g1, g2)


def test_padding_rows_of_a_poisson_batch_contribute_zero(tiny_lm):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 6, (20, 5)).astype(np.int32)
    y = np.where(rng.random((20, 5)) < 0.3, IGNORE, rng.integers(0, 6, (20, 5))).astype(np.int32)
    data = dpmp.Dataset.from_tokens((x, y), (x[:3], y[:3]), vocab_size=6)
    sampler = PoissonSampler(20, 4, padded_batch_size=12, seed=3, num_steps=5)
    sampled = sampler.batch(0)
    batch, pad = gather(data, sampled)
    assert batch["y"].shape == (12, 5) and batch["y"].dtype == np.int32 and pad.any()
    model, params = tiny_lm
    grad = jax.jit(dpmp.private_grad(model.loss_fn, l2_clip_norm=1.0, policy="fp32", method="vmap"))
    other = {k: v.copy() for k, v in batch.items()}
    other["x"][pad] = (other["x"][pad] + 2) % 6
    other["y"][pad] = 1
    a = grad(params, jax.tree.map(jnp.asarray, batch), is_padding_example=jnp.asarray(pad))
    b = grad(params, jax.tree.map(jnp.asarray, other), is_padding_example=jnp.asarray(pad))
    jax.tree.map(np.testing.assert_array_equal, a.grads, b.grads)


@pytest.mark.slow  # ~4 s on 2 cores
def test_evaluation_is_the_mean_cross_entropy_per_labelled_token(tiny_lm, strict_promotion):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 6, (5, 5)).astype(np.int32)
    y = rng.integers(0, 6, (5, 5)).astype(np.int32)
    y[1, 1:] = IGNORE
    model, params = tiny_lm
    accuracy, loss = evaluator(model, chunk=2, input_dtype=np.int32)(params, x, y)
    logits = np.asarray(model.predict(params, jnp.asarray(x)))
    per_token = _np_token_ce(logits, y) * (y >= 0).sum(1)
    assert loss == pytest.approx(per_token.sum() / (y >= 0).sum(), rel=1e-5)
    hits = ((logits.argmax(-1) == y) & (y >= 0)).sum()
    assert accuracy == pytest.approx(hits / (y >= 0).sum())


def test_no_example_holds_tokens_of_two_records(tmp_path):
    # record i uses its own words only, so any mixing would show
    records = [" ".join(f"r{i}w{j}" for j in range(i % 7 + 1)) for i in range(14)]
    records[3] = " ".join(f"r3w{j}" for j in range(30))  # longer than the context
    vocab = ["<unk>"] + sorted({w for r in records for w in r.split()})
    path = _word_tokenizer(tmp_path, vocab)
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"text": r}) for r in records))
    data = load_dataset("text", path=str(tmp_path / "t.jsonl"), seq_len=6, tokenizer=str(path))
    assert data.num_classes == len(vocab) and data.input_shape == (6,)
    assert data.cut_to == "7 tokens" and sum(data.records_cut) == 1  # record 3 alone
    owner = {vocab.index(w): i for i, r in enumerate(records) for w in r.split()}
    rows = [(x, y) for s in ("train", "test") for x, y in zip(*data_split(data, s), strict=True)]
    assert len(rows) == len(records)
    seen = set()
    for x, y in rows:
        tokens = [int(t) for t in y if t >= 0] + [int(x[0])]
        (record,) = {owner[t] for t in tokens}  # one record's tokens only
        ids = [vocab.index(w) for w in records[record].split()]
        np.testing.assert_array_equal(x[: min(len(ids), 6)], ids[:6])  # truncated, not split
        np.testing.assert_array_equal(y[y >= 0], ids[1:7])
        assert (y[len(ids) - 1 :] == IGNORE).all()
        seen.add(record)
    assert seen == set(range(len(records)))


def data_split(data, split):
    return getattr(data, f"x_{split}"), getattr(data, f"y_{split}")


def test_encode_token_records_truncates_and_pads():
    x, y = encode_token_records([[5, 6, 7, 8, 9], [3], []], 3)
    np.testing.assert_array_equal(x, [[5, 6, 7], [3, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(y, [[6, 7, 8], [-1, -1, -1], [-1, -1, -1]])


@pytest.mark.parametrize(
    "train, message",
    [
        ((np.ones((10, 3), int), np.zeros((10, 3))), "y_train: must be integer token ids"),
        ((np.ones((10, 3), int), np.full((10, 3), 9)), "y_train: 9 at [0, 0] is outside"),
        ((np.full((10, 3), -1), np.full((10, 3), 1)), "x_train: -1 at [0, 0] is outside"),
        ((np.ones((10, 3), int), np.ones((10, 2), int)), "shapes differ"),
        ((np.ones((4, 3), int), np.ones((4, 3), int)), "too few training records"),
    ],
)
def test_from_tokens_refuses_ids_outside_the_vocabulary(train, message):
    test = (np.ones((2, 3), int), np.full((2, 3), -1))
    with pytest.raises(DataError, match=message.replace("[", r"\[")):
        dpmp.Dataset.from_tokens(train, test, vocab_size=9)


def test_two_dimensional_labels_through_from_arrays_point_to_from_tokens():
    with pytest.raises(DataError, match="from_tokens"):
        dpmp.Dataset.from_arrays(
            (np.ones((10, 3)), np.ones((10, 3), int)), (np.ones((2, 3)), [0, 1])
        )


def test_load_tokenizer_names_the_field_and_the_file(tmp_path):
    path = _word_tokenizer(tmp_path, ["<unk>", "a", "b"])
    assert vocab_size(load_tokenizer(path)) == 3
    with pytest.raises(DataError, match="data.tokenizer: no such file"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match=r"pretrain.x: '.*bad.json' is not a tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json", field="pretrain.x")


def test_a_tokenizer_needs_text_data():
    with pytest.raises(ConfigError, match="data.tokenizer: encodes text"):
        load_config(None, ['data.tokenizer="t.json"'])


class WideHead(nn.Module):
    """Embeds positions (4 rows: fine) and token ids (4 rows), gives 9 logits."""

    @nn.compact
    def __call__(self, tokens):
        positions = nn.Embed(4, 8)(jnp.arange(tokens.shape[1])[None])
        return nn.Dense(9)(nn.Embed(4, 8, name="tokens")(tokens) + positions)


def test_a_model_smaller_than_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="gives 5 logits per token, fewer than .* 9 token ids"):
        as_model(TinyLM(5), (4,), 9, "fp32", input_dtype=jnp.int32)
    with pytest.raises(ValueError, match="embedding tokens has 4 rows, fewer than .* 9 token"):
        as_model(WideHead(), (4,), 9, "fp32", input_dtype=jnp.int32)
    as_model(WideHead(), (4,), 4, "fp32", input_dtype=jnp.int32)  # positions: not token ids
    built = as_model(TinyLM(5), (4,), 5, "fp32", input_dtype=jnp.int32)  # a dpmp Model
    with pytest.raises(ValueError, match="gives 5 logits per token, fewer than .* 9 token ids"):
        as_model(built, (4,), 9, "fp32", input_dtype=jnp.int32)


def _cli_text(tmp_path, tokenizer, *extra):
    (tmp_path / "t.txt").write_text("\n".join(f"a b a b {i % 3}" for i in range(30)))
    return [
        "train",
        "--out",
        str(tmp_path / "run"),
        "--set",
        'data.dataset="text"',
        "--set",
        f'data.path="{tmp_path / "t.txt"}"',
        "--set",
        f'data.tokenizer="{tokenizer}"',
        "--set",
        'model.kind="lm"',
        *extra,
    ]


@pytest.mark.parametrize(
    "tokenizer, needle",
    [("missing.json", "data.tokenizer: no such file"), ("t.txt", "is not a tokenizer.json")],
)
def test_a_bad_tokenizer_exits_2_with_one_line_and_writes_nothing(
    tmp_path, capsys, tokenizer, needle
):
    assert cli.main(_cli_text(tmp_path, tmp_path / tokenizer)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpmp train: error: ") and needle in err
    assert not (tmp_path / "run").exists()


def test_a_too_small_model_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    path = _word_tokenizer(tmp_path, ["<unk>", "a", "b", "0", "1", "2", "extra"])
    (tmp_path / "small_lm.py").write_text(
        "import flax.linen as nn\n\n"
        "def make(shape, vocab):\n"
        "    return nn.Sequential([nn.Embed(4, 8), nn.Dense(4)])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = _cli_text(tmp_path, path)
    argv[argv.index('model.kind="lm"')] = 'model.kind="small_lm:make"'
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fewer than the data's vocabulary of 7" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_user_flax_lm_trains_on_per_token_labels_through_dpmp_train(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 8, (40, 6)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -1] = IGNORE
    y[::3, 3:] = IGNORE  # shorter records
    data = dpmp.Dataset.from_tokens((x[:32], y[:32]), (x[32:], y[32:]), vocab_size=8)
    config = load_config(
        None,
        [
            "training.steps=3",
            "training.expected_batch_size=8",
            "training.eval_every=3",
            "training.checkpoint_every=0",
        ],
    )
    report = dpmp.train(
        config, out_dir=tmp_path / "run", model=TinyLM(8), data=data, progress=False
    )
    assert report["steps"] == 3 and report["data"]["task"] == "next_token"
    assert np.isfinite(report["test_loss"]) and 0 <= report["test_accuracy"] <= 1
    assert report["test_perplexity"] == pytest.approx(np.exp(report["test_loss"]))


@pytest.mark.slow
def test_the_builtin_lm_on_per_token_labels_clips_the_same_by_ghost_and_vmap():
    from dpmp.models.families import Architecture, build_model

    rng = np.random.default_rng(5)
    x = rng.integers(0, 11, (12, 6)).astype(np.int32)
    y = np.where(rng.random((12, 6)) < 0.3, IGNORE, rng.integers(0, 11, (12, 6))).astype(np.int32)
    data = dpmp.Dataset.from_tokens((x, y), (x[:2], y[:2]), vocab_size=11)
    model = build_model("lm", data, "fp32", Architecture(dim=16, depth=1, heads=2))
    params = jax.jit(model.init)(jax.random.key(3))
    batch = {"x": jnp.asarray(x[:6]), "y": jnp.asarray(y[:6])}
    pad = jnp.asarray([False] * 5 + [True])

    def clipped_sum(method):
        grad = dpmp.private_grad(model.loss_fn, l2_clip_norm=0.1, policy="fp32", method=method)
        return jax.jit(grad)(params, batch, is_padding_example=pad)

    sums = {method: clipped_sum(method) for method in ("vmap", "ghost")}
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6),
        sums["vmap"].grads,
        sums["ghost"].grads,
    )


def test_a_loaded_gpt2_is_refused_for_a_tokenizer_with_more_ids_than_its_logits(tmp_path):
    from tests.test_gpt2 import WORDS, _tensors, _write

    loaded = dpmp.models.load_gpt2(_write(tmp_path / "ckpt", _tensors(np.random.default_rng(1))))
    path = _word_tokenizer(tmp_path, WORDS + [f"w{i}" for i in range(10)])  # 20 ids; GPT-2: 12
    (tmp_path / "t.txt").write_text("\n".join(f"the cat sat {i}" for i in range(20)))
    config = load_config(
        None,
        [
            'data.dataset="text"',
            f'data.path="{tmp_path / "t.txt"}"',
            f'data.tokenizer="{path}"',
            "data.seq_len=8",
        ],
    )
    with pytest.raises(ValueError, match="gives 12 logits per token, fewer than .* 20 token ids"):
        dpmp.train(config, out_dir=tmp_path / "run", model=loaded.model, progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # end to end: two steps of a tiny LM
def test_a_run_states_the_cut_rule_and_keeps_the_count_private(tmp_path):
    """A 1 MB line was cut without a word. train.log states the rule (the same
    words whatever the data); the count is in private/diagnostics.json alone."""
    lines = [f"record {i}: {'ab' * (i % 7)}" for i in range(40)]
    lines[5] = "z" * 1_000_000
    (tmp_path / "t.txt").write_text("\n".join(lines))
    sets = ["data.dataset=text", f"data.path={json.dumps(str(tmp_path / 't.txt'))}"]
    sets += ["data.seq_len=12", "model.kind=lm", "model.dim=16", "model.depth=1"]
    sets += ["model.heads=2", "training.steps=2", "training.expected_batch_size=8"]
    out = tmp_path / "run"
    dpmp.train(load_config(None, sets), out_dir=out, progress=False)
    log = (out / "train.log").read_text()
    rule = "data: a record longer than 12 bytes is cut to its first 12 bytes (how many were: "
    assert rule + "private/diagnostics.json)" in log
    cut = json.loads((out / "private" / "diagnostics.json").read_text())["records_cut"]
    assert cut["cut_to"] == "12 bytes" and cut["train"] + cut["test"] >= 1
    for name in ("report.json", "metrics.jsonl", "train.log"):
        assert "records_cut" not in (out / name).read_text()


@pytest.mark.slow
def test_a_held_out_split_without_labels_reports_no_test_loss_and_says_why(tmp_path):
    """Every held-out label -1: no test loss, accuracy or perplexity anywhere public
    (not 0 and 1: a perfect score of nothing), and train.log says why once."""
    rng = np.random.default_rng(6)
    x = rng.integers(0, 8, (36, 6)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    y[:, -1] = IGNORE
    y[32:] = IGNORE
    data = dpmp.Dataset.from_tokens((x[:32], y[:32]), (x[32:], y[32:]), vocab_size=8)
    sets = ["training.steps=2", "training.expected_batch_size=8", "training.eval_every=1"]
    out = tmp_path / "run"
    config = load_config(None, sets + ["training.checkpoint_every=0"])
    report = dpmp.train(config, out_dir=out, model=TinyLM(8), data=data, progress=False)
    assert report["steps"] == 2
    assert report["test_loss"] is report["test_perplexity"] is report["test_accuracy"] is None
    assert json.loads((out / "report.json").read_text())["test_perplexity"] is None
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "test_loss" in r]
    assert evaluated and all(r["test_loss"] is r["test_accuracy"] is None for r in evaluated)
    log = (out / "train.log").read_text()
    assert log.count("held-out split holds no labelled prediction") == 1


@pytest.mark.parametrize("tokenized", [False, True])
def test_records_dataset_splits_at_the_positions_a_source_gives(tmp_path, tokenized):
    """A ``Split`` of the source's own (Shakespeare's users) replaces the seeded one:
    each record lands in the split its position says, encoded as it would be."""
    from dpmp.data._text import BOS, PAD, Split
    from dpmp.data._tokens import records_dataset

    words = ["<unk>"] + [f"w{i}" for i in range(13)]
    records = [f"w{i} w{i + 1}" for i in range(12)]
    tokenizer = str(_word_tokenizer(tmp_path, words)) if tokenized else None
    split = Split(np.array([0, 2, 3, 5, 6, 7, 8, 9, 10, 11]), np.array([1, 4]), "split by hand")
    data = records_dataset(
        records, "hand", tokenizer=tokenizer, seq_len=4, test_fraction=0.5, seed=0, split=split
    )
    for where, x, y in (
        (split.train, data.x_train, data.y_train),
        (split.test, data.x_test, data.y_test),
    ):
        assert len(x) == len(y) == len(where)
        for i, row, labels in zip(where, x, y, strict=True):
            if tokenized:  # two words: one prediction, the rest padding
                assert row.tolist() == [i + 1, i + 2, 0, 0] and labels.tolist() == [
                    i + 2,
                    -1,
                    -1,
                    -1,
                ]
            else:  # BOS, the first 4 bytes, and how many
                text = records[i].encode()[:4]
                assert row.tolist() == [BOS, *text] + [PAD] * (4 - len(text)) and labels == 4
    assert "split by hand" in data.description and "10 train / 2 test records" in data.description
