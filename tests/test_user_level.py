"""User-level privacy (``privacy.unit = "user"``): users in the data, Poisson sampling
over users with up to k records each, per-user clipping of each user's summed
gradient, and a run whose report names the unit and the number of users."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dpmp
from dpmp.app import cli
from dpmp.app.config import ConfigError, load_config
from dpmp.clipping._users import RECORD_MASK, UNIT_REASON, user_private_grad
from dpmp.data._dataset import DataError, split_positions
from dpmp.data._user_sampling import UserPoissonSampler
from dpmp.data.sources import load_dataset

U32 = 2.0**-24


# ---- per-user clipped sums against a float64 reference ---------------------------


def _mlp_loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"])
    return jnp.mean(jnp.square((h @ p["w2"])[:, 0] - b["y"]))


def _lm_loss(p, b):
    """A tiny language model: embedding, one dense layer to the vocabulary, the mean
    cross-entropy over each record's labelled tokens (label -1: none)."""
    logits = jnp.tanh(p["emb"][b["x"]]) @ p["out"]  # [B, T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    labelled = b["y"] >= 0
    picked = jnp.take_along_axis(logp, jnp.maximum(b["y"], 0)[..., None], -1)[..., 0]
    per_record = -jnp.sum(jnp.where(labelled, picked, 0.0), -1)
    return jnp.mean(per_record / jnp.maximum(jnp.sum(labelled, -1), 1).astype(jnp.float32))


