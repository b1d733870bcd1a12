"""How ``--set section.key=value`` values and a TOML file's numbers become config values."""

from __future__ import annotations

import tomllib
import typing
from typing import Any

__all__ = ["coerce", "parse_value"]


def parse_value(text: str) -> Any:
    """``text`` as a TOML literal (``4``, ``1e-5``, ``"adam"``, ``[128, 128]``, ``true``);
    a bare word is taken as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string


def coerce(section, key: str, value: Any) -> Any:
    """Ints given where floats are expected (``--set privacy.delta=1``) become floats."""
    hints = typing.get_type_hints(section)
    hint = str(hints.get(key, ""))
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and "float" in hint
        and "int" not in hint
    ):
        return float(value)
    return value
