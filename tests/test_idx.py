"""The idx reader and the ``idx`` and ``fashion_mnist`` sources: files written here
(raw and gzip) read back as numpy wrote them; every bad file is one line naming it."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from dpmp.data import DataError, load_dataset
from dpmp.data._idx import IDX_DTYPES, read_idx, read_idx_pair
from dpmp.data.sources import SOURCES
from dpmp.data.sources._base import SourceOptions
from dpmp.data.sources._fashion_mnist import FOLDER, FashionMNIST

CODES = {np.dtype(d).newbyteorder("="): code for code, d in IDX_DTYPES.items()}


def idx_bytes(array: np.ndarray, *, code: int | None = None) -> bytes:
    """The idx encoding of ``array``, written from the format's definition: two zero
    bytes, the type code, the number of dimensions, the sizes as big-endian uint32,
    then the elements big-endian."""
    code = CODES[array.dtype] if code is None else code
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(IDX_DTYPES[code]).tobytes()


def write(path: Path, data: bytes, *, gz: bool) -> Path:
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def images_and_labels(n: int, rng, *, side: int = 28, classes: int = 10):
    images = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
    labels = (np.arange(n) % classes).astype(np.uint8)  # every class present
    return images, labels


def idx_folder(folder: Path, rng, *, gz: bool, n_train: int = 40, n_test: int = 12, **kw):
    """A folder of the four files as MNIST names them; returns the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images, labels = images_and_labels(n, rng, **kw)
        write(folder / f"{split}-images-idx3-ubyte{suffix}", idx_bytes(images), gz=gz)
        write(folder / f"{split}-labels-idx1-ubyte{suffix}", idx_bytes(labels), gz=gz)
        arrays[split] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", ["uint8", "int8", ">i2", ">i4", ">f4", ">f8"])
def test_read_idx_gives_back_what_was_written(tmp_path, gz, dtype):
    rng = np.random.default_rng(0)
    array = (rng.normal(size=(3, 5, 4)) * 100).astype(np.dtype(dtype).newbyteorder("="))
    file = write(tmp_path / "a-idx3", idx_bytes(array), gz=gz)
    back = read_idx(file)
    assert back.dtype == array.dtype and back.dtype.isnative
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("gz", [False, True])
def test_an_idx_folder_is_the_images_scaled_by_their_public_range(tmp_path, gz):
    written = idx_folder(tmp_path / "mnist", np.random.default_rng(1), gz=gz)
    data = load_dataset("idx", path=str(tmp_path / "mnist"))
    for split, (images, labels) in (("train", written["train"]), ("test", written["t10k"])):
        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
        assert x.dtype == np.float32 and x.shape == (*images.shape, 1)
        # the pixels 0..255 divided by 255, nothing read from the data
        np.testing.assert_array_equal(x[..., 0], images.astype(np.float32) / np.float32(255))
        np.testing.assert_array_equal(y, labels.astype(np.int32))
    assert data.num_classes == 10 and data.input_shape == (28, 28, 1)
    assert "40 train / 12 test" in data.description


def test_an_emnist_style_prefix_and_test_for_t10k_are_read(tmp_path):
    folder = tmp_path / "emnist"
    folder.mkdir()
    rng = np.random.default_rng(2)
    for split in ("train", "test"):
        images, labels = images_and_labels(20, rng)
        write(folder / f"emnist-digits-{split}-images-idx3-ubyte", idx_bytes(images), gz=False)
        write(folder / f"emnist-digits-{split}-labels-idx1-ubyte.gz", idx_bytes(labels), gz=True)
    data = load_dataset("idx", path=str(folder))
    assert (data.num_train, data.num_test) == (20, 20)


def _corrupt(folder: Path, name: str, data: bytes) -> Path:
    (folder / name).write_bytes(data)
    return folder / name


