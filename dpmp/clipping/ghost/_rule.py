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
from typing import Annotated, Any, Protocol

import jax
import jax.numpy as jnp

from dpmp._registry import Registry

__all__ = [
    "RULES",
    "GhostRule",
    "PerExampleRule",
    "Unsupported",
    "is_float",
    "register_rule",
    "registered_rules",
    "rule_for",
    "supported",
]

Eqn = Annotated[Any, "jax.extend.core.JaxprEqn: the layer's equation"]
# The arrays a rule reads and returns, by shape (B: the batch's examples).
Batched = Annotated[jax.Array, "[B, ...]: per example, laid out as the layer's operand"]
Example = Annotated[jax.Array, "[...]: one example's, laid out as the layer's operand"]
PerExample = Annotated[jax.Array, "[B]: one value per example"]
Keep = Annotated[jax.Array, "bool[B]: the examples that count"]
Operand = Annotated[jax.Array, "the parameter operand's shape (operand pos)"]


class OperandGrad(Protocol):
    """A rule's ``operand_grad``: one example's gradient of the parameter operand."""

    def __call__(self, eqn: Eqn, pos: int, a: Example, g: Example, dtype: Any) -> Operand: ...


class ClippedSum(Protocol):
    """A rule's ``clipped_sum``: the clip-weighted sum over the batch, in ``out_dtype``."""

    def __call__(
        self,
        eqn: Eqn,
        pos: int,
        a: Batched,
        g: Batched,
        factor: PerExample,
        keep: Keep,
        before: Any,
        dtype: Any,
        out_dtype: Any,
    ) -> Operand: ...


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
    operand_grad: OperandGrad | None
    clipped_sum: ClippedSum | None
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

    def magnitude_ratio(self, eqn: Eqn, pos: int, dtype: Any, wide_dtype: Any) -> float:
        """``lambda``: the computed magnitude ``m`` is at least ``lambda sum_t |x_t|
        |g_t|`` (exact); see ``dpmp.clipping.ghost.GhostPlan.sum_rounding``."""
        ...

    def sq_norms(
        self, eqn: Eqn, pos: int, a: Batched, g: Batched, dtype: Any, wide_dtype: Any
    ) -> tuple[PerExample, PerExample]:
        """``(sq, m)``: per example, the squared norm of the parameter's
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


# primitive name -> the rule of the layer family that takes a parameter in it
RULES: Registry[GhostRule] = Registry("ghost rule", protocol=GhostRule)


def register_rule(rule: GhostRule, *, replace: bool = False) -> GhostRule:
    """Make ``rule`` the one for each of its ``primitives``; returns it.

    Raises:
      TypeError: ``rule`` lacks a member of ``GhostRule`` (named).
      ValueError: a primitive already has another rule and ``replace`` is false;
        then no primitive is registered.
    """
    RULES.check(rule)
    for p in rule.primitives:
        if RULES.find(p) not in (None, rule) and not replace:
            RULES.register(rule, name=p)  # refused: names the taken primitive
    for p in rule.primitives:
        RULES.register(rule, name=p, replace=True)
    return rule


def rule_for(primitive: str) -> GhostRule | None:
    """The rule of the layer family that takes a parameter in ``primitive``, if any."""
    return RULES.find(primitive)


def registered_rules() -> dict[str, GhostRule]:
    """A copy of the registry: primitive name -> rule."""
    return dict(zip(RULES.names(), RULES, strict=True))


def supported() -> str:
    """The registered families, as the message naming what is supported lists them."""
    return ", ".join(dict.fromkeys(r.described for r in RULES))
