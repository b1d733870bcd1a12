"""Offsets XLA cannot fold into the program: kernels shared by same-shaped parts.

XLA:CPU compiles one kernel (an LLVM module) for each distinct fused
computation. A program that reads many parts of one array at constant offsets
fuses each read, its offset included, into the part's reader, so every part
gets a kernel of its own although the parts of one shape do the same work: the
noise of many small leaves drawn as one vector, read back by the optimizer's
update of each leaf (``dpmp.noise._snapped``), or a wide sum written a block
of columns at a time (``dpmp.clipping.ghost._dense.in_blocks``). Read at an
offset that the kernel takes as an argument, the readers of one shape are one
computation, compiled once. Nothing here changes a value.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp

__all__ = ["always_true", "opaque_ints", "traced_for_cpu"]


def traced_for_cpu() -> bool:
    """Whether the program is being traced for XLA:CPU (JAX's default backend)."""
    return jax.default_backend() == "cpu"


def always_true(x: jax.Array) -> jax.Array:
    """A boolean scalar that is always true but that XLA cannot prove so: it reads the
    first entry of ``x`` (any dtype, as float32: NaN or not, it is true)."""
    b = x.ravel()[0].astype(jnp.float32)
    return jnp.isnan(b) | ~jnp.isnan(b)


def opaque_ints(values: Iterable[int], always: jax.Array) -> tuple:
    """``values`` as int32 scalars that XLA cannot fold into constants, where the
    program is traced for XLA:CPU: the outputs of a loop that runs once (its trip
    count is ``always``, a boolean scalar that is true at run time but not known to
    XLA, e.g. ``always_true``) and adds 0. Elsewhere the constants themselves:
    XLA:GPU reads a loop's trip count back to the host."""
    constants = tuple(jnp.int32(v) for v in values)
    if len(constants) < 2 or not traced_for_cpu():
        return constants
    once = always.astype(jnp.int32)

    def add_zero(_, carry):
        zero, ints = carry
        return zero, tuple(i + zero for i in ints)

    return jax.lax.fori_loop(0, once, add_zero, (1 - once, _varying_as(always, constants)))[1]


def _varying_as(x: jax.Array, ints: tuple) -> tuple:
    """``ints`` made to vary over the mesh axes ``x`` varies over (inside
    ``shard_map``: a loop's carry keeps its type, and adding ``x``'s zero makes it
    vary)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    axes = tuple(sorted(getattr(manual, "varying", ())))
    return tuple(jax.lax.pcast(i, axes, to="varying") for i in ints) if axes else ints
