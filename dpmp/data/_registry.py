"""A registry of named variants: the extension point behind a config choice.

A variant is an object with a ``name``; ``registry.register(variant)`` makes
that name a valid choice (config validation and the allowed values it lists
read ``registry.names()`` when they run), ``registry.get(name)`` finds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["Named", "Registry"]


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    """Variants by name, in registration order.

    Args:
      what: what a variant is, for error messages (``"data source"``).
    """

    def __init__(self, what: str):
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, variant: T, *, replace: bool = False) -> T:
        """Adds ``variant`` under ``variant.name`` and returns it.

        Raises:
          ValueError: the name is not a non-empty string, or is taken and
            ``replace`` is false.
        """
        name = getattr(variant, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what}: a variant needs a non-empty string name, got {name!r}")
        if name in self._items and not replace:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._items[name] = variant
        return variant

    def unregister(self, name: str) -> None:
        """Removes ``name`` (a registered name)."""
        del self._items[name]

    def get(self, name: str) -> T:
        """The variant called ``name``.

        Raises:
          ValueError: no such variant; the message lists the registered names.
        """
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self.what} {name!r}; registered: {', '.join(self._items)}"
            ) from None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._items)

    def __iter__(self) -> Iterator[T]:
        """The registered variants, in registration order."""
        return iter(tuple(self._items.values()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items
