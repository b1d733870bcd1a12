"""Text as byte tokens: records of text become a next-token ``Dataset``.

A record (one line of a ``.txt`` file, one ``{"text": ...}`` object of a
``.jsonl`` file, one line of a shipped corpus) is one example, the privacy
unit. ``encode_records`` makes it ``BOS``, its first ``seq_len`` UTF-8 bytes,
then ``PAD``; ``text_dataset`` splits the records into train and test at
the positions of a ``Split``: by default those a seeded permutation picks
(``seeded_split``: never a function of the records). ``read_text_file``
reads a user's file; ``distinct_lines`` is how the shipped corpora
(``dpmp.data.sources``) turn documents into records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dpmp.data._dataset import DataError, Dataset, split_positions

__all__ = [
    "BOS",
    "MIN_LINE",
    "PAD",
    "VOCAB",
    "Split",
    "distinct_lines",
    "encode_records",
    "read_text_file",
    "seeded_split",
    "text_dataset",
]

# One token per UTF-8 byte, then a begin-of-record and a padding token.
BOS, PAD = 256, 257
VOCAB = 258
# The shipped corpora keep lines of at least this many characters.
MIN_LINE = 16


class Split(NamedTuple):
    """Which records a dataset trains on and which it holds out: ``train`` and
    ``test``, int positions among all the records (each in increasing order), and
    ``how`` they were chosen, in the words of the dataset's description."""

    train: np.ndarray
    test: np.ndarray
    how: str


def seeded_split(n: int, test_fraction: float, seed: int) -> Split:
    """The ``Split`` of ``n`` records by ``split_positions(n, test_fraction, seed)``.

    Raises:
      DataError: too few records to train and test on.
    """
    train, test = split_positions(n, test_fraction, seed)
    return Split(train, test, f"split test_fraction={test_fraction}, seed={seed}")


def text_dataset(records: list[str], source: str, seq_len: int, split: Split) -> Dataset:
    """A next-token ``Dataset`` of ``records`` (byte tokens), split at ``split``.

    ``x`` is ``[n, seq_len + 1]`` int32 tokens, ``y`` each record's token
    count, ``num_classes`` the vocabulary (``VOCAB``); ``source`` says where
    the records came from.
    """
    train, test = split.train, split.test
    tokens, counts = encode_records(records, seq_len)
    cut = np.fromiter((len(r.encode("utf-8")) > seq_len for r in records), bool, len(records))
    return Dataset(
        x_train=tokens[train],
        y_train=counts[train],
        x_test=tokens[test],
        y_test=counts[test],
        num_classes=VOCAB,
        input_shape=(seq_len + 1,),
        description=(
            f"{source}: {len(train)} train / {len(test)} test records, UTF-8 bytes, "
            f"{seq_len} per record (longer ones cut; {split.how})"
        ),
        task="next_token",
        cut_to=f"{seq_len} bytes",
        records_cut=(int(cut[train].sum()), int(cut[test].sum())),
    )


def distinct_lines(texts: Iterable[str]) -> list[str]:
    """The distinct stripped lines of at least ``MIN_LINE`` characters, sorted (so that
    no test record is also a training record)."""
    lines = (line.strip() for text in texts for line in text.splitlines())
    return sorted({line for line in lines if len(line) >= MIN_LINE})


def encode_records(records: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [n, seq_len + 1] int32, counts [n] int32)``: BOS, then each record's
    first ``seq_len`` UTF-8 bytes, then PAD; ``counts`` are the predicted tokens."""
    tokens = np.full((len(records), seq_len + 1), PAD, np.int32)
    tokens[:, 0] = BOS
    counts = np.zeros(len(records), np.int32)
    for i, record in enumerate(records):
        data = np.frombuffer(record.encode("utf-8")[:seq_len], np.uint8)
        tokens[i, 1 : 1 + len(data)] = data
        counts[i] = len(data)
    return tokens, counts


def read_text_file(path: str | None, field: str = "data.path") -> tuple[list[str], str]:
    """Records of a ``.txt`` (one per non-empty line) or ``.jsonl`` (``{"text": ...}``);
    errors name the ``field`` that gave the path."""
    file = Path(str(path))
    if not file.is_file():
        what = "is not a regular file" if file.exists() else "no such file"
        raise DataError(f"{field}: {what} {str(file)!r}")
    if file.suffix not in (".txt", ".jsonl"):
        raise DataError(f"{field}: {file.name}: expected a .txt or .jsonl file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text: {e}") from None
    if file.suffix == ".txt":
        return [line for line in lines if line.strip()], f"{file.name} (one record per line)"
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{number}: not a JSON object: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise DataError(f'{file}:{number}: expected an object with a string "text"')
        records.append(obj["text"])
    return records, f"{file.name} (one record per JSON line)"
