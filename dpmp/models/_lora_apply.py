"""Low-rank adapters applied beside the weights they adapt, not merged into them.

``unmerged(fn, alpha)`` runs ``fn(base, *args)`` (a model's loss, predict or
metrics) with every adapted weight ``W`` of a dense layer ``y = x W`` used as::

    y = x W + s (x A) B        s = alpha / r,  A [fan_in, r],  B [r, fan_out]

which is ``x (W + s A B)``, the merged layer (``dpmp.models._lora.merge``), in
exact arithmetic. Each adapter is then the weight of an ordinary dense layer
of its own (``A`` takes ``x``, ``B`` takes ``x A``), so ghost clipping's dense
rule (``dpmp.clipping.ghost``) takes their per-example norms from those
layers' inputs and output gradients, with its certified bound, and no
per-example gradient of ``W`` (``fan_in x fan_out`` per example) is formed.

How: ``fn`` is traced with the base as its input and flattened (``jit`` calls
inlined); a weight whose only use is a ``dot_general`` that takes it as its
right operand, possibly after a cast, contracting exactly the axes that
``A``'s rows stand for (the leading ones, ``dpmp.models._lora._split``), with
no batch axes (flax ``Dense``/``DenseGeneral``/``Einsum`` kernels, plain
``x @ W``), gets the low-rank path in that layer's dtypes and precision. Any
other weight is merged as before (in float32, ``wide``), so every model is
computed exactly as its merged form says; the planner then sees the merge's
product of two parameters and ``method="auto"`` uses per-example gradients.

Inside ``shard_map`` (a data-parallel mesh) the base is replicated while the
adapters and the inputs vary over the mesh axis; the base is first made to vary
as they do, so that ``fn`` is traced with the types it is evaluated on and its
jaxpr, and the dense layers found in it, are the ones of one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core

from dpmp.clipping._jaxpr import uses as jaxpr_uses
from dpmp.clipping._replay import aval, bind, inline, vary_like

__all__ = ["merged_weight", "unmerged"]

_CAST = "convert_element_type"


def unmerged(fn: Callable, alpha: float, names: Callable[[Any], list]) -> Callable:
    """``run(base, adapters, *args) = fn(base with adapters, *args)``, each adapted
    weight of a dense layer applied as ``x W + s (x A) B`` (see the module docstring),
    the others merged. ``names(base)``: the adapter name of each leaf of ``base``
    (None for a leaf without adapters)."""

    def run(base, adapters, *args):
        # Inside shard_map the base is replicated (invariant) while the adapters and
        # the inputs vary over the mesh axes the batch is split over. Traced as it
        # is, every weight would meet its layer's input through a ``pvary`` that
        # JAX inserts: the dense layers would not be found (``_dense_layers`` reads
        # a weight's uses), and a weight merged with its (varying) adapters would be
        # replayed into a ``pvary`` of a value that already varies, which JAX
        # refuses. Made to vary as they do, the base is traced with the types it is
        # evaluated on, merged or not, and the jaxpr is the one-device one.
        base = vary_like(base, (adapters, args))
        leaves, tree = jax.tree.flatten(base)
        arg_leaves, arg_tree = jax.tree.flatten(args)
        n = len(leaves)
        named = names(base)

        def trace(leaf_avals):
            def flat(*ls):
                return fn(jax.tree.unflatten(tree, ls[:n]), *jax.tree.unflatten(arg_tree, ls[n:]))

            avals = [*leaf_avals, *(aval(x) for x in arg_leaves)]
            closed, shape = jax.make_jaxpr(flat, return_shape=True)(*avals)
            jaxpr = jax.make_jaxpr(lambda *a: inline(closed.jaxpr, closed.consts, *a))(*avals)
            return jaxpr, shape, _dense_layers(jaxpr.jaxpr, named, adapters)

        jaxpr, shape, layers = trace([aval(x) for x in leaves])
        inputs = list(leaves)
        for i, name in enumerate(named):
            if name is not None and i not in layers.values():
                inputs[i] = merged_weight(leaves[i], adapters[name], alpha)
        if any(a.dtype != b.dtype for a, b in zip(inputs, leaves)):  # merged wider
            jaxpr, shape, layers = trace([aval(x) for x in inputs])
            layers = {i: leaf for i, leaf in layers.items() if inputs[leaf] is leaves[leaf]}
        outs = _evaluate(jaxpr, [*inputs, *arg_leaves], layers, named, adapters, alpha)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def merged_weight(w, adapter, alpha: float):
    """``W + s A B`` in float32 (or wider): ``A B`` at full precision (a TF32 matmul
    would round the update to 10 bits), then scaled and added."""
    a, b = adapter["a"], adapter["b"]
    dtype = jnp.promote_types(a.dtype, jnp.float32)
    scale = jnp.asarray(alpha / a.shape[1], dtype)
    delta = jnp.matmul(a.astype(dtype), b.astype(dtype), precision=lax.Precision.HIGHEST)
    out = jnp.promote_types(w.dtype, dtype)
    return w.astype(out) + (delta * scale).reshape(w.shape).astype(out)


def _dense_layers(jaxpr, named, adapters) -> dict[int, int]:
    """``{equation index: base leaf}`` of the dense layers whose adapted weight takes
    the low-rank path."""
    uses, outs = jaxpr_uses(jaxpr)
    found = {}
    for leaf, (v, name) in enumerate(zip(jaxpr.invars, named)):
        if name is None:
            continue
        while v not in outs and len(uses.get(v, ())) == 1:
            i, pos = uses[v][0]
            eqn = jaxpr.eqns[i]
            if eqn.primitive.name == _CAST and pos == 0:
                v = eqn.outvars[0]
                continue
            if _is_adaptable(eqn, pos, _cut(adapters[name], v)):
                found[i] = leaf
            break
    return found


def _cut(adapter, v) -> int:
    """How many leading axes of the weight ``A``'s rows stand for."""
    fan_in = adapter["a"].shape[0]
    shape = v.aval.shape
    for k in range(1, len(shape)):
        if math.prod(shape[:k]) == fan_in:
            return k
    return 0


