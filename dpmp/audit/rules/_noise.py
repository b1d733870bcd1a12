"""Noise rules: random bits, and the Gaussian draws made from them.

A value computed from random bits or a PRNG key is ``RNG``. A Gaussian draw is
a ``noise_sample`` site, checked against ``policy.noise``, and its output is
``NOISE``. Two draws are recognised: ``erf_inv`` of random bits (what
``jax.random.normal`` lowers to), and the call of a noise sampler of dpmp's
own that draws without ``erf_inv`` (:func:`sampler_drawn_by`).
"""

from __future__ import annotations

import dataclasses

from dpmp.audit._values import GRAD, NOISE, RNG, dtype_of
from dpmp.audit.rules._registry import Outs, Step, register

_RANDOM_BITS = (
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_split",
    "random_fold_in",
    "threefry2x32",
)

# The named jit of dpmp.snapped_gaussian's normal draw (dpmp/noise/_noise.py).
SNAPPED_SAMPLE = "snapped_normal_sample"


def sampler_drawn_by(eqn) -> str | None:
    """The dpmp noise sampler whose draw the call equation ``eqn`` is, or ``None``.

    The one place where the audit recognises a sampler by its call: the snapped
    Gaussian's float64 ``ndtri`` draw is a jit named :data:`SNAPPED_SAMPLE`.
    """
    return SNAPPED_SAMPLE if eqn.params.get("name") == SNAPPED_SAMPLE else None


def sampler_call(s: Step, outs: Outs) -> Outs:
    """The outputs of a walked call, marked ``NOISE`` (and recorded as a
    ``noise_sample`` site) when the call is a sampler's draw from random bits."""
    sampler = sampler_drawn_by(s.eqn)
    if sampler is None or not any(av.has(RNG) for av in s.ins):
        return outs
    s.walker.record(
        ("noise_sample", s.loc),
        "noise_sample",
        sampler,
        in_dtype=dtype_of(s.eqn.invars[0]),
        acc_dtype=None,
        out_dtype=s.out_dtype,
        location=s.loc,
        required=s.policy.noise,
        message="Gaussian sample (dpmp.snapped_gaussian: float64 ndtri of random bits)",
    )
    return [dataclasses.replace(av, flags=(av.flags | NOISE) & ~GRAD) for av in outs]


def _random(s: Step) -> None:
    s.flags |= RNG


def _erf_inv(s: Step) -> None:
    if s.ins[0].has(RNG) and not s.ins[0].has(GRAD):
        s.record(
            "noise_sample",
            s.in_dtypes[0],
            None,
            s.policy.noise,
            "Gaussian sample (erf_inv of random bits)",
        )
        s.flags |= NOISE


register(*_RANDOM_BITS, source=_random)
register("erf_inv", source=_erf_inv)
