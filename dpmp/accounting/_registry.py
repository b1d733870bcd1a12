"""Registries of named variants: accountants here, noise samplers in ``dpmp.noise``.

A variant is an object registered under its ``name``. Built-in variants are
registered as ``"module:attribute"`` paths and loaded on first use, so that
listing the names (the config's choices, the command line's ``--help``)
imports neither JAX nor dp-accounting.
"""

from __future__ import annotations

import importlib
from typing import Any, Generic, TypeVar

__all__ = ["ACCOUNTANT_REGISTRY", "Registry", "accountant_names"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named variants of one kind, in the order they were registered.

    Example:
      >>> r = Registry("colour", {"red": "colorsys:ONE_THIRD"})
      >>> r.names()
      ('red',)
      >>> round(r.get("red"), 3)  # loaded from its module on first use
      0.333
    """

    def __init__(self, kind: str, builtins: dict[str, str] | None = None):
        self.kind = kind
        self._entries: dict[str, T | str] = dict(builtins or {})

    def register(self, variant: T, *, name: str | None = None) -> T:
        """Registers ``variant`` under ``name`` (default ``variant.name``); returns it.

        A name already taken raises ``ValueError``: a variant replaces no other.
        """
        name = variant.name if name is None else name  # type: ignore[attr-defined]
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind}: a name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind}: {name!r} is already registered")
        self._entries[name] = variant
        return variant

    def unregister(self, name: str) -> None:
        """Removes ``name`` (a test's toy variant, say)."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: Any) -> bool:
        return name in self._entries

    def get(self, name: str) -> T:
        """The variant registered as ``name``; ``ValueError`` naming the known ones."""
        try:
            entry = self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.kind} must be one of {self.names()}, got {name!r}.") from None
        if isinstance(entry, str):
            module, attribute = entry.split(":")
            entry = getattr(importlib.import_module(module), attribute)
            self._entries[name] = entry
        return entry


# The accountants dpmp knows (``dpmp.accounting.Accountant``): a new one is a
# module with its object and one line here, or ``register_accountant(obj)``.
ACCOUNTANT_REGISTRY: Registry[Any] = Registry(
    "accountant",
    {"rdp": "dpmp.accounting._rdp:RDP", "pld": "dpmp.accounting._pld:PLD"},
)


def accountant_names() -> tuple[str, ...]:
    """The names of the registered accountants (no import of dp-accounting)."""
    return ACCOUNTANT_REGISTRY.names()
