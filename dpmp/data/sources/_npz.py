"""``npz``: a user's ``.npz`` file of arrays ``x``, ``y`` and optionally ``x_test``, ``y_test``.

Features of shape ``[n, h, w, c]`` keep their image shape, ``[n, h, w]``
becomes ``[n, h, w, 1]`` and ``[n, d]`` stays flat; they are read whole into
float32. Without a test split, one is held out at the positions a seeded
permutation picks (``split_positions``: never a function of the records, not
stratified by label). Pickled (object) arrays are refused. With
``data.user_field``, the array of that name holds a user id per record of
``x`` (strings or integers; ``dpmp.data._users``).
"""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import numpy as np

from dpmp.data._dataset import (
    MIN_TEST_EXAMPLES,
    MIN_TRAIN_EXAMPLES,
    DataError,
    Dataset,
    _assemble,
    _features,
    _labels,
    _same_length,
    split_positions,
)
from dpmp.data._users import npz_user_ids, train_users
from dpmp.data.sources._base import SourceOptions, register_source


class Npz:
    """The arrays of the ``.npz`` file ``options.path``."""

    name = "npz"
    needs_path = True
    task = "classify"

    def load(self, options: SourceOptions) -> Dataset:
        if not options.path:
            raise DataError(f'data.path: required when data.dataset = "{self.name}"')
        file = Path(options.path)
        arrays = _read(file)
        x = _features("x", arrays["x"])
        y = _labels("y", arrays["y"])
        _same_length("x", x, "y", y)
        field, train = options.user_field, np.arange(len(x))
        ids = None if field is None else npz_user_ids(arrays, field, file, len(x))
        if "x_test" in arrays:
            x_train, y_train = x, y
            x_test = _features("x_test", arrays["x_test"])
            y_test = _labels("y_test", arrays["y_test"])
            _same_length("x_test", x_test, "y_test", y_test)
            if x_test.shape[1:] != x_train.shape[1:]:
                raise DataError(
                    f"x_test: examples have shape {x_test.shape[1:]}, but x has {x_train.shape[1:]}"
                )
            split = "test split from the file"
        else:
            if len(x) < MIN_TRAIN_EXAMPLES + MIN_TEST_EXAMPLES:
                raise DataError(
                    f"x: too few examples ({len(x)}); need at least "
                    f"{MIN_TRAIN_EXAMPLES + MIN_TEST_EXAMPLES} to hold out a test split"
                )
            fraction, seed = options.test_fraction, options.seed
            train, test = split_positions(len(y), fraction, seed)
            x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
            split = f"split test_fraction={fraction}, seed={seed}"
        if len(x_train) < MIN_TRAIN_EXAMPLES:
            raise DataError(
                f"x: too few training examples ({len(x_train)}); need at least {MIN_TRAIN_EXAMPLES}"
            )
        if len(x_test) < MIN_TEST_EXAMPLES:
            raise DataError("x_test: no test examples")
        description = (
            f"{file.name}: {len(x_train)} train / {len(x_test)} test examples of shape "
            f"{tuple(x_train.shape[1:])}; {split}"
        )
        data = _assemble(
            np.ascontiguousarray(x_train, np.float32),
            y_train,
            np.ascontiguousarray(x_test, np.float32),
            y_test,
            description,
        )
        if ids is None:
            return data
        users = train_users(ids, train, lambda i: f"{file}: {field}[{i}]")
        return dataclasses.replace(data, users_train=users)


def _read(file: Path) -> dict[str, np.ndarray]:
    """The arrays of ``file``: ``x`` and ``y``, with ``x_test`` and ``y_test`` both or neither."""
    if not file.is_file():
        raise DataError(f"data.path: no such file {str(file)!r}")
    if not zipfile.is_zipfile(file):
        raise DataError(f"{file}: not a readable .npz file (not a zip archive of .npy arrays)")
    try:
        with open(file, "rb") as f, np.load(f, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except ValueError as e:  # object arrays need pickle, which we refuse
        raise DataError(
            f"{file}: an array holds Python objects (not numbers); store numeric arrays: {e}"
        ) from e
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"{file}: not a readable .npz file: {e}") from e
    for name in ("x", "y"):
        if name not in arrays:
            raise DataError(
                f"{file}: missing array {name!r}; found {sorted(arrays) or 'none'} "
                "(expected x, y and optionally x_test, y_test)"
            )
    has_test = ("x_test" in arrays, "y_test" in arrays)
    if has_test[0] != has_test[1]:
        present, absent = ("x_test", "y_test") if has_test[0] else ("y_test", "x_test")
        raise DataError(f"{file}: array {present!r} is given without {absent!r}")
    return arrays


register_source(Npz())
