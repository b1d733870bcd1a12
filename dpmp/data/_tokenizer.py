"""A user's ``tokenizer.json`` (the Hugging Face ``tokenizers`` format), loaded and checked.

``load_tokenizer(path, field=...)`` reads the file and returns a
``tokenizers.Tokenizer``; every problem is one ``DataError`` naming the
config ``field`` that gave the path. ``vocab_size(tokenizer)`` is one more than
its largest token id (added tokens included): every id it produces is below it.
``checkpoint_tokenizer`` reads a checkpoint folder's ``tokenizer.json`` against
the model's vocabulary, and ``pad_token_id`` finds its padding token.
``tokenizers`` is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpmp.data._dataset import DataError

__all__ = ["checkpoint_tokenizer", "load_tokenizer", "pad_token_id", "vocab_size"]

TOKENIZER = "tokenizer.json"


def load_tokenizer(path: str | Path | None, field: str = "data.tokenizer") -> Any:
    """The ``tokenizers.Tokenizer`` saved at ``path`` (a ``tokenizer.json``).

    Raises:
      DataError: no such file, or the file is not a tokenizer (its JSON or its
        contents); the message names ``field`` and the file.
    """
    from tokenizers import Tokenizer

    file = Path(str(path))
    if not file.is_file():
        what = "is not a regular file" if file.exists() else "no such file"
        raise DataError(f"{field}: {what} {str(file)!r}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception with the parser's message
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{field}: {str(file)!r} is not a tokenizer.json ({reason})") from None
    if vocab_size(tokenizer) < 2:
        raise DataError(f"{field}: {str(file)!r} has {vocab_size(tokenizer)} token ids; need 2")
    return tokenizer


def vocab_size(tokenizer: Any) -> int:
    """One more than the largest token id of ``tokenizer``, its added tokens included
    (its number of tokens, unless its ids have gaps)."""
    return 1 + max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)


def checkpoint_tokenizer(folder: str | Path, vocab_size_: int | None, embedding: str) -> Any:
    """``folder/tokenizer.json`` of a checkpoint as a ``tokenizers.Tokenizer``; None
    without one.

    Args:
      vocab_size_: the rows of the model's token embedding (None: not checked).
      embedding: the embedding's tensor name, for the message (``"wte.weight"``).

    Raises:
      DataError: not a tokenizer file, or it has more tokens than ``vocab_size_``.
    """
    path = Path(folder) / TOKENIZER
    if not path.is_file():
        return None
    tokenizer = load_tokenizer(path, field="checkpoint")
    size = vocab_size(tokenizer)  # one more than its largest token id
    if vocab_size_ is not None and size > vocab_size_:
        raise DataError(
            f"{path}: {size} tokens, more than the model's vocab_size {vocab_size_} "
            f"(rows of {embedding})"
        )
    return tokenizer


def pad_token_id(tokenizer: Any) -> int | None:
    """The id of ``tokenizer``'s ``<pad>`` or ``[PAD]`` token, or None without one."""
    found = [tokenizer.token_to_id(t) for t in ("<pad>", "[PAD]")]
    return next((i for i in found if i is not None), None)
