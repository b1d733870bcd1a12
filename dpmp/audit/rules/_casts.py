"""Cast rules: ``convert_element_type`` of a value that carries a guarantee.

A cast that narrows below the policy is a site of the kind whose value it
rounds: a norm or clip factor below ``clip`` (``norm``), a noisy gradient
below ``noise`` (``noise_add``, naming where the noise was added), a sum of
gradients over examples below ``accumulate`` (``batch_reduction``), and new
parameters below the parameter dtype (``update``). A widening cast of a
parameter leaf is still the parameter.
"""

from __future__ import annotations

from dpmp.audit._values import IS_PARAM, NOISY, REDUCED, UPDATED, bits
from dpmp.audit.rules._registry import Step, register


def _norm_cast(s: Step) -> None:
    out, clip = s.out_dtype, s.policy.clip
    if s.out_float and bits(out) < bits(clip) and bits(out) < bits(s.in_dtypes[0]):
        message = "norm or clip factor cast below the clip dtype"
        s.record("norm", s.in_dtypes[0], None, clip, message)


def _protected_cast(s: Step) -> None:
    in_dtype, out, x = s.in_dtypes[0], s.out_dtype, s.ins[0]
    if not s.out_float or in_dtype is None:
        return
    narrowing = bits(out) < bits(in_dtype)
    pol = s.policy
    if narrowing and x.has(NOISY) and bits(out) < bits(pol.noise):
        origin = ", ".join(x.src) if x.src else "?"
        s.record(
            "noise_add",
            in_dtype,
            None,
            pol.noise,
            f"noisy gradient cast below the noise dtype after the noise addition at {origin}",
        )
        s.flags &= ~NOISY
        s.src = ()
    if narrowing and x.has(REDUCED) and not x.has(NOISY) and bits(out) < bits(pol.accumulate):
        s.record(
            "batch_reduction",
            in_dtype,
            None,
            pol.accumulate,
            "sum of gradients over examples rounded below the accumulate dtype",
        )
        s.flags &= ~REDUCED
    if narrowing and x.has(UPDATED) and not x.has(IS_PARAM):
        required = s.walker.param_dtype or pol.param
        if bits(out) < bits(required):
            s.record(
                "update", in_dtype, None, required, "new parameters cast below the parameter dtype"
            )
    if x.has(IS_PARAM) and not narrowing:
        s.flags |= IS_PARAM


register("convert_element_type", of_norm=_norm_cast, gradient=_protected_cast)
