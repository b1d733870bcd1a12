"""The driver of ghost clipping: one backward pass, the norms, the clipped sum.

The whole clipped sum follows from what the norms were taken from:
``sum_i c_i x_i^T g_i`` is one contraction over the batch (and the tokens) per
ghost layer, and ``sum_i c_i G_i`` over the per-example gradients of the
others, with ``c_i = min(1, C / ||grad_i||)``. This is the "book-keeping" form
of Bu et al. 2023 ("Differentially private optimization on large model at
small cost", ICML): no second backward pass, and the norms and the sum come
from the very same stored values — so the bound on each clipped contribution
holds for exactly what is summed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from dpmp.clipping._replay import vary_like
from dpmp.clipping._rounding import certified_sum_of_squares, sum_of_squares, wide
from dpmp.clipping._weighted import after, clip_factors, weighted_examples, weighted_kept_sum
from dpmp.clipping.ghost._gram import cancellation_floor
from dpmp.clipping.ghost._layers import example_layer, forward, layer_grad, replay_chain, site, view
from dpmp.clipping.ghost._operands import half_operands, unscaled_norms
from dpmp.clipping.ghost._plan import GhostPlan, Tap
from dpmp.clipping.ghost._rule import is_float
from dpmp.clipping.ghost._tied import (
    cross_term,
    formed_cross_term,
    tied_clipped_sum,
    tied_sq_norm,
)
from dpmp.clipping.ghost._window import from_view
from dpmp.precision._stages import STAGES

__all__ = ["ghost_clipped_sum"]


def ghost_clipped_sum(
    plan: GhostPlan,
    *,
    params_leaves,
    others_leaves,
    batch_leaves,
    scale,
    is_padding,
    clip_norm: float,
    clip_dtype,
    sum_dtype,
    norm_dtype=None,
    out_dtype=None,
):
    """Clipped sum over one batch from activations and output gradients.

    Returns ``(sum_leaves, norms, finite, losses)``: the clipped sum as a list
    matching ``params_leaves`` (the contractions over examples accumulate in
    ``sum_dtype``; dense ghost layers' sums come back rounded to ``out_dtype``,
    by default ``sum_dtype``, the others in ``sum_dtype``), per-example norms of
    the unscaled gradient (``clip_dtype``; their squares added up in ``norm_dtype``, by default the
    clip dtype), finiteness and float32 losses. A 64-bit ``sum_dtype`` or
    ``norm_dtype`` is formed inside ``wide`` only.
    """
    norm_dtype = clip_dtype if norm_dtype is None else norm_dtype
    out_dtype = sum_dtype if out_dtype is None else out_dtype
    with jax.named_scope(STAGES["forward_backward"]):
        losses, acts, grads_out = _tapped_backward(
            plan, params_leaves, others_leaves, batch_leaves, scale, clip_dtype
        )
    acts32 = [None if a is None else _cast_act(a, clip_dtype) for a in acts]
    p32 = [view(plan, t, params_leaves[t.leaf]).astype(clip_dtype) for t in plan.taps]
    inv = (1 / scale.astype(clip_dtype)).astype(clip_dtype)
    unscale = functools.partial(_unscale, inv=inv, dtype=clip_dtype)
    with jax.named_scope(STAGES["norms"]):
        sq, formed = _squared_norms(
            plan, (acts, acts32), grads_out, p32, (unscale, inv), clip_dtype, norm_dtype
        )
        norms, finite, keep, factor = clip_factors(sq, is_padding, clip_norm, clip_dtype)

    reads = _Reads(plan, acts32, grads_out, p32, formed, unscale, factor, keep)
    with jax.named_scope(STAGES["clipped_sum"]):
        sums = _clipped_sums(reads, len(params_leaves), sum_dtype, out_dtype)
    for leaf in plan.unused:
        with wide(sum_dtype):
            sums[leaf] = jnp.zeros(jnp.shape(params_leaves[leaf]), sum_dtype)
    return sums, norms, finite, losses


def _unscale(g, *, inv, dtype):
    """``g`` in the clip dtype with the loss scale divided out (unscaled first)."""
    return g.astype(dtype) * inv


def _cast_act(a, dtype):
    return a.astype(dtype) if is_float(a.dtype) else a


def _tapped_backward(plan, params_leaves, others_leaves, batch_leaves, scale, clip_dtype):
    """``(losses, acts, grads)``: per example, the float32 loss; per tap, the stored
    operand (ghost and ``after`` taps) and the cotangent of its perturbation (the
    layer's output gradient, or for ``example`` taps its per-example parameter
    gradient in the clip dtype), loss scale still inside."""
    eqns = plan.jaxpr.jaxpr.eqns
    batch = jax.tree.leaves(batch_leaves)[0].shape[0]

    def zeros(t):
        if t.mode == "example":  # the cotangent is the gradient of the leaf's view
            shape = plan.view_shape(t, jnp.shape(params_leaves[t.leaf]))
            return jnp.zeros((batch,) + shape, clip_dtype)
        out = eqns[t.eqn].outvars[0].aval  # the cotangent is the layer's output gradient
        return jnp.zeros((batch,) + out.shape, out.dtype)

    # Inside shard_map the perturbations vary over the mesh axes the batch varies
    # over: their cotangents are this device's examples' own, never all-reduced.
    perturb = vary_like(tuple(zeros(t) for t in plan.taps), batch_leaves)
    layers = {
        k: example_layer(plan, t, clip_dtype)
        for k, t in enumerate(plan.taps)
        if t.mode == "example"
    }

    def one(pert, example):
        loss, acts = forward(plan, pert, (*params_leaves, *others_leaves, *example), layers)
        loss32 = jnp.asarray(loss).astype(jnp.float32)
        return loss32 * scale, (loss32, acts)

    def batched(pert):
        scaled, aux = jax.vmap(one)(pert, tuple(batch_leaves))
        return scaled, aux

    scaled, vjp_fn, (losses, acts) = jax.vjp(batched, perturb, has_aux=True)
    (grads_out,) = vjp_fn(jnp.ones_like(scaled))
    # The norms and the sum must read the same x_i and g_i: XLA may keep a
    # half-precision value unrounded inside one fusion (``xla_allow_excess_precision``)
    # and rounded in another, and the bound on each clipped contribution would then
    # hold for a slightly different vector than is summed. The barrier stops CSE from
    # merging these values with other copies, but it does not materialise them:
    # XLA:CPU removes barriers right after CSE (its ``cse_barrier_expander`` pass,
    # jaxlib 0.10.2), before fusion, which may recompute a value inside each consumer.
    # There every consumer runs the same elementwise code without fast-math, and
    # tests/test_ghost.py checks the half-precision bound on CPU. On GPUs it is
    # unverified.
    acts, grads_out = lax.optimization_barrier((acts, grads_out))
    return losses, acts, grads_out


def _squared_norms(plan, acts, grads_out, p32, unscale, clip_dtype, norm_dtype):
    """``(sq, formed)``: per example, the certified squared norm of the whole unscaled
    gradient (clip dtype), and per ``after`` tap the per-example gradients formed here.
    ``acts``: the stored operands as they are and cast to the clip dtype; ``unscale``:
    the function dividing the loss scale out of a cotangent, and its ``1 / S``.

    Layer by layer, from (x_i, g_i) alone. A non-finite entry of x_i or g_i makes
    the squared norm inf or NaN under every rule (inf * 0 is NaN), so
    ``isfinite(sq)`` is the overflow test.

    Per-example gradients (``example`` taps, and ``after`` taps, whose gradient is
    formed here and kept) are normed and summed from one tensor. Ghost norms carry
    their rounding error (``dpmp.clipping.ghost._gram.gram``) and a floor against
    cancellation (``cancellation_floor``): never below the exact norm of what is
    summed. The layers' squared norms are added up in ``norm_dtype`` (float64 by
    default) and the total made an upper bound of its exact value
    (``certified_sum_of_squares``) before it is rounded to the clip dtype.
    """
    formed = {}  # tap index -> that layer's per-example gradients, unscaled
    parts, terms, own = [], 0, {}  # own: tied tap index -> its (sq, m), unfloored
    (stored, acts32), (unscale, inv) = acts, unscale
    for k, (g, a, p) in enumerate(zip(grads_out, acts32, p32)):
        sq, m = _tap_sq_norm(
            plan, k, stored[k], a, g, p, (unscale, inv), formed, clip_dtype, norm_dtype
        )
        with wide(norm_dtype):
            if plan.tie(k) is not None:  # unfloored: its leaf's part is added below
                own[k] = (sq, jnp.sqrt(sq) if m is None else m)
                continue
            parts.append(sq if m is None else cancellation_floor(sq, m).astype(norm_dtype))
        terms += 1
    for tie in plan.ties:  # one part per tied leaf: both layers' terms and their cross term
        e, h = plan.taps[tie.embedding], plan.taps[tie.head]
        ids, dy = acts32[tie.embedding], unscale(grads_out[tie.embedding])
        gh = unscale(grads_out[tie.head])
        if h.mode == "ghost":
            cross = cross_term(
                plan.eqn(e), plan.eqn(h), h.pos, ids, dy, acts32[tie.head], gh, clip_dtype
            )
        else:  # the head's per-example gradient is formed
            cross = formed_cross_term(plan.eqn(e), ids, dy, gh, clip_dtype)
        with wide(norm_dtype):
            parts.append(tied_sq_norm(own[tie.embedding], own[tie.head], cross, norm_dtype))
        terms += 1
    with wide(norm_dtype):
        sq = parts[0]
        for part in parts[1:]:
            sq = sq + part
        sq = certified_sum_of_squares(sq, terms, norm_dtype).astype(clip_dtype)
    return sq, formed


def _tap_sq_norm(plan, k, stored, a, g, p, unscale, formed, clip_dtype, norm_dtype):
    """``(sq, m)`` of tap ``k``, per example: the certified squared norm of its unscaled
    gradient (``norm_dtype``) and, for a ghost norm, the magnitude its cancellation floor
    reads (``None`` where the gradient is formed: a formed gradient's norm is its
    magnitude). ``stored``, ``a``: the stored operand as it is and in the clip dtype;
    ``g``: the cotangent, scale inside; ``unscale``: the function and ``1 / S``. An
    ``after`` tap's gradient is formed here and kept in ``formed``."""
    tap = plan.taps[k]
    unscale, inv = unscale
    if tap.mode == "ghost" and _reads_half(tap, stored, g, clip_dtype):
        # The rule reads the stored half values; the scale leaves its results.
        eqn = plan.eqn(tap)
        ratio = tap.rule.magnitude_ratio(eqn, tap.pos, clip_dtype, norm_dtype)
        with wide(norm_dtype):
            sq_m = tap.rule.sq_norms(eqn, tap.pos, stored, g, clip_dtype, norm_dtype)
            return unscaled_norms(*sq_m, inv, clip_dtype, ratio)
    g = unscale(g)  # unscale first, in the clip dtype
    if tap.mode == "after":
        layer = site(plan, tap, clip_dtype)
        g = formed[k] = jax.vmap(lambda a_, g_: layer_grad(layer, p, a_, g_))(a, g)
    with wide(norm_dtype):
        if tap.mode == "ghost":
            return tap.rule.sq_norms(plan.eqn(tap), tap.pos, a, g, clip_dtype, norm_dtype)
        axes = tuple(range(1, g.ndim))  # this layer's per-example gradient
        return sum_of_squares(g, math.prod(g.shape[1:]), clip_dtype, norm_dtype, axes), None


