"""``python_docs``: the default private text, the help topics of Python's documentation.

``pydoc_data.topics`` ships with Python; each distinct line of at least
``MIN_LINE`` characters is a record.
"""

from __future__ import annotations

import sys

from dpmp.data._text import MIN_LINE, distinct_lines
from dpmp.data.sources._base import TextSource, register_source

__all__ = ["python_docs_records"]


def python_docs_records() -> tuple[list[str], str]:
    """The default private text: lines of the help topics of Python's documentation."""
    from pydoc_data.topics import topics

    source = (
        f"Python {sys.version.split()[0]} documentation help topics (pydoc_data.topics): "
        f"distinct lines of at least {MIN_LINE} characters"
    )
    return distinct_lines(topics[k] for k in sorted(topics)), source


class PythonDocs:
    """Python's documentation help topics (needs no path)."""

    name = "python_docs"
    needs_path = False

    def records(self, path: str | None, field: str) -> tuple[list[str], str]:
        del path, field  # shipped with Python
        return python_docs_records()


register_source(TextSource(PythonDocs()))
