"""The scattering transform against kymatio's NumPy frontend, its per-record
property (no image's features read another image), and the on-disk cache of
``data.features = "scattering"``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpmp.data import DataError, Dataset, load_dataset
from dpmp.data import _features as features
from dpmp.data._features import FEATURE_MAPS, ScatteringFeatures
from dpmp.data._scattering import Scattering2D

kymatio = pytest.importorskip("kymatio.scattering2d.frontend.numpy_frontend")

CHUNK = 16  # one compiled batch shape for the tests
U32 = 2.0**-24  # float32's unit roundoff


def kymatio_features(x: np.ndarray, J: int, L: int) -> np.ndarray:
    """kymatio's features of grey images ``[n, h, w]``, laid out ``[n, h', w', K]``."""
    s = kymatio.ScatteringNumPy2D(J=J, shape=x.shape[1:], L=L)(x)
    return np.moveaxis(s, 1, -1)


def tolerance(J: int, shape: tuple[int, int], scale: float) -> float:
    """Both implementations round in float32 through the same chain: per order, an FFT,
    an inverse FFT and the modulus, then the low-pass's FFT and inverse (2 J + 2
    transforms for J scales' second order), each within ~log2(M N) u of the norm
    of its input; the input's norm bounds every coefficient's (the filters' gains
    are at most 1). Twice that (two implementations), of the largest coefficient."""
    M, N = (((side + 2**J) // 2**J + 1) * 2**J for side in shape)
    return 2 * (2 * J + 2) * math.log2(M * N) * U32 * scale


@pytest.mark.parametrize(
    ("J", "L", "shape"), [(2, 8, (28, 28)), (1, 4, (16, 16)), (3, 4, (32, 24))]
)
def test_the_transform_is_kymatios_to_float32_rounding(J, L, shape):
    rng = np.random.default_rng(J)
    x = rng.random((CHUNK, *shape, 1), dtype=np.float32)
    ours = np.asarray(Scattering2D(J=J, L=L, shape=shape)(x))
    ref = kymatio_features(x[..., 0], J, L)
    assert ours.shape == ref.shape == (CHUNK, shape[0] // 2**J, shape[1] // 2**J, ours.shape[-1])
    assert ours.shape[-1] == 1 + J * L + L * L * J * (J - 1) // 2
    np.testing.assert_allclose(ours, ref, rtol=0, atol=tolerance(J, shape, np.abs(ref).max()))


def test_81_channels_on_7x7_and_colours_are_transformed_apart():
    s = Scattering2D(J=2, L=8, shape=(28, 28))
    assert s.channels == 81 and s.output_shape(3) == (7, 7, 243)
    x = np.random.default_rng(0).random((CHUNK, 28, 28, 3), dtype=np.float32)
    colour = np.asarray(s(x))
    for c in range(3):  # colour-major: channels c * 81 .. c * 81 + 80 are colour c's
        grey = kymatio_features(x[..., c], 2, 8)
        np.testing.assert_allclose(
            colour[..., 81 * c : 81 * (c + 1)],
            grey,
            rtol=0,
            atol=tolerance(2, (28, 28), np.abs(grey).max()),
        )


def test_an_images_features_do_not_read_the_other_images():
    """The privacy claim: a fixed function of each image alone. Changing every other
    image of the batch leaves one image's features bit-identical (same program)."""
    s = Scattering2D(J=2, L=8, shape=(28, 28))
    rng = np.random.default_rng(1)
    a = rng.random((CHUNK, 28, 28, 1), dtype=np.float32)
    b = rng.random((CHUNK, 28, 28, 1), dtype=np.float32)
    b[5] = a[5]
    np.testing.assert_array_equal(np.asarray(s(a))[5], np.asarray(s(b))[5])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="divisible by 2\\^J = 4"):
        Scattering2D(J=2, L=8, shape=(30, 28))


def images(n_train: int, n_test: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.random((n_train + n_test, 28, 28, 1), dtype=np.float32)
    y = np.arange(n_train + n_test) % 3
    return Dataset.from_arrays((x[:n_train], y[:n_train]), (x[n_train:], y[n_train:]))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "dpmp" / "features"


def test_features_are_computed_once_and_read_from_the_cache(cache, monkeypatch):
    data = images(40, 10, seed=2)
    calls = []
    mapped = ScatteringFeatures(chunk=CHUNK).apply(data, progress=lambda n, **kw: calls.append(n))
    assert mapped.input_shape == (7, 7, 81) and mapped.num_train == 40 and mapped.num_test == 10
    assert "scattering features (J = 2, L = 8" in mapped.description
    assert calls and calls[-1] == 10  # the test split's chunks were counted
    ref = kymatio_features(data.x_test[..., 0], 2, 8)
    tol = tolerance(2, (28, 28), np.abs(ref).max())
    np.testing.assert_allclose(mapped.x_test, ref, rtol=0, atol=tol)
    assert sorted(p.name.rsplit("-", 1)[1] for p in cache.iterdir()) == ["test.npy", "train.npy"]
    assert cache.stat().st_mode & 0o077 == 0  # the owner's only: as secret as the data

    def no_compute(*args):
        raise AssertionError("computed again")

    monkeypatch.setattr(features, "_compute", no_compute)
    again = ScatteringFeatures(chunk=CHUNK).apply(data)
    np.testing.assert_array_equal(again.x_train, mapped.x_train)
    with pytest.raises(AssertionError, match="computed again"):  # other data: another key
        ScatteringFeatures(chunk=CHUNK).apply(images(40, 10, seed=3))


def test_an_unreadable_cache_file_is_computed_again(cache):
    data = images(20, 4, seed=4)
    first = ScatteringFeatures(chunk=CHUNK).apply(data)
    expected = np.array(first.x_train)
    (train,) = cache.glob("*-train.npy")
    train.write_bytes(train.read_bytes()[:200])
    again = ScatteringFeatures(chunk=CHUNK).apply(data)
    np.testing.assert_array_equal(again.x_train, expected)


def test_features_need_images_with_sides_divisible_by_4(cache):
    flat = Dataset.from_arrays(
        (np.zeros((20, 12), np.float32), np.arange(20) % 2),
        (np.zeros((4, 12), np.float32), np.arange(4) % 2),
    )
    with pytest.raises(DataError, match=r'data.features: "scattering" needs images'):
        ScatteringFeatures().apply(flat)


def test_the_registry_names_the_maps_and_load_dataset_applies_one(cache, tmp_path):
    assert {"none", "scattering"} <= set(FEATURE_MAPS.names())
    for feature_map in FEATURE_MAPS:
        assert isinstance(feature_map.describe(), str)
    with pytest.raises(ValueError, match="feature map must be one of"):
        load_dataset("digits", features="pca")
    digits = load_dataset("digits")  # 8x8: divisible by 2^2, so 2x2x81 features
    mapped = load_dataset("digits", features="scattering")
    assert mapped.input_shape == (2, 2, 81) and mapped.num_train == digits.num_train
    np.testing.assert_array_equal(mapped.y_train, digits.y_train)


def test_data_features_is_a_checked_config_key_that_load_data_applies(cache, tmp_path):
    from dpmp.app.config import ConfigError, DataConfig, load_config
    from dpmp.app.inputs import load_data
    from tests.test_idx import idx_folder

    with pytest.raises(ConfigError, match="data.features: 'pca' is not allowed; allowed: none"):
        load_config(None, ["data.features=pca"])
    idx_folder(tmp_path / "mnist", np.random.default_rng(9), gz=True, n_train=24, n_test=8)
    config = DataConfig(dataset="idx", path=str(tmp_path / "mnist"), features="scattering")
    data = load_data(config)
    assert data.input_shape == (7, 7, 81) and (data.num_train, data.num_test) == (24, 8)
    assert "scattering features" in data.description
