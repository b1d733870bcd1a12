"""Noise rules: random bits, and the Gaussian draws made from them.

A value computed from random bits or a PRNG key is ``RNG``. A Gaussian draw is
a ``noise_sample`` site, checked against ``policy.noise``, and its output is
``NOISE``. Two draws are recognised: ``erf_inv`` of random bits (what
``jax.random.normal`` lowers to), and the call of a noise sampler of dpmp's
own that draws without ``erf_inv`` (``sampler_drawn_by``).
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


def _sampler_jits() -> dict[str, str]:
    """jit name -> sampler name, of every registered noise sampler that draws in a
    named jit of its own (``dpmp.noise.NoiseSampler.jit_name``)."""
    from dpmp.noise import sampler, sampler_names

    drawn = (sampler(name) for name in sampler_names())
    return {s.jit_name: s.name for s in drawn if s.jit_name is not None}


def sampler_drawn_by(eqn) -> str | None:
    """The jit name of the dpmp noise sampler whose draw the call equation ``eqn``
    is, or ``None``.

    The one place where the audit recognises a sampler by its call: a registered
    sampler that does not draw with ``erf_inv`` names the jit that draws its
    normals (the snapped Gaussian's float64 ``ndtri`` draw is
    ``snapped_normal_sample``).
    """
    name = eqn.params.get("name")
    return name if name in _sampler_jits() else None


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
        in_dtype=_random_input_dtype(s.eqn),
        acc_dtype=None,
        out_dtype=s.out_dtype,
        location=s.loc,
        required=s.policy.noise,
        message=f"Gaussian sample (noise sampler {_sampler_jits()[sampler]!r}: its draw {sampler})",
    )
    return [dataclasses.replace(av, flags=(av.flags | NOISE) & ~GRAD) for av in outs]


def _random_input_dtype(eqn):
    """The dtype of the random words a sampler's draw reads (its first input), or
    None when that input is a typed PRNG key (which has no numeric dtype: the
    draw's output dtype is then what is checked)."""
    import jax

    dtype = dtype_of(eqn.invars[0]) if eqn.invars else None
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return dtype


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
