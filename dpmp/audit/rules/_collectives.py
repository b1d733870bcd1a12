"""Collective rules: cross-device sums (``psum`` and its relatives).

Each gradient operand of an all-reduce is an ``all_reduce`` site, checked
against ``policy.accumulate``. Summing per-example gradients across devices
before they are clipped mixes examples of different devices, so that the clip
bound no longer holds per example: such a site is a violation whatever its
dtype. The outputs keep their operands' values (a sum across devices of the
same shape).
"""

from __future__ import annotations

from dpmp.audit._values import (
    CLIPPED,
    GRAD,
    NORM_LINE,
    NOT_INHERITED,
    REDUCED,
    Value,
    dtype_of,
    is_float,
)
from dpmp.audit.rules._registry import Outs, Step, register

_ALL_REDUCES = (
    "psum",
    "psum2",
    "psum_invariant",
    "reduce_scatter",
    "psum_scatter",
    "all_reduce",
    "pmean",
)
_PER_EXAMPLE = (
    " of PER-EXAMPLE gradients before clipping (examples on different "
    "devices are mixed: the clip bound no longer holds per example)"
)


def _all_reduce(s: Step) -> Outs:
    eqn = s.eqn
    # psum names its axes "axes"; psum_scatter (reduce_scatter) "axis_name"
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    axes = tuple(axes) if isinstance(axes, tuple | list) else (axes,)
    for k, (v, av) in enumerate(zip(eqn.invars, s.ins, strict=False)):
        if av.has(GRAD) and is_float(dtype_of(v)) and not av.has(NORM_LINE):
            per_example = bool(av.bax) and not av.has(CLIPPED | REDUCED)
            s.record(
                "all_reduce",
                dtype_of(v),
                None,
                s.policy.accumulate,
                f"cross-device sum over axes {axes}" + (_PER_EXAMPLE if per_example else ""),
                out_dtype=dtype_of(eqn.outvars[k]),
                key=("all_reduce", s.loc, k),
                violation=per_example,
            )
    outs = []
    for v, av in zip(eqn.outvars, s.ins, strict=False):
        grad = GRAD if s.in_transpose and is_float(dtype_of(v)) else 0
        outs.append(Value((av.flags & ~NOT_INHERITED) | grad, av.bax, av.sq, av.src))
    return outs


register(*_ALL_REDUCES, gradient=_all_reduce)
