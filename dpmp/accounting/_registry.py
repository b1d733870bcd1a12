"""The registry of accountants (``dpmp.accounting.Accountant``), by name.

A :class:`dpmp._registry.Registry`, the one registry type of every extension
point. The built-in accountants are ``"module:attribute"`` paths loaded on
first use, so that listing the names (the config's choices, the command
line's ``--help``) imports neither JAX nor dp-accounting. A new accountant is
a module with its object and ``register_accountant(obj)``.
"""

from __future__ import annotations

from typing import Any

from dpmp._registry import Registry

__all__ = ["ACCOUNTANT_REGISTRY", "accountant_names"]

# The accountants dpmp knows (``dpmp.accounting.Accountant``): a new one is a
# module with its object and one line here, or ``register_accountant(obj)``.
ACCOUNTANT_REGISTRY: Registry[Any] = Registry(
    "accountant",
    {"rdp": "dpmp.accounting._rdp:RDP", "pld": "dpmp.accounting._pld:PLD"},
)


def accountant_names() -> tuple[str, ...]:
    """The names of the registered accountants (no import of dp-accounting)."""
    return ACCOUNTANT_REGISTRY.names()
