"""The per-example forward pass with its layers tapped, and one layer's own gradient.

Each ghost layer gets a zero "perturbation" added to its output, each other
layer a zero per-example "perturbation" whose cotangent its backward defines
as the per-example parameter gradient (a ``custom_vjp``, ``example_layer``);
the gradient of the summed, loss-scaled per-example losses with respect to the
perturbations is ``g_i`` or the layer's per-example gradient for every layer
and example, from one backward pass that computes no batch parameter
gradients. The other equations are re-emitted by
``dpmp.clipping._replay.replay_bind``, which keeps the batch axis of 1 out
of reductions (XLA:CPU runs those 15-20x slower).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from dpmp.clipping._replay import bind, inline, replay_bind
from dpmp.clipping._rounding import HIGHEST
from dpmp.clipping.ghost._operands import half_operands
from dpmp.clipping.ghost._plan import GhostPlan, Tap
from dpmp.clipping.ghost._window import to_view

__all__ = ["example_layer", "forward", "layer_grad", "replay_chain", "site", "view"]


def forward(plan: GhostPlan, perturb, leaves, layers):
    """One example: the loss and, per ghost tap, the activation operand.

    Ghost taps get ``perturb[k]`` added to their output; per-example taps are
    computed by ``layers[k]`` (see ``example_layer``), which gives the
    layer's own gradient as the cotangent of ``perturb[k]``.
    """
    jaxpr = plan.jaxpr.jaxpr
    by_eqn = {id(jaxpr.eqns[t.eqn]): k for k, t in enumerate(plan.taps)}
    acts = [None] * len(plan.taps)

    def emit(eqn, invals):
        k = by_eqn.get(id(eqn))
        if k is None:
            return replay_bind(eqn, invals)
        tap = plan.taps[k]
        if tap.mode == "example":
            p = view(plan, tap, leaves[tap.leaf])
            return [layers[k](invals[tap.pos], p, invals[1 - tap.pos], perturb[k])]
        acts[k] = invals[1 - tap.pos]
        return [bind(eqn, invals)[0] + perturb[k]]

    (loss,) = inline(jaxpr, plan.jaxpr.consts, *leaves, emit=emit)
    return loss, tuple(acts)


def example_layer(plan: GhostPlan, tap: Tap, dtype) -> Callable:
    """``layer(w, p, act, delta)``: the tap's output; ``delta``'s cotangent is the
    gradient of ``p`` (the parameter leaf's view, ``view``) for this example, in
    ``dtype``.

    The forward is the layer as traced (``w`` is the parameter as it reaches
    the layer, in the compute dtype). The backward returns the usual input
    gradient and, in place of the parameter gradient, this example's own one,
    from ``x_i`` and ``g_i`` (loss scale still inside) cast to ``dtype`` with
    ``Precision.HIGHEST``, or read as they are where both are in one half dtype and
    the rule has a contraction of its own (``_example_grad``). Under ``vmap``
    this is the batched per-example weight gradient that per-example clipping
    forms, for this one layer, inside the backward pass: neither ``x_i`` nor
    ``g_i`` outlives it.
    """
    eqn = plan.eqn(tap)
    param_grad = _example_grad(plan, tap, dtype)

    def apply(w, act):
        ins = [None, None]
        ins[tap.pos], ins[1 - tap.pos] = w, act
        return replay_bind(eqn, ins)[0]

    @jax.custom_vjp
    def layer(w, p, act, delta):
        return apply(w, act)

    def fwd(w, p, act, delta):
        return apply(w, act), (w, p, act)

    def bwd(res, g):
        w, p, act = res
        _, pull_act = jax.vjp(lambda a: apply(w, a), act)
        (d_act,) = pull_act(g)
        d_p = param_grad(p.astype(dtype), act, g)
        return jnp.zeros_like(w), jnp.zeros_like(p), d_act, d_p

    layer.defvjp(fwd, bwd)
    return layer


def view(plan: GhostPlan, tap: Tap, p):
    """The parameter leaf ``p`` as the tap's chain starts from: its static slice where
    it is used through one (``dpmp.clipping.ghost._window``), else ``p``."""
    return to_view(plan.jaxpr.jaxpr.eqns, tap.window, p)


def replay_chain(plan: GhostPlan, tap: Tap, p):
    """The layout ops from a parameter leaf's view (``view``) to its layer, casts
    skipped (``p``'s dtype stays)."""
    for i in tap.chain:
        e = plan.jaxpr.jaxpr.eqns[i]
        if e.primitive.name != "convert_element_type":
            (p,) = replay_bind(e, [p])
    return p


def site(plan: GhostPlan, tap: Tap, dtype) -> Callable:
    """``site(view, act) -> layer output`` for one example, computed in ``dtype``
    (a contraction with ``Precision.HIGHEST``)."""

    def layer_site(p, act):
        x = replay_chain(plan, tap, p)
        e = plan.eqn(tap)
        over = {}
        if "precision" in e.params and "preferred_element_type" in e.params:
            over = {"precision": HIGHEST, "preferred_element_type": dtype}
        ins = [None, None]
        ins[tap.pos] = x
        ins[1 - tap.pos] = act  # for a gather: the indices (the parameter is operand 0)
        (out,) = bind(e, ins, **over) if over else replay_bind(e, ins)
        return out

    return layer_site


def _example_grad(plan: GhostPlan, tap: Tap, dtype) -> Callable:
    """``grad(p, act, g)``: one example's gradient of ``p`` (the leaf's view), in ``dtype``.

    The rule's own form of the operand's gradient where it has one
    (``GhostRule.operand_grad``: one contraction over a dense layer's tokens, one
    per kernel offset of a convolution), pulled back through the layout
    operations from the leaf to the layer; any other layer's is the vjp of the
    layer itself. ``act`` and ``g`` come as stored: the rule's form reads them as
    they are where both are in one half dtype and the rule takes half operands
    (``dpmp.clipping.ghost._operands``), the others cast them to ``dtype``.
    """
    eqn = plan.eqn(tap)
    rule = tap.rule
    if rule is None or rule.operand_grad is None:
        layer = site(plan, tap, dtype)
        return lambda p, act, g: layer_grad(layer, p, act.astype(dtype), g.astype(dtype))

    def grad(p, act, g):
        half = rule.half_operands
        if not (half and half_operands(act.dtype, g.dtype, dtype)):
            act, g = act.astype(dtype), g.astype(dtype)
        _, pull = jax.vjp(lambda q: replay_chain(plan, tap, q), p)
        (out,) = pull(rule.operand_grad(eqn, tap.pos, act, g, dtype))
        return out

    return grad


def layer_grad(layer_site, p, act, g):
    """The gradient of one layer's parameter ``p`` (the leaf's view) for one example,
    from its input ``act`` and output gradient ``g``."""
    _, pull = jax.vjp(lambda q: layer_site(q, act), p)
    return pull(g)[0]