def _reference(loss_fn, params, batch, real, pad_user, clip):
    """float64: each real user's summed gradient over its real records, clipped to
    ``clip`` and summed over the real users."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        wide = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in batch.items()}
        flat = {k: v.reshape(-1, 1, *v.shape[2:]) for k, v in wide.items()}  # one record each
        per_record = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0)))(p64, flat)
        leaves = [
            np.asarray(g).reshape(*real.shape, *g.shape[1:]) for g in jax.tree.leaves(per_record)
        ]
    keep = (real & ~pad_user[:, None]).astype(np.float64)
    per_user = [np.einsum("uk,uk...->u...", keep, g) for g in leaves]
    norms = np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, 1) for g in per_user))
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    return [np.einsum("u,u...->...", factor, g) for g in per_user]


def _jitted(g):
    """``g`` compiled once (eagerly, each operation would compile on its own)."""
    return jax.jit(lambda params, batch, pad: g(params, batch, is_padding_example=pad))


def _masks(rng, users, k):
    real = rng.random((users, k)) < 0.7
    real[:, 0] = True  # a sampled user has a record
    pad_user = np.zeros(users, bool)
    pad_user[-2:] = True  # two padding users
    real[pad_user] = False
    return real, pad_user


def _mlp_case(rng, users, k):
    params = {
        "w1": jnp.asarray(rng.normal(size=(5, 7)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(7, 1)), jnp.float32),
    }
    batch = {
        "x": rng.normal(size=(users, k, 5)).astype(np.float32),
        "y": rng.normal(size=(users, k)).astype(np.float32),
    }
    return _mlp_loss, params, batch


def _lm_case(rng, users, k):
    vocab, dim, length = 11, 6, 5
    params = {
        "emb": jnp.asarray(rng.normal(size=(vocab, dim)), jnp.float32),
        "out": jnp.asarray(rng.normal(size=(dim, vocab)), jnp.float32),
    }
    y = rng.integers(0, vocab, size=(users, k, length)).astype(np.int32)
    y[..., -2:] = -1  # padding tokens: no loss
    x = rng.integers(0, vocab, size=(users, k, length)).astype(np.int32)
    return _lm_loss, params, {"x": x, "y": y}


@pytest.mark.parametrize("method", ["auto", "vmap", "ghost"])
@pytest.mark.parametrize("case", [_mlp_case, _lm_case], ids=["mlp", "lm"])
def test_per_user_clipped_sum_matches_float64_reference(case, method):
    rng = np.random.default_rng(0)
    users, k, clip = 7, 4, 0.3
    loss_fn, params, batch = case(rng, users, k)
    real, pad_user = _masks(rng, users, k)
    g = user_private_grad(loss_fn, l2_clip_norm=clip, policy="fp32", method=method)
    out = _jitted(g)(params, {**batch, RECORD_MASK: real}, pad_user)
    want = _reference(loss_fn, params, batch, real, pad_user, clip)
    # Each clipped user's float32 gradient is within (depth of its arithmetic) x u32
    # of the float64 one relative to its norm, at most C after clipping; a sum of
    # `users` of them is within users x C x that. A depth of 64 operations per
    # entry (forward, backward, k records, norm and factor) is generous here.
    tol = users * clip * 64 * U32
    for got, ref in zip(jax.tree.leaves(out.grads), want, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0, atol=tol)
    assert int(out.stats.num_examples) == users - 2  # the real users are the examples
    info = g.explain(params, {**batch, RECORD_MASK: real})
    assert info["unit"] == "user" and info["reason"].startswith(UNIT_REASON)
    assert info["method"] == (method if method != "auto" else g.resolved_method)


def test_a_crafted_user_moves_the_sum_by_at_most_the_sensitivity():
    """A user whose k records all push one way: at user level it moves the clipped
    sum by at most the accounted sensitivity (about C); at record level, by k C."""
    k, clip, dim = 8, 1.0, 3
    w = jnp.zeros(dim, jnp.float32)
    direction = np.array([1.0, 2.0, 2.0], np.float32) / 3.0  # unit norm

    def loss(p, b):  # the gradient of each record is -x: norm 3 C, same direction
        return -jnp.mean(b["x"] @ p)

    x = np.tile(3.0 * clip * direction, (2, k, 1)).astype(np.float32)
    x[1] = np.random.default_rng(1).normal(size=(k, dim))  # another user, some records
    real = np.ones((2, k), bool)
    g = user_private_grad(loss, l2_clip_norm=clip, policy="fp32")
    step = _jitted(g)
    with_user = step(w, {"x": x, RECORD_MASK: real}, np.array([False, False]))
    without = step(w, {"x": x, RECORD_MASK: real}, np.array([True, False]))
    moved = float(jnp.linalg.norm(with_user.grads - without.grads))
    bound = g.sensitivity_bound(batch_size=2)["sensitivity"]
    assert moved <= bound
    assert moved > clip * (1 - 16 * U32)  # clipped to C, not to less
    record_level = dpmp.private_grad(loss, l2_clip_norm=clip, policy="fp32", method="vmap")
    alone = _jitted(record_level)(w, {"x": x[0]}, np.zeros(k, bool))  # each record a unit
    assert float(jnp.linalg.norm(alone.grads)) > k * clip * (1 - 16 * U32)


def test_every_method_is_accepted_with_a_user_unit():
    """The config takes ghost, vmap and auto per user; explain names the unit."""
    for method in ("auto", "vmap", "ghost"):
        config = load_config(None, ["privacy.unit=user", f"privacy.clip_method={method}"])
        assert config.privacy.clip_method == method


# ---- sampling over users -----------------------------------------------------------


def _user_of(users):
    def of(indices):
        return users[indices]

    return of


def test_each_sampled_user_gives_its_own_records_at_most_k():
    k = 4
    # user 0: 3000 records; user 1: 2; users 2..49: one each
    users = np.concatenate([np.zeros(3000, int), [1, 1], np.arange(2, 50)])
    users = np.random.default_rng(0).permutation(users)
    sampler = UserPoissonSampler(users, 10, records_per_user=k, seed=3)
    seen_big = 0
    for step in range(200):
        b = sampler.batch(step)
        assert b.indices.shape == (sampler.padded_batch_size, k)
        assert (b.is_padding_record == (b.indices < 0)).all()
        assert b.is_padding_record[b.is_padding_example].all()
        for row in np.flatnonzero(~b.is_padding_example):
            records = b.indices[row][~b.is_padding_record[row]]
            assert len(records) >= 1 and len(set(records.tolist())) == len(records)
            owner = set(users[records].tolist())
            assert len(owner) == 1  # one user's records
            count = int((users == owner.pop()).sum())
            assert len(records) == min(count, k)
            seen_big += count == 3000
    assert seen_big > 0


def _same_partition(a, b):
    """Whether two labelings of the same items group them alike."""
    pairs = set(zip(np.asarray(a).tolist(), np.asarray(b).tolist()))
    return len(pairs) == len(set(np.asarray(a).tolist())) == len(set(np.asarray(b).tolist()))


def test_jsonl_and_npz_users_follow_their_records_through_the_split(tmp_path):
    from dpmp.data._text import BOS, PAD

    rows = [{"text": f"user {i % 7} wrote line {i}", "user": i % 7 or "zero"} for i in range(40)]
    data = load_dataset("text", path=_jsonl(tmp_path, rows), user_field="user", seed=3)
    texts = [bytes(t for t in row if t not in (BOS, PAD)).decode() for row in data.x_train]
    writers = [int(t.split()[1]) for t in texts]
    assert _same_partition(writers, data.users_train) and data.num_users == len(set(writers))

    x = np.arange(60, dtype=np.float32).reshape(30, 2)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(30) % 2, who=np.arange(30) % 4)
    data = load_dataset("npz", path=str(tmp_path / "d.npz"), user_field="who", seed=1)
    assert _same_partition(data.x_train[:, 0].astype(int) // 2 % 4, data.users_train)
    with pytest.raises(DataError, match="no array 'users'"):
        load_dataset("npz", path=str(tmp_path / "d.npz"), user_field="users")
    with pytest.raises(DataError, match="carries no user ids"):
        load_dataset("digits", user_field="users")


def test_a_user_with_no_training_record_is_not_a_user():
    x = np.random.default_rng(0).normal(size=(12, 2)).astype(np.float32)
    y = np.arange(12) % 2
    data = dpmp.Dataset.from_arrays((x, y), (x[:2], y[:2]), users=["a", "b", 7] * 4)
    assert data.num_users == 3 and data.summary()["num_users"] == 3
    assert sorted(set(data.users_train.tolist())) == [0, 1, 2]
    with pytest.raises(ValueError, match="has no record"):
        UserPoissonSampler(np.array([0, 0, 2]), 1, records_per_user=2, seed=0)


def test_users_are_included_at_the_sampling_rate():
    """Each user's inclusion count over T steps is Binomial(T, q): within z standard
    deviations of T q, z chosen so that all U users pass with probability 1 - 1e-6
    (Bonferroni over U, the normal tail; T q (1 - q) = 320 makes it accurate)."""
    n_users, q, steps = 40, 0.2, 2000
    users = np.random.default_rng(2).integers(0, n_users, size=400)
    users = np.searchsorted(np.unique(users), users)  # every index has a record
    sampler = UserPoissonSampler(users, sampling_prob=q, records_per_user=2, seed=11)
    counts = np.zeros(sampler.num_users)
    for step in range(steps):
        b = sampler.batch(step)
        first = b.indices[~b.is_padding_example, 0]
        counts[np.unique(users[first])] += 1
    z = stats.norm.isf(1e-6 / (2 * sampler.num_users))
    sd = np.sqrt(steps * q * (1 - q))
    assert np.abs(counts - steps * q).max() <= z * sd
    # pooled over users the count is Binomial(T U, q): it accepts q and rejects 0.22
    pooled_sd = np.sqrt(steps * sampler.num_users * q * (1 - q))
    total = steps * sampler.num_users
    assert abs(counts.sum() - total * q) <= z * pooled_sd
    assert abs(counts.sum() - total * 0.22) > z * pooled_sd


def test_the_sampler_resumes_at_its_step():
    users = np.repeat(np.arange(30), 3)
    a = UserPoissonSampler(users, 5, records_per_user=2, seed=5, num_steps=10)
    for _ in range(4):
        next(a)
    b = a.from_state_dict(a.state_dict(), num_steps=10)
    assert b.step == 4 and (next(b).indices == next(a).indices).all()


# ---- bad inputs: one line, exit 2 ---------------------------------------------------


def _jsonl(tmp_path, rows):
    path = tmp_path / "people.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _one_line_exit_2(capsys, argv, *needles):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    "bad, needles",
    [
        ({"text": "no user here"}, ("people.jsonl:3", "no user field 'user'")),
        ({"text": "a float id", "user": 1.5}, ("people.jsonl:3", "string or an integer")),
        ({"text": "a list id", "user": ["a"]}, ("people.jsonl:3", "string or an integer")),
    ],
    ids=["missing", "float", "list"],
)
def test_bad_user_ids_are_one_line_exit_2(tmp_path, capsys, bad, needles):
    rows = [{"text": f"line {i} of text", "user": f"u{i % 3}"} for i in range(20)]
    rows[2] = bad
    path = _jsonl(tmp_path, rows)
    argv = ["train", "--out", str(tmp_path / "run"), "--set", "data.dataset=text"]
    argv += ["--set", f"data.path={path}", "--set", "data.user_field=user"]
    argv += ["--set", "model.kind=lm", "--set", "privacy.unit=user"]
    _one_line_exit_2(capsys, argv, *needles)


@pytest.mark.parametrize(
    "sets, needles",
    [
        (["privacy.unit=user", "privacy.user_records=0"], ("privacy.user_records",)),
        (["privacy.unit=user", "privacy.user_records=-3"], ("privacy.user_records",)),
        (["privacy.unit=user"], ("privacy.unit", "data.user_field")),
        (["privacy.unit=people"], ("privacy.unit", "record, user")),
    ],
    ids=["k=0", "k<0", "no-users", "unknown"],
)
def test_bad_unit_settings_are_one_line_exit_2(tmp_path, capsys, sets, needles):
    argv = ["train", "--out", str(tmp_path / "run")]
    for item in sets + ["training.steps=1"]:
        argv += ["--set", item]
    _one_line_exit_2(capsys, argv, *needles)


def test_config_and_data_errors_name_the_field():
    with pytest.raises(ConfigError, match="privacy.user_records"):
        load_config(None, ["privacy.user_records=0"])
    x = np.zeros((12, 2), np.float32)
    y = np.arange(12) % 2
    with pytest.raises(DataError, match=r"users\[3\].*string or an integer"):
        dpmp.Dataset.from_arrays((x, y), (x, y), users=[1, 2, 3, 4.5] + [0] * 8)
    with pytest.raises(DataError, match="11 user ids for 12"):
        dpmp.Dataset.from_arrays((x, y), (x, y), users=[0] * 11)


# ---- a whole run ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_user_level_run_reports_its_unit_and_users(tmp_path, capsys):
    rng = np.random.default_rng(0)
    n = 600
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    users = np.array([f"person-{u}" for u in rng.integers(0, 150, size=n)])
    np.savez(tmp_path / "people.npz", x=x, y=y, people=users)
    out = tmp_path / "run"
    sets = [
        "data.dataset=npz",
        f"data.path={tmp_path / 'people.npz'}",
        "data.user_field=people",
        "privacy.unit=user",
        "privacy.clip_method=ghost",
        "privacy.user_records=3",
        "privacy.target_epsilon=3",
        "privacy.delta=1e-3",
        "training.steps=3",
        "training.expected_batch_size=20",
        "training.eval_every=0",
        "model.hidden=[8]",
    ]
    argv = ["train", "--out", str(out)]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    train_users = len(set(users[split_positions(n, 0.2, 0)[0]].tolist()))
    assert report["privacy_unit"] == "user" and report["num_users"] == train_users
    assert report["data"]["num_users"] == train_users and report["user_records"] == 3
    assert 0 < report["epsilon"] <= 3.0 and report["private"] is True
    assert report["sampling"]["sampling_prob"] == pytest.approx(20 / train_users)
    clipping = report["clipping"]
    assert clipping["method"] == "ghost" and clipping["unit"] == "user"
    assert clipping["method_reason"].startswith(UNIT_REASON) and report["audit"]["ok"] is True
    assert "privacy unit" in capsys.readouterr().out
