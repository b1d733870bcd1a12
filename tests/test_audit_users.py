"""The run audit of a user-level config: canary users of k identical records, in or
out whole (``dpmp.app.audit_users``)."""

import json

import numpy as np
import pytest

from dpmp import cli
from dpmp.app import audit_run as audit_module
from dpmp.app.audit_users import record_out, with_canary_users, zero_out_users
from dpmp.app.trainer import plan as plan_module
from dpmp.data._dataset import Dataset
from dpmp.data._user_sampling import UserBatch


def test_canary_users_are_k_copies_of_one_record_each():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype(np.float32)
    y = np.arange(10) % 2
    base = Dataset.from_arrays((x, y), (x, y), users=[f"u{i % 4}" for i in range(10)])
    cx = np.float32([[1, -1, 1], [-1, -1, 1]])
    data = with_canary_users(base, cx, np.array([0, 1]), k=3)
    assert data.num_train == 16 and data.num_users == 6
    np.testing.assert_array_equal(data.x_train[10:13], np.repeat(cx[:1], 3, 0))
    np.testing.assert_array_equal(data.users_train[10:], [4, 4, 4, 5, 5, 5])
    out = record_out(10, np.array([True, False]), 3)
    np.testing.assert_array_equal(np.flatnonzero(out), [13, 14, 15])


def test_a_user_that_is_out_is_zeroed_out_whole():
    out = np.zeros(16, bool)
    out[13:] = True  # the second canary user's records
    batch = UserBatch(
        indices=np.array([[0, 4, -1], [13, 15, -1], [-1, -1, -1]], np.int32),
        is_padding_example=np.array([False, False, True]),
        is_padding_record=np.array([[0, 0, 1], [0, 0, 1], [1, 1, 1]], bool),
    )
    got = zero_out_users(batch, out)
    np.testing.assert_array_equal(got.is_padding_example, [False, True, True])
    assert got.is_padding_record[1].all() and not got.is_padding_record[0, :2].any()
    np.testing.assert_array_equal(got.indices, batch.indices)


WIDE = [
    *("--set", 'model.kind="linear"', "--set", "model.hidden=[]", "--set", 'policy="fp32"'),
    *("--set", "training.steps=200", "--set", "training.expected_batch_size=64"),
    *("--set", "training.learning_rate=1e-4", "--set", "data.user_field=people"),
    *("--set", "privacy.unit=user", "--set", "privacy.user_sampling=records"),
    *("--set", "privacy.user_records=4", "--set", "privacy.target_epsilon=2"),
]


def _wide_users(path, d=4096, classes=10, n=200):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * n, d)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(d, classes)), 1).astype(np.int32)
    people = np.array([f"p{i // 4}" for i in range(n)])  # 50 users of 4 records
    np.savez(path, x=x[:n], y=y[:n], x_test=x[n:], y_test=y[n:], people=people)
    return str(path)


def _audit(capsys, data, *argv):
    status = cli.main(["audit", "--run", "--quiet", "--json", "--data", data, *WIDE, *argv])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_records_sampled_users_leak_what_a_record_level_claim_would_miss(
    tmp_path, capsys, monkeypatch
):
    """Example-level sampling of users, k = 4 identical records per canary user: the
    claim of k records per user holds (exit 0); the same run claimed at record level
    (the accounting told 1 record per user, as a library that ignores the cap would)
    is caught, its lower bound above the claim (exit 1)."""
    data = _wide_users(tmp_path / "wide.npz")
    status, honest = _audit(capsys, data)
    assert status == 0 and honest["ok"], honest
    assert honest["epsilon_lower"] <= honest["epsilon_claimed"] <= 2.0 + 1e-9
    monkeypatch.setattr(plan_module, "records_per_unit", lambda privacy: 1)
    monkeypatch.setattr(audit_module, "records_per_unit", lambda privacy: 1)
    status, naive = _audit(capsys, data)
    assert naive["epsilon_claimed"] <= 2.0 + 1e-9
    assert naive["noise_multiplier"] < honest["noise_multiplier"]
    assert status == 1 and naive["epsilon_lower"] > naive["epsilon_claimed"], naive


@pytest.mark.slow
def test_sampled_users_stay_below_their_claim(tmp_path, capsys):
    """User-level sampling (users Poisson-sampled, each user's summed gradient
    clipped): canary users of k = 4 identical records are one unit each; the audit's
    lower bound stays below the claim, and a canary user's k copies are clipped as
    one (its exact-Gaussian column is that of the user-level Poisson step)."""
    data = _wide_users(tmp_path / "wide.npz")
    sets = ["--set", "privacy.user_sampling=users", "--set", "training.expected_batch_size=16"]
    status, report = _audit(capsys, data, *sets)
    assert status == 0 and report["ok"], report
    assert report["epsilon_lower"] <= report["epsilon_claimed"] <= 2.0 + 1e-9
    assert report["num_train"] == 200 and report["sampling_prob"] == pytest.approx(
        round(16 / 50 * 1050) / 1050, rel=1e-9
    )
