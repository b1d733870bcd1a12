"""Per-example clipping without per-example gradients ("ghost" clipping).

For a layer ``y = x W`` the gradient of one example's loss with respect to
``W`` is ``x_i^T g_i``, where ``g_i = dL_i/dy_i`` is the layer's output
gradient. Its norm needs neither ``x_i^T g_i`` nor any other per-example
gradient (Goodfellow 2015, "Efficient per-example gradient computations";
Li et al. 2022, "Large language models can be strong differentially private
learners", the Gram form for sequences):

* flat input (one token):  ``||x_i^T g_i||^2 = ||x_i||^2 ||g_i||^2``;
* T tokens:                ``||X_i^T G_i||_F^2 = <X_i X_i^T, G_i G_i^T>`` (two
  T x T Gram matrices);
* embedding rows:          ``sum_{t,s} [id_t = id_s] <g_t, g_s>``;
* convolutions: the same Gram form on image patches.

Per layer, whichever is smaller is used (Bu et al. 2022, "Scalable and
efficient training of large convolutional neural networks with differential
privacy", mixed ghost clipping): the ghost norm above, which keeps ``x_i`` and
``g_i`` (``T (K + N)`` numbers per example), or the layer's own per-example
gradient (``K N`` numbers), which is formed inside the backward pass where the
non-private step forms the batch gradient, so that this layer's ``x_i`` and
``g_i`` are never kept. Biases, norm scales and most convolution kernels take
the second route; wide dense layers and embeddings the first. A dense layer's
per-example gradient is one contraction over its tokens and a convolution
kernel's one per kernel offset (:func:`_example_grad`): ``vmap`` of the layer's
own transpose would give XLA:CPU a grouped convolution or a re-laid-out
operand, 1.2-3x slower than the batch gradient.

The whole clipped sum then follows from what the norms were taken from:
``sum_i c_i x_i^T g_i`` is one contraction over the batch (and the tokens) per
ghost layer, and ``sum_i c_i G_i`` over the per-example gradients of the
others, with ``c_i = min(1, C / ||grad_i||)``. This is the "book-keeping" form
of Bu et al. 2023 ("Differentially private optimization on large model at
small cost", ICML): no second backward pass, and the norms and the sum come
from the very same stored values — so the bound on each clipped contribution
holds for exactly what is summed.

How the layers are found. ``loss_fn`` stays an ordinary function (flax linen,
flax nnx or plain JAX). Its jaxpr for ONE example is traced and flattened
(``jit`` calls inlined); each parameter leaf is followed through layout-only
operations (``convert_element_type``, ``reshape``, ``broadcast_in_dim``,
``transpose``, ``squeeze``, ``expand_dims``, ``copy``) to the single equation
that uses it: a ``dot_general`` (dense layers, attention projections, einsum),
a ``conv_general_dilated`` (kernel), a ``gather`` (embedding), an ``add`` /
``sub`` (bias) or a ``mul`` (norm scale). A parameter used anywhere else — in
two places (tied weights), inside a ``scan``, a ``custom_jvp`` function,
``remat``, or by any other primitive — makes the model unsupported, and
``method="auto"`` falls back to per-example gradients: the norm is never
computed by a rule that does not hold.

Each ghost layer gets a zero "perturbation" added to its output, each other
layer a zero per-example "perturbation" whose cotangent its backward defines
as the per-example parameter gradient (a ``custom_vjp``); the gradient of the
summed, loss-scaled per-example losses with respect to the perturbations is
``g_i`` or the layer's per-example gradient for every layer and example, from
one backward pass that computes no batch parameter gradients. The other
equations are re-emitted by :func:`dpmp.clipping._replay.replay_bind`, which keeps
the batch axis of 1 out of reductions (XLA:CPU runs those 15-20x slower).

Precision. The forward pass and the output gradients stay in the compute
dtype; the activations and output gradients are cast to the clip dtype and
the loss scale is divided out (in float32) BEFORE any norm; Gram matrices,
norms and clip factors are computed in the clip dtype, the layers' squared
norms added up in ``norm_dtype`` and the clip-weighted contractions
accumulated in ``sum_dtype`` (both float64 by default, see
``dpmp.private_grad``'s ``accumulation``), with ``Precision.HIGHEST`` (no TF32
on GPUs). A float64 contraction of float32 values is within
``gamma_(B T) sum_i c_i sum_t |x_t| |g_t|`` of the exact sum, whatever order it
adds in; :meth:`GhostPlan.sum_rounding` gives the ``T`` and the factor by which
``sum_t |x_t| |g_t|`` may exceed the norm that clipped it, from which
``PrivateGradFn.sensitivity`` bounds the rounding of the whole sum.

Certified norms. A per-example gradient that is formed (the vmap path, and
every ``per-example`` layer here) is normed and summed from one tensor, and
its sum of squares made an upper bound of the exact one
(:func:`certified_sum_of_squares`), so its clipped contribution is bounded by
construction. A ghost norm is a formula
instead, and over several tokens it can cancel: with equal activations and
output gradients ``(h, -h, e)`` the Gram terms are ``|x|^2 |h|^2`` while the
norm is ``|x| |e|``, and float32 rounding of the large terms can leave an
estimate far below the norm, or negative (NaN after the square root). So
each ghost rule returns its computed value PLUS a bound on its rounding error
(Higham's ``gamma_n`` bounds, see :func:`_gram`), never below the exact
squared norm; and the clip factor takes each ghost layer's norm as at least
``sum_t |x_t| |g_t| / 64`` (:func:`_certified`), which keeps the rounding of
the clip-weighted contraction of a cancelling example below ``64 u C``. A
negative or NaN value counts as overflow: the example is dropped and counted.
The stats' norms are these certified upper bounds. On ordinary examples the
bound adds about ``(K + N + T^2) u`` relative (0.08% of the norm on a
64-token transformer; nothing on single-token layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from dpmp.clipping._replay import aval, bind, inline, replay_bind, vary_like

__all__ = [
    "GhostPlan",
    "Unsupported",
    "ghost_clipped_sum",
    "plan_ghost",
    "weighted_example_sum",
]

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
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
_CONV_CHUNK = 64  # examples per step when convolution norms are taken from image patches
# A convolution with few input features (I) gives each kernel offset's contraction an
# [I, O] output that XLA:CPU computes far below matmul speed (RGB input: 9 offsets of
# [3, 16] took 24 ms of the 87 ms ghost step of benchmarks/clipping.py's CNN). Up to
# this many rows, the offsets along the last kernel dim are contracted together
# ([k, I, O]): that CNN's ghost step 1.17x -> 1.02x the non-private one (f32) at the
# same temp memory; at I k = 48 (its second convolution) it was slower and larger.
_ROW_FEATURES = 16
_CANCELLATION = 64.0  # a ghost layer's norm is at least sum_t |x_t| |g_t| / 64 (_certified)
# The Gram bound's terms grow like (T^2 + K + N) u in the worst case (the bound of
# gamma_K E_K, with E_K up to T times the norm): past 5% (T above ~900 tokens in
# float32) the layer forms its per-example gradient.
_U32 = 2.0**-24
_MAX_GAMMA = 0.05


class Unsupported(ValueError):
    """The model has a parameterised operation ghost clipping has no rule for."""


@dataclasses.dataclass(frozen=True)
class _Tap:
    """One parameter leaf and the equation that consumes it."""

    leaf: int  # index of the parameter leaf
    path: str  # its pytree path, for messages
    chain: tuple[int, ...]  # equation indices of layout ops from the leaf to the layer
    eqn: int  # the layer equation
    pos: int  # operand position of the (transformed) parameter in it
    rule: str  # "dot" | "conv" | "embed" | "generic"
    kind: str  # a readable layer kind
    mode: str  # "ghost" (norm from stored x_i, g_i) | "example" (own per-example gradient)


@dataclasses.dataclass(frozen=True, eq=False)
class GhostPlan:
    """The flattened per-example jaxpr and, for each parameter leaf, its layer.

    Attributes:
      jaxpr: the flat per-example ``ClosedJaxpr`` (inputs: parameter leaves,
        other-argument leaves, example leaves; output: the float32 loss).
      taps: one ``_Tap`` per used floating parameter leaf.
      unused: indices of parameter leaves the loss does not use (zero gradient).
    """

    jaxpr: Any
    taps: tuple[_Tap, ...]
    unused: tuple[int, ...]

    def sum_rounding(self, clip_dtype, norm_dtype=None) -> tuple[int, float]:
        """``(rows, cancellation)``: what bounds the rounding of the clipped sum.

        ``rows``: the most rows one example adds to one contraction over the
        batch (a ghost layer's tokens, patches or ids; 1 where the layer's
        per-example gradient is formed). ``cancellation``: the most that
        ``sum_rows |x_t| |g_t|`` (what the contraction's rounding is proportional
        to) can exceed the norm the clip factor used for that layer: 1 where the
        gradient is formed or the layer has one row, else ``64 / lambda`` with
        ``lambda`` the float32 rounding of the magnitude ``m`` (:func:`_certified`,
        :func:`_magnitude_ratio`); ``inf`` when no bound exists.
        """
        rows, cancellation = 1, 1.0
        for tap in self.taps:
            if tap.mode != "ghost" or tap.rule == "generic":
                continue
            eqn = self.jaxpr.jaxpr.eqns[tap.eqn]
            t = _ghost_rows(eqn, tap)
            rows = max(rows, t)
            if t > 1:
                ratio = _magnitude_ratio(eqn, tap, clip_dtype, norm_dtype or clip_dtype)
                cancellation = max(cancellation, _CANCELLATION / ratio if ratio > 0 else math.inf)
        return rows, cancellation

    def layers(self) -> list[dict[str, str]]:
        """One row per parameter leaf: its path, layer kind and norm rule."""
        return [
            {"param": t.path, "layer": t.kind, "rule": _RULE_NAMES[t.rule, t.mode]}
            for t in self.taps
        ]


# ---- the plan ------------------------------------------------------------------------


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def plan_ghost(example_loss: Callable, params, others, example) -> GhostPlan:
    """Trace ``example_loss(params, others, *example)`` for one example and find the layers.

    ``params``, ``others`` and ``example`` may be arrays or ``ShapeDtypeStruct``s
    (``example`` without the batch axis). Raises :class:`Unsupported` naming
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
    taps, unused = _find_taps(flat.jaxpr, len(p_leaves), paths)
    return GhostPlan(flat, tuple(taps), tuple(unused))


