"""Contraction rules: ``dot_general`` and ``conv_general_dilated``.

Each maps the example axes of both operands to the output, and reports a sum
over examples when it contracts an axis that indexes examples (the walker then
records a ``batch_reduction`` site, with ``preferred_element_type`` as the
accumulation dtype). A ``dot_general`` of a gradient with itself is a sum of
squares (see ``dpmp.audit.rules._norms``).
"""

from __future__ import annotations

from dpmp.audit._values import shape_of
from dpmp.audit.rules._registry import register


def _dot_general(eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    lr, rr = len(shape_of(lhs)), len(shape_of(rhs))
    lfree = [a for a in range(lr) if a not in lc and a not in lb]
    rfree = [a for a in range(rr) if a not in rc and a not in rb]
    la, ra = ins[0].bax, ins[1].bax
    out = set()
    for k, (a, b) in enumerate(zip(lb, rb, strict=True)):
        if a in la or b in ra:
            out.add(k)
    for k, a in enumerate(lfree):
        if a in la:
            out.add(len(lb) + k)
    for k, b in enumerate(rfree):
        if b in ra:
            out.add(len(lb) + len(lfree) + k)
    lshape, rshape = shape_of(lhs), shape_of(rhs)
    contracted = any(a in la and lshape[a] > 1 for a in lc) or any(
        b in ra and rshape[b] > 1 for b in rc
    )
    return frozenset(out), contracted


def _conv(eqn, ins):
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    grouped = eqn.params.get("feature_group_count", 1) > 1 or (
        eqn.params.get("batch_group_count", 1) > 1
    )
    la, ra = ins[0].bax, ins[1].bax
    out = set()
    if lhs_spec[0] in la:
        out.add(out_spec[1] if eqn.params.get("batch_group_count", 1) > 1 else out_spec[0])
    if rhs_spec[0] in ra or (grouped and lhs_spec[1] in la):
        out.add(out_spec[1])
    contracted = not grouped and (lhs_spec[1] in la or rhs_spec[1] in ra)
    return frozenset(out), contracted


register("dot_general", axes=_dot_general)
register("conv_general_dilated", axes=_conv)
