"""A run that starts from a published checkpoint folder (``model.kind = "gpt2"``,
``"llama"``, ``"qwen2"``, ``"gemma"``: a family whose ``checkpoint`` is set).

``start_from_checkpoint`` reads ``model.checkpoint`` before anything of the run
is written and gives what the trainer needs instead of a configured model:

* the model (the family's ``load``, in the run's policy) and its stored
  parameters, the public pre-trained starting point (the frozen base, with
  ``model.lora_rank > 0``);
* the data, encoded by the checkpoint's ``tokenizer.json``: ``data.tokenizer``
  may name another file only if it holds the same vocabulary (the same token
  for every id), since the embedding rows are indexed by the checkpoint's ids;
* what the report's ``starting_point`` says: the folder.

Every error is one line naming the field or file: a missing folder or file,
a missing, unexpected or mis-shaped tensor, another ``model_type`` (and the
``model.kind`` that reads it, where a family declares it), a
tokenizer of more ids than the embedding has rows, another vocabulary, or
records (``data.seq_len``) longer than the model's ``n_positions``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

from dpmp.app.config import Config, ConfigError
from dpmp.data._dataset import DataError
from dpmp.data._tokenizer import TOKENIZER

__all__ = ["Start", "checkpoint_folder", "load_checkpoint", "start_from_checkpoint"]


class Start(NamedTuple):
    """What a run from a checkpoint trains: ``model`` (a ``dpmp.models.Model``),
    ``init_params`` (its stored parameters), ``data`` (a ``Dataset``) and
    ``source`` (the report's ``starting_point.source``)."""

    model: Any
    init_params: Any
    data: Any
    source: str


def checkpoint_folder(path: str | Path, field: str = "model.checkpoint") -> Path:
    """``path`` as a folder that exists.

    Raises:
      DataError: no such path, or not a folder (named by ``field``).
    """
    folder = Path(path)
    if not folder.exists():
        raise DataError(f"{field}: no such folder {str(path)!r}")
    if not folder.is_dir():
        raise DataError(f"{field}: {str(path)!r} is not a folder")
    return folder


def load_checkpoint(kind: str, folder: Path, policy: Any) -> Any:
    """The checkpoint in ``folder`` as the family ``model.kind = kind`` loads it
    (``CheckpointFamily.load``): ``model``, ``params``, ``tokenizer``, ``config``.

    The family's ``load`` is the one reader of ``config.json`` on the way to a
    model; only when it refuses the folder is the file's ``model_type`` read
    again, to name the family that reads it.

    Raises:
      DataError: the folder's ``config.json`` ``model_type`` is one another family
        reads (named), or as the family's ``load``.
    """
    from dpmp.models.families import FAMILIES, family_reading

    family = FAMILIES.get(kind)
    try:
        return family.load(folder, policy)
    except DataError:
        found = _model_type(folder / "config.json")
        other = None if found in family.model_types else family_reading(found)
        if other is None:
            raise
        raise DataError(
            f"{folder / 'config.json'}: model_type {found!r} is not supported by "
            f"model.kind = {kind!r}; model.kind = {other.name!r} reads it"
        ) from None


def _model_type(path: Path) -> Any:
    """``path``'s ``model_type`` if it is a readable JSON object, else None."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


def start_from_checkpoint(config: Config, *, model: Any, init_params: Any, data: Any) -> Start:
    """The model, starting parameters and data of a run whose ``model.kind`` is read
    from ``model.checkpoint`` (see the module docstring); ``data``: the user's
    ``Dataset``, or None to load ``config.data`` with the checkpoint's tokenizer.

    Raises:
      ConfigError: ``model=`` or ``init_params=`` given too, data that is not
        text, no tokenizer, or records longer than ``n_positions``.
      DataError: a bad checkpoint folder or tokenizer (named).
    """
    from dpmp.models.families import FAMILIES

    kind = config.model.kind
    if model is not None or init_params is not None:
        raise ConfigError(
            f"model.kind: {kind!r} builds the model and its starting parameters from "
            "model.checkpoint; pass model= and init_params= with another model.kind, or neither"
        )
    folder = checkpoint_folder(config.model.checkpoint)
    loaded = load_checkpoint(kind, folder, config.precision)
    n_positions = loaded.config.n_positions
    if data is None:
        tokenizer = _data_tokenizer(config, loaded, folder / TOKENIZER)
        _check_length("data.seq_len", config.data.seq_len, n_positions)
        data = _load_text(config, tokenizer)
    else:
        _check_length("data", int(data.input_shape[-1]), n_positions)
    held = FAMILIES.get(kind).checkpoint.removeprefix("a ").removesuffix(" folder")
    source = f"public pre-trained {held} {folder.name} (no epsilon)"  # no folders
    return Start(loaded.model, loaded.params, data, source)


def _data_tokenizer(config: Config, loaded: Any, own: Path) -> str:
    """The ``tokenizer.json`` that encodes the data: the checkpoint's, or
    ``data.tokenizer`` if it has the same vocabulary."""
    from dpmp.data._tokenizer import load_tokenizer, vocab_size

    given = config.data.tokenizer
    if given is None:
        if loaded.tokenizer is None:
            raise ConfigError(
                f"data.tokenizer: model.checkpoint {config.model.checkpoint!r} has no "
                f"{own.name}; set data.tokenizer to the tokenizer its model was trained with"
            )
        return str(own)
    tokenizer = load_tokenizer(given)
    if loaded.tokenizer is None:
        size, rows = vocab_size(tokenizer), loaded.config.vocab_size
        if size > rows:
            raise DataError(
                f"data.tokenizer: {given!r} has {size} tokens, more than the checkpoint's "
                f"vocab_size {rows} (rows of wte.weight)"
            )
        return given
    ours, theirs = tokenizer.get_vocab(True), loaded.tokenizer.get_vocab(True)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        raise DataError(
            f"data.tokenizer: {given!r} has another vocabulary than the checkpoint's "
            f"{own} ({len(ours)} against {len(theirs)} tokens; token {differ[0][0]!r} differs); "
            "leave data.tokenizer unset to use the checkpoint's"
        )
    return given


def _check_length(field: str, length: int, n_positions: int) -> None:
    if length > n_positions:
        what = "tokens per record" if field == "data.seq_len" else "token positions per record"
        raise ConfigError(
            f"{field}: {length} {what}, more than the checkpoint's n_positions {n_positions} "
            "(its longest sequence)"
        )


def _load_text(config: Config, tokenizer: str) -> Any:
    """``config.data`` encoded by ``tokenizer``; the data set must be text."""
    from dpmp.app.inputs import load_data
    from dpmp.data.sources import SOURCES, TextSource

    if not isinstance(SOURCES.get(config.data.dataset), TextSource):
        texts = ", ".join(repr(s.name) for s in SOURCES if isinstance(s, TextSource))
        raise ConfigError(
            f"data.dataset: model.kind = {config.model.kind!r} trains on text; "
            f"got {config.data.dataset!r} (text: {texts})"
        )
    data_config = dataclasses.replace(config.data, tokenizer=tokenizer)
    return load_data(data_config, config.training.seed)
