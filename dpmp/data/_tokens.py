"""Tokenized text with per-token labels: one record is one example, whatever its length.

A next-token ``Dataset`` with per-token labels holds

* ``x``: int32 token ids ``[n, T]`` in ``[0, num_classes)``;
* ``y``: int32 labels ``[n, T]``: ``y[i, t]`` is the token that follows
  ``x[i, t]`` in record ``i``, or ``IGNORE`` (-1) where none does (after the
  record's end): those positions contribute nothing to the loss;
* ``num_classes``: the vocabulary size (public: the tokenizer's, not the data's).

``token_dataset`` makes one of text records and a user's ``tokenizer.json``
(``dpmp.data._tokenizer``). Each record is encoded on its own
(``tokenizer.encode(record).ids``, with the special tokens the tokenizer's
post-processor adds) and becomes exactly one example, so no example holds
tokens of two records and the record stays the privacy unit. With ``T =
seq_len``, a record of more than ``T + 1`` tokens is truncated: its first
``T + 1`` tokens give ``T`` predictions and the rest is dropped (never moved
to another example); a shorter one is padded (``x`` with id 0, ``y`` with
``IGNORE``). ``tokens_dataset`` validates arrays a user made
(``dpmp.Dataset.from_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpmp.data._dataset import MIN_TRAIN_EXAMPLES, DataError, Dataset
from dpmp.data._text import Split, seeded_split, text_dataset
from dpmp.data._tokenizer import load_tokenizer, vocab_size

__all__ = [
    "IGNORE",
    "encode_token_records",
    "records_dataset",
    "token_dataset",
    "tokens_dataset",
]

# The label of a position that has no next token (padding): no loss.
IGNORE = -1


def encode_token_records(
    ids: Sequence[Sequence[int]], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(x [n, seq_len], y [n, seq_len])`` int32: record ``i``'s first ``seq_len + 1``
    token ids ``ids[i]`` as inputs ``x[i, t]`` and next-token labels ``y[i, t] =
    ids[i][t + 1]``; ``x`` padded with 0, ``y`` with ``IGNORE``."""
    x = np.zeros((len(ids), seq_len), np.int32)
    y = np.full((len(ids), seq_len), IGNORE, np.int32)
    for i, record in enumerate(ids):
        kept = np.asarray(record[: seq_len + 1], np.int32)
        x[i, : min(len(kept), seq_len)] = kept[:seq_len]
        y[i, : max(len(kept) - 1, 0)] = kept[1:]
    return x, y


def records_dataset(
    records: list[str],
    source: str,
    *,
    tokenizer: str | None,
    seq_len: int,
    test_fraction: float,
    seed: int,
    split: Split | None = None,
) -> Dataset:
    """Text ``records`` as a next-token ``Dataset``: encoded by the ``tokenizer.json``
    at ``tokenizer`` (``token_dataset``), or as UTF-8 bytes when it is None
    (``text_dataset``). The private data and the public pre-training text both
    come through here, so that they are encoded alike.

    ``split``: the train and test positions of a source that chooses them itself
    (the Shakespeare speeches are split by users); by default
    ``seeded_split(len(records), test_fraction, seed)``.

    Raises:
      DataError: too few records to split, or the tokenizer cannot be loaded.
    """
    if split is None:
        split = seeded_split(len(records), test_fraction, seed)
    if tokenizer is None:
        return text_dataset(records, source, seq_len, split)
    return token_dataset(records, source, tokenizer=tokenizer, seq_len=seq_len, split=split)


def token_dataset(
    records: list[str],
    source: str,
    *,
    tokenizer: str,
    seq_len: int,
    split: Split,
    field: str = "data.tokenizer",
) -> Dataset:
    """A next-token ``Dataset`` of ``records`` encoded by the ``tokenizer.json`` at
    ``tokenizer``, one example per record, split at ``split`` (as byte-level text is).

    Raises:
      DataError: the tokenizer cannot be loaded (the message names ``field``).
    """
    encoder = load_tokenizer(tokenizer, field)
    vocab = vocab_size(encoder)
    ids = [e.ids for e in encoder.encode_batch(records)]
    x, y = encode_token_records(ids, seq_len)
    _check_ids("x_train", x, vocab, low=0)  # a tokenizer's ids are below its vocab_size
    description = (
        f"{source}: {len(split.train)} train / {len(split.test)} test records, tokenized by "
        f"{Path(str(tokenizer)).name} ({vocab} token ids), {seq_len} predicted tokens "
        f"per record (longer ones cut; {split.how})"
    )
    return split_token_records(
        x, y, ids, split.train, split.test, vocab=vocab, description=description
    )


