"""The one registry type behind every extension point: variants of one kind by name.

Accountants, noise samplers, data sources, public texts, model families, ghost
rules, audit rules and ``dpmp`` commands are each a ``Registry``. A
variant is an object; ``registry.register(variant)`` makes its name a valid
choice everywhere that name is read (the config, the command line, the error
messages, the docs' key table read ``registry.names()`` when they run), and
``registry.get(name)`` finds it. Decisions about a variant are asked of the
object it returns, never of its name.

Built-in variants may be given as ``"module:attribute"`` paths, imported when
first needed, so that listing the names (the config's choices, ``--help``)
imports neither JAX nor dp-accounting. This module sits below every layer and
imports nothing of dpmp.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "members"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Variants of one kind, by name, in the order they were registered.

    Args:
      kind: what a variant is, for messages (``"data source"``, ``"accountant"``).
      builtins: ``{name: "module:attribute"}``: built-in variants, loaded from
        their modules when first got (or iterated over).
      protocol: the class that declares every attribute and method the driver
        reads of a variant (a ``typing.Protocol``, a dataclass): a variant lacking
        one is refused in one line naming the variant and what it lacks, when it
        is registered or loaded.

    Example:
      >>> r = Registry("colour", {"third": "colorsys:ONE_THIRD"})
      >>> r.names(), "third" in r
      (('third',), True)
      >>> round(r.get("third"), 3)  # loaded from its module on first use
      0.333
      >>> r.get("red")
      Traceback (most recent call last):
        ...
      ValueError: colour must be one of ('third',), got 'red'.
    """

    def __init__(
        self,
        kind: str,
        builtins: Mapping[str, str] | None = None,
        *,
        protocol: type | None = None,
    ):
        self.kind = kind
        self.protocol = protocol
        self.members = () if protocol is None else members(protocol)
        self._entries: dict[str, T | _Lazy] = {n: _Lazy(p) for n, p in (builtins or {}).items()}

    def register(self, variant: T, *, name: str | None = None, replace: bool = False) -> T:
        """Registers ``variant`` under ``name`` (default ``variant.name``); returns it.

        Raises:
          TypeError: the variant lacks a member of ``protocol`` (named).
          ValueError: the name is not a non-empty string, or it is taken and
            ``replace`` is false (a variant replaces another only when asked).
        """
        self.check(variant)
        name = getattr(variant, "name", None) if name is None else name
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind}: a name must be a non-empty string, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(
                f"{self.kind} {name!r} is already registered; pass replace=True to replace it"
            )
        self._entries[name] = variant
        return variant

    def unregister(self, name: str) -> T | None:
        """Removes ``name`` (a test's toy variant, say) and returns its variant
        (None for a built-in never loaded).

        Raises:
          ValueError: ``name`` is not registered (the message lists the names).
        """
        if name not in self:
            raise self._unknown(name)
        entry = self._entries.pop(name)
        return None if isinstance(entry, _Lazy) else entry

    def get(self, name: str) -> T:
        """The variant registered as ``name``.

        Raises:
          ValueError: no such name; the message names the kind, the name asked
            for and the registered names.
        """
        try:
            entry = self._entries[name]
        except (KeyError, TypeError):
            raise self._unknown(name) from None
        if isinstance(entry, _Lazy):
            entry = entry.load()
            self.check(entry)
            self._entries[name] = entry
        return entry

    def check(self, variant: Any) -> None:
        """Raises ``TypeError`` naming the variant and each member of ``protocol`` it lacks."""
        missing = [m for m in self.members if not hasattr(variant, m)]
        if missing:
            name = getattr(variant, "name", None)
            label = type(variant).__name__ + (f" {name!r}" if isinstance(name, str) else "")
            raise TypeError(
                f"{self.kind}: {label} lacks {', '.join(missing)} "
                f"(see {self.protocol.__qualname__})"
            )

    def find(self, name: Any) -> T | None:
        """The variant registered as ``name``, or None."""
        return self.get(name) if name in self else None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (loads nothing)."""
        return tuple(self._entries)

    def copy(self) -> Registry[T]:
        """A registry of the same kind holding the same entries (a test's scratch copy)."""
        out: Registry[T] = Registry(self.kind, protocol=self.protocol)
        out._entries = dict(self._entries)
        return out

    def __iter__(self) -> Iterator[T]:
        """The registered variants, in registration order (built-ins loaded)."""
        return iter([self.get(name) for name in self.names()])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"

    def _unknown(self, name: Any) -> ValueError:
        return ValueError(f"{self.kind} must be one of {self.names()}, got {name!r}.")


def members(protocol: type) -> tuple[str, ...]:
    """The public attributes and methods ``protocol`` and its bases declare, in order.

    Example:
      >>> import typing
      >>> class Named(typing.Protocol):
      ...     name: str
      ...     def load(self, path: str) -> bytes: ...
      >>> members(Named)
      ('name', 'load')
    """
    found: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or cls.__module__ in ("typing", "typing_extensions", "abc"):
            continue
        for name in (*vars(cls).get("__annotations__", {}), *vars(cls)):
            if not name.startswith("_"):
                found[name] = None
    return tuple(found)


class _Lazy:
    """A built-in variant not yet loaded: its ``"module:attribute"`` path."""

    def __init__(self, path: str):
        module, sep, attribute = path.partition(":")
        if not (module and sep and attribute):
            raise ValueError(f"a built-in is 'module:attribute', got {path!r}")
        self.module, self.attribute = module, attribute

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.attribute)
