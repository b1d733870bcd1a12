"""Norm rules: the per-example norm and the clip, checked against ``policy.clip``.

A norm is followed along its lineage: squares of a gradient (``SQUARE``:
``square``, ``integer_pow`` with ``y=2``, ``x * x``), their sum (``SQSUM``: a
``reduce_sum`` of squares, or a ``dot_general`` of a gradient with itself),
its square root (``NORM``), what is computed from the norm alone (the clip
factor; the walker keeps it on the lineage), and the clip factor applied to
the gradient (``mul``/``div``, giving ``CLIPPED``). Each of these is a
``norm`` site.
"""

from __future__ import annotations

from dpmp.audit._values import (
    CLIPPED,
    GRAD,
    NOISY,
    NORM,
    NORM_LINE,
    REDUCED,
    SQSUM,
    SQUARE,
    is_literal,
    narrowest,
)
from dpmp.audit.rules._registry import Outs, Step, register

# Flags a square, or a sum of squares, no longer carries: it is a norm's lineage now.
_LEAVES_GRADIENT = GRAD | CLIPPED | NOISY | REDUCED | NORM_LINE


def _is_square(s: Step) -> bool:
    """``square(g)``, ``integer_pow(g, 2)`` or ``g * g`` of a gradient ``g``."""
    if not s.ins[0].has(GRAD):
        return False
    if s.name == "square":
        return True
    if s.name == "integer_pow":
        return s.eqn.params.get("y") == 2
    invars = s.eqn.invars
    return len(invars) == 2 and invars[0] is invars[1] and not is_literal(invars[0])


def _square(s: Step) -> Outs | None:
    if not _is_square(s):
        return None
    flags = (s.flags & ~_LEAVES_GRADIENT) | SQUARE
    return s.outs(flags, narrowest(narrowest(s.sq, s.in_dtypes[0]), s.out_dtype), ())


def _sum_of_squares(s: Step, in_dtype) -> Outs:
    s.record(
        "norm",
        in_dtype,
        s.eqn.params.get("preferred_element_type") or s.out_dtype,
        s.policy.clip,
        "sum of squares of a gradient (norm)",
    )
    flags = (s.flags & ~_LEAVES_GRADIENT) | SQSUM
    return s.outs(flags, narrowest(s.sq, s.out_dtype), ())


def _reduce_sum(s: Step) -> Outs | None:
    if not (s.out_float and s.ins[0].has(SQUARE)):
        return None
    return _sum_of_squares(s, narrowest(s.ins[0].sq, s.in_dtypes[0]))


def _self_dot(s: Step) -> Outs | None:
    lhs, rhs = s.eqn.invars
    if not (lhs is rhs and not is_literal(lhs) and s.ins[0].has(GRAD) and s.out_float):
        return None
    return _sum_of_squares(s, s.in_dtypes[0])


def _root(s: Step) -> Outs | None:
    x = s.ins[0]
    if x.has(SQUARE) and not x.has(SQSUM | NORM):
        # elementwise root of squares (e.g. Adam's second moment): not a norm
        return s.outs(s.flags & ~SQUARE, None, s.src)
    if not x.has(SQSUM):
        return None
    s.record("norm", s.in_dtypes[0], None, s.policy.clip, "square root of a sum of squares (norm)")
    flags = (s.flags & ~(SQUARE | SQSUM)) | NORM
    return s.outs(flags, narrowest(s.sq, s.out_dtype), ())


def _clip(s: Step) -> Outs | None:
    """A gradient multiplied or divided by a norm's descendant (the clip factor)."""
    norm_ops = [av.has(NORM) for av in s.ins]
    grad_ops = s.grad_operands
    if not (any(norm_ops) and any(grad_ops)):
        return None
    gi, ni = grad_ops.index(True), norm_ops.index(True)
    s.record(
        "norm",
        s.in_dtypes[gi],
        s.in_dtypes[ni],
        s.policy.clip,
        "clip factor applied to a gradient",
    )
    return s.outs((s.flags & ~NORM_LINE) | GRAD | CLIPPED, None, s.src)


def _mul(s: Step) -> Outs | None:
    outs = _square(s)
    return outs if outs is not None else _clip(s)


def _division_by_norm(s: Step) -> None:
    if len(s.ins) == 2 and s.ins[1].has(NORM):
        s.record("norm", s.in_dtypes[1], None, s.policy.clip, "division by a norm (clip factor)")


register("square", "integer_pow", norm=_square)
register("mul", norm=_mul)
register("reduce_sum", norm=_reduce_sum)
register("dot_general", norm=_self_dot)
register("sqrt", "rsqrt", norm=_root)
register("div", norm=_clip, of_norm=_division_by_norm)