def split_token_records(
    x: np.ndarray,
    y: np.ndarray,
    ids: Sequence[Sequence[int]],
    train: np.ndarray,
    test: np.ndarray,
    *,
    vocab: int,
    description: str,
) -> Dataset:
    """The next-token ``Dataset`` of ``encode_token_records``' ``x, y`` (made of each
    record's token ``ids``), split at the positions ``train`` and ``test``; a record
    of more than ``seq_len + 1`` tokens is counted as cut, per split."""
    seq_len = x.shape[1]
    cut = np.fromiter((len(i) > seq_len + 1 for i in ids), bool, len(ids))
    return Dataset(
        x_train=x[train],
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        num_classes=vocab,
        input_shape=(seq_len,),
        description=description,
        task="next_token",
        cut_to=f"{seq_len + 1} tokens",
        records_cut=(int(cut[train].sum()), int(cut[test].sum())),
    )


def tokens_dataset(
    train: tuple[Any, Any],
    test: tuple[Any, Any],
    *,
    vocab_size: int,
    description: str | None = None,
) -> Dataset:
    """A next-token ``Dataset`` of ``(x, y)`` arrays of token ids and per-token labels
    (see the module docstring); ``vocab_size`` is the model's vocabulary.

    Raises:
      DataError: an array is not ``[n, T]`` integers, ``x`` and ``y`` differ in
        shape, an id or label is outside the vocabulary (``y`` may be
        ``IGNORE``), or there are too few training records.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer):
        raise DataError(f"vocab_size: must be an integer >= 2, got {vocab_size!r}")
    if vocab_size < 2:
        raise DataError(f"vocab_size: must be an integer >= 2, got {vocab_size}")
    x_train, y_train = _pair("train", train, int(vocab_size))
    x_test, y_test = _pair("test", test, int(vocab_size))
    if x_test.shape[1] != x_train.shape[1]:
        raise DataError(
            f"x_test: records of {x_test.shape[1]} tokens, but x_train has {x_train.shape[1]}"
        )
    if len(x_train) < MIN_TRAIN_EXAMPLES:
        raise DataError(
            f"x_train: too few training records ({len(x_train)}); need at least "
            f"{MIN_TRAIN_EXAMPLES}"
        )
    return Dataset(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=int(vocab_size),
        input_shape=(int(x_train.shape[1]),),
        description=description or "user token ids with per-token labels",
        task="next_token",
    )


def _pair(split: str, pair: Any, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    if not (isinstance(pair, tuple | list) and len(pair) == 2):
        raise DataError(f"data: the {split} split must be an (x, y) pair of arrays")
    x = _check_ids(f"x_{split}", pair[0], vocab, low=0)
    y = _check_ids(f"y_{split}", pair[1], vocab, low=IGNORE)
    if x.shape != y.shape:
        raise DataError(
            f"x_{split} and y_{split}: shapes differ ({x.shape} vs {y.shape}); y holds one "
            "label per token of x"
        )
    return x, y


def _check_ids(name: str, values: Any, vocab: int, *, low: int) -> np.ndarray:
    """``values`` as int32 ``[n, T]``, every entry in ``[low, vocab)``."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        raise DataError(f"{name}: must be integer token ids, got dtype {a.dtype}")
    if a.ndim != 2 or 0 in a.shape:
        raise DataError(f"{name}: must have shape [records, tokens], got shape {a.shape}")
    bad = (a < low) | (a >= vocab)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        allowed = f"0..{vocab - 1}" + (", or -1 for no loss" if low < 0 else "")
        raise DataError(
            f"{name}: {int(a[at])} at {list(at)} is outside the vocabulary of {vocab} "
            f"token ids ({allowed}); {int(bad.sum())} such"
        )
    return np.ascontiguousarray(a, np.int32)
