"""The extension point of ghost clipping: one rule per layer family, in a registry.

A rule says, for the equation of the per-example jaxpr that consumes a
parameter (``eqn``, with the parameter as operand ``pos``), what kind of layer
it is and whether the family's ghost norm holds for it; and, where it does,
how that norm is taken from the layer's input ``x_i`` and output gradient
``g_i`` alone. Rules are looked up by the equation's primitive name.

A family without a ghost norm (a bias, a norm scale) is a
``PerExampleRule``: its layer's per-example gradient is formed and normed
like any other. A new family is one module with its rule and one
``register_rule`` call in ``dpmp.clipping.ghost``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

__all__ = [
    "GhostRule",
    "PerExampleRule",
    "Unsupported",
    "is_float",
    "register_rule",
    "registered_rules",
    "rule_for",
    "supported",
]

Eqn = Any  # a ``jax.extend.core.JaxprEqn``


class Unsupported(ValueError):
    """The model has a parameterised operation ghost clipping has no rule for."""


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


class GhostRule(Protocol):
    """One layer family's rule.

    Attributes:
      primitives: the jaxpr primitives whose parameter operand the family takes
        (``"dot_general"``, ``"gather"``, ...): the registry's keys.
      described: the family as the message naming what is supported says it.
      norm: the norm rule's name in ``PrivateGradFn.explain()`` (``"gram"``, ...)
        where the ghost norm is used; ``"per-example"`` otherwise.
      operand_grad: ``operand_grad(eqn, pos, act, g, dtype) -> array`` (one
        example, laid out as operand ``pos``), a faster form of the layer's
        per-example gradient than the vjp of the layer; or ``None``.
      clipped_sum: ``clipped_sum(eqn, pos, a, g, factor, keep, before, dtype,
        out_dtype) -> array`` (laid out as operand ``pos``, in ``out_dtype``):
        ``sum_i factor_i`` (gradient from ``a_i``, ``g_i``), rows of examples not in
        ``keep`` adding exactly 0, read after ``before`` (see
        ``dpmp.clipping._weighted.after``); or ``None``: the vjp of the layer,
        weighted, on zero-filled operands.
      half_operands: whether ``sq_norms``, ``operand_grad`` and ``clipped_sum`` read
        bf16/fp16 operands as they are (their bounds hold for such operands), so
        the driver need not widen them first; False: it widens them.

    A rule is for a primitive of two inputs, the parameter (operand ``pos``) and
    the layer's input (operand ``1 - pos``): a parameter reaching a primitive of
    one input (``exp``) is refused in one line (``Unsupported``).
    """

    primitives: tuple[str, ...]
    described: str
    norm: str
    operand_grad: Callable[..., jax.Array] | None
    clipped_sum: Callable[..., jax.Array] | None
    half_operands: bool

    def classify(self, eqn: Eqn, pos: int, bijective: bool, path: str) -> tuple[str, bool]:
        """``(layer kind, ghost)``: the readable kind (``"dense"``), and whether the
        family's ghost norm holds for this layer (``bijective``: the parameter reaches
        it through layout operations that keep every entry once). Raises
        ``Unsupported`` naming ``path`` where no gradient can be formed."""
        ...

    def mode(self, eqn: Eqn, pos: int) -> str:
        """``"ghost"`` (the norm from stored ``x_i``, ``g_i``) or ``"example"`` (the
        layer's own per-example gradient, formed inside the backward pass), for a
        layer ``classify`` accepted: whichever is cheaper and keeps its bound."""
        ...

    def rows(self, eqn: Eqn, pos: int) -> int:
        """The rows one example adds to the layer's contraction over the batch
        (tokens, patches, ids)."""
        ...

    def magnitude_ratio(self, eqn: Eqn, pos: int, dtype, wide_dtype) -> float:
        """``lambda``: the computed magnitude ``m`` is at least ``lambda sum_t |x_t|
        |g_t|`` (exact); see ``dpmp.clipping.ghost.GhostPlan.sum_rounding``."""
        ...

    def sq_norms(self, eqn: Eqn, pos: int, a, g, dtype, wide_dtype) -> tuple[jax.Array, jax.Array]:
        """``(sq, m)``, each ``[B]``: per example, the squared norm of the parameter's
        gradient PLUS a bound on its rounding error (never below the exact one), and
        the magnitude ``sum_t |x_t| |g_t|``, from the batch's inputs ``a`` and unscaled
        output gradients ``g`` (``dtype``; sums of squares in ``wide_dtype``)."""
        ...


@dataclasses.dataclass(frozen=True)
class PerExampleRule:
    """A layer family without a ghost norm: its per-example gradient is formed,
    inside the backward pass (or after it, from the stored operand, when the
    layer's other operand is an integer array), and normed like any other.

    Attributes:
      primitives: the primitives the family takes its parameter in.
      kind: the layer kind ``explain()`` reports (``"bias"``).
      described: the family in the message naming what is supported.
    """

    primitives: tuple[str, ...]
    kind: str
    described: str
    norm = "per-example"
    operand_grad = None
    clipped_sum = None
    half_operands = False

    def classify(self, eqn: Eqn, pos: int, bijective: bool, path: str) -> tuple[str, bool]:
        return self.kind, False

    def _no_ghost_norm(self, *args, **kwargs):
        """Never called: ``classify`` says the family has no ghost norm."""
        raise NotImplementedError(f"{self.kind}: no ghost norm")

    mode = rows = magnitude_ratio = sq_norms = _no_ghost_norm


_RULES: dict[str, GhostRule] = {}
# What the driver reads of a rule (GhostRule's attributes and methods).
_MEMBERS = (
    "primitives",
    "described",
    "norm",
    "operand_grad",
    "clipped_sum",
    "half_operands",
    "classify",
    "mode",
    "rows",
    "magnitude_ratio",
    "sq_norms",
)


def register_rule(rule: GhostRule, *, replace: bool = False) -> GhostRule:
    """Make ``rule`` the one for each of its primitives; returns it.

    Raises ``ValueError`` when a primitive already has a rule, unless ``replace``,
    and ``TypeError`` naming what ``rule`` lacks of ``GhostRule``.
    """
    missing = [m for m in _MEMBERS if not hasattr(rule, m)]
    if missing:
        raise TypeError(f"ghost rule {rule!r}: lacks {', '.join(missing)} (see GhostRule)")
    taken = [p for p in rule.primitives if p in _RULES and _RULES[p] is not rule]
    if taken and not replace:
        raise ValueError(
            f"ghost rule for {', '.join(taken)} already registered "
            f"({_RULES[taken[0]].described}); pass replace=True to override it"
        )
    for p in rule.primitives:
        _RULES[p] = rule
    return rule


def rule_for(primitive: str) -> GhostRule | None:
    """The rule of the layer family that takes a parameter in ``primitive``, if any."""
    return _RULES.get(primitive)


def registered_rules() -> dict[str, GhostRule]:
    """A copy of the registry: primitive name -> rule."""
    return dict(_RULES)


def supported() -> str:
    """The registered families, as the message naming what is supported lists them."""
    return ", ".join(dict.fromkeys(r.described for r in _RULES.values()))
