"""Data loading: the digits split, the public pixel range, the fingerprint, and
validation of user .npz files."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import dpmp
from dpmp.app.config import DataConfig
from dpmp.app.inputs import load_data
from dpmp.data._dataset import DataError, fingerprint


def test_digits_split_and_shapes():
    data = load_data(DataConfig(), seed=0)
    assert (data.num_train, data.num_test) == (1437, 360)
    assert data.x_train.shape == (1437, 8, 8, 1) and data.x_train.dtype == np.float32
    assert data.y_train.dtype == np.int32 and data.num_classes == 10
    assert data.input_shape == (8, 8, 1)


def test_digits_hold_out_the_positions_of_the_seeded_permutation():
    """Not a stratified split: the held-out digits are those at
    ``split_positions(1797, 0.2, seed)``, whatever their labels."""
    from sklearn.datasets import load_digits

    target = load_digits().target
    for seed in (0, 1):
        train, test = dpmp.data.split_positions(len(target), 0.2, seed)
        data = load_data(DataConfig(), seed=seed)
        np.testing.assert_array_equal(data.y_test, target[test])
        np.testing.assert_array_equal(data.y_train, target[train])


def test_digits_split_is_seeded():
    a, b, c = (load_data(DataConfig(), seed=s) for s in (0, 0, 1))
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_test, c.y_test)


def test_digits_use_their_public_pixel_range():
    """x / 8 - 1 of sklearn's 0..16 pixels: no statistic of the training data."""
    from sklearn.datasets import load_digits

    data = load_data(DataConfig(), seed=0)
    assert data.standardize == "none" and data.summary()["standardize"] == "none"
    assert data.x_train.min() == -1.0 and data.x_train.max() == 1.0
    images = load_digits().images.reshape(-1, 64).astype(np.float64)
    expected = {tuple(row) for row in images / 8 - 1}
    got = {tuple(row) for row in data.x_train.reshape(-1, 64).astype(np.float64)}
    assert got <= expected  # every training example is its own pixels, mapped


def _held_out(tmp_path, name, x, y):
    """The positions an ``.npz`` of ``x, y`` (no test split) holds out: its first
    feature column holds each record's position."""
    x = np.concatenate([np.arange(len(y))[:, None], x], axis=1)
    data = load_data(_npz(tmp_path, name, x=x, y=y), seed=3)
    return sorted(data.x_test[:, 0].astype(int).tolist())


def test_the_held_out_positions_are_a_function_of_n_and_the_seed_alone(tmp_path):
    """Neighbours (one record's label or features changed, or two unrelated
    datasets of equal n) are split at the same positions. A split stratified by
    label is a function of the labels: changing one training digit's label
    replaced 48-65 of the 360 held-out digits (40 targets, each other label)."""
    rng = np.random.default_rng(0)
    n = 90
    x, y = rng.normal(size=(n, 4)), rng.integers(0, 3, n)
    held_out = _held_out(tmp_path, "a.npz", x, y)
    assert len(held_out) == 18 and held_out == sorted(dpmp.data.split_positions(n, 0.2, 3)[1])
    target = next(i for i in range(n) if i not in held_out)
    relabelled = y.copy()
    relabelled[target] = (y[target] + 1) % 3  # one training label changed
    moved = x.copy()
    moved[target] = 1e6  # one training record's features changed
    other_x, other_y = rng.normal(size=(n, 4)), rng.integers(0, 3, n)  # any data of n records
    for name, (xs, ys) in {"b": (x, relabelled), "c": (moved, y), "d": (other_x, other_y)}.items():
        assert _held_out(tmp_path, f"{name}.npz", xs, ys) == held_out, name


