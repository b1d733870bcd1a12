"""Data sets: train and test arrays, validated, and what a model needs to know of them.

A ``Dataset`` holds float32 features (or anything indexed by rows: a
memory-mapped ``.npy``, a random-access source) and int32 labels, split into
train and test. ``Dataset.from_arrays`` and ``Dataset.from_sources`` make one
of a user's arrays or random-access sources (grain's
``RandomAccessDataSource`` protocol: ``__len__`` and ``__getitem__(i)``
returning ``(x, y)`` or ``{"x": x, "y": y}``); the named sources of
``dpmp.data.sources`` (the digits, ``.npz`` and ``.npy`` files, text) build
theirs with the same checks. Nothing here computes a statistic of the
training data: standardisation is a separate, opt-in stage
(``dpmp.data._preprocess``). ``fingerprint(data)`` identifies the arrays (a
resumed run refuses other data).

Features keep the shape of one example (``input_shape``): the digits are
8 x 8 x 1 images, so the vision transformer can cut them into patches and the
MLPs flatten them; ``[n, h, w]`` features become ``[n, h, w, 1]`` and
``[n, d]`` stay flat. Data larger than memory is read by the rows of each
batch; validation and the fingerprint stream over the rows.

Every problem with a user's data is a ``DataError`` (a ``ValueError``)
whose message names the array and what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

__all__ = [
    "DataError",
    "Dataset",
    "MIN_TRAIN_EXAMPLES",
    "RecordColumn",
    "as_dataset",
    "fingerprint",
    "split_positions",
]

# Bytes read at a time when a split is streamed (validation, fingerprint).
_BLOCK_BYTES = 1 << 22


def _rows_per_block(x: Any) -> int:
    row = max(1, int(np.prod(x.shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize)
    return max(1, _BLOCK_BYTES // row)


# Fewer examples than this cannot be sampled, split and evaluated meaningfully.
MIN_TRAIN_EXAMPLES = 10
MIN_TEST_EXAMPLES = 1


class DataError(ValueError):
    """The data cannot be used; the message names the array and the problem."""


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test arrays and what a model needs to know about them.

    Attributes:
      x_train, x_test: features, ``[n, *input_shape]``: float32 arrays in
        memory, or anything indexed by rows (a memory-mapped ``.npy`` of any
        numeric dtype, a ``RecordColumn``); batches are cast to float32.
      y_train, y_test: int32 labels in ``[0, num_classes)``, in memory: ``[n]``,
        or ``[n, T]`` per-token labels where -1 marks no label (see ``task``).
      num_classes: K; the training labels are exactly 0..K-1 (``_check_classes``);
        for next-token data the vocabulary.
      input_shape: shape of one example (``(8, 8, 1)`` for digits).
      description: one line saying where the data came from.
      standardize: how the features were standardised: ``"none"``,
        ``"private"`` or ``"nonprivate"`` (see ``dpmp.data._preprocess``).
      task: ``"classify"`` (``y`` are class labels) or ``"next_token"``, in
        one of two forms: byte tokens (``x`` int32 ``[n, seq_len + 1]``: BOS,
        the record's UTF-8 bytes, PAD after its end; ``y`` the record's token
        count; ``num_classes`` the vocabulary, ``VOCAB``), or token ids with
        per-token labels (``x`` and ``y`` int32 ``[n, T]``, ``y[i, t]`` the
        token after ``x[i, t]`` or -1 for no loss; ``num_classes`` the
        vocabulary: ``from_tokens``, a ``tokenizer.json``; see
        ``dpmp.data._tokens``). Either way one record is one example.
      cut_to: text: what a longer record is cut to (``"64 bytes"``, ``"65
        tokens"``): the rule, public; None when nothing is cut.
      records_cut: ``(train, test)``: how many records were longer and cut. A
        statistic of the private data: a run writes it to
        ``private/diagnostics.json`` only, never to ``summary()`` or a log.
      users_train: int32 ``[n]``, the user ``0..U-1`` each training record
        belongs to, or None (``dpmp.data._users``: ``data.user_field``, or
        ``users=`` here); what ``privacy.unit = "user"`` protects. ``U``
        (``num_users``) is public as ``n`` is, and in ``summary()``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    description: str
    standardize: str = "none"
    task: str = "classify"
    cut_to: str | None = None
    records_cut: tuple[int, int] = (0, 0)
    users_train: np.ndarray | None = None

    def __post_init__(self):
        if self.users_train is not None and len(self.users_train) != self.num_train:
            raise DataError(
                f"users: {len(self.users_train)} user ids for {self.num_train} training records"
            )

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_users(self) -> int | None:
        """U, the number of users among the training records (None: no users)."""
        return None if self.users_train is None else int(self.users_train.max()) + 1

    def with_users(self, ids: Any, where: Any = None) -> Dataset:
        """This dataset with ``ids`` (one string or integer per training record) as
        its users (``dpmp.data._users.user_indices``)."""
        from dpmp.data._users import user_indices

        if len(ids) != self.num_train:
            raise DataError(f"users: {len(ids)} user ids for {self.num_train} training records")
        users = user_indices(ids, where or (lambda i: f"users[{i}]"))
        return dataclasses.replace(self, users_train=users)

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])

    @property
    def in_memory(self) -> bool:
        """Whether the features are plain float32 arrays in memory (not mapped,
        streamed or tokens)."""
        return all(
            type(x) is np.ndarray and x.dtype == np.float32 for x in (self.x_train, self.x_test)
        )

    @classmethod
    def from_arrays(
        cls,
        train: tuple[Any, Any],
        test: tuple[Any, Any],
        *,
        description: str | None = None,
        users: Any = None,
    ) -> Dataset:
        """A dataset of ``train = (x, y)`` and ``test = (x, y)`` arrays.

        Features are not copied: a memory-mapped array (``np.load(...,
        mmap_mode="r")``) stays on disk. ``[n, h, w]`` features get a channel
        axis. ``users``: a user id (string or integer) per training record, for
        ``privacy.unit = "user"``. Raises ``DataError`` naming the array at fault.
        """
        x_train = _features("x_train", train[0], copy=not isinstance(train[0], np.memmap))
        x_test = _features("x_test", test[0], copy=not isinstance(test[0], np.memmap))
        data = _assemble(x_train, train[1], x_test, test[1], description or "user arrays")
        return data if users is None else data.with_users(users)

    @classmethod
    def from_sources(cls, train: Any, test: Any, *, description: str | None = None) -> Dataset:
        """A dataset of two random-access sources of ``(x, y)`` or ``{"x", "y"}`` records.

        Each source needs ``len(source)`` and ``source[i]`` (grain's
        ``RandomAccessDataSource`` protocol). Labels are read once, here (one
        pass over the records); features are read by the batch.
        """
        x_train, y_train = _columns("train", train)
        x_test, y_test = _columns("test", test)
        return _assemble(x_train, y_train, x_test, y_test, description or "user sources")

    @classmethod
    def from_tokens(
        cls,
        train: tuple[Any, Any],
        test: tuple[Any, Any],
        *,
        vocab_size: int,
        description: str | None = None,
        users: Any = None,
    ) -> Dataset:
        """A next-token dataset of ``train = (x, y)`` and ``test = (x, y)``: integer
        token ids ``x [n, T]`` in ``[0, vocab_size)`` and per-token labels ``y [n, T]``
        (the token each position predicts, or -1 where it predicts none: padding,
        no loss). Each row is one record; ``users``: a user id (string or integer)
        per training record, for ``privacy.unit = "user"``. Raises ``DataError``
        naming the array at fault (an id or label outside the vocabulary among them).
        """
        from dpmp.data._tokens import tokens_dataset

        data = tokens_dataset(train, test, vocab_size=vocab_size, description=description)
        return data if users is None else data.with_users(users)

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable description (for the run report)."""
        return {
            "description": self.description,
            "num_train": self.num_train,
            "num_test": self.num_test,
            "num_classes": self.num_classes,
            "input_shape": list(self.input_shape),
            "standardize": self.standardize,
            "task": self.task,
        } | ({} if self.users_train is None else {"num_users": self.num_users})


