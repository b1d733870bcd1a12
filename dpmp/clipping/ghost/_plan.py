"""The plan of ghost clipping: the flat per-example jaxpr and, per parameter leaf, its layer.

``loss_fn`` stays an ordinary function (flax linen, flax nnx or plain JAX). Its
jaxpr for ONE example is traced and flattened (``jit`` calls inlined); each
parameter leaf is followed through layout-only operations
(``convert_element_type``, ``reshape``, ``broadcast_in_dim``, ``transpose``,
``squeeze``, ``expand_dims``, ``copy``) and static slices (its "window",
``dpmp.clipping.ghost._window``: the layer sees a view of the parameter) to
the single equation that uses it, whose primitive names the rule of its layer
family (``dpmp.clipping.ghost._rule.rule_for``), or to the two layers of a table
tied between an embedding and an output projection
(``dpmp.clipping.ghost._tied``). A parameter used anywhere else —
in two other places (shared weights), inside a ``scan``, a ``custom_jvp`` function,
``remat``, or by a primitive no rule takes — makes the model unsupported, and
``method="auto"`` falls back to per-example gradients: the norm is never
computed by a rule that does not hold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jax_core

from dpmp.clipping._jaxpr import uses as jaxpr_uses
from dpmp.clipping._replay import aval, inline
from dpmp.clipping.ghost._gram import CANCELLATION
from dpmp.clipping.ghost._rule import GhostRule, Unsupported, is_float, rule_for, supported
from dpmp.clipping.ghost._tied import Tie, pair
from dpmp.clipping.ghost._window import is_window, split_window, view_shape

__all__ = ["GhostPlan", "Tap", "plan_ghost"]

# Operations that only move, cast or broadcast a parameter on its way to a layer.
_LAYOUT = frozenset(
    (
        "convert_element_type",
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
    )
)
# Layout operations that keep every entry once (the norm of W' is the norm of W).
_BIJECTIVE = frozenset(
    ("convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p")
)


@dataclasses.dataclass(frozen=True)
class Tap:
    """One parameter leaf and the equation that consumes it.

    The layer sees the leaf's "view": the leaf itself, or where ``window`` is not
    empty the static slice of it those equations take
    (``dpmp.clipping.ghost._window``); every per-example quantity of the tap
    (gradients, norms, the clipped sum before it is padded back) is the view's.

    ``mode``: ``"ghost"`` (the norm from the stored ``x_i``, ``g_i`` by ``rule``),
    ``"example"`` (the layer's own per-example gradient, formed inside the backward
    pass) or ``"after"`` (no ghost norm holds and the layer's other operand is an
    integer array, cheap to keep: its per-example gradient is formed after the
    backward pass from the stored operand and ``g_i``).
    """

    leaf: int  # index of the parameter leaf
    path: str  # its pytree path, for messages
    chain: tuple[int, ...]  # equation indices of layout ops from the view to the layer
    eqn: int  # the layer equation
    pos: int  # operand position of the (transformed) parameter in it
    rule: GhostRule | None  # the family's rule where its ghost norm holds, else None
    kind: str  # a readable layer kind
    mode: str  # "ghost" | "example" | "after"
    window: tuple[int, ...] = ()  # ops from the leaf to its view, ending in a slice; or none


@dataclasses.dataclass(frozen=True, eq=False)
class GhostPlan:
    """The flattened per-example jaxpr and, for each parameter leaf, its layer.

    Attributes:
      jaxpr: the flat per-example ``ClosedJaxpr`` (inputs: parameter leaves,
        other-argument leaves, example leaves; output: the float32 loss).
      taps: one ``Tap`` per used floating parameter leaf.
      unused: indices of parameter leaves the loss does not use (zero gradient).
      ties: the leaves tied between an embedding and an output projection, each with
        two taps whose norms add a cross term (``dpmp.clipping.ghost._tied``).
    """

    jaxpr: Any
    taps: tuple[Tap, ...]
    unused: tuple[int, ...]
    ties: tuple[Tie, ...] = ()

    def tie(self, k: int) -> Tie | None:
        """The tie tap ``k`` belongs to, if any."""
        return next((t for t in self.ties if k in (t.embedding, t.head)), None)

    def eqn(self, tap: Tap):
        """The layer equation of ``tap``."""
        return self.jaxpr.jaxpr.eqns[tap.eqn]

    def sum_rounding(self, clip_dtype, norm_dtype=None) -> tuple[int, float]:
        """``(rows, cancellation)``: what bounds the rounding of the clipped sum.

        ``rows``: the most rows one example adds to one contraction over the
        batch (a ghost layer's tokens, patches or ids; 1 where the layer's
        per-example gradient is formed). ``cancellation``: the most that
        ``sum_rows |x_t| |g_t|`` (what the contraction's rounding is proportional
        to) can exceed the norm the clip factor used for that layer: 1 where the
        gradient is formed or the layer has one row, else ``64 / lambda`` with
        ``lambda`` the float32 rounding of the magnitude ``m``
        (``dpmp.clipping.ghost._gram.cancellation_floor``,
        ``GhostRule.magnitude_ratio``); ``inf`` when no bound exists.
        """
        rows, cancellation = 1, 1.0
        for tap in self.taps:
            if tap.mode != "ghost":
                continue
            eqn = self.eqn(tap)
            t = tap.rule.rows(eqn, tap.pos)
            rows = max(rows, t)
            if t > 1:
                ratio = tap.rule.magnitude_ratio(eqn, tap.pos, clip_dtype, norm_dtype or clip_dtype)
                cancellation = max(cancellation, CANCELLATION / ratio if ratio > 0 else math.inf)
        return rows, cancellation

    def view_shape(self, tap: Tap, shape) -> tuple[int, ...]:
        """The shape of the view of ``tap``'s leaf, of ``shape`` (the leaf's own if unsliced)."""
        return view_shape(self.jaxpr.jaxpr.eqns, tap.window, shape)

    def layers(self) -> list[dict[str, str]]:
        """One row per parameter leaf: its path, layer kind and norm rule."""
        return [{"param": t.path, "layer": t.kind, "rule": _norm_name(t)} for t in self.taps]


def _norm_name(tap: Tap) -> str:
    """How the tap's norm is taken, as ``explain()`` reports it."""
    return tap.rule.norm if tap.mode == "ghost" else "per-example"


