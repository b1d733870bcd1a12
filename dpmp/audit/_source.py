"""Where an equation of a jaxpr came from, read through JAX's public API.

``jax.extend.source_info_util.summarize`` is the public way to name an
equation's innermost user frame (JAX's own files and the standard library are
skipped). It writes ``"file:line:column (function)"`` (``":column"`` left out
when it is 0) or ``""`` when no user frame is known; ``location`` parses
that back into ``file:line``. ``tests/test_audit_rules.py`` pins the format, so
a change in JAX fails a test instead of silently dropping locations.
"""

from __future__ import annotations

import functools
import os
import re

from jax.extend import source_info_util

# Non-greedy file name: "a.py:12:5 (f)" is line 12, column 5, not file "a.py:12".
_SUMMARY = re.compile(r"^(?P<file>.+?):(?P<line>-?\d+)(?::\d+)? \((?P<function>.*)\)$")


def short_path(path: str) -> str:
    """``path`` inside site-packages, relative to the working directory where it is
    below it, else as given."""
    return _short_path(path, os.getcwd())


@functools.lru_cache(maxsize=256)  # one entry per source file; relpath is slow
def _short_path(path: str, cwd: str) -> str:
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    try:
        rel = os.path.relpath(path, cwd)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def location(eqn) -> str:
    """``file:line`` of the user code that wrote ``eqn``, or ``""`` if unknown."""
    match = _SUMMARY.match(source_info_util.summarize(eqn.source_info))
    if match is None:
        return ""
    return f"{short_path(match['file'])}:{match['line']}"


def in_transpose(eqn) -> bool:
    """Whether ``eqn`` was written by a transpose (the backward pass of
    ``jax.grad``/``jax.vjp``): its name stack holds a ``transpose(...)`` scope."""
    return "transpose(" in str(eqn.source_info.name_stack)