def _reads_half(tap: Tap, a, g, clip_dtype) -> bool:
    """Whether the ghost rule of ``tap`` reads its stored operands in their half dtype
    (``dpmp.clipping.ghost._operands``), the loss scale still inside ``g``."""
    if not tap.rule.half_operands:
        return False
    return half_operands(a.dtype, g.dtype, clip_dtype) is not None


@dataclasses.dataclass(frozen=True)
class _Reads:
    """What the clipped sums read: the values the norms were taken from, and the factors.

    ``acts``, ``grads``, ``params``: per tap, the stored operand (clip dtype), the
    cotangent (scaled) and the parameter leaf's view (clip dtype, ``view``); ``formed``: per
    ``after`` tap, its per-example gradients; ``factor``, ``keep``: per example.
    """

    plan: GhostPlan
    acts: list[Any]
    grads: Any
    params: list[Any]
    formed: dict[int, Any]
    unscale: Callable
    factor: Any
    keep: Any


def _clipped_sums(reads: _Reads, n_leaves: int, sum_dtype, out_dtype) -> list[Any]:
    """The clip-weighted sum of every used leaf, from the SAME activations and output
    gradients the norms were taken from: one contraction over examples (and tokens)
    per layer.

    (A second backward pass could recompute g_i instead of keeping it. Under
    emulated or fused half precision the recomputed g_i can round differently
    from the measured one, so each layer's recomputed gradient would have to be
    measured again and weighted by c_i min(1, n_ik / n'_ik) for the bound to
    hold. Built and measured that way it kept more on XLA:CPU: the second pass
    keeps the pre-activations its ReLU masks need as well as the activations the
    sums need: 6,305,056 B of compiled temp memory for the float32 MLP of
    benchmarks/clipping.py, where this path needs 4,212,496 B.)

    Every kept example's x_i and g_i are finite (its squared norm is); a dropped
    example's may not be, and inf * 0 is NaN, so its rows are set to exactly 0
    with ``where`` before they are weighted or contracted.

    Dense ghost layers (the bulk of the values kept): ``where(kept, x)`` and
    ``where(kept, c * g)``, then one contraction (``GhostRule.clipped_sum``). Each
    is the last reader of x_i and g_i, so XLA writes both in place and the step
    keeps no copy of either (float32 MLP of benchmarks/clipping.py: 4,212,496 B of
    compiled temp memory against the non-private step's 4,194,304 B; 5,265,112 B
    when a ``cond`` chose between the weights alone and zero-filled copies: a
    conditional's branches cannot overwrite its operands, so each branch added its
    copies). Per-example gradients (``example`` and ``after`` taps) likewise:
    ``where(kept, g)`` and one contraction with the weights as a vector, or, summed
    wider than they are (float64), one fused reduction of ``where(kept, c * g)``
    (``weighted_kept_sum``). (Weighted inside a ``cond`` that zero-filled
    only when some squared norm was not finite, every such layer's code was in
    the program twice: the private LoRA step, whose adapters are all such
    layers, compiled 2.4x longer than its non-private step, 1.3x without.)

    Order. Layers are summed from the output back to the input (in the plan's
    equation order: a bias after its kernel's product comes first, so the
    kernel's contraction is the last reader of g_i), and each layer's sum reads
    the one summed just before it (``dpmp.clipping._weighted.after``, a
    dependency that changes no value). That makes XLA free each layer's x_i and
    g_i as soon as its own sum is done; left to itself, XLA:CPU schedules the sums
    input-first and keeps every layer's values until the last one (float32 MLP:
    8,177,360 B without the dependency).
    """
    plan, taps = reads.plan, reads.plan.taps
    eqns = plan.jaxpr.jaxpr.eqns
    with wide(sum_dtype):  # a 64-bit sum is formed here only
        sums = [None] * n_leaves
        before = None  # the sum done just before this one
        for k in sorted(range(len(taps)), key=lambda k: taps[k].eqn, reverse=True):
            tie = plan.tie(k)
            if tie is not None and taps[tie.head].mode == "ghost":
                if k == tie.head:  # both layers, a block of the table at a time
                    before = sums[tie.leaf] = _tied_sum(reads, tie, before, sum_dtype, out_dtype)
                continue
            # else a tied leaf's two layers add up in sum_dtype, rounded to out_dtype once
            out = out_dtype if tie is None else sum_dtype
            before = _layer_sum(reads, k, before, sum_dtype, out)
            # a sliced leaf: the view's sum, zero outside the window (exact)
            shape = plan.jaxpr.jaxpr.invars[taps[k].leaf].aval.shape
            leaf_sum = from_view(eqns, taps[k].window, shape, before)
            if sums[taps[k].leaf] is not None:
                leaf_sum = sums[taps[k].leaf] + leaf_sum
            sums[taps[k].leaf] = leaf_sum
    return sums