def plan_ghost(example_loss: Callable, params, others, example) -> GhostPlan:
    """Trace ``example_loss(params, others, *example)`` for one example and find the layers.

    ``params``, ``others`` and ``example`` may be arrays or ``ShapeDtypeStruct``s
    (``example`` without the batch axis). Raises ``Unsupported`` naming
    the first parameter leaf without a rule.
    """
    p_leaves = jax.tree.leaves(params)
    o_leaves = jax.tree.leaves(others)
    e_leaves = jax.tree.leaves(example)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    p_def = jax.tree.structure(params)
    o_def = jax.tree.structure(others)
    e_def = jax.tree.structure(example)

    def flat_loss(*leaves):
        p = jax.tree.unflatten(p_def, leaves[: len(p_leaves)])
        o = jax.tree.unflatten(o_def, leaves[len(p_leaves) : len(p_leaves) + len(o_leaves)])
        e = jax.tree.unflatten(e_def, leaves[len(p_leaves) + len(o_leaves) :])
        return example_loss(p, o, *e)

    avals = [aval(x) for x in (*p_leaves, *o_leaves, *e_leaves)]
    traced = jax.make_jaxpr(flat_loss)(*avals)
    flat = jax.make_jaxpr(lambda *a: inline(traced.jaxpr, traced.consts, *a))(*avals)
    taps, unused, ties = _find_taps(flat.jaxpr, len(p_leaves), paths)
    return GhostPlan(flat, tuple(taps), tuple(unused), tuple(ties))


def _find_taps(jaxpr, n_params: int, paths) -> tuple[list[Tap], list[int], list[Tie]]:
    """Each parameter leaf followed to its layer, or to the two layers of a tied
    embedding and output projection (``dpmp.clipping.ghost._tied``), or found unused."""
    uses, outs = jaxpr_uses(jaxpr)
    param_vars = set(jaxpr.invars[:n_params])
    taps, unused, ties, claimed = [], [], [], {}
    for leaf, v in enumerate(jaxpr.invars[:n_params]):
        path = paths[leaf]
        if not is_float(v.aval.dtype):
            raise Unsupported(f"parameter {path}: dtype {v.aval.dtype} is not floating")
        found = _follow(jaxpr, uses, outs, v, path)
        if not found:
            unused.append(leaf)
            continue
        tied = None
        if len(found) == 1:
            layers = [_layer(jaxpr, *found[0], path)]
        else:
            try:
                layers = [_layer(jaxpr, chain, i, pos, path) for chain, i, pos in found]
            except Unsupported:
                raise Unsupported(_shared(path, len(found))) from None
            tied = pair(jaxpr.eqns, layers, v.aval.shape)
            if tied is None:
                raise Unsupported(_shared(path, len(layers)))
            ties.append(Tie(leaf, len(taps) + tied[0], len(taps) + tied[1]))
        for chain, i, pos, rule, ghost, window, kind in layers:
            eqn = jaxpr.eqns[i]
            name = eqn.primitive.name
            for k, u in enumerate(eqn.invars):
                if k != pos and not isinstance(u, jax_core.Literal) and u in param_vars:
                    raise Unsupported(f"parameter {path}: {name} of two parameters")
            if i in claimed:
                raise Unsupported(f"parameter {path}: {name} also takes parameter {claimed[i]}")
            claimed[i] = path
            mode = _mode(rule, ghost, eqn, pos)
            if tied:
                kind = f"{kind} (tied)"
            elif window:
                view = list(view_shape(jaxpr.eqns, window, v.aval.shape))
                kind = f"{kind} (slice {view} of {list(v.aval.shape)})"
            rule = rule if ghost else None
            taps.append(Tap(leaf, path, chain, i, pos, rule, kind, mode, window))
    return taps, unused, ties


