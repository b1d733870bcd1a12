"""Addition rules: noise added to the gradient sum, and the parameter update.

An ``add``/``add_any``/``sub`` of noise (``NOISE``, not mixed with a gradient)
and a gradient is a ``noise_add`` site, checked against ``policy.noise``; its
result is ``NOISY`` and remembers where the noise was added. An addition of a
parameter leaf (``IS_PARAM``) and a gradient-derived value is an ``update``
site, checked against the parameter dtype; its result is ``UPDATED``.
Additions keep ``NOISE`` on a value mixed with a gradient, so that this rule
sees the noise being added.
"""

from __future__ import annotations

from dpmp.audit._values import GRAD, IS_PARAM, NOISE, NOISY, REDUCED, UPDATED
from dpmp.audit.rules._registry import Outs, Step, register


def _noise_added(s: Step) -> Outs | None:
    noise_i = [av.has(NOISE) and not av.has(GRAD) for av in s.ins]
    grad_i = [av.has(GRAD) and not av.has(NOISE) for av in s.ins]
    if not ((noise_i[0] and grad_i[1]) or (noise_i[1] and grad_i[0])):
        return None
    ni = 0 if noise_i[0] else 1
    gi = 1 - ni
    s.record(
        "noise_add",
        s.in_dtypes[gi],
        s.in_dtypes[ni],
        s.policy.noise,
        "noise added to the gradient sum",
    )
    flags = (s.flags & ~(NOISE | REDUCED)) | GRAD | NOISY
    return s.outs(flags, None, (s.site,))


def _update(s: Step) -> Outs | None:
    pi = [av.has(IS_PARAM) for av in s.ins]
    if not any(pi) or all(pi):
        return None
    p_i = pi.index(True)
    if not s.ins[1 - p_i].has(GRAD):
        return None
    s.record(
        "update",
        s.in_dtypes[1 - p_i],
        s.in_dtypes[p_i],
        s.walker.param_dtype or s.policy.param,
        "optimizer update applied to the parameters",
    )
    return s.outs((s.flags & ~(NOISE | NOISY)) | UPDATED, None, ())


def _addition(s: Step) -> Outs | None:
    if len(s.ins) != 2:
        return None
    outs = _noise_added(s)
    return outs if outs is not None else _update(s)


register("add", "add_any", "sub", gradient=_addition, keeps_noise=True)
