"""Layout rules: where the example axes go when data is moved, not computed.

``transpose``, ``broadcast_in_dim``, ``reshape``, ``squeeze`` and
``expand_dims`` carry their input's flags unchanged (the walker's default);
these rules only say which output axes index examples.
"""

from __future__ import annotations

from dpmp.audit._axes import right_aligned, without_axes
from dpmp.audit._values import shape_of
from dpmp.audit.rules._registry import register


def _transpose(eqn, ins):
    perm = eqn.params["permutation"]
    return frozenset(j for j, a in enumerate(perm) if a in ins[0].bax), False


def _broadcast_in_dim(eqn, ins):
    dims = eqn.params["broadcast_dimensions"]
    in_shape = shape_of(eqn.invars[0])
    return frozenset(dims[a] for a in ins[0].bax if a < len(dims) and in_shape[a] > 1), False


def reshaped_axes(bax, in_shape, out_shape, dimensions=None) -> frozenset:
    """Output axes of a reshape that share elements with an input batch axis
    (``dimensions``: the input's axes in the order they are read)."""
    if not bax:
        return frozenset()
    if dimensions is not None:
        in_shape = tuple(in_shape[d] for d in dimensions)
        bax = frozenset(i for i, d in enumerate(dimensions) if d in bax)

    def intervals(shape):
        out, acc = [], 1
        for s in shape:
            out.append((acc, acc * s))
            acc *= s
        return out

    ins, outs = intervals(in_shape), intervals(out_shape)
    res = set()
    for a in bax:
        lo, hi = ins[a]
        if hi <= lo:  # size-1 axis carries nothing
            continue
        for j, (olo, ohi) in enumerate(outs):
            if ohi > olo and max(lo, olo) < min(hi, ohi):
                res.add(j)
    return frozenset(res)


def _reshape(eqn, ins):
    in_shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    return reshaped_axes(ins[0].bax, in_shape, out_shape, eqn.params.get("dimensions")), False


def _squeeze(eqn, ins):
    return without_axes(ins[0].bax, eqn.params["dimensions"]), False


def _expand_dims(eqn, ins):
    return right_aligned(ins[0].bax, shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])), False


register("transpose", axes=_transpose)
register("broadcast_in_dim", axes=_broadcast_in_dim)
register("reshape", axes=_reshape)
register("squeeze", axes=_squeeze)
register("expand_dims", axes=_expand_dims)
