"""A user's ``tokenizer.json`` (the Hugging Face ``tokenizers`` format), loaded and checked.

``load_tokenizer(path, field=...)`` reads the file and returns a
``tokenizers.Tokenizer``; every problem is one ``DataError`` naming the
config ``field`` that gave the path. ``vocab_size(tokenizer)`` is one more than
its largest token id (added tokens included): every id it produces is below it.
``tokenizers`` is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpmp.data._dataset import DataError

__all__ = ["load_tokenizer", "vocab_size"]


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
