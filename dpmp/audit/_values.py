"""What the precision audit knows about one jaxpr variable, and what it reports.

Every jaxpr variable gets a ``Value``: a set of taint flags and the set
of its axes that index examples of the batch.

Taint flags and where they come from:

* ``BATCH``   derived from a batch argument;
* ``PARAM``   derived from a parameter argument; ``IS_PARAM`` marks the
  parameter leaves themselves (kept through sub-jaxpr boundaries and widening
  casts, dropped by any computation);
* ``GRAD``    computed by the backward pass (an equation whose name stack holds
  a ``transpose(...)`` scope, as written by ``jax.grad``/``jax.vjp``) or
  derived from such a value;
* ``RNG``     derived from random bits or a PRNG key;
* ``NOISE``   a float Gaussian sample (the ``erf_inv`` that ``jax.random.normal``
  lowers to, applied to random bits) or derived from one without mixing with a
  gradient;
* ``SQUARE``  elementwise squares of a gradient;
* ``SQSUM``   a sum of ``SQUARE`` values (a squared norm) and what is computed
  from it;
* ``NORM``    a square root of ``SQSUM`` and what is computed from it without a
  gradient: the norm and the clip factor;
* ``CLIPPED`` a gradient multiplied (or divided) by a clip factor;
* ``NOISY``   a gradient with noise added;
* ``REDUCED`` a sum of gradients over examples (before noise);
* ``UPDATED`` new parameters (a parameter plus/minus a gradient-derived update).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

BATCH = 1
PARAM = 2
IS_PARAM = 4
GRAD = 8
RNG = 16
NOISE = 32
SQUARE = 64
NORM = 128
CLIPPED = 256
NOISY = 512
UPDATED = 1024
REDUCED = 2048
SQSUM = 4096
# The lineage of a norm: squares of a gradient, their sum, its root.
NORM_LINE = SQUARE | SQSUM | NORM
# Flags a computation does not pass on to its result.
NOT_INHERITED = IS_PARAM
# Flags only a floating-point value can carry.
FLOAT_ONLY = GRAD | NORM_LINE | NOISE | NOISY | CLIPPED | REDUCED | UPDATED


@dataclasses.dataclass(frozen=True)
class Value:
    """The abstract value of one jaxpr variable.

    Attributes:
      flags: taint flags (see the module docstring), or-ed together.
      bax: the variable's axes that index examples of the batch.
      sq: the narrowest float dtype seen along a norm lineage (squares, sums,
        square root), or ``None``.
      src: locations of the noise additions a ``NOISY`` value descends from.
    """

    flags: int = 0
    bax: frozenset = frozenset()
    sq: Any = None
    src: tuple = ()

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)


EMPTY = Value()


def join(a: Value, b: Value) -> Value:
    """The least value that covers both: union of flags, axes and sources."""
    if a is b or b is EMPTY:
        return a
    if a is EMPTY:
        return b
    return Value(
        a.flags | b.flags,
        a.bax | b.bax,
        narrowest(a.sq, b.sq),
        tuple(dict.fromkeys(a.src + b.src)),
    )


def narrowest(a, b):
    """The narrower of two float dtypes; ``None`` stands for "none seen yet"."""
    if a is None:
        return b
    if b is None:
        return a
    return a if bits(a) <= bits(b) else b


def bits(dtype) -> int:
    """Width of a float dtype; anything else counts as wider than every float."""
    if dtype is not None and is_float(dtype):
        return jnp.finfo(dtype).bits
    return 10**6


def is_float(dtype) -> bool:
    try:
        return jax.dtypes.issubdtype(dtype, jnp.floating)
    except TypeError:
        return False


def is_key(dtype) -> bool:
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def dtype_of(var):
    """Dtype of a jaxpr variable or literal (``None`` where it has none)."""
    aval = getattr(var, "aval", None)
    return getattr(aval, "dtype", None)


def shape_of(var) -> tuple:
    aval = getattr(var, "aval", None)
    return tuple(getattr(aval, "shape", ()))


def is_literal(var) -> bool:
    return isinstance(var, jax_core.Literal)


def open_jaxpr(jaxpr_like):
    """Returns (open jaxpr, consts) for a Jaxpr or ClosedJaxpr."""
    if isinstance(jaxpr_like, jax_core.ClosedJaxpr):
        return jaxpr_like.jaxpr, jaxpr_like.consts
    return jaxpr_like, ()


@dataclasses.dataclass
class RawFinding:
    """One site as the walker records it (``dpmp.audit.Finding`` is its public form)."""

    kind: str
    primitive: str
    in_dtype: Any
    acc_dtype: Any
    out_dtype: Any
    location: str
    required: Any  # dtype the site must reach, or None for "at least param"
    message: str
    ok: bool
