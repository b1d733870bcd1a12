"""``python_stdlib``: the default PUBLIC text, the docstrings of Python's standard library.

Modules', classes' and functions' docstrings are parsed from the library's
source files (not imported), which ship with Python; tests and programs
(``idlelib``, ``lib2to3``, ...) are left out. The lines that are also
records of ``python_docs``, the default private text, are left out too (25 of
27,423 under Python 3.11), so that pre-training on this public text reads no
private record of the default language-model run.
"""

from __future__ import annotations

import ast
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dpmp.data._text import MIN_LINE, distinct_lines
from dpmp.data.sources._base import register_public_text
from dpmp.data.sources._python_docs import python_docs_records

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
    private = set(python_docs_records()[0])
    records = [
        line
        for line in distinct_lines(doc for file in files for doc in _docstrings(file))
        if line not in private
    ]
    source = (
        f"Python {sys.version.split()[0]} standard library docstrings ({len(files)} source "
        f"files): distinct lines of at least {MIN_LINE} characters, less the lines of "
        "python_docs (the default private text)"
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