def _find_taps(jaxpr, n_params: int, paths) -> tuple[list[_Tap], list[int]]:
    uses: dict[Any, list[tuple[int, int]]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for pos, v in enumerate(eqn.invars):
            if not isinstance(v, jax_core.Literal):
                uses.setdefault(v, []).append((i, pos))
    outs = {v for v in jaxpr.outvars if not isinstance(v, jax_core.Literal)}
    param_vars = set(jaxpr.invars[:n_params])
    taps, unused, claimed = [], [], {}
    for leaf, v in enumerate(jaxpr.invars[:n_params]):
        path = paths[leaf]
        if not _is_float(v.aval.dtype):
            raise Unsupported(f"parameter {path}: dtype {v.aval.dtype} is not floating")
        chain = []
        while True:
            if v in outs:
                raise Unsupported(f"parameter {path}: returned by the loss function")
            here = uses.get(v, [])
            if not here:
                if chain:
                    raise Unsupported(f"parameter {path}: transformed but unused")
                unused.append(leaf)
                break
            if len(here) > 1:
                raise Unsupported(
                    f"parameter {path}: used {len(here)} times (shared or tied weights); "
                    "ghost clipping needs each parameter in exactly one layer"
                )
            i, pos = here[0]
            eqn = jaxpr.eqns[i]
            name = eqn.primitive.name
            if name in _LAYOUT and pos == 0:
                chain.append(i)
                v = eqn.outvars[0]
                continue
            rule, kind = _rule(eqn, pos, chain, jaxpr, path)
            others = [u for k, u in enumerate(eqn.invars) if k != pos]
            for u in others:
                if u in param_vars:
                    raise Unsupported(f"parameter {path}: {name} of two parameters")
            if i in claimed:
                raise Unsupported(f"parameter {path}: {name} also takes parameter {claimed[i]}")
            claimed[i] = path
            mode = _mode(eqn, pos, rule)
            taps.append(_Tap(leaf, path, tuple(chain), i, pos, rule, kind, mode))
            break
    return taps, unused


def _rule(eqn, pos, chain, jaxpr, path) -> tuple[str, str]:
    name = eqn.primitive.name
    bijective = all(jaxpr.eqns[i].primitive.name in _BIJECTIVE for i in chain)
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        other = eqn.invars[1 - pos]
        if not _is_float(other.aval.dtype):
            raise Unsupported(f"parameter {path}: dot_general with a non-float operand")
        if bijective and not lb and not rb:
            return "dot", "dense"
        return "generic", "dense (batched)"
    if name == "conv_general_dilated":
        if pos != 1:
            raise Unsupported(f"parameter {path}: used as the input of a convolution")
        p = eqn.params
        if bijective and p["feature_group_count"] == 1 and p["batch_group_count"] == 1:
            return "conv", "conv"
        return "generic", "conv (grouped)"
    if name == "gather":
        if pos != 0:
            raise Unsupported(f"parameter {path}: used as gather indices")
        if bijective and _is_embedding_gather(eqn):
            return "embed", "embedding"
        return "generic", "gather"
    if name in ("add", "sub"):
        return "generic", "bias"
    if name == "mul":
        return "generic", "scale"
    raise Unsupported(
        f"parameter {path}: used by {name!r}, for which ghost clipping has no rule "
        "(supported: dense/einsum, convolution, embedding, bias, norm scale)"
    )


def _is_embedding_gather(eqn) -> bool:
    op, idx = eqn.invars
    if len(op.aval.shape) != 2:
        return False
    dn = eqn.params["dimension_numbers"]
    out_nd = len(eqn.outvars[0].aval.shape)
    return (
        tuple(dn.offset_dims) == (out_nd - 1,)
        and tuple(dn.collapsed_slice_dims) == (0,)
        and tuple(dn.start_index_map) == (0,)
        and not tuple(getattr(dn, "operand_batching_dims", ()))
        and tuple(eqn.params["slice_sizes"]) == (1, op.aval.shape[1])
        and idx.aval.shape[-1] == 1
    )


# How each (rule, mode) takes its norm, as ``explain()`` reports it.
_RULE_NAMES = {
    ("dot", "ghost"): "gram",  # ||x||^2 ||g||^2 for one token, <X X^T, G G^T> for several
    ("conv", "ghost"): "patch-gram",  # the Gram form on image patches
    ("embed", "ghost"): "id-gram",  # sum over equal ids of <g_t, g_s>
    ("generic", "ghost"): "per-example",  # integer operand: the layer's gradient after the pass
    ("dot", "example"): "per-example",
    ("conv", "example"): "per-example",
    ("generic", "example"): "per-example",
}


def _tkn(eqn, pos, rule) -> tuple[int, int, int]:
    """A dense or convolution layer's (tokens T, fan-in K, fan-out N) for one example."""
    w = eqn.invars[pos].aval.shape
    if rule == "conv":
        out = eqn.outvars[0].aval.shape
        spec = eqn.params["dimension_numbers"].out_spec
        n = out[spec[1]]
        t = out[spec[0]] * math.prod(out[d] for d in spec[2:])
        return t, math.prod(w) // n, n
    (lc, rc), _ = eqn.params["dimension_numbers"]
    a = eqn.invars[1 - pos].aval.shape
    k = math.prod(a[d] for d in (rc if pos == 0 else lc))
    return math.prod(a) // k, k, math.prod(w) // k


def _ghost_rows(eqn, tap: _Tap) -> int:
    """The rows one example adds to a ghost layer's contraction: tokens, patches or ids."""
    if tap.rule == "embed":
        return math.prod(eqn.invars[1].aval.shape)
    return _tkn(eqn, tap.pos, tap.rule)[0]


def _magnitude_ratio(eqn, tap: _Tap, dtype, wide_dtype) -> float:
    """``lambda``: the computed magnitude ``m`` of a ghost layer with several rows is at
    least ``lambda sum_t |x_t| |g_t|`` (exact), and ``fl((m / 64)^2)`` at least
    ``lambda^2 (m_exact / 64)^2``.

    Dense and convolution (:func:`_gram`): ``|x_t|``, ``|g_t|`` are square roots of
    dot products of length K and N, their products summed over T rows, so
    ``lambda = sqrt((1 - g_K)(1 - g_N)) (1 - g_T) (1 - u)^4``. Embedding
    (:func:`_sq_norm_embed`): ``m = ||R_abs||_F``; the Gram form bounds it through
    row sums (``sqrt((1 - g_D)(1 - g_2T)) (1 - u)^4``), the table form through a
    scatter-add of T rows and a sum of V D squares in the wide dtype
    (``(1 - g_T) sqrt(1 - g'_{V D}) (1 - u)^3``). ``g_n`` is :func:`higham_gamma`
    in ``dtype``, ``g'_n`` in ``wide_dtype``.
    """
    u = unit_roundoff(dtype)

    def keep(n):  # 1 - gamma_n, or 0 where no bound exists
        return max(0.0, 1.0 - higham_gamma(n, dtype))

    if tap.rule == "embed":
        vocab, dim = eqn.invars[0].aval.shape
        t = _ghost_rows(eqn, tap)
        if t * t <= vocab * dim:
            return math.sqrt(keep(dim) * keep(2 * t)) * (1 - u) ** 4
        wide_keep = max(0.0, 1.0 - higham_gamma(vocab * dim, wide_dtype))
        return keep(t) * math.sqrt(wide_keep) * (1 - u) ** 3
    t, k, n = _tkn(eqn, tap.pos, tap.rule)
    return math.sqrt(keep(k) * keep(n)) * keep(t) * (1 - u) ** 4


def _mode(eqn, pos, rule) -> str:
    """Ghost norm from stored (x_i, g_i), or the layer's own per-example gradient.

    Per layer, the smaller of the two (Bu et al. 2022, "mixed ghost clipping"):
    a dense or convolution layer stores T (K + N) numbers per example for the
    ghost norm and K N for its per-example gradient, and the Gram form costs
    about T^2 (K + N) against T K N. Biases and norm scales are always cheaper
    per example, and so is a layer on so many tokens that the Gram form's
    rounding bound (:func:`_gram`) would exceed 5%. The per-example gradient of
    a layer is formed inside the backward pass (as the non-private step forms
    the batch gradient), so its x_i and g_i are never kept.
    """
    if rule == "embed":
        return "ghost"
    act = eqn.invars[1 - pos]  # a gather's parameter is its operand (pos 0): act = indices
    if not _is_float(act.aval.dtype):
        return "ghost"
    if rule in ("dot", "conv"):
        t, k, n = _tkn(eqn, pos, rule)
        if (t * t + k + n + 1) * _U32 > _MAX_GAMMA:  # the Gram bound would be too loose
            return "example"
        return "example" if k * n <= t * (k + n) else "ghost"
    return "example"


# ---- evaluation ---------------------------------------------------------------------


def _forward(plan: GhostPlan, perturb, leaves, layers):
    """One example: the loss and, per ghost tap, the activation operand.

    Ghost taps get ``perturb[k]`` added to their output; per-example taps are
    computed by ``layers[k]`` (see :func:`_example_layer`), which gives the
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
            return [layers[k](invals[tap.pos], leaves[tap.leaf], invals[1 - tap.pos], perturb[k])]
        acts[k] = invals[1 - tap.pos]
        return [bind(eqn, invals)[0] + perturb[k]]

    (loss,) = inline(jaxpr, plan.jaxpr.consts, *leaves, emit=emit)
    return loss, tuple(acts)


def _example_layer(plan: GhostPlan, tap: _Tap, dtype) -> Callable:
    """``layer(w, p, act, delta)``: the tap's output; ``delta``'s cotangent is the
    gradient of the parameter leaf ``p`` for this example, in ``dtype``.

    The forward is the layer as traced (``w`` is the parameter as it reaches
    the layer, in the compute dtype). The backward returns the usual input
    gradient and, in place of the parameter gradient, this example's own one,
    from ``x_i`` and ``g_i`` cast to ``dtype`` (loss scale still inside) with
    ``Precision.HIGHEST``. Under ``vmap`` this is the batched per-example weight
    gradient that per-example clipping forms, for this one layer, inside the
    backward pass: neither ``x_i`` nor ``g_i`` outlives it.
    """
    eqn = plan.jaxpr.jaxpr.eqns[tap.eqn]
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
        d_p = param_grad(p.astype(dtype), act.astype(dtype), g.astype(dtype))
        return jnp.zeros_like(w), jnp.zeros_like(p), d_act, d_p

    layer.defvjp(fwd, bwd)
    return layer


def _replay_chain(plan: GhostPlan, tap: _Tap, p):
    """The layout ops from a parameter leaf to its layer, casts skipped (``p``'s dtype stays)."""
    for i in tap.chain:
        e = plan.jaxpr.jaxpr.eqns[i]
        if e.primitive.name != "convert_element_type":
            (p,) = replay_bind(e, [p])
    return p


def _site(plan: GhostPlan, tap: _Tap, dtype) -> Callable:
    """``site(param_leaf, act) -> layer output`` for one example, computed in ``dtype``."""
    eqns = plan.jaxpr.jaxpr.eqns

    def site(p, act):
        x = _replay_chain(plan, tap, p)
        e = eqns[tap.eqn]
        name = e.primitive.name
        over = {}
        if name in ("dot_general", "conv_general_dilated"):
            over = {"precision": _HIGHEST, "preferred_element_type": dtype}
        ins = [None, None]
        ins[tap.pos] = x
        ins[1 - tap.pos] = act  # for a gather: the indices (the parameter is operand 0)
        (out,) = bind(e, ins, **over) if over else replay_bind(e, ins)
        return out

    return site


def _example_grad(plan: GhostPlan, tap: _Tap, dtype) -> Callable:
    """``grad(p, act, g)``: one example's gradient of the parameter leaf ``p``, in ``dtype``.

    A dense layer's is one contraction over its tokens (:func:`_dot_kernel_grad`),
    a convolution kernel's one per kernel offset (:func:`_conv_kernel_grad`),
    each then pulled back through the layout operations from the leaf to the
    layer; any other layer's is the vjp of the layer itself.
    """
    eqn = plan.jaxpr.jaxpr.eqns[tap.eqn]
    if tap.rule == "conv":
        operand_grad = lambda act, g: _conv_kernel_grad(eqn, act, g, dtype)  # noqa: E731
    elif tap.rule == "dot":
        operand_grad = lambda act, g: _dot_kernel_grad(eqn, tap.pos, act, g, dtype)  # noqa: E731
    else:
        site = _site(plan, tap, dtype)
        return lambda p, act, g: _layer_grad(site, p, act, g)

    def grad(p, act, g):
        _, pull = jax.vjp(lambda q: _replay_chain(plan, tap, q), p)
        (out,) = pull(operand_grad(act, g))
        return out

    return grad


def _conv_kernel_grad(eqn, x, g, dtype):
    """One example's kernel gradient of a convolution (one group), laid out as the kernel.

    ``dW[o, i, k] = sum_{n, y} g[n, o, y] x_pad[n, i, y * stride + k * rhs_dilation]``
    (``x_pad``: ``x`` padded, ``lhs_dilation`` as interior padding): per kernel
    offset ``k``, one contraction of the input slice that offset reads with ``g``
    over the example's batch and spatial dims, in ``dtype`` with
    ``Precision.HIGHEST``. It is the sum the convolution's own transpose
    computes; but under ``vmap`` that transpose becomes a grouped convolution
    (``feature_group_count = B``), which XLA:CPU runs 1.5-3x slower than the
    batch's kernel gradient, while each offset here is one batched matrix
    product. Where windows overlap the offsets are a loop (``lax.map``), so that
    one slice, the size of the output times the input features, exists at a
    time: image patches, or all slices unrolled, hold them all (+44 MB on the
    CNN of benchmarks/clipping.py at batch 256, 2/3 of its non-private step's).
    With few input features the loop takes a row of offsets at a time (the last
    kernel dim's, ``_ROW_FEATURES``), so that each contraction has k I rows.
    """
    p = eqn.params
    dn = p["dimension_numbers"]
    sp_in = dn.lhs_spec[2:]
    window = tuple(eqn.invars[1].aval.shape[d] for d in dn.rhs_spec[2:])
    out_sp = tuple(eqn.outvars[0].aval.shape[d] for d in dn.out_spec[2:])
    config = [(0, 0, 0)] * x.ndim
    for s, d in enumerate(sp_in):
        lo, hi = p["padding"][s]
        config[d] = (lo, hi, p["lhs_dilation"][s] - 1)
    xp = lax.pad(x, jnp.zeros((), x.dtype), config)
    size, strides = list(xp.shape), [1] * x.ndim
    for s, d in enumerate(sp_in):
        size[d] = (out_sp[s] - 1) * p["window_strides"][s] + 1
        strides[d] = p["window_strides"][s]
    x_c = (dn.lhs_spec[0], *sp_in)  # batch and spatial dims, contracted
    g_c = (dn.out_spec[0], *dn.out_spec[2:])

    def contract(xs, lead=0):  # [lead dims..., I, O]
        dims = tuple(c + lead for c in x_c)
        return lax.dot_general(
            xs, g, ((dims, g_c), ((), ())), precision=_HIGHEST, preferred_element_type=dtype
        )

    def static_offset(start):  # start: the offset times the kernel dilation, per spatial dim
        begin = [0] * x.ndim
        for s, d in enumerate(sp_in):
            begin[d] = int(start[s])
        return contract(lax.slice(xp, begin, [b + n for b, n in zip(begin, size)], strides))

    def run_of_offsets(start, k):  # the k offsets from ``start`` along the last kernel dim
        d_last, dil = sp_in[-1], p["rhs_dilation"][-1]
        begin = [jnp.asarray(0, jnp.int32)] * x.ndim
        for s, d in enumerate(sp_in):
            begin[d] = start[s]
        span = list(size)
        span[d_last] += (k - 1) * dil
        xr = lax.dynamic_slice(xp, begin, span)  # under vmap a gather
        slices = []
        for j in range(k):
            lo = [0] * x.ndim
            lo[d_last] = j * dil
            slices.append(lax.slice(xr, lo, [a + n for a, n in zip(lo, size)], strides))
        return contract(jnp.stack(slices), lead=1)  # [k, I, O]

    starts = np.array(list(np.ndindex(*window)), np.int32) * np.array(p["rhs_dilation"], np.int32)
    starts = starts.reshape(-1, len(window))
    reach = [(k - 1) * r + 1 for k, r in zip(window, p["rhs_dilation"])]
    if all(k <= st for k, st in zip(reach, p["window_strides"])):
        # Windows that do not overlap (patch embeddings): the slices together are no
        # larger than the input, and unrolled they need no loop and no gather.
        per_offset = jnp.stack([static_offset(start) for start in starts])
    else:
        # Few input features: a row of offsets per contraction (``_ROW_FEATURES``).
        k = window[-1] if x.shape[dn.lhs_spec[1]] * window[-1] <= _ROW_FEATURES else 1
        runs = lax.map(lambda start: run_of_offsets(start, k), jnp.asarray(starts[::k]))
        per_offset = runs.reshape((-1,) + runs.shape[2:])
    kio = per_offset.reshape(window + per_offset.shape[1:])  # [k..., I, O]
    dims = (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])  # the kernel dim of each axis
    return jnp.transpose(kio, np.argsort(dims))


def _layer_grad(site, p, act, g):
    """The gradient of one layer's parameter leaf ``p`` for one example, from its
    input ``act`` and output gradient ``g``."""
    _, pull = jax.vjp(lambda q: site(q, act), p)
    return pull(g)[0]


def weighted_example_sum(x, factor, keep, dtype):
    """``sum_i factor_i x_i`` over the leading (example) axis, in ``dtype``.

    Examples not kept add exactly zero: ``where``, not a multiply by 0, since an
    overflowed example's ``inf * 0`` would be NaN.
    """
    return jnp.sum(_kept_rows(_weighted_examples(x, factor, dtype), keep), axis=0)


def _kept_rows(x, keep):
    """``x`` with the rows (leading axis) of examples not kept set to exactly 0."""
    rows = keep.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(rows, x, jnp.zeros_like(x))


def _after(keep, before):
    """``keep``, made to read ``before`` (the sum done just before) without changing:
    a scheduling dependency (see the ordering note in :func:`ghost_clipped_sum`)."""
    if before is None or not before.size:
        return keep
    b = before.ravel()[0]
    return keep & (jnp.isnan(b) | ~jnp.isnan(b))


def _weighted_examples(x, factor, dtype):
    """``factor_i x_i`` per example in ``dtype`` (a non-finite ``x_i`` stays non-finite)."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    return x.astype(dtype) * factor.astype(dtype).reshape(shape)


def _weighted_example_dot(x, factor, dtype):
    """``sum_i factor_i x_i`` as one contraction over the example axis, in ``dtype``
    (every ``x_i`` finite): no weighted copy of ``x`` is formed. Wider than ``x``
    (float64), a reduction instead: XLA:CPU fuses the widening, the product and the
    sum into it, where a float64 contraction would first copy ``x`` to float64."""
    if jnp.dtype(dtype) != x.dtype:
        return jnp.sum(_weighted_examples(x, factor, dtype), axis=0)
    return lax.dot_general(
        factor.astype(dtype),
        x.astype(dtype),
        (((0,), (0,)), ((), ())),
        precision=_HIGHEST,
        preferred_element_type=dtype,
    )


def _cast_act(a, dtype):
    return a.astype(dtype) if _is_float(a.dtype) else a


def _dot_operands(eqn, pos, a, g):
    """One example's activation and output gradient of a dense layer as A [T, K], G [T, N].

    T are the activation's free dims (tokens), K its contracting dims in the order
    the parameter's contracting dims pair with them, N the parameter's free dims;
    the parameter's per-example gradient is ``A^T G`` laid out [K, N].
    """
    (lc, rc), _ = eqn.params["dimension_numbers"]
    ca = tuple(rc if pos == 0 else lc)
    fa = tuple(d for d in range(a.ndim) if d not in ca)
    t = math.prod(a.shape[d] for d in fa)
    k = math.prod(a.shape[d] for d in ca)
    n = g.size // max(t, 1)
    am = jnp.transpose(a, fa + ca).reshape(t, k)
    gm = g.reshape(t, n) if pos == 1 else g.reshape(n, t).T
    return am, gm


def _sq_norm_dot(eqn, pos, a, g, dtype, wide_dtype):
    """Certified ``||per-example grad||^2`` of the dot_general's parameter operand for one
    example, and the magnitude ``sum_t |x_t| |g_t|`` (see :func:`_gram`)."""
    return _gram(*_dot_operands(eqn, pos, a, g), dtype, wide_dtype)


def _gamma(n: int, dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` for the unit roundoff ``u`` of ``dtype``.

    A dot product of length ``n`` computed in floating point, summed in any
    order, is within ``gamma_n |x|.|y|`` of the exact one (Higham 2002,
    "Accuracy and Stability of Numerical Algorithms", Eq. 3.5). Capped at 1 when
    ``n u >= 1/2``, which only an unsafe (below float32) clip dtype reaches: the
    plan keeps float32 bounds below 5% (:func:`_mode`).
    """
    nu = n * unit_roundoff(dtype)
    return nu / (1 - nu) if nu < 0.5 else 1.0


def unit_roundoff(dtype) -> float:
    """``u = 2^-p`` for a dtype with ``p`` significand bits (float32: 2^-24, float64: 2^-53)."""
    return float(jnp.finfo(dtype).eps) / 2


def higham_gamma(n: int, dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` of ``dtype``, ``inf`` when ``n u >= 1``:
    the relative error bound of a sum of ``n + 1`` terms (or of a dot product of
    length ``n``) added in any order (Higham 2002, Lemma 3.1 and Eq. 3.5)."""
    nu = max(n, 0) * unit_roundoff(dtype)
    return nu / (1 - nu) if nu < 1 else math.inf


def wide(dtype):
    """A context in which values of ``dtype`` can be formed: ``jax.enable_x64`` for a
    64-bit dtype (which JAX otherwise truncates to 32 bits), else nothing.

    Only reductions run inside it; the loss and its gradients are traced outside,
    so that a model's own constants keep the dtypes the user gave them.
    """
    if jnp.dtype(dtype).itemsize >= 8 and not jax.config.jax_enable_x64:
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def certified_sum_of_squares(sq, terms: int, dtype, term_dtype=None):
    """An upper bound of the exact value of ``sq``, a sum of ``terms`` non-negative
    numbers (squares, products of norms) computed in ``dtype`` in any order.

    A sum of non-negative terms is never below the exact one by more than a
    factor ``1 - gamma_terms`` (:func:`higham_gamma`; the rounding of each square is
    one more term of it), so ``sq / (1 - gamma)`` bounds it from above; the factor
    is rounded up by ``(1 + 8 u)``, which covers the rounding of the constant and of
    the multiply. ``term_dtype``: each term was rounded to it (relative
    ``u_term``) before the sum, which a factor ``1 + 2 u_term`` covers (squares
    taken in float32 and added in float64, so that XLA need not keep a float64
    copy of what is squared). In float64 this changes a float32 norm by at most a
    few ulps; in float32, a norm over ``P`` entries grows by up to ``P u / 2``
    relative. Raises ``ValueError`` when ``gamma_terms >= 1/2``: no useful bound
    exists.
    """
    gamma = higham_gamma(terms + 2, dtype)
    if not gamma < 0.5:
        raise ValueError(
            f"a squared norm over {terms:,} terms computed in {jnp.dtype(dtype).name} has no "
            "useful rounding bound (n u >= 1/3); accumulate it in float64 "
            "(private_grad(accumulation='float64'), the default)"
        )
    factor = (1 + 8 * unit_roundoff(dtype)) / (1 - gamma)
    if term_dtype is not None:
        factor *= 1 + 2 * unit_roundoff(term_dtype)
    return sq * jnp.asarray(factor, sq.dtype)


def _gram(am, gm, dtype, wide_dtype):
    """Certified ``||A^T G||_F^2`` for A [T, K], G [T, N], and ``m = sum_t |a_t| |g_t|``.

    One token: ``||a||^2 ||g||^2``, a product of two sums of squares (no
    cancellation), each accumulated in ``wide_dtype`` and made an upper bound
    (:func:`certified_sum_of_squares`); ``m`` is then the norm itself. Several tokens: the Gram
    form ``S = <A A^T, G G^T> = sum_{t,s} P_ts Q_ts`` mixes signs and can cancel
    (equal ``a_t`` with ``g = (h, -h, e)`` has ``S = |a|^2 |e|^2`` from terms of size
    ``|a|^2 |h|^2``), so the computed ``S^`` comes with a bound on its error and
    ``S^ + bound`` is returned, never below the exact ``S``. With ``P^, Q^`` the
    computed Gram matrices, ``|P^_ts - P_ts| <= gamma_K |a_t| |a_s|`` and
    ``|Q^_ts - Q_ts| <= gamma_N |g_t| |g_s|`` (:func:`_gamma`), so::

        |S - S^| <= gamma_K  sum_ts |a_t||a_s| |Q^_ts|       (errors of P)
                  + gamma_N  sum_ts |g_t||g_s| |P^_ts|       (errors of Q)
                  + gamma_2T sum_ts |P^_ts Q^_ts|            (the final sum)
                  + gamma_K gamma_N m^2                       (second order)

    with ``|a_t|, |g_t|`` read off the Gram diagonals. The final sum is T row dot
    products ``sum_s P^_ts Q^_ts`` (one ``dot_general``, length T) and then a sum of
    T rows, so its error is within ``gamma_2T``, whatever order XLA adds in; one
    flat reduction of the T^2 products could only be bounded by ``gamma_{T^2}``.
    The bound is doubled, which covers the rounding of the bound itself and of
    those norms. On ordinary inputs the extra terms are the size of the diagonal,
    so the bound adds about ``(K + N + 2T) u`` relative; on a cancelling example it
    grows with the cancelled terms, and the example is clipped as hard as they
    require.
    """
    t, k = am.shape
    n = gm.shape[1]
    if t == 1:
        with wide(wide_dtype):
            sa = _sum_of_squares(am, k, dtype, wide_dtype)
            sg = _sum_of_squares(gm, n, dtype, wide_dtype)
            sq = certified_sum_of_squares(sa * sg, 0, wide_dtype).astype(dtype)
        return sq, jnp.sqrt(sq)
    gram = lambda x: lax.dot_general(  # noqa: E731
        x, x, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=dtype
    )
    p, q = gram(am), gram(gm)
    na = jnp.sqrt(jnp.maximum(jnp.diagonal(p), 0))
    ng = jnp.sqrt(jnp.maximum(jnp.diagonal(q), 0))
    m = jnp.sum(na * ng)
    # The bound's terms are sums of non-negative numbers (rounding there is covered
    # by the doubling), taken elementwise: no reduced-precision (TF32) matmul.
    err = (
        _gamma(k, dtype) * jnp.sum(na[:, None] * jnp.abs(q) * na[None, :])
        + _gamma(n, dtype) * jnp.sum(ng[:, None] * jnp.abs(p) * ng[None, :])
        + _gamma(2 * t, dtype) * jnp.sum(jnp.abs(p * q))
        + _gamma(k, dtype) * _gamma(n, dtype) * m * m
    )
    return _row_dot_sum(p, q, dtype) + 2 * err, m


def _sum_of_squares(x, terms: int, dtype, wide_dtype, axis=None):
    """Certified sum of squares of ``x`` (``terms`` entries per sum) in ``wide_dtype``:
    squared in ``dtype`` and then widened, not widened and then squared, so that
    the widened ``x`` is not a value XLA can share with (and keep for) another
    consumer of ``x``: it stays inside the reduction."""
    sq = jnp.sum(jnp.square(x.astype(dtype)).astype(wide_dtype), axis=axis)
    same = jnp.dtype(dtype) == jnp.dtype(wide_dtype)
    return certified_sum_of_squares(sq, terms, wide_dtype, None if same else dtype)


def _row_dot_sum(p, q, dtype):
    """``sum_ts p_ts q_ts`` as T row dot products then a sum of T (error <= gamma_2T)."""
    rows = lax.dot_general(
        p, q, (((1,), (1,)), ((0,), (0,))), precision=_HIGHEST, preferred_element_type=dtype
    )
    return jnp.sum(rows)


def _sq_norm_conv(eqn, a, g, dtype, wide_dtype):
    """A convolution's kernel gradient is patches^T g: the dense rule on image patches."""
    p = eqn.params
    dn = p["dimension_numbers"]
    rhs_shape = eqn.invars[1].aval.shape
    window = tuple(rhs_shape[d] for d in dn.rhs_spec[2:])
    patches = lax.conv_general_dilated_patches(
        a,
        window,
        p["window_strides"],
        p["padding"],
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["rhs_dilation"],
        dimension_numbers=dn,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=dtype,
    )
    order = (dn.out_spec[0], *dn.out_spec[2:], dn.out_spec[1])  # batch, spatial..., feature
    pm = jnp.transpose(patches, order)
    gm = jnp.transpose(g, order)
    return _gram(pm.reshape(-1, pm.shape[-1]), gm.reshape(-1, gm.shape[-1]), dtype, wide_dtype)


def _sum_dot(plan: GhostPlan, tap: _Tap, a, g, factor, keep, before, p, dtype, out_dtype):
    """``sum_i factor_i x_i^T g_i`` for a dense layer, laid out as the parameter leaf
    ``p`` and rounded to ``out_dtype``: ONE contraction over examples and tokens,
    accumulated in ``dtype``. ``a``, ``g``: the layer's inputs and unscaled output
    gradients (clip dtype); rows of examples not in ``keep`` add exactly 0.

    In the accumulate dtype itself (``dtype == out_dtype``) the weighted ``g`` and
    the zero-filled ``x`` overwrite their operands in place. Wider (float64):
    ``factor_i g_it`` is exact there and each product with ``x_it`` rounded once,
    so the whole sum is within ``gamma_{BT} sum_i factor_i sum_t |x_t| |g_t|`` of the
    exact one. The float64 operands and result cannot be written in place, so the
    output's columns are taken in blocks of at most ``max(B T, 128)``, each
    rounded to ``out_dtype`` as soon as it is done and the next one started only
    then (:func:`_after`): the float64 result of one block, not of the layer, is
    held at a time (float32 MLP of benchmarks/clipping.py, 784-1024-1024-1024-10
    at batch 256: 10,516,240 B of compiled temp memory unblocked).
    """
    eqn = plan.jaxpr.jaxpr.eqns[tap.eqn]

    def operands(x, w):  # [B T, K] and [B T, N]: examples and tokens contracted together
        am, gm = jax.vmap(lambda a_, g_: _dot_operands(eqn, tap.pos, a_, g_))(x, w)
        return am.reshape(-1, am.shape[-1]), gm.reshape(-1, gm.shape[-1])

    def contract(x, w):
        return lax.dot_general(
            x, w, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=dtype
        )

    if jnp.dtype(dtype) == jnp.dtype(out_dtype):
        rows = _after(keep, before)
        wg = _kept_rows(_weighted_examples(g, factor, dtype), rows)
        am, gm = operands(_kept_rows(a.astype(dtype), rows), wg)
        kn = contract(am, gm)
    else:
        am, gm = jax.vmap(lambda a_, g_: _dot_operands(eqn, tap.pos, a_, g_))(a, g)
        bt, k, n = am.shape[0] * am.shape[1], am.shape[-1], gm.shape[-1]
        x = _kept_rows(am.astype(dtype), _after(keep, before)).reshape(bt, k)
        width = max(bt, 128)
        kn = jnp.zeros((k, n), out_dtype)
        done = before
        for lo in range(0, n, width):
            hi = min(n, lo + width)
            rows = _after(keep, done)
            wg = _kept_rows(_weighted_examples(gm[..., lo:hi], factor, dtype), rows)
            done = contract(x, wg.reshape(bt, hi - lo)).astype(out_dtype)
            # int32 start indices: under enable_x64 Python ints would be int64, which
            # a later vmap of this function (outside the scope) truncates with a warning.
            kn = lax.dynamic_update_slice(kn, done, (np.int32(0), np.int32(lo)))
    _, pull = jax.vjp(lambda q: _replay_chain(plan, tap, q), p.astype(kn.dtype))
    (out,) = pull(_kn_to_operand(eqn, tap.pos, kn).astype(out_dtype))
    return out


def _kn_to_operand(eqn, pos, kn):
    """A dense layer's gradient as ``[K, N]`` -> laid out as its parameter operand W'
    (contracting dims cw, then its free dims, as :func:`_dot_operands` orders them)."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    cw = tuple(lc if pos == 0 else rc)
    w_shape = eqn.invars[pos].aval.shape
    fw = tuple(d for d in range(len(w_shape)) if d not in cw)
    kn = kn.reshape(tuple(w_shape[d] for d in cw + fw))
    return jnp.transpose(kn, np.argsort(cw + fw))


def _dot_kernel_grad(eqn, pos, a, g, dtype):
    """One example's gradient of a dense layer's parameter operand: ``A^T G`` as one
    contraction over the tokens of A [T, K], G [T, N] (:func:`_dot_operands`).

    The vjp of the layer gives the same sum, but on the example's own shapes
    (``[1, T, K]`` for a flax layer): under ``vmap`` XLA:CPU then copies one
    operand into another layout before a slower batched product (1.25x the
    batch gradient's time against 0.75x for this form, ViT of
    benchmarks/clipping.py).
    """
    am, gm = _dot_operands(eqn, pos, a, g)
    kn = lax.dot_general(
        am, gm, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=dtype
    )
    return _kn_to_operand(eqn, pos, kn)


def _sq_norm_embed(eqn, idx, g, dtype, wide_dtype):
    """Certified squared norm of one example's embedding-table gradient, and its magnitude.

    The gradient's row ``r`` is ``sum_{t: id_t = r} g_t``. Few tokens: the Gram form
    ``sum_{t,s} [id_t = id_s] <g_t, g_s>``, which cancels like the dense one and is
    bounded the same way (:func:`_gram`; the id mask is exact). Many tokens: the
    rows themselves, each a sum of at most T vectors, so ``||R - R^||_F <= gamma_T
    ||R_abs||_F`` with ``R_abs`` the rows of ``|g_t|``. The magnitude ``m`` is
    ``||R_abs||_F`` (or its Gram bound ``sum [id_t = id_s] |g_t| |g_s|`` squared).
    """
    vocab, dim = eqn.invars[0].aval.shape
    ids = idx.reshape(-1)
    t = ids.shape[0]
    gm = g.reshape(t, dim)
    mode = eqn.params["mode"]
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        valid = (ids >= 0) & (ids < vocab)
    else:
        ids = jnp.clip(ids, 0, vocab - 1)
        valid = jnp.ones_like(ids, dtype=bool)
    if t * t <= vocab * dim:
        same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]
        mask = same.astype(dtype)
        q = lax.dot_general(
            gm, gm, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=dtype
        )
        ng = jnp.sqrt(jnp.maximum(jnp.diagonal(q), 0))
        # Row sums, then a sum of T (gamma_2T), as in _gram: never one flat T^2 reduction.
        mm = _row_dot_sum(mask, ng[:, None] * ng[None, :], dtype)
        err = _gamma(dim, dtype) * mm + _gamma(2 * t, dtype) * _row_dot_sum(mask, jnp.abs(q), dtype)
        return _row_dot_sum(mask, q, dtype) + 2 * err, jnp.sqrt(mm)
    slot = jnp.where(valid, ids, vocab)
    rows = jnp.zeros((vocab, dim), dtype).at[slot].add(gm, mode="drop")
    rows_abs = jnp.zeros((vocab, dim), dtype).at[slot].add(jnp.abs(gm), mode="drop")
    # Sums of squares over the whole table: added up in the wide dtype, the norm's made
    # an upper bound of its exact value (in float32 a flat V D reduction is off by up
    # to gamma_{V D}, which for a large table bounds nothing).
    with wide(wide_dtype):
        m = jnp.sqrt(jnp.sum(jnp.square(rows_abs).astype(wide_dtype))).astype(dtype)
        norm = jnp.sqrt(_sum_of_squares(rows, vocab * dim, dtype, wide_dtype)).astype(dtype)
    return jnp.square(norm * (1 + 4 * _gamma(1, dtype)) + 2 * _gamma(t, dtype) * m), m


def _sq_norms(plan: GhostPlan, tap: _Tap, a, g, dtype, wide_dtype):
    """Per-example certified squared norm of one ghost layer's parameter gradient and its
    magnitude (``(sq, m)``, each ``[B]``), batched: see :func:`_certified`."""
    eqn = plan.jaxpr.jaxpr.eqns[tap.eqn]
    if tap.rule == "dot":
        return jax.vmap(lambda a_, g_: _sq_norm_dot(eqn, tap.pos, a_, g_, dtype, wide_dtype))(a, g)
    if tap.rule == "embed":
        return jax.vmap(lambda i_, g_: _sq_norm_embed(eqn, i_, g_, dtype, wide_dtype))(a, g)
    # Image patches are kernel-size times the activation: taken a few examples at a
    # time so they never all exist at once.
    return lax.map(
        lambda ag: _sq_norm_conv(eqn, ag[0], ag[1], dtype, wide_dtype),
        (a, g),
        batch_size=_CONV_CHUNK,
    )


def _certified(sq, m):
    """A ghost layer's squared norm as the clip factor uses it: ``max(sq, (m / 64)^2)``.

    ``sq`` is already an upper bound of the exact squared norm (its rounding error
    added). The clip-weighted sum of a ghost layer is one contraction over
    examples AND tokens (or patches, or ids), whose rounding for example ``i`` is
    about ``u c_i m_i`` with ``m_i = sum_t |x_t| |g_t|``: a few ulps of the
    cancelled terms. Taking the norm as at least ``m_i / 64`` keeps ``c_i m_i <= 64 C``,
    so that rounding stays below ``64 u C`` (4e-6 C in float32) however much the
    tokens cancel. An ordinary example's tokens cancel far less than 64-fold in
    norm, and this leaves it alone. A negative or NaN ``sq`` is never finite.
    """
    floor = jnp.square(m / _CANCELLATION)
    return jnp.where(sq >= 0, jnp.maximum(sq, floor), jnp.full_like(sq, jnp.nan))


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
    ``norm_dtype`` is formed inside :func:`wide` only.
    """
    norm_dtype = clip_dtype if norm_dtype is None else norm_dtype
    out_dtype = sum_dtype if out_dtype is None else out_dtype
    jaxpr = plan.jaxpr.jaxpr
    eqns = jaxpr.eqns
    batch = jax.tree.leaves(batch_leaves)[0].shape[0]

    def zeros(t):
        if t.mode == "example":  # the cotangent is the parameter leaf's gradient
            return jnp.zeros((batch,) + jnp.shape(params_leaves[t.leaf]), clip_dtype)
        out = eqns[t.eqn].outvars[0].aval  # the cotangent is the layer's output gradient
        return jnp.zeros((batch,) + out.shape, out.dtype)

    # Inside shard_map the perturbations vary over the mesh axes the batch varies
    # over: their cotangents are this device's examples' own, never all-reduced.
    perturb = vary_like(tuple(zeros(t) for t in plan.taps), batch_leaves)
    layers = {
        k: _example_layer(plan, t, clip_dtype)
        for k, t in enumerate(plan.taps)
        if t.mode == "example"
    }

    def one(pert, example):
        loss, acts = _forward(plan, pert, (*params_leaves, *others_leaves, *example), layers)
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
    acts32 = [None if a is None else _cast_act(a, clip_dtype) for a in acts]
    p32 = [params_leaves[t.leaf].astype(clip_dtype) for t in plan.taps]
    inv = (1 / scale.astype(clip_dtype)).astype(clip_dtype)

    def unscale(g):
        return g.astype(clip_dtype) * inv

    # Output gradients -> per-example squared norms, layer by layer, from
    # (x_i, g_i) alone.
    # A non-finite entry of x_i or g_i makes the squared norm inf or NaN under
    # every rule below (inf * 0 is NaN), so ``isfinite(sq)`` is the overflow test.
    #
    # Per-example gradients (``example`` taps, and ghost taps with an integer
    # operand, whose gradient is formed here and kept) are normed and summed from
    # one tensor. Ghost norms carry their rounding error (:func:`_gram`) and a floor
    # against cancellation (:func:`_certified`): never below the exact norm of what
    # is summed.
    #
    # The layers' squared norms are added up in ``norm_dtype`` (float64 by default)
    # and the total made an upper bound of its exact value
    # (:func:`certified_sum_of_squares`) before it is rounded to the clip dtype.
    formed = {}  # tap index -> that layer's per-example gradients, unscaled
    parts, terms = [], 0
    for k, (tap, g, a, p) in enumerate(zip(plan.taps, grads_out, acts32, p32)):
        g = unscale(g)  # unscale first, in the clip dtype
        if tap.mode == "ghost" and tap.rule == "generic":
            site = _site(plan, tap, clip_dtype)
            g = formed[k] = jax.vmap(lambda a_, g_, s=site, q=p: _layer_grad(s, q, a_, g_))(a, g)
        with wide(norm_dtype):
            if tap.mode == "example" or k in formed:  # this layer's per-example gradient
                size = math.prod(g.shape[1:])
                axes = tuple(range(1, g.ndim))
                parts.append(_sum_of_squares(g, size, clip_dtype, norm_dtype, axes))
                terms += 1
            else:
                sq_k = _certified(*_sq_norms(plan, tap, a, g, clip_dtype, norm_dtype))
                parts.append(sq_k.astype(norm_dtype))
                terms += 1
    with wide(norm_dtype):
        sq = parts[0]
        for part in parts[1:]:
            sq = sq + part
        sq = certified_sum_of_squares(sq, terms, norm_dtype).astype(clip_dtype)
    finite = jnp.isfinite(sq)
    norms = jnp.sqrt(sq)

    keep = finite & ~is_padding
    safe = jnp.where(keep, norms, jnp.ones_like(norms))
    factor = jnp.minimum(jnp.ones_like(safe), jnp.asarray(clip_norm, clip_dtype) / safe)
    factor = jnp.where(keep, factor, jnp.zeros_like(factor))

    # The clip-weighted sum from the SAME activations and output gradients the
    # norms were taken from: one contraction over examples (and tokens) per layer.
    # (A second backward pass could recompute g_i instead of keeping it. Under
    # emulated or fused half precision the recomputed g_i can round differently
    # from the measured one, so each layer's recomputed gradient would have to be
    # measured again and weighted by c_i min(1, n_ik / n'_ik) for the bound to
    # hold. Built and measured that way it kept more on XLA:CPU: the second pass
    # keeps the pre-activations its ReLU masks need as well as the activations the
    # sums need: 6,305,056 B of compiled temp memory for the float32 MLP of
    # benchmarks/clipping.py, where this path needs 4,212,496 B.)
    #
    # Every kept example's x_i and g_i are finite (its squared norm is); a dropped
    # example's may not be, and inf * 0 is NaN, so its rows are set to exactly 0
    # with ``where`` before they are weighted or contracted.
    #
    # Dense ghost layers (the bulk of the values kept): ``where(kept, x)`` and
    # ``where(kept, c * g)``, then one contraction. Each is the last reader of x_i
    # and g_i, so XLA writes both in place and the step keeps no copy of either
    # (float32 MLP of benchmarks/clipping.py: 4,212,496 B of compiled temp memory
    # against the non-private step's 4,194,304 B; 5,265,112 B when a ``cond``
    # chose between the weights alone and zero-filled copies: a conditional's
    # branches cannot overwrite its operands, so each branch added its copies).
    # Other per-example gradients and bias-like layers are weighted inside a
    # ``cond`` (:func:`_weighted_example_dot` takes the weights as a vector, no
    # copy), which zero-fills only when some squared norm is not finite.
    #
    # Order. Layers are summed from the output back to the input (in the plan's
    # equation order: a bias after its kernel's product comes first, so the
    # kernel's contraction is the last reader of g_i), and each layer's sum reads
    # the one summed just before it (:func:`_after`, a dependency that changes no
    # value). That makes XLA free each layer's x_i and g_i as soon as its own sum
    # is done; left to itself, XLA:CPU schedules the sums input-first and keeps
    # every layer's values until the last one (float32 MLP: 8,177,360 B without
    # the dependency).
    all_finite = finite.all()

    def zero_filled(x):
        if x is None or not _is_float(x.dtype):
            return x
        return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))

    with wide(sum_dtype):  # a 64-bit sum is formed here only
        sums = [None] * len(params_leaves)
        before = None  # the sum done just before this one
        for k in sorted(range(len(plan.taps)), key=lambda k: plan.taps[k].eqn, reverse=True):
            tap, g, a, p = plan.taps[k], grads_out[k], acts32[k], p32[k]
            if tap.mode == "ghost" and tap.rule == "dot":
                sums[tap.leaf] = _sum_dot(
                    plan, tap, a, unscale(g), factor, keep, before, p, sum_dtype, out_dtype
                )
                before = sums[tap.leaf]
                continue

            def clipped_sum(a, g, tap=tap, p=p, formed=k in formed):
                """sum_i factor_i (this layer's gradient from x_i, g_i); every entry finite."""
                if formed:  # the per-example gradients the norm was taken from
                    return _weighted_example_dot(g, factor, sum_dtype)
                g = unscale(g)
                if tap.mode == "example":  # g is the layer's per-example gradient
                    return _weighted_example_dot(g, factor, sum_dtype)
                p = p.astype(sum_dtype)
                if _is_float(a.dtype):
                    a = a.astype(sum_dtype)
                wg = _weighted_examples(g, factor, sum_dtype)
                site = _site(plan, tap, sum_dtype)
                _, pull = jax.vjp(lambda q: jax.vmap(site, (None, 0))(q, a), p)
                return pull(wg)[0]

            if k in formed:
                operands = (None, formed.pop(k))
            else:
                operands = (None, g) if tap.mode == "example" else (a, g)
            if tap.mode == "example" or tap.rule == "generic":
                fast = all_finite
                if before is not None and before.size:
                    fast = fast & jnp.isfinite(before.ravel()[0])
                sums[tap.leaf] = lax.cond(
                    fast,
                    clipped_sum,
                    lambda *xs, f=clipped_sum: f(*map(zero_filled, xs)),
                    *operands,
                )
            else:
                # Convolutions, embeddings and the like always take the zero-filled
                # route: XLA:CPU runs convolutions inside a conditional ~10x slower.
                sums[tap.leaf] = clipped_sum(*map(zero_filled, operands))
            before = sums[tap.leaf]
        for leaf in plan.unused:
            sums[leaf] = jnp.zeros(jnp.shape(params_leaves[leaf]), sum_dtype)
    return sums, norms, finite, losses