def as_dataset(data: Any) -> Dataset:
    """``data`` as a ``Dataset``: a ``Dataset`` as it is, a ``(train, test)`` pair of
    ``(x, y)`` array pairs or of random-access sources."""
    if isinstance(data, Dataset):
        return data
    if not (isinstance(data, tuple | list) and len(data) == 2):
        raise DataError(
            f"data: expected a dpmp.Dataset or a (train, test) pair, got {type(data).__name__}"
        )
    train, test = data
    if isinstance(train, tuple | list) and len(train) == 2:
        return Dataset.from_arrays(tuple(train), tuple(test))
    return Dataset.from_sources(train, test)


def _assemble(x_train, y_train, x_test, y_test, description: str) -> Dataset:
    y_train = _labels("y_train", np.asarray(y_train))
    y_test = _labels("y_test", np.asarray(y_test))
    _same_length("x_train", x_train, "y_train", y_train)
    _same_length("x_test", x_test, "y_test", y_test)
    if tuple(x_test.shape[1:]) != tuple(x_train.shape[1:]):
        raise DataError(
            f"x_test: examples have shape {tuple(x_test.shape[1:])}, but x_train has "
            f"{tuple(x_train.shape[1:])}"
        )
    if len(y_train) < MIN_TRAIN_EXAMPLES:
        raise DataError(
            f"x_train: too few training examples ({len(y_train)}); need at least "
            f"{MIN_TRAIN_EXAMPLES}"
        )
    num_classes = _check_classes(y_train, y_test)
    return Dataset(
        x_train=x_train,
        y_train=np.ascontiguousarray(y_train, np.int32),
        x_test=x_test,
        y_test=np.ascontiguousarray(y_test, np.int32),
        num_classes=num_classes,
        input_shape=tuple(int(d) for d in x_train.shape[1:]),
        description=description,
    )


