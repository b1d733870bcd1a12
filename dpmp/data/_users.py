"""Users in the data: a user id per training record, for user-level privacy.

One person writes many records. ``privacy.unit = "user"`` protects all of a
user's records together, and needs to know whose each training record is:
``Dataset.users_train`` holds an int32 index ``0..U-1`` per training record
(or None: no users). The ids come from the data itself:

* text and chat ``.jsonl`` files: the field ``data.user_field`` of each JSON
  line (``{"text": "...", "user": "ada"}``);
* an ``.npz`` file: the array named by ``data.user_field``, one id per
  record of ``x``;
* ``Dataset.from_arrays(..., users=ids)`` and ``Dataset.from_tokens(...,
  users=ids)``: one id per training record.

An id is a string or an integer (a JSON number without a fraction, a numpy
integer or string array); anything else (a float, a list, an object, null, a
boolean), or a record without the field, is refused in one line naming the
record. Ids are mapped to indices in the order they first appear among the
training records; which index a user gets changes nothing (each user is
sampled independently). The test split needs no users: it is held out, and
its records are never sampled.

The number of users ``U`` is public the way the number of records ``n`` is:
the neighbouring relation of a user-level run is zero-out of one user (all
of one user's records replaced by null records), so ``U`` and ``n`` are the
same in both neighbours, and ``U`` is used only where ``n`` is used at record
level (the sampling rate ``q = expected users / U``). ``num_users`` is in the
report.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpmp.data._dataset import DataError

__all__ = [
    "jsonl_user_ids",
    "npz_user_ids",
    "train_users",
    "user_indices",
]


def _is_id(value: Any) -> bool:
    if isinstance(value, bool | np.bool_):
        return False
    return isinstance(value, str | np.str_ | numbers.Integral)


def _id_type(value: Any) -> str:
    if isinstance(value, bool | np.bool_):
        return "a boolean"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


def user_indices(ids: Sequence[Any], where: Callable[[int], str]) -> np.ndarray:
    """int32 ``[n]``: each record's user index ``0..U-1``, in the order the ids first
    appear (``U`` is ``indices.max() + 1``).

    Args:
      ids: one id per record: strings or integers (numpy arrays of them too).
      where: ``where(i)`` names record ``i`` in a message (a file and line).

    Raises:
      DataError: an id that is neither a string nor an integer (one line naming
        the record and what it is).
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind in "iuU":
            ids = ids.tolist()
        elif ids.dtype.kind != "O" and len(ids):
            raise DataError(
                f"{where(0)}: a user id must be a string or an integer, got dtype {ids.dtype}"
            )
    index: dict[tuple[str, Any], int] = {}
    out = np.empty(len(ids), np.int32)
    for i, value in enumerate(ids):
        if not _is_id(value):
            raise DataError(
                f"{where(i)}: a user id must be a string or an integer, got {_id_type(value)} "
                f"({value!r})"[:200]
            )
        key = ("s", str(value)) if isinstance(value, str | np.str_) else ("i", int(value))
        out[i] = index.setdefault(key, len(index))
    return out


def jsonl_user_ids(path: str | None, field: str, dataset: str) -> list[Any]:
    """The ``field`` of each non-empty line of the ``.jsonl`` file at ``path``, in the
    order the text and chat readers read their records (a line of a record that is
    not JSON was refused by them already).

    Raises:
      DataError: the data is not a ``.jsonl`` file, or a line has no ``field``
        (one line naming the file and line).
    """
    file = Path(str(path))
    if path is None or file.suffix != ".jsonl":
        raise DataError(
            f"data.user_field: reads a field of each JSON line; data.dataset = {dataset!r} "
            + ("reads no file" if path is None else f"reads {file.name}, not a .jsonl file")
        )
    ids = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if field not in obj:
            raise DataError(f"{file}:{number}: no user field {field!r} (data.user_field)")
        value = obj[field]
        if not _is_id(value):
            raise DataError(
                f"{file}:{number}: user field {field!r} must be a string or an integer, got "
                f"{_id_type(value)} ({json.dumps(value)[:60]})"
            )
        ids.append(value)
    return ids


def npz_user_ids(arrays: dict[str, np.ndarray], field: str, file: Path, n: int) -> np.ndarray:
    """The array ``field`` of an ``.npz`` file: one user id per record of ``x``.

    Raises:
      DataError: no such array, or not one id per record.
    """
    if field not in arrays:
        raise DataError(
            f"{file}: no array {field!r} (data.user_field); found {sorted(arrays)} "
            "(store one user id per record of x)"
        )
    ids = arrays[field]
    if ids.shape != (n,):
        raise DataError(
            f"{file}: array {field!r} (data.user_field) has shape {ids.shape}; expected ({n},), "
            "one user id per record of x"
        )
    return ids


def train_users(ids: Sequence[Any], train: np.ndarray, where: Callable[[int], str]) -> np.ndarray:
    """The user indices of the training records (``train``: their positions among
    all records): ids of held-out records are checked but not counted as users."""
    every = user_indices(ids, where)  # every id checked, held-out ones too
    return user_indices(every[np.asarray(train)], lambda i: where(int(train[i])))
