"""``text``: a user's ``.txt`` (one record per non-empty line) or ``.jsonl``
(one ``{"text": ...}`` object per line) file.

It serves both as private data (``data.dataset = "text"``) and as public
text for pre-training (``pretrain.dataset = "text"``).
"""

from __future__ import annotations

from dpmp.data._text import read_text_file
from dpmp.data.sources._base import TextSource, register_public_text, register_source


class TextFile:
    """The records of the text file at ``path``."""

    name = "text"
    needs_path = True

    def records(self, path: str | None, field: str) -> tuple[list[str], str]:
        return read_text_file(path, field)


register_source(TextSource(TextFile()))
register_public_text(TextFile())