def fingerprint(data: Dataset) -> str:
    """sha256 (hex) of the train and test arrays: their dtypes, shapes and bytes.

    A function of the private data: it is kept in checkpoints (as secret as
    the data) and never written to a report or log.
    """
    h = hashlib.sha256()
    names = ("x_train", "y_train", "x_test", "y_test")
    for name in names + ("users_train",) * (data.users_train is not None):
        arr = getattr(data, name)
        h.update(f"{name}:{np.dtype(arr.dtype).str}:{tuple(arr.shape)};".encode())
        rows = _rows_per_block(arr)
        for start in range(0, len(arr), rows):  # streamed: never the whole split
            h.update(np.ascontiguousarray(arr[start : start + rows]).tobytes())
    return h.hexdigest()


def split_positions(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train positions, test positions)`` of ``n`` records: ``ceil(test_fraction * n)``
    of them (at least one) held out by a permutation of ``0..n-1`` seeded by ``seed``.

    Which records are held out is a function of ``(n, test_fraction, seed)``
    alone, never of the records: two datasets of ``n`` records are split at
    the same positions, whatever their features and labels. A split that
    reads the records (one stratified by label) is a function of the private
    data: changing one label changes the class counts and so which records
    are held out, and the published test accuracy and loss, computed on
    those, would tell the neighbouring datasets apart. ``n`` is public
    under the zero-out relation (``docs/privacy.md``).

    Raises:
      DataError: too few records to train and test on.
    """
    if n < MIN_TRAIN_EXAMPLES + MIN_TEST_EXAMPLES:
        raise DataError(
            f"data: {n} records; need at least {MIN_TRAIN_EXAMPLES + MIN_TEST_EXAMPLES} to "
            "hold out a test split"
        )
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(MIN_TEST_EXAMPLES, int(np.ceil(test_fraction * n)))
    return order[n_test:], order[:n_test]


def _features(name: str, x: Any, *, copy: bool = True) -> Any:
    """Validated features; float32 in memory, or (``copy=False``) the array as it is
    (a memory-mapped file stays mapped). Finiteness is checked row block by block."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    if np.dtype(x.dtype).kind not in "biuf":
        raise DataError(f"{name}: must be numeric, got dtype {x.dtype}")
    if len(x.shape) < 2:
        raise DataError(
            f"{name}: must have shape [examples, features...], got shape {tuple(x.shape)} "
            "(one feature per example? reshape to [n, 1])"
        )
    if len(x.shape) == 3 and isinstance(x, np.ndarray):  # [n, h, w] grey images: a view
        x = x[..., None]
    if len(x.shape) > 4:
        raise DataError(f"{name}: at most 4 dimensions [n, h, w, c], got shape {x.shape}")
    if x.shape[0] == 0:
        raise DataError(f"{name}: has no examples")
    if copy:
        x = np.asarray(x, np.float32)
    if np.dtype(x.dtype).kind == "f":
        _check_finite(name, x)
    return x


def _check_finite(name: str, x: Any) -> None:
    bad_values, bad_rows, first, kind = 0, 0, None, "inf"
    rows = _rows_per_block(x)
    for start in range(0, len(x), rows):
        block = np.asarray(x[start : start + rows])
        bad = ~np.isfinite(block)
        if bad.any():
            rows = np.unique(np.nonzero(bad)[0])
            bad_values += int(bad.sum())
            bad_rows += len(rows)
            first = start + int(rows[0]) if first is None else first
            kind = "NaN" if kind == "NaN" or np.isnan(block).any() else "inf"
    if bad_values:
        raise DataError(
            f"{name}: {bad_values} non-finite values ({kind}) in {bad_rows} example(s), "
            f"first at index {first}"
        )