def test_one_more_or_one_fewer_record_is_another_n(tmp_path):
    """Under add-or-remove, n itself differs: the split is that of the other n
    (``split_positions`` of n +- 1), the same for every dataset of that size. A
    run publishes n (zero-out neighbours keep it), so it discloses nothing more."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(61, 4)), rng.integers(0, 2, 61)
    for m in (60, 61):
        expected = sorted(dpmp.data.split_positions(m, 0.2, 3)[1])
        assert _held_out(tmp_path, f"{m}.npz", x[:m], y[:m]) == expected


def test_recomputing_the_split_for_each_label_tells_nothing(tmp_path):
    """The attack on a split that reads the labels: knowing every record but one
    training label, compute the test split under each hypothesis for that label
    and evaluate the released model on it; only the true label's split
    reproduced the published test loss. Here every hypothesis gives the same
    test arrays, bit for bit, so any number computed on them is the same."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.data.astype(np.float32) / 8 - 1, digits.target
    _, test = dpmp.data.split_positions(len(y), 0.2, 0)
    target = next(i for i in range(len(y)) if i not in set(test))
    splits = []
    for label in range(10):
        hypothesis = y.copy()
        hypothesis[target] = label
        data = load_data(_npz(tmp_path, f"h{label}.npz", x=x, y=hypothesis), seed=0)
        splits.append((data.x_test.tobytes(), data.y_test.tobytes()))
    assert len(set(splits)) == 1


def test_text_records_are_held_out_by_position(tmp_path):
    """Text is split as arrays are: changing one record's text moves no other record."""
    lines = [f"record number {i:03d}, some text" for i in range(40)]
    _, test = dpmp.data.split_positions(40, 0.2, 0)
    target = next(i for i in range(40) if i not in set(test))
    changed = list(lines)
    changed[target] = "another text of another length entirely"
    tests = []
    for name, records in (("a.txt", lines), ("b.txt", changed)):
        (tmp_path / name).write_text("\n".join(records))
        data = load_data(DataConfig(dataset="text", path=str(tmp_path / name), seq_len=48), seed=0)
        tests.append(data.x_test.tobytes())
    assert tests[0] == tests[1]


def test_user_features_do_not_depend_on_the_other_records(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 5)) * 7 + 3, np.arange(40) % 2
    x_test, y_test = rng.normal(size=(6, 5)), np.arange(6) % 2
    a = load_data(_npz(tmp_path, "a.npz", x=x, y=y, x_test=x_test, y_test=y_test), seed=0)
    x2 = x.copy()
    x2[0] = 1e6  # one record replaced by an extreme one
    b = load_data(_npz(tmp_path, "b.npz", x=x2, y=y, x_test=x_test, y_test=y_test), seed=0)
    np.testing.assert_array_equal(a.x_train[1:], b.x_train[1:])
    np.testing.assert_array_equal(a.x_test, b.x_test)
    np.testing.assert_array_equal(a.x_train, x.astype(np.float32))


def test_fingerprint_is_a_sha256_of_the_arrays():
    import hashlib

    data = load_data(DataConfig(), seed=0)
    h = hashlib.sha256()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        arr = getattr(data, name)
        h.update(f"{name}:{arr.dtype.str}:{arr.shape};".encode() + arr.tobytes())
    assert fingerprint(data) == h.hexdigest()
    assert fingerprint(load_data(DataConfig(), seed=0)) == fingerprint(data)
    assert fingerprint(load_data(DataConfig(), seed=1)) != fingerprint(data)  # another split
    x = data.x_train.copy()
    x[5, 3, 3, 0] += np.float32(1 / 8)  # one pixel of one record
    assert fingerprint(dataclasses.replace(data, x_train=x)) != fingerprint(data)
    y = data.y_train.copy()
    y[0] = (y[0] + 1) % 10  # one label
    assert fingerprint(dataclasses.replace(data, y_train=y)) != fingerprint(data)


def _npz(tmp_path, name="d.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return DataConfig(dataset="npz", path=str(path))


def test_npz_flat_features_with_split(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 5))
    y = np.arange(50) % 3
    data = load_data(_npz(tmp_path, x=x, y=y), seed=0)
    assert data.input_shape == (5,) and data.num_classes == 3
    assert data.num_train + data.num_test == 50 and data.num_test == 10


def test_npz_images_and_own_test_split(tmp_path):
    x = np.ones((20, 6, 6), np.uint8)
    y = np.arange(20) % 2
    cfg = _npz(tmp_path, x=x, y=y, x_test=np.ones((4, 6, 6)), y_test=np.array([0, 1, 1, 0.0]))
    data = load_data(cfg, seed=0)
    assert data.input_shape == (6, 6, 1) and data.num_test == 4 and data.y_test.dtype == np.int32


