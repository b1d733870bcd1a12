"""``python_stdlib``: the default PUBLIC text, the docstrings of Python's standard library.

Modules', classes' and functions' docstrings are parsed from the library's
source files (not imported), which ship with Python; tests and programs
(``idlelib``, ``lib2to3``, ...) are left out. It shares 25 of its 27,423
lines with ``python_docs`` (Python 3.11).
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dpmp.data._text import MIN_LINE, distinct_lines
from dpmp.data.sources._base import register_public_text

__all__ = ["python_stdlib_records"]

# Folders of the standard library left out of the public corpus: tests, and
# programs rather than library modules.
_STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "lib2to3", "__phello__", "site-packages"})
_KINDS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def python_stdlib_records() -> tuple[list[str], str]:
    """The default PUBLIC text: lines of the docstrings of Python's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not _STDLIB_SKIP & set(p.relative_to(root).parts)
    )
    records = distinct_lines(doc for file in files for doc in _docstrings(file))
    source = (
        f"Python {sys.version.split()[0]} standard library docstrings ({len(files)} source "
        f"files): distinct lines of at least {MIN_LINE} characters"
    )
    return records, source


def _docstrings(file: Path) -> Iterator[str]:
    try:
        tree = ast.parse(file.read_bytes())
    except (SyntaxError, ValueError, OSError):  # a broken or unreadable file: skip it
        return
    for node in ast.walk(tree):
        if isinstance(node, _KINDS) and (doc := ast.get_docstring(node)):
            yield doc


class PythonStdlib:
    """The standard library's docstrings (needs no path)."""

    name = "python_stdlib"
    needs_path = False

    def records(self, path: str | None, field: str) -> tuple[list[str], str]:
        del path, field  # shipped with Python
        return python_stdlib_records()


register_public_text(PythonStdlib())
