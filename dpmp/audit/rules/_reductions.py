"""Reduction rules: which example axes survive a reduction, and whether it sums
over examples.

A ``reduce_sum`` (or ``cumsum``) over an axis that indexes examples, of a
gradient, is a ``batch_reduction`` site; the walker records it from the
``True`` these axes rules return. The other reductions (max, min, product,
arg-max, logical) only drop the reduced axes.
"""

from __future__ import annotations

from dpmp.audit._axes import without_axes
from dpmp.audit._values import shape_of
from dpmp.audit.rules._registry import register

_REDUCTIONS = (
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "argmax",
    "argmin",
    "reduce_and",
    "reduce_or",
)
_CUMULATIVE = ("cumsum", "cumlogsumexp", "cumprod", "cummax", "cummin")


def reduced_axes(eqn) -> tuple:
    """The axes a reduction runs over (``axes``, or ``axis`` for arg-max/min)."""
    p = eqn.params
    if "axes" in p:
        return tuple(p["axes"])
    if "axis" in p:
        return (p["axis"],)
    return ()


def _reduction(eqn, ins):
    axes = reduced_axes(eqn)
    shape = shape_of(eqn.invars[0])
    sums_examples = eqn.primitive.name == "reduce_sum" and any(
        a in ins[0].bax and shape[a] > 1 for a in axes
    )
    return without_axes(ins[0].bax, axes), sums_examples


def _cumulative(eqn, ins):
    sums_examples = eqn.primitive.name == "cumsum" and eqn.params["axis"] in ins[0].bax
    return ins[0].bax, sums_examples


register(*_REDUCTIONS, axes=_reduction)
register(*_CUMULATIVE, axes=_cumulative)
