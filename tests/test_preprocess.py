"""Standardisation: the private mechanism against a numpy reference, its noise and
sensitivity, and the exact (non-private) statistics."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from dpmp.app.config import DataConfig
from dpmp.app.inputs import load_data
from dpmp.data._preprocess import (
    FeatureStats,
    exact_feature_stats,
    private_feature_stats,
    release_noise_multiplier,
    standardize,
)


def _clipped_sums(x, clip):
    """float64 reference: clip each example to L2 norm ``clip``, sum and sum of squares."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    out = []
    for row in flat:
        norm = math.sqrt(float(row @ row))
        out.append(row * min(1.0, clip / norm) if norm > 0 else row)
    c = np.array(out)
    return c.sum(0), (c**2).sum(0)


@pytest.fixture(scope="module")
def x():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(500, 3, 2)) * np.array([1.0, 3.0]) + 2.0).astype(np.float32)


def test_without_noise_the_private_stats_are_those_of_the_clipped_features(x):
    clip = 4.0
    s1, s2 = _clipped_sums(x, clip)
    got = private_feature_stats(x, clip=clip, noise_multiplier=1e-12, seed=1)
    mean = s1 / len(x)
    var = np.maximum(s2 / len(x) - mean**2, max(1e-12 * clip**2 / len(x), 1e-6 * clip**2 / 6))
    np.testing.assert_allclose(got.mean.ravel(), mean, rtol=1e-6)
    np.testing.assert_allclose(got.std.ravel(), np.sqrt(var), rtol=1e-6)
    assert got.mean.shape == (3, 2) and got.mode == "private"
    # a clip above every norm: the plain mean and std
    big = private_feature_stats(x, clip=1e3, noise_multiplier=1e-12, seed=1)
    np.testing.assert_allclose(big.mean, x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(big.std, x.std(0), rtol=1e-4)


def test_the_noise_is_gaussian_with_the_stated_scale(x):
    """mean * n - clipped sum is N(0, (sigma B)^2); a wrong scale is rejected."""
    clip, sigma = 4.0, 3.0
    s1, _ = _clipped_sums(x, clip)
    z = np.concatenate(
        [
            private_feature_stats(x, clip=clip, noise_multiplier=sigma, seed=s).mean.ravel()
            * len(x)
            - s1
            for s in range(2000)
        ]
    )
    assert stats.kstest(z, "norm", args=(0, sigma * clip)).pvalue > 1e-3
    assert stats.kstest(z, "norm", args=(0, 1.1 * sigma * clip)).pvalue < 1e-4
    a = private_feature_stats(x, clip=clip, noise_multiplier=sigma, seed=7)
    b = private_feature_stats(x, clip=clip, noise_multiplier=sigma, seed=7)
    np.testing.assert_array_equal(a.mean, b.mean)  # the seed is the only randomness


def test_zero_out_neighbours_move_the_sums_by_at_most_the_sensitivity(x):
    """(s1 / B, s2 / B^2) moves by <= sqrt(2) when one record contributes nothing."""
    clip = 2.0
    base = np.concatenate(_clipped_sums(x, clip) * np.array([[1 / clip], [1 / clip**2]]))
    worst = 0.0
    for i in range(0, len(x), 25):
        zeroed = x.copy()
        zeroed[i] = 0.0  # the null record
        other = np.concatenate(_clipped_sums(zeroed, clip) * np.array([[1 / clip], [1 / clip**2]]))
        worst = max(worst, float(np.linalg.norm(base - other)))
    assert worst <= math.sqrt(2) + 1e-9
    assert worst > 1.0  # the bound is not vacuous here: records are clipped


def test_release_noise_multiplier_is_the_joint_gaussian():
    """Two Gaussians of noise multiplier sigma on one dataset = one of sigma / sqrt(2)."""
    sigma = 5.0
    two = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(sigma)]
    )
    one = dp_accounting.GaussianDpEvent(release_noise_multiplier(sigma))
    eps = [dp_accounting.rdp.RdpAccountant().compose(e).get_epsilon(1e-5) for e in (two, one)]
    assert eps[0] == pytest.approx(eps[1], rel=1e-9)


def test_exact_stats_and_standardize_both_splits():
    data = load_data(DataConfig(), seed=0)
    st = exact_feature_stats(data.x_train)
    mean = data.x_train.mean(0, dtype=np.float64)
    sd = data.x_train.std(0, dtype=np.float64)
    sd = np.where(sd > 1e-8, sd, 1.0)  # constant border pixels do not divide by 0
    out = standardize(data, st)
    assert out.standardize == "nonprivate" and st.mode == "nonprivate"
    np.testing.assert_allclose(out.x_test, (data.x_test - mean) / sd, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.x_train.mean(0), 0, atol=1e-5)
    assert np.isfinite(out.x_train).all()
    np.testing.assert_array_equal(out.y_train, data.y_train)


def test_stats_round_trip_through_json():
    import json

    x = np.random.default_rng(1).normal(size=(50, 4, 4, 1)).astype(np.float32)
    st = private_feature_stats(x, clip=3.0, noise_multiplier=2.0, seed=3)
    back = FeatureStats.from_dict(json.loads(json.dumps(st.to_dict())))
    np.testing.assert_array_equal(back.mean, st.mean)
    np.testing.assert_array_equal(back.std, st.std)
    assert (back.mode, back.clip, back.noise_multiplier) == ("private", 3.0, 2.0)
    with pytest.raises(ValueError, match="clip"):
        private_feature_stats(x, clip=0.0, noise_multiplier=1.0, seed=0)