def _layer(jaxpr, chain, i, pos, path):
    """``(chain, eqn index, pos, rule, ghost, window, kind)`` of one use of a parameter."""
    window, chain = split_window(jaxpr.eqns, chain, _BIJECTIVE, path)
    rule, kind, ghost = _classify(jaxpr.eqns[i], pos, chain, jaxpr, path)
    return tuple(chain), i, pos, rule, ghost, window, kind


def _shared(path, n) -> str:
    return (
        f"parameter {path}: used {n} times (shared or tied weights); "
        "ghost clipping needs each parameter in exactly one layer"
    )


def _follow(jaxpr, uses, outs, v, path) -> list[tuple[list[int], int, int]]:
    """Per layer a parameter variable reaches through layout ops and static slices,
    ``(chain, eqn index, operand position)``; empty when it is unused. A variable used
    twice (tied weights) is followed along each use."""
    chain = []
    while True:
        if v in outs:
            raise Unsupported(f"parameter {path}: returned by the loss function")
        here = uses.get(v, [])
        if not here:
            if chain:
                raise Unsupported(f"parameter {path}: transformed but unused")
            return []
        if len(here) > 1:
            found = []
            for i, pos in here:
                found += _follow_use(jaxpr, uses, outs, chain, i, pos, path)
            return found
        i, pos = here[0]
        eqn = jaxpr.eqns[i]
        if _passes(eqn, pos):
            chain.append(i)
            v = eqn.outvars[0]
            continue
        return [(chain, i, pos)]


def _passes(eqn, pos: int) -> bool:
    """Whether a parameter followed into operand ``pos`` of ``eqn`` passes through it
    to a layer: a layout op or a static slice of it."""
    return pos == 0 and (eqn.primitive.name in _LAYOUT or is_window(eqn))


def _follow_use(jaxpr, uses, outs, chain, i, pos, path):
    """One use ``(i, pos)`` of a variable reached through ``chain``, followed to its layers."""
    eqn = jaxpr.eqns[i]
    if not _passes(eqn, pos):
        return [(list(chain), i, pos)]
    found = _follow(jaxpr, uses, outs, eqn.outvars[0], path)
    if not found:
        raise Unsupported(f"parameter {path}: transformed but unused")
    return [([*chain, i, *rest], j, p) for rest, j, p in found]


def _classify(eqn, pos, chain, jaxpr, path) -> tuple[GhostRule, str, bool]:
    """``(rule, layer kind, ghost)`` from the rule registered for the layer's primitive."""
    name = eqn.primitive.name
    rule = rule_for(name)
    if rule is None:
        raise Unsupported(
            f"parameter {path}: used by {name!r}, for which ghost clipping has no rule "
            f"(supported: {supported()})"
        )
    if len(eqn.invars) != 2:
        raise Unsupported(
            f"parameter {path}: used by {name!r}, a primitive of {len(eqn.invars)} inputs; "
            "ghost rules are for two (the parameter and the layer's input): use "
            "method='vmap' for this model"
        )
    bijective = all(jaxpr.eqns[i].primitive.name in _BIJECTIVE for i in chain)
    kind, ghost = rule.classify(eqn, pos, bijective, path)
    return rule, kind, ghost


def _mode(rule: GhostRule, ghost: bool, eqn, pos) -> str:
    """The rule's choice where its ghost norm holds; else the layer's per-example
    gradient, formed inside the backward pass, or after it where the layer's other
    operand is an integer array (as cheap to keep as ``g_i``)."""
    if ghost:
        return rule.mode(eqn, pos)
    act = eqn.invars[1 - pos]  # a gather's parameter is its operand (pos 0): act = indices
    return "example" if is_float(act.aval.dtype) else "after"