BAD_FILES = {
    # name: (how the train images file is spoilt, what the error says)
    "empty": (lambda b: b"", "truncated: 0 bytes"),
    "short header": (lambda b: b[:6], "shorter than its 16-byte header"),
    "truncated data": (lambda b: b[:-5], "truncated:"),
    "trailing bytes": (lambda b: b + b"\x00" * 3, "3 bytes after"),
    "wrong magic": (lambda b: b"\x08\x03" + b[2:], "bad magic number 0x0803"),
    "unknown type": (lambda b: b[:2] + b"\x07" + b[3:], "unknown idx element type 0x07"),
    "labels not images": (lambda b: b[:3] + b"\x01" + b[4:], "1 dimensions in its header"),
    "pixels not bytes": (
        lambda b: idx_bytes(np.zeros((40, 28, 28), ">i2"), code=0x0B),
        "pixels of type int16",
    ),
    "broken gzip": (lambda b: gzip.compress(b)[:-20], "truncated gzip stream"),
    "not gzip inside": (lambda b: b"\x1f\x8b" + b"garbage" * 4, "not a readable gzip file"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_each_bad_images_file_is_one_line_naming_it(tmp_path, case):
    folder = tmp_path / "d"
    idx_folder(folder, np.random.default_rng(3), gz=False)
    file = folder / "train-images-idx3-ubyte"
    spoil, needle = BAD_FILES[case]
    file.write_bytes(spoil(file.read_bytes()))
    with pytest.raises(DataError) as err:
        load_dataset("idx", path=str(folder))
    message = str(err.value)
    assert len(message.splitlines()) == 1 and needle in message and str(file) in message


def test_labels_that_disagree_with_the_images_are_one_line(tmp_path):
    folder = tmp_path / "d"
    idx_folder(folder, np.random.default_rng(4), gz=False)
    labels = folder / "t10k-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(np.zeros(11, np.uint8)))
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: 11 labels for the 12 images"):
        load_dataset("idx", path=str(folder))
    labels.write_bytes(idx_bytes(np.zeros(12, ">f4").astype(np.float32)))
    with pytest.raises(DataError, match="labels of type float32; expected integers"):
        load_dataset("idx", path=str(folder))


def test_labels_outside_the_classes_are_refused(tmp_path):
    images, labels = images_and_labels(30, np.random.default_rng(5))
    labels[17] = 12
    a = write(tmp_path / "i", idx_bytes(images), gz=False)
    b = write(tmp_path / "l", idx_bytes(labels), gz=True)
    with pytest.raises(DataError, match=r"l: label 12 at record 17 is outside 0\.\.9$"):
        read_idx_pair(a, b, num_classes=10)
    got_images, got_labels = read_idx_pair(a, b)  # without a class count: any label >= 0
    np.testing.assert_array_equal(got_labels, labels)
    np.testing.assert_array_equal(got_images, images)


def test_a_folder_without_one_set_of_files_says_what_is_missing(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        load_dataset("idx", path=str(tmp_path / "nowhere"))
    folder = tmp_path / "d"
    idx_folder(folder, np.random.default_rng(6), gz=False)
    (folder / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DataError, match="no file for the test images"):
        load_dataset("idx", path=str(folder))
    idx_folder(folder, np.random.default_rng(6), gz=True)  # now .gz beside the raw files
    with pytest.raises(DataError, match=r"2 files \(train-images-idx3-ubyte, train-images"):
        load_dataset("idx", path=str(folder))


def test_the_idx_source_needs_a_path_and_fashion_mnist_reads_none():
    assert SOURCES.get("idx").needs_path and not SOURCES.get("fashion_mnist").needs_path
    with pytest.raises(DataError, match="data.path: required"):
        load_dataset("idx")


def test_fashion_mnist_without_the_package_says_how_to_install_it(tmp_path):
    with pytest.raises(DataError) as err:
        FashionMNIST(tmp_path).load(SourceOptions())
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert "apt-get install dataset-fashion-mnist" in message and 'data.dataset = "idx"' in message


def test_fashion_mnist_reads_its_four_files_with_labels_checked(tmp_path):
    rng = np.random.default_rng(7)
    written = idx_folder(tmp_path, rng, gz=True)
    data = FashionMNIST(tmp_path).load(SourceOptions())
    np.testing.assert_array_equal(data.y_test, written["t10k"][1])
    assert data.x_train.shape == (40, 28, 28, 1) and data.num_classes == 10
    labels = written["train"][1].copy()
    labels[3] = 10  # an 11th class: not Fashion-MNIST
    write(tmp_path / "train-labels-idx1-ubyte.gz", idx_bytes(labels), gz=True)
    with pytest.raises(DataError, match=r"label 10 at record 3 is outside 0\.\.9"):
        FashionMNIST(tmp_path).load(SourceOptions())


def test_a_bad_idx_file_stops_dpmp_train_with_one_line_and_exit_2(tmp_path, capsys):
    from dpmp.app import cli

    folder = tmp_path / "d"
    idx_folder(folder, np.random.default_rng(8), gz=True)
    file = folder / "train-images-idx3-ubyte.gz"
    file.write_bytes(file.read_bytes()[:-30])
    argv = ["train", "--quiet", "--out", str(tmp_path / "run")]
    argv += ["--set", "data.dataset=idx", "--set", f"data.path={folder}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "truncated gzip stream" in err and str(file) in err


@pytest.mark.skipif(
    not (FOLDER / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_the_installed_fashion_mnist_is_the_published_split():
    data = load_dataset("fashion_mnist")
    assert (data.num_train, data.num_test, data.num_classes) == (60_000, 10_000, 10)
    assert data.input_shape == (28, 28, 1)
    # the published files are balanced: 6,000 and 1,000 of each class
    assert np.bincount(data.y_train).tolist() == [6000] * 10
    assert np.bincount(data.y_test).tolist() == [1000] * 10
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