def _is_adaptable(eqn, pos: int, cut: int) -> bool:
    """A ``dot_general`` taking the weight on the right, contracting its ``cut``
    leading axes, without batch axes."""
    if eqn.primitive.name != "dot_general" or pos != 1 or not cut:
        return False
    (_, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return not lb and not rb and sorted(rc) == list(range(cut))


def _evaluate(closed, inputs, layers, named, adapters, alpha) -> list:
    """The flat jaxpr evaluated on ``inputs``, the ``layers`` taking the low-rank path."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, inputs))

    def read(v):
        return v.val if isinstance(v, jax_core.Literal) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        outs = bind(eqn, invals)
        if i in layers:
            low = _low_rank(eqn, invals, adapters[named[layers[i]]], alpha)
            outs = [outs[0] + low.astype(outs[0].dtype)]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _low_rank(eqn, invals, adapter, alpha: float):
    """``s (x A) B`` of a dense layer ``x W`` (``eqn``), in its dtypes and precision,
    laid out as its output."""
    x, w = invals
    (lc, rc), _ = eqn.params["dimension_numbers"]
    cut = len(rc)
    r = adapter["a"].shape[1]
    a = adapter["a"].reshape((*w.shape[:cut], r)).astype(w.dtype)
    b = adapter["b"].reshape((r, *w.shape[cut:])).astype(w.dtype)
    kw = {
        "precision": eqn.params.get("precision"),
        "preferred_element_type": eqn.params.get("preferred_element_type"),
    }
    xa = lax.dot_general(x, a, ((lc, rc), ((), ())), **kw).astype(w.dtype)
    xab = lax.dot_general(xa, b, (((xa.ndim - 1,), (0,)), ((), ())), **kw)
    return xab * jnp.asarray(alpha / r, xab.dtype)
