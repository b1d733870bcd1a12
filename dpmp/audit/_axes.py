"""How the axes that index examples move from an equation's inputs to its output.

Batch axes start at axis 0 of every batch leaf (see
``dpmp.audit._jaxpr.example_axes``) and follow the data through
elementwise operations, broadcasts and sub-jaxpr boundaries (this module) and
through reshapes, transposes, reductions, dot products and convolutions (the
``axes`` stage of the rules in ``dpmp.audit.rules``).
"""

from __future__ import annotations

from collections.abc import Sequence

from dpmp.audit._values import Value, shape_of


def right_aligned(bax: frozenset, in_shape: tuple, out_shape: tuple) -> frozenset:
    """Batch axes of ``in_shape`` carried to ``out_shape`` by numpy broadcasting:
    same rank keeps them; otherwise the trailing axes of equal size are matched."""
    if not bax:
        return frozenset()
    if len(in_shape) == len(out_shape):
        return frozenset(a for a in bax if a < len(out_shape))
    res = set()
    i, j = len(in_shape) - 1, len(out_shape) - 1
    while i >= 0 and j >= 0 and in_shape[i] == out_shape[j]:
        if i in bax:
            res.add(j)
        i, j = i - 1, j - 1
    return frozenset(res)


def without_axes(bax: frozenset, axes: Sequence[int]) -> frozenset:
    """Batch axes left after ``axes`` are removed (by a reduction or a squeeze)."""
    axes = set(axes)
    res = set()
    for a in bax:
        if a in axes:
            continue
        res.add(a - sum(1 for r in axes if r < a))
    return frozenset(res)


def elementwise(eqn, ins: Sequence[Value]) -> tuple[frozenset, bool]:
    """The axes of any primitive without an ``axes`` rule: the union of the batch
    axes of the inputs of the output's rank, or the first input's axes
    right-aligned to the output. Never a sum over examples."""
    out_vars = eqn.outvars
    if not out_vars:
        return frozenset(), False
    out_shape = shape_of(out_vars[0])
    if len(shape_of(eqn.invars[0]) if eqn.invars else ()) == len(out_shape):
        res = frozenset()
        for v, av in zip(eqn.invars, ins, strict=False):
            if av.bax and len(shape_of(v)) == len(out_shape):
                res |= av.bax
        return res, False
    if eqn.invars:
        return right_aligned(ins[0].bax, shape_of(eqn.invars[0]), out_shape), False
    return frozenset(), False