@pytest.mark.parametrize(
    "arrays, match",
    [
        (dict(y=np.zeros(20)), r"missing array 'x'"),
        (dict(x=np.zeros((20, 2))), r"missing array 'y'"),
        (dict(x=np.zeros((20, 2)), y=np.zeros(19, int)), r"x and y: lengths differ \(20"),
        (dict(x=np.array([["a", "b"]] * 20), y=np.zeros(20, int)), r"x: must be numeric"),
        (
            dict(x=np.where(np.eye(20, 3) > 0, np.nan, 0.0), y=np.zeros(20, int)),
            r"x: .*non-finite values \(NaN\)",
        ),
        (dict(x=np.full((20, 2), np.inf), y=np.zeros(20, int)), r"x: .*\(inf\)"),
        (dict(x=np.zeros((20, 2)), y=np.full(20, 0.5)), r"y: labels must be integers"),
        (dict(x=np.zeros((20, 2)), y=-np.ones(20, int)), r"y: labels must be integers >= 0"),
        (dict(x=np.zeros((20, 2)), y=np.zeros((20, 3))), r"y: must be a 1-D array"),
        (dict(x=np.zeros((20, 2)), y=np.zeros(20, bool)), r"y: labels must be integers"),
        (dict(x=np.zeros((5, 2)), y=np.zeros(5, int)), r"x: too few examples \(5\)"),
        (dict(x=np.zeros(20), y=np.zeros(20, int)), r"x: must have shape \[examples"),
        (
            dict(x=np.zeros((20, 2)), y=np.zeros(20, int), x_test=np.zeros((3, 2))),
            r"'x_test' is given without 'y_test'",
        ),
        (
            dict(
                x=np.zeros((20, 2)),
                y=np.zeros(20, int),
                x_test=np.zeros((3, 4)),
                y_test=np.zeros(3, int),
            ),
            r"x_test: examples have shape \(4,\)",
        ),
    ],
)
def test_npz_validation_errors(tmp_path, arrays, match):
    with pytest.raises(DataError, match=match):
        load_data(_npz(tmp_path, **arrays), seed=0)


def test_the_missing_class_error_does_not_advise_deriving_classes_from_the_data(tmp_path):
    """K is published: the advice is a public label set, never np.unique of the data."""
    with pytest.raises(DataError, match="missing") as e:
        load_data(_npz(tmp_path, x=np.ones((20, 3)), y=np.where(np.arange(20) % 2, 2, 0)), seed=0)
    assert "public knowledge" in str(e.value) and "K is published" in str(e.value)
    assert "np.unique" not in str(e.value)


def test_npz_object_array_and_missing_file(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([[1, 2], [3]], dtype=object), y=np.zeros(2, int))
    with pytest.raises(DataError, match="Python objects"):
        load_data(DataConfig(dataset="npz", path=str(path)), seed=0)
    with pytest.raises(DataError, match="no such file"):
        load_data(DataConfig(dataset="npz", path=str(tmp_path / "nope.npz")), seed=0)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a readable .npz"):
        load_data(DataConfig(dataset="npz", path=str(tmp_path / "bad.npz")), seed=0)
    assert issubclass(DataError, ValueError)


@pytest.mark.parametrize(
    "y, y_test, match",
    [
        (np.arange(20) % 2 + 100_000, None, "more than 65,536 classes"),  # no huge model
        (np.zeros(20, int), None, "one class"),
        (np.where(np.arange(20) % 2, 5, 0), None, "missing"),  # 0 and 5: 1..4 absent
        (np.arange(20) % 2, np.array([0, 1, 2, 1]), "y_test: label 2 never appears"),
    ],
)
def test_labels_that_do_not_name_k_classes_are_one_line_errors(tmp_path, y, y_test, match):
    """Labels must be 0..K-1, every class in training, test labels among them: a
    stray label used to build a 100,002-way model (out of memory), a single class
    reported accuracy 1, a test-only class accuracy 0."""
    arrays = dict(x=np.ones((20, 3)), y=y)
    if y_test is not None:
        arrays.update(x_test=np.ones((len(y_test), 3)), y_test=y_test)
    with pytest.raises(DataError, match=match) as e:
        load_data(_npz(tmp_path, **arrays), seed=0)
    assert "\n" not in str(e.value)


