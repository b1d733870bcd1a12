"""Tracing a per-example function and replaying it, equation by equation, under ``vmap``.

The private paths trace the loss of ONE example (with a batch axis of 1, as the
model expects a batch) and evaluate it for every example under ``vmap``: the
per-example gradients of ``method="vmap"`` through ``replayed``, and ghost
clipping (``dpmp.clipping.ghost``) through its own replay, which also swaps the
layers it taps. Both re-emit each equation with ``replay_bind``.

Per example, every value keeps that batch axis of 1, so under ``vmap`` XLA:CPU
sees shapes like (B, 1, T, D). Its YNNPACK fusions of a product and a reduction
over such a shape run 15-20x slower than over (B, T, D) (jaxlib 0.10.2: 5.2 ms
against 0.33 ms for one (256, 1, 64, 64) product summed over tokens), and the
backward of layer norms, softmax and every per-example scale or bias gradient
is made of them: 60% of the ghost ViT step of benchmarks/clipping.py, and a
quarter of its vmap step. ``replay_bind`` therefore emits reductions and
broadcasts on operands with their size-1 axes reshaped away, and makes an
elementwise operation's implicit size-1 broadcasting explicit that way, so that
their transposes are squeezed too. Reshapes and broadcasts are exact: the
values are those of the traced model.

Inside ``shard_map`` the avals carry their manual axis types (``aval``,
``vary_like``), so that a function is traced with the types it is replayed on.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core
from jax.extend import source_info_util

__all__ = [
    "aval",
    "bind",
    "inline",
    "replay_bind",
    "replayed",
    "vary_like",
]

# Calls inlined when a function is flattened.
_CALLS = frozenset(("jit", "pjit", "closed_call", "core_call"))


def _read(env, v):
    """The value of a jaxpr variable or literal."""
    return v.val if isinstance(v, jax_core.Literal) else env[v]


def bind(eqn, invals, **overrides):
    """Re-emit one equation (as ``jax.core.eval_jaxpr`` does), keeping its source info:
    its traceback and name stack (``jax.extend.source_info_util``), which the
    precision audit reads to tell a backward pass's equations from the forward's."""
    params = dict(eqn.params, **overrides) if overrides else eqn.params
    bind_params = eqn.primitive.get_bind_params(params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*invals, **bind_params)
    return out if eqn.primitive.multiple_results else [out]


_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"))
_ELEMENTWISE = frozenset(
    (
        "add", "sub", "mul", "div", "max", "min", "pow", "rem", "atan2", "nextafter",
        "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n",
    )
)  # fmt: skip


def _squeezed(x):
    """``x`` without its size-1 axes, and the kept axes' positions."""
    keep = tuple(i for i, n in enumerate(jnp.shape(x)) if n != 1)
    return x.reshape(tuple(jnp.shape(x)[i] for i in keep)), keep


def _broadcast(x, shape, dims):
    """``lax.broadcast_in_dim(x, shape, dims)`` emitted without size-1 axes."""
    x, keep = _squeezed(x)
    out_keep = [i for i, n in enumerate(shape) if n != 1]
    where = {axis: k for k, axis in enumerate(out_keep)}
    dims_sq = tuple(where[dims[i]] for i in keep)
    out = lax.broadcast_in_dim(x, tuple(shape[i] for i in out_keep), dims_sq)
    return out.reshape(shape)


def replay_bind(eqn, invals):
    """``bind`` for the batched replays, with size-1 axes kept out of reductions
    and broadcasts (see the module docstring)."""
    name = eqn.primitive.name
    if eqn.params.get("out_sharding") is not None or eqn.params.get("sharding") is not None:
        return bind(eqn, invals)  # an explicit output sharding names the original axes
    if name in _REDUCTIONS and 1 in jnp.shape(invals[0]):
        (x,) = invals
        axes = set(eqn.params["axes"])
        x, keep = _squeezed(x)
        axes_sq = tuple(k for k, i in enumerate(keep) if i in axes)
        (out,) = bind(eqn, [x], axes=axes_sq) if axes_sq else [x]
        return [out.reshape(eqn.outvars[0].aval.shape)]
    if name == "broadcast_in_dim" and len(invals) == 1:
        p = eqn.params
        return [_broadcast(invals[0], tuple(p["shape"]), tuple(p["broadcast_dimensions"]))]
    if name in _ELEMENTWISE:
        full = tuple(eqn.outvars[0].aval.shape)

        def implicit(v):  # same rank, some size-1 axis broadcast
            return len(jnp.shape(v)) == len(full) and tuple(jnp.shape(v)) != full

        if any(map(implicit, invals)):
            dims = tuple(range(len(full)))
            invals = [_broadcast(v, full, dims) if implicit(v) else v for v in invals]
    return bind(eqn, invals)