class RecordColumn:
    """One field of a random-access source, indexed by rows like an array.

    ``column[i:j]`` and ``column[indices]`` read only those records and stack
    their ``field`` (``0``/``"x"`` for features) into a float32 array.
    """

    def __init__(self, source: Any, field: int | str, shape: tuple[int, ...]):
        self._source = source
        self._field = field
        self.shape = (len(source), *shape)
        self.dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        rows = range(*index.indices(len(self))) if isinstance(index, slice) else index
        values = [np.asarray(_field(self._source[int(i)], self._field), np.float32) for i in rows]
        if not values:
            return np.zeros((0, *self.shape[1:]), np.float32)
        return np.stack(values)


def _field(record: Any, field: int | str) -> Any:
    if isinstance(record, dict):
        return record["x" if field == 0 else "y"]
    return record[field]


def _columns(name: str, source: Any) -> tuple[Any, np.ndarray]:
    """(features column, labels) of a source; every record is read once."""
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise DataError(
            f"data: the {name} source must support len() and [i] (grain's "
            f"RandomAccessDataSource protocol), got {type(source).__name__}"
        )
    n = len(source)
    if n == 0:
        raise DataError(f"data: the {name} source has no records")
    labels, shape = np.empty(n, np.int64), None
    for i in range(n):
        record = source[i]
        if not (isinstance(record, dict) and {"x", "y"} <= set(record)) and not (
            isinstance(record, tuple | list) and len(record) == 2
        ):
            raise DataError(
                f"data: record {i} of the {name} source must be (x, y) or {{'x': x, 'y': y}}, "
                f"got {type(record).__name__}"
            )
        x = np.asarray(_field(record, 0))
        if shape is None:
            shape = x.shape
        elif x.shape != shape:
            raise DataError(
                f"data: record {i} of the {name} source has x of shape {x.shape}, record 0 {shape}"
            )
        if x.dtype.kind not in "biuf" or (x.dtype.kind == "f" and not np.isfinite(x).all()):
            raise DataError(f"data: record {i} of the {name} source: x must be finite numbers")
        label = np.asarray(_field(record, 1))
        if label.shape != () or label.dtype.kind not in "iu":
            raise DataError(f"data: record {i} of the {name} source: y must be an integer label")
        labels[i] = int(label)
    if len(shape) not in (1, 3):
        raise DataError(
            f"data: {name} records: x must be a vector [d] or an image [h, w, c], got {shape}"
        )
    return RecordColumn(source, 0, shape), labels


# More classes than this is taken for a label column that is not class labels.
MAX_CLASSES = 65_536


def _check_classes(y_train: np.ndarray, y_test: np.ndarray) -> int:
    """The number of classes K: the training labels must be exactly 0..K-1 (each
    present), with 2 <= K <= MAX_CLASSES, and every test label among them."""
    top = int(y_train.max())
    if top >= MAX_CLASSES:
        raise DataError(f"y: label {top} implies more than {MAX_CLASSES:,} classes")
    present = np.unique(y_train)
    if len(present) < 2:
        raise DataError(f"y: the training labels hold one class ({top}); a classifier needs 2")
    missing = np.setdiff1d(np.arange(top + 1), present)
    if len(missing):
        shown = ", ".join(str(int(m)) for m in missing[:5])
        raise DataError(
            f"y: labels must be 0..K-1 with every class in the training split; "
            f"{len(missing)} missing ({shown}{', ...' if len(missing) > 5 else ''}); number "
            "a label set chosen from public knowledge 0..K-1, not the classes the private "
            "data happens to hold (K is published), and give each class training examples"
        )
    unseen = np.setdiff1d(np.unique(y_test), present)
    if len(unseen):
        raise DataError(f"y_test: label {int(unseen[0])} never appears in the training labels")
    return top + 1


def _labels(name: str, y: np.ndarray) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(
            f"{name}: must be a 1-D array of integer class labels, got shape {y.shape} "
            "(one-hot labels? store their argmax; per-token labels: dpmp.Dataset.from_tokens)"
        )
    if y.dtype.kind == "b" or y.dtype.kind not in "iuf":
        raise DataError(f"{name}: labels must be integers >= 0, got dtype {y.dtype}")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            raise DataError(f"{name}: labels must be integers >= 0, got non-integer values")
    if y.size and y.min() < 0:
        raise DataError(f"{name}: labels must be integers >= 0, got {y.min()}")
    if y.size and y.max() >= 2**31:
        raise DataError(f"{name}: label {y.max()} is too large")
    return y.astype(np.int32)


def _same_length(xname: str, x: np.ndarray, yname: str, y: np.ndarray) -> None:
    if x.shape[0] != y.shape[0]:
        raise DataError(
            f"{xname} and {yname}: lengths differ ({x.shape[0]} examples vs {y.shape[0]} labels)"
        )