def _npy_folder(path, n=200, shape=(4, 4, 1), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    path.mkdir(exist_ok=True)
    np.save(path / "x_train.npy", rng.normal(size=(n, *shape)).astype(dtype))
    np.save(path / "y_train.npy", np.arange(n) % 3)
    np.save(path / "x_test.npy", rng.normal(size=(20, *shape)).astype(dtype))
    np.save(path / "y_test.npy", np.arange(20) % 3)
    return path


def test_npy_folder_is_memory_mapped_and_fingerprinted_like_arrays(tmp_path):
    folder = _npy_folder(tmp_path / "data")
    data = load_data(DataConfig(dataset="npy", path=str(folder)))
    assert isinstance(data.x_train, np.memmap) and isinstance(data.x_test, np.memmap)
    assert data.num_classes == 3 and data.input_shape == (4, 4, 1) and not data.in_memory
    arrays = dpmp.Dataset.from_arrays(
        (np.load(folder / "x_train.npy"), np.load(folder / "y_train.npy")),
        (np.load(folder / "x_test.npy"), np.load(folder / "y_test.npy")),
    )
    assert arrays.in_memory and fingerprint(arrays) == fingerprint(data)


def test_npy_streamed_validation_finds_a_nan_past_the_first_block(tmp_path):
    folder = _npy_folder(tmp_path / "data", n=3000, shape=(512,))
    x = np.load(folder / "x_train.npy")
    x[2900, 7] = np.nan  # 2,900 rows of 2 KiB: past the first 4 MiB block
    np.save(folder / "x_train.npy", x)
    with pytest.raises(DataError, match=r"x_train: 1 non-finite values \(NaN\).*index 2900"):
        load_data(DataConfig(dataset="npy", path=str(folder)))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda f: (f / "y_test.npy").unlink(), "missing y_test.npy"),
        (lambda f: np.save(f / "y_train.npy", np.zeros(7, int)), "lengths differ"),
        (lambda f: np.save(f / "x_test.npy", np.zeros((20, 3))), "x_test: examples have shape"),
    ],
)
def test_npy_folder_errors_name_the_file(tmp_path, change, match):
    folder = _npy_folder(tmp_path / "data")
    change(folder)
    with pytest.raises(DataError, match=match):
        load_data(DataConfig(dataset="npy", path=str(folder)))


def test_npy_path_of_the_wrong_kind_says_so(tmp_path):
    (tmp_path / "file.npy").write_bytes(b"")
    with pytest.raises(DataError, match="is a file, not a folder"):
        load_data(DataConfig(dataset="npy", path=str(tmp_path / "file.npy")))
    with pytest.raises(DataError, match="no such folder"):
        load_data(DataConfig(dataset="npy", path=str(tmp_path / "absent")))


class Records:
    """A random-access source (grain's protocol): len() and [i]."""

    def __init__(self, x, y, as_dict=False):
        self.x, self.y, self.as_dict, self.reads = x, y, as_dict, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        return {"x": self.x[i], "y": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def test_random_access_sources_read_only_the_rows_asked_for():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(50, 6)), np.arange(50) % 2
    train = Records(x, y, as_dict=True)
    data = dpmp.Dataset.from_sources(train, Records(x[:10], y[:10]))
    assert data.num_train == 50 and data.num_classes == 2 and data.input_shape == (6,)
    np.testing.assert_array_equal(data.y_train, y)
    train.reads = 0
    got = data.x_train[np.array([3, 3, 41])]
    assert train.reads == 3 and got.dtype == np.float32
    np.testing.assert_array_equal(got, x[[3, 3, 41]].astype(np.float32))
    np.testing.assert_array_equal(data.x_train[48:], x[48:].astype(np.float32))


@pytest.mark.parametrize(
    "record, match",
    [
        ("text", "must be \\(x, y\\)"),
        ((np.zeros(6), 0.5), "y must be an integer label"),
        ((np.full(6, np.inf), 1), "x must be finite numbers"),
        ((np.zeros(5), 1), "has x of shape \\(5,\\), record 0 \\(6,\\)"),
    ],
)
def test_bad_records_are_named_by_index(record, match):
    records = [(np.zeros(6), i % 2) for i in range(12)]
    records[7] = record
    with pytest.raises(DataError, match="record 7 of the train source.*" + match):
        dpmp.Dataset.from_sources(records, records[:3])