def _tied_sum(reads: _Reads, tie, before, sum_dtype, out_dtype):
    """The clip-weighted sum of a tied table whose head takes the Gram form
    (``dpmp.clipping.ghost._tied.tied_clipped_sum``)."""
    plan = reads.plan
    e, h = plan.taps[tie.embedding], plan.taps[tie.head]
    return tied_clipped_sum(
        plan.eqn(e),
        plan.eqn(h),
        h.pos,
        reads.acts[tie.embedding],
        reads.unscale(reads.grads[tie.embedding]),
        reads.acts[tie.head],
        reads.unscale(reads.grads[tie.head]),
        reads.factor,
        reads.keep,
        before,
        sum_dtype,
        out_dtype,
    )


def _layer_sum(reads: _Reads, k: int, before, sum_dtype, out_dtype):
    """The clip-weighted sum of tap ``k``'s parameter leaf's view (see ``_clipped_sums``)."""
    plan, tap = reads.plan, reads.plan.taps[k]
    g, a, p = reads.grads[k], reads.acts[k], reads.params[k]
    if tap.mode == "ghost" and tap.rule.clipped_sum is not None:
        eqn, factor, keep = plan.eqn(tap), reads.factor, reads.keep
        summed = tap.rule.clipped_sum(
            eqn, tap.pos, a, reads.unscale(g), factor, keep, before, sum_dtype, out_dtype
        )
        _, pull = jax.vjp(lambda q: replay_chain(plan, tap, q), p.astype(summed.dtype))
        (out,) = pull(summed.astype(out_dtype))
        return out
    if tap.mode in ("after", "example"):  # the per-example gradients the norm was taken from
        grads = reads.formed[k] if tap.mode == "after" else reads.unscale(g)
        return weighted_kept_sum(grads, reads.factor, after(reads.keep, before), sum_dtype)
    # Convolutions, embeddings and the like: non-finite entries set to 0.
    return _weighted_layer_sum(reads, tap, p, sum_dtype, *map(_zero_filled, (a, g)))


def _weighted_layer_sum(reads: _Reads, tap: Tap, p, sum_dtype, a, g):
    """``sum_i factor_i`` (this layer's gradient from x_i, g_i); every entry finite."""
    g = reads.unscale(g)
    p = p.astype(sum_dtype)
    if is_float(a.dtype):
        a = a.astype(sum_dtype)
    wg = weighted_examples(g, reads.factor, sum_dtype)
    layer = site(reads.plan, tap, sum_dtype)
    _, pull = jax.vjp(lambda q: jax.vmap(layer, (None, 0))(q, a), p)
    return pull(wg)[0]


def _zero_filled(x):
    if x is None or not is_float(x.dtype):
        return x
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))