def replayed(fn: Callable) -> Callable:
    """``fn`` (arrays in, a pytree of arrays out), evaluated equation by equation
    from its jaxpr (``jit`` calls inlined) with ``replay_bind``.

    The same values; for a per-example function under ``vmap`` (the per-example
    gradients of ``method="vmap"``) its reductions and broadcasts then leave out
    the batch axis of 1.
    """

    def run(*args):
        leaves, tree = jax.tree.flatten(args)
        traced = jax.make_jaxpr(lambda *ls: fn(*jax.tree.unflatten(tree, ls)), return_shape=True)
        closed, out_shape = traced(*[aval(x) for x in leaves])
        outs = inline(closed.jaxpr, closed.consts, *leaves, emit=replay_bind)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def _call_jaxpr(eqn):
    """The jaxpr and consts a call equation (``jit`` and the like) evaluates."""
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(sub, jax_core.ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def inline(jaxpr, consts, *args, emit: Callable = bind):
    """Evaluate ``jaxpr`` with every ``jit`` call inlined (traced, this flattens it),
    each other equation re-emitted by ``emit`` (``bind`` or ``replay_bind``)."""
    env = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        if eqn.primitive.name in _CALLS:
            sub, sub_consts = _call_jaxpr(eqn)
            outs = inline(sub, sub_consts, *invals, emit=emit)
        else:
            outs = emit(eqn, invals)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [_read(env, v) for v in jaxpr.outvars]


def vary_like(x, refs):
    """``x`` (a pytree) cast to vary over every mesh axis some leaf of ``refs``
    varies over; unchanged outside ``shard_map``."""
    axes = set()
    for r in jax.tree.leaves(refs):
        typ = _manual_type(r)
        if typ is not None:
            axes |= set(typ[0].varying)
    if not axes:
        return x
    return jax.tree.map(lambda leaf: _vary(leaf, axes), x)


def _vary(x, axes):
    typ = _manual_type(x)
    missing = axes - set(typ[0].varying if typ is not None else ())
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def aval(x, *, drop_batch: bool = False) -> jax.ShapeDtypeStruct:
    """Shape, dtype and weak type of an array, tracer, ``ShapeDtypeStruct`` or
    Python scalar (inside ``shard_map`` also its manual axis type and sharding).

    The weak type matters: a Python float traced as a strong float32 would turn
    a bf16 product into a float32 one.
    """
    shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    shape = shape[1:] if drop_batch else shape
    weak = _weak_type(x)
    typ = _manual_type(x)
    if typ is None:
        return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
    mat, sharding = typ
    if drop_batch:
        sharding = sharding.update(spec=jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=sharding, weak_type=weak, manual_axis_type=mat
    )


def _weak_type(x) -> bool:
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(x.weak_type)
    try:
        return bool(jax.typeof(x).weak_type)
    except (TypeError, AttributeError):
        return False


def _manual_type(x):
    """Inside ``shard_map``: the mesh axes ``x`` varies over (with its sharding on
    the abstract mesh), so that a plan is traced with the types it is replayed on."""
    if isinstance(x, jax.ShapeDtypeStruct):
        mat = getattr(x, "manual_axis_type", None)
        return None if mat is None or mat.empty else (mat, x.sharding)
    try:
        typ = jax.typeof(x)
        mat = typ.mat
    except (TypeError, AttributeError):
        return None
    return None if mat.empty else (mat, typ.sharding)