def test_the_default_text_ships_with_python_and_splits_distinct_records():
    data = load_data(DataConfig(dataset="python_docs", seq_len=32), seed=0)
    assert data.task == "next_token" and data.num_classes == 258
    assert data.x_train.dtype == np.int32 and data.x_train.shape[1] == 33
    assert (data.x_train[:, 0] == 256).all()  # BOS
    rows = {bytes(r[1 : 1 + n].astype(np.uint8)) for r, n in zip(data.x_train, data.y_train)}
    test_rows = {bytes(r[1 : 1 + n].astype(np.uint8)) for r, n in zip(data.x_test, data.y_test)}
    assert len(data.x_test) == pytest.approx(0.2 * (len(data.x_train) + len(data.x_test)), abs=1)
    # distinct lines: a test record is a training record only if their first 32 bytes agree
    assert len(rows & test_rows) < 0.05 * len(test_rows)


@pytest.mark.slow  # parses the standard library's ~600 source files (~9 s)
def test_the_public_text_is_the_standard_librarys_docstrings():
    import ast

    from dpmp.data._text import MIN_LINE
    from dpmp.data.sources._python_docs import python_docs_records
    from dpmp.data.sources._python_stdlib import python_stdlib_records

    records, source = python_stdlib_records()
    assert records == sorted(set(records)) and min(map(len, records)) >= MIN_LINE
    assert len(records) > 10_000 and "standard library docstrings" in source
    # every line of a module's docstring that is long enough, parsed independently
    doc = ast.get_docstring(ast.parse(Path(json.__file__).read_text(encoding="utf-8")))
    lines = {line.strip() for line in doc.splitlines() if len(line.strip()) >= MIN_LINE}
    assert lines and lines <= set(records)
    # it is not the private default text: no private record is a line of it
    private, _ = python_docs_records()
    assert not set(records) & set(private)


def test_text_files_one_record_per_line_or_json_object(tmp_path):
    from dpmp.data._text import PAD, encode_records

    lines = [f"record number {i} é" for i in range(30)]
    (tmp_path / "a.txt").write_text("\n".join(lines[:15]) + "\n\n" + "\n".join(lines[15:]))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines))
    for name in ("a.txt", "a.jsonl"):
        data = load_data(DataConfig(dataset="text", path=str(tmp_path / name), seq_len=16))
        assert data.num_train + data.num_test == 30  # the blank line is no record
    tokens, counts = encode_records(["é!", "x" * 40], 8)
    assert tokens.tolist()[0] == [256, 0xC3, 0xA9, ord("!"), PAD, PAD, PAD, PAD, PAD]
    assert counts.tolist() == [3, 8] and tokens[1, 1:].tolist() == [ord("x")] * 8


def test_a_record_longer_than_seq_len_is_cut_and_counted_apart_from_the_summary(tmp_path):
    """A 1 MB line was cut to seq_len without a word. The rule is public; how many
    records were cut is a statistic of the private data (for private/ only)."""
    lines = [f"record {i:03d}" for i in range(30)]
    lines[4] = "x" * 1_000_000
    (tmp_path / "a.txt").write_text("\n".join(lines))
    data = load_data(DataConfig(dataset="text", path=str(tmp_path / "a.txt"), seq_len=16))
    assert data.cut_to == "16 bytes" and sum(data.records_cut) == 1
    _, test = dpmp.data.split_positions(30, 0.2, 0)
    assert data.records_cut == ((0, 1) if 4 in test else (1, 0))
    assert "records_cut" not in json.dumps(data.summary())
    assert load_data(DataConfig(), seed=0).cut_to is None  # arrays: nothing is cut


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("b.jsonl", '{"text": "ok"}\n[1, 2]\n', r"b.jsonl:2: expected an object"),
        ("c.jsonl", '{"text": "ok"}\n{oops\n', r"c.jsonl:2: not a JSON object"),
        ("d.csv", "a,b\n", "expected a .txt or .jsonl file"),
        ("e.txt", "\n".join(["line"] * 5), "5 records; need at least 11"),
    ],
)
def test_bad_text_files_are_one_line_errors(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=match):
        load_data(DataConfig(dataset="text", path=str(tmp_path / name)))
