"""Per-example clipped gradients in half precision, with fp32 norms and sums.

The data path of ``private_grad`` for one example ``i`` of a batch:

    loss_i   = loss_fn(params in grad dtype, batch_i in compute dtype)
    g_i      = grad(float32(loss_i) * S)          # grad dtype (bf16/fp16 possible)
    u_i      = clip_dtype(g_i) / S                 # the loss scale leaves FIRST
    finite_i = every entry of u_i is finite and ||u_i|| is finite
    u_i      = u_i if finite_i and not padding_i else 0    # whole example zeroed
    ||u_i||  = sqrt(sum of squares, added up in float64, made an upper bound)
    c_i      = u_i * min(1, C / ||u_i||)          # norm and factor in clip dtype
    grads    = round(sum_i c_i)                    # float64 accumulation (products
                                                   # exact), across microbatches
                                                   # too; rounded once to the
                                                   # accumulate dtype

It follows ``jax_privacy.clipping.clipped_grad`` (per-example ``jax.grad``
under ``vmap``, padding examples zeroed as in ``clip_pytree``'s
``return_zero``, microbatches summed by ``optax.microbatching.microbatch``),
and departs from it on four points, each needed for the guarantee or for the
point of half precision:

* ``clipped_grad`` reports the norm of the raw gradient in its native dtype,
  i.e. with the loss scale still inside and in half precision. dpmp removes the
  scale in float32 before anything is measured, so clipping happens at C, not
  at C / S.
* jax-privacy 2.0's ``nan_safe`` zeroes only the non-finite *entries*: an
  example whose fp16 gradient overflowed in one layer still contributes a
  norm-C vector built from the other layers. dpmp zeroes the whole example and
  counts it (the count must be taken before zeroing, which ``clipped_grad``
  gives no hook for).
* ``clipped_fun`` casts each per-example gradient to its ``dtype`` inside the
  vmapped function, so the B x P per-example buffer is float32 whatever the
  gradient dtype. dpmp keeps per-example gradients in the grad dtype and lets
  the cast happen inside the norm and the clip-weighted sum (one fused
  ``convert -> multiply -> reduce``), so the buffer stays half size where the
  backend computes natively in half precision (GPU/TPU; XLA:CPU emulates bf16
  through float32 and gains nothing).
* jax-privacy clips and sums in a single ``dtype``; dpmp computes norms and
  factors in ``policy.clip`` and returns the sum in ``promote(clip,
  accumulate)``, accumulated in float64 (``accumulation``) so that its
  sensitivity, rounding included, is what ``g.sensitivity(...)`` says.

Formal guarantees (add/remove-one adjacency; replace-one doubles the bound):
  * every clipped per-example gradient, exactly as it enters the sum, has L2
    norm at most ``B = C (1 + 16 u_c)`` (``u_c`` the clip dtype's unit
    roundoff): each squared norm is made an upper bound of its exact value
    before the clip factor reads it, and the factor's own rounding is covered;
  * the returned sum has L2 sensitivity ``g.sensitivity(batch_size=n,
    parts=M)``, floating-point rounding included, for any summation order XLA
    picks. A floating-point sum is not exact: with other records crafted to
    round away against the running sum, removing one record clipped to C moved
    a float32 sum of 512 examples by 1.00034 C (ghost clipping, XLA:CPU, the
    records of tests/test_clipping.py; 1.00066 C with a small record in every
    row), and Casacuberta et al. 2022 ("Widespread
    underestimation of sensitivity in differentially private libraries")
    found this across DP libraries. With
    Higham's bound ``|fl(sum) - sum| <= gamma_(N-1) sum |x_i|`` per coordinate
    (``gamma_k = k u / (1 - k u)``), the sum of a batch and that of its
    neighbour are each within ``E`` of the exact sums of their contributions,
    so the sensitivity is ``B + 2 E``. By default the products ``c_i g_i`` are
    exact in float64 and every sum over examples (and tokens) accumulates in
    float64, so ``E`` is the one rounding to float32 (``u n B``) plus
    ``gamma64_(n (T + 1)) K n B`` (negligible) plus ``gamma32_(M-1) n B`` for M
    float32 partial sums added up later (chunks, devices): ``sensitivity ~ C
    (1 + 2 M n 2^-24)``, 1.00003 C for n = 256 and M = 1. With
    ``accumulation="policy"`` the sums accumulate in float32 and ``E`` is
    Higham's ``gamma32_(n (T + 1)) K n B``: about ``C (1 + 4 n^2 2^-24)`` with
    per-example gradients (1.06 C at n = 512), useless for ghost layers with
    many tokens (``K`` >= 64): see :meth:`PrivateGradFn.sensitivity`;
  * padding and non-finite examples contribute exactly zero;
  * ``stats`` are per-batch functions of private data, for monitoring only —
    except ``noised_overflow_count``, which is a privatized release accounted
    by ``dpmp.accounting``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpmp.clipping import _replay as replay
from dpmp.clipping import ghost as ghost_lib
from dpmp.clipping._private_loss_scale import PrivateDynamicLossScale
from dpmp.clipping._rounding import certified_sum_of_squares, higham_gamma, unit_roundoff, wide
from dpmp.clipping._weighted import weighted_example_sum
from dpmp.precision._casting import cast_tree
from dpmp.precision._loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from dpmp.precision._policy import Policy

__all__ = [
    "PrivateGrad",
    "PrivateGradFn",
    "PrivateGradStats",
    "adjust_loss_scale",
    "combine_stats",
    "private_grad",
]

_METHODS = ("auto", "vmap", "ghost")
_ACCUMULATIONS = ("float64", "policy")


class PrivateGradStats(NamedTuple):
    """Per-batch statistics of a private gradient (monitoring; see the guarantees).

    Attributes:
      num_examples: real (non-padding) examples in the batch.
      num_nonfinite: real examples whose unscaled gradient was not finite
        (they contributed zero).
      num_clipped: real, finite examples whose norm exceeded the clip norm.
      norm_mean, norm_max, norm_median: over real, finite examples, of the
        unscaled per-example gradient norm (clip dtype) that the clip factor
        used; under ghost clipping a certified upper bound of it (its rounding
        error added, see ``dpmp.clipping.ghost``).
      loss_mean: mean per-example loss over real examples (float32).
      loss_scale: the loss scale used in this step (float32).
      noised_overflow_count: the privatized overflow count released by a
        ``PrivateDynamicLossScale`` (NaN when none was released).
    """

    num_examples: jax.Array
    num_nonfinite: jax.Array
    num_clipped: jax.Array
    norm_mean: jax.Array
    norm_max: jax.Array
    norm_median: jax.Array
    loss_mean: jax.Array
    loss_scale: jax.Array
    noised_overflow_count: jax.Array


def combine_stats(parts: Sequence[PrivateGradStats] | PrivateGradStats) -> PrivateGradStats:
    """The statistics of a batch processed as ``parts`` (chunks of one logical batch,
    or the shares of the devices of a mesh): a sequence of statistics, or one
    ``PrivateGradStats`` whose fields are stacked along a leading axis.

    Counts add up; the mean norm and mean loss are weighted by the examples
    behind them; the maximum is the maximum; the median is the median of the
    parts' medians (an approximation: the parts' norms are not kept).
    """
    if isinstance(parts, PrivateGradStats):
        stack = parts
    elif len(parts) == 1:
        return parts[0]
    else:
        stack = PrivateGradStats(*(jnp.stack(field) for field in zip(*parts)))
    n = stack.num_examples.sum()
    n_ok = n - stack.num_nonfinite.sum()
    finite_weights = (stack.num_examples - stack.num_nonfinite).astype(jnp.float32)
    return PrivateGradStats(
        num_examples=n,
        num_nonfinite=stack.num_nonfinite.sum(),
        num_clipped=stack.num_clipped.sum(),
        norm_mean=(stack.norm_mean * finite_weights).sum()
        / jnp.maximum(n_ok, 1).astype(jnp.float32),
        norm_max=stack.norm_max.max(),
        norm_median=jnp.nan_to_num(
            jnp.nanmedian(jnp.where(finite_weights > 0, stack.norm_median, jnp.nan))
        ),
        loss_mean=(stack.loss_mean * stack.num_examples.astype(jnp.float32)).sum()
        / jnp.maximum(n, 1).astype(jnp.float32),
        loss_scale=stack.loss_scale[0],
        noised_overflow_count=stack.noised_overflow_count[-1],
    )


class PrivateGrad(NamedTuple):
    """What a ``private_grad`` function returns.

    Attributes:
      grads: the SUM of clipped per-example gradients, before noise, in the
        accumulate dtype (at least float32).
      stats: a ``PrivateGradStats``.
      loss_scale: the loss scale for the next step.
    """

    grads: Any
    stats: PrivateGradStats
    loss_scale: Any


class PrivateGradFn:
    """A function computing clipped-gradient sums that knows its sensitivity.

    Call as ``g(params, batch, loss_scale=dpmp.NoOpLossScale(),
    is_padding_example=None)``; with ``batch_argnums=(1, 2)`` pass
    ``g(params, x, y, ...)``.
    """

    def __init__(
        self,
        fun: Callable,
        *,
        l2_norm_bound: float,
        method: str,
        policy: Policy,
        explain: Callable,
        chooser: _MethodChooser,
        accumulation: str = "float64",
        microbatched: bool = False,
    ):
        self._fun = fun
        self._microbatched = microbatched
        self._explain = explain
        self._chooser = chooser
        self.l2_norm_bound = l2_norm_bound
        self.method = method
        self.policy = policy
        self.accumulation = accumulation
        self._sum_dtype = jnp.promote_types(policy.clip, policy.accumulate)
        wide64 = accumulation == "float64"
        self._acc_dtype = (
            jnp.promote_types(self._sum_dtype, jnp.float64) if wide64 else self._sum_dtype
        )
        self._norm_dtype = (
            jnp.promote_types(policy.clip, jnp.float64) if wide64 else jnp.dtype(policy.clip)
        )

    def explain(self, params, *args) -> dict[str, Any]:
        """Which method computes ``g(params, *args)`` and why.

        Returns ``{"requested", "method", "reason", "layers"}``: ``method`` is
        ``"vmap"`` or ``"ghost"``; ``reason`` says why ``"auto"`` fell back to
        per-example gradients (empty when it did not); ``layers`` lists each
        parameter leaf with the layer kind and the norm rule ghost clipping
        uses for it (``gram``, ``patch-gram``, ``id-gram`` or ``per-example``).
        Only shapes and dtypes of the arguments are used.
        """
        return self._explain(params, *args)

    def __call__(self, *args, **kwargs) -> PrivateGrad:
        return self._fun(*args, **kwargs)

    def sensitivity(
        self,
        neighboring_relation: dp_accounting.NeighboringRelation = (
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        ),
        *,
        batch_size: int | None = None,
        parts: int = 1,
    ) -> float:
        """L2 sensitivity of the clipped sum AS COMPUTED, floating-point rounding included.

        Args:
          neighboring_relation: add/remove-one (and replace-special) give the bound
            below; replace-one doubles it.
          batch_size: ``n``, the padded number of examples behind one sum (a public
            constant: padding examples count, real ones are never more).
          parts: ``M``, how many sums of ``g`` (each over a share of the ``n``
            examples: physical chunks, devices of a mesh) are added up in the
            accumulate dtype to make the sum that is noised; 1 when ``g``'s own
            output is noised.

        The bound (add/remove one, ``C`` the clip norm; ``u_c``, ``u_a``, ``u_o``
        the unit roundoffs of the clip dtype, of the dtype the sum accumulates in
        and of the one it is returned in, ``u_o = 0`` when those are the same;
        ``g_k(n)`` Higham's ``gamma_n`` in the dtype of ``u_k``)::

            B       = C (1 + 16 u_c [+ K u_a with accumulation="policy"])
            E_acc   = g_a(n (T + 1)) K n B     # the accumulation over examples and rows
            S       = n B + E_acc              # a bound on the norm of the computed sum
            E_round = r u_o (1 + u_o) S        # rounding to the output dtype, r times
            E_parts = g_o(M - 1) (S + E_round) # the M parts added up, in any order
            sensitivity = B + 2 (E_acc + E_round + E_parts)

        ``B`` bounds the norm of one clipped contribution exactly as it enters the
        sum (certified norms; the rounding of the clip factor); the rest bounds
        how far the computed sum of a batch and of its neighbour can each be
        from the exact sum of their contributions (for every summation order
        XLA may choose). ``r`` is 2 with ``microbatch_size`` (the sums of dense
        ghost layers are rounded once per microbatch, then added up in float64),
        else 1. ``T`` is the most rows (tokens, patches, ids) one example
        adds to one contraction and ``K`` how much those rows' magnitudes may
        exceed the norm used to clip them (both 1 with per-example gradients;
        ghost layers with several rows: ``K`` is 64, the floor of
        :func:`dpmp.clipping.ghost._gram.cancellation_floor`, over the float32 rounding of the
        magnitude it reads, between 64.0 and about 71). Both are read from the shapes ``g``
        has been traced or explained for: with ``method`` "auto" or "ghost",
        call ``g.explain(params, *batch)`` (or ``g`` itself) first.

        With the default float64 accumulation, ``sensitivity ~ C (1 + 2 M n
        u32)``: 1.00003 C at n = 256, 1.0005 C at n = 4096 (M = 1). With
        ``accumulation="policy"`` (float32) it is ``~ C (1 + 2 K n^2 (T + 1) u32)``.
        """
        rel = dp_accounting.NeighboringRelation
        if neighboring_relation not in (
            rel.ADD_OR_REMOVE_ONE,
            rel.REPLACE_SPECIAL,
            rel.REPLACE_ONE,
        ):
            raise ValueError(f"unsupported neighboring relation {neighboring_relation}")
        bound = self.sensitivity_bound(batch_size=batch_size, parts=parts)["sensitivity"]
        return 2 * bound if neighboring_relation == rel.REPLACE_ONE else bound

    def sensitivity_bound(self, *, batch_size: int | None, parts: int = 1) -> dict[str, Any]:
        """The add/remove-one sensitivity (``"sensitivity"``) and the terms of its bound
        (see :meth:`sensitivity`): ``clip_norm``, ``per_example`` (B),
        ``accumulation_error``, ``rounding_error``, ``parts_error`` (absolute
        L2 bounds), ``rows`` (T), ``cancellation`` (K), ``batch_size``, ``parts``,
        ``accumulation`` and ``accumulate_dtype`` (where the sum accumulates)."""
        n = _count("batch_size", batch_size, "the padded number of examples behind one sum")
        m = _count("parts", parts, "how many partial sums are added up (1: none)")
        shape = self._chooser.rounding(self.policy.clip, self._norm_dtype)
        if shape is None:
            raise ValueError(
                f"sensitivity: method={self.method!r} bounds the rounding of its sum from "
                "the model's shapes (rows per example of its ghost layers): call "
                "g.explain(params, *batch) or g(params, *batch) first"
            )
        rows, cancellation = shape
        return _sum_sensitivity(
            self.l2_norm_bound,
            batch_size=n,
            parts=m,
            rows=rows,
            cancellation=cancellation,
            clip_dtype=self.policy.clip,
            acc_dtype=self._acc_dtype,
            out_dtype=self._sum_dtype,
            exact_products=self.accumulation == "float64",
            roundings=2 if self._microbatched else 1,
        ) | {"accumulation": self.accumulation}

    @property
    def resolved_method(self) -> str | None:
        """The method the last traced call used (``None`` before the first call)."""
        return self._chooser.last

    def __repr__(self):
        return (
            f"PrivateGradFn(l2_norm_bound={self.l2_norm_bound}, method={self.method!r}, "
            f"policy='{self.policy}', accumulation={self.accumulation!r})"
        )


def _count(name: str, value: Any, what: str) -> int:
    """``value`` as a positive int, or a ``ValueError`` naming ``name`` and ``what`` it is."""
    if value is None:
        raise ValueError(f"sensitivity: {name} is required ({what})")
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"sensitivity: {name} must be a positive integer ({what}), got {value!r}")
    return int(value)


def _sum_sensitivity(
    clip_norm: float,
    *,
    batch_size: int,
    parts: int,
    rows: int,
    cancellation: float,
    clip_dtype,
    acc_dtype,
    out_dtype,
    exact_products: bool,
    roundings: int = 1,
) -> dict[str, Any]:
    """The bound of :meth:`PrivateGradFn.sensitivity`, term by term (all in L2)."""
    u_c = unit_roundoff(clip_dtype)
    u_a = unit_roundoff(acc_dtype)
    same = jnp.dtype(acc_dtype) == jnp.dtype(out_dtype)
    u_o = 0.0 if same else unit_roundoff(out_dtype)
    n, m, t, k = batch_size, parts, rows, cancellation
    per_example = clip_norm * (1 + 16 * u_c + (0.0 if exact_products else k * u_a))
    acc_error = higham_gamma(n * (t + 1), acc_dtype) * k * n * per_example
    total = n * per_example + acc_error
    rounding = roundings * u_o * total * (1 + u_o)
    parts_error = higham_gamma(m - 1, out_dtype) * (total + rounding)
    return {
        "sensitivity": per_example + 2 * (acc_error + rounding + parts_error),
        "clip_norm": clip_norm,
        "per_example": per_example,
        "accumulation_error": acc_error,
        "rounding_error": rounding,
        "parts_error": parts_error,
        "rows": t,
        "cancellation": k,
        "batch_size": n,
        "parts": m,
        "accumulate_dtype": jnp.dtype(acc_dtype).name,
    }


def _batch_size(batch_args, argnums) -> int:
    """The common leading-axis size of the batch arguments; a ``ValueError`` names a leaf
    without a batch axis, or the leaves whose sizes disagree."""
    sizes: dict[int, str] = {}
    for argnum, arg in zip(argnums, batch_args):
        for path, leaf in jax.tree_util.tree_leaves_with_path(arg):
            name = f"argument {argnum}{jax.tree_util.keystr(path)}"
            if not jnp.ndim(leaf):
                raise ValueError(
                    f"batch {name} is a scalar: every leaf of a batch argument needs a "
                    "leading batch axis (pass per-batch constants in a non-batch argument, "
                    "see batch_argnums)"
                )
            sizes.setdefault(jnp.shape(leaf)[0], name)
    if not sizes:
        raise ValueError(f"batch arguments at positions {argnums} have no array leaves")
    if len(sizes) != 1:
        found = ", ".join(f"{n} ({name})" for n, name in sorted(sizes.items()))
        raise ValueError(f"batch arguments disagree on the batch size: {found}")
    return next(iter(sizes))


def _global_sq_norm(tree):
    """Sum of squares over all leaves, in the leaves' dtype."""
    leaves = [jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)]
    return sum(leaves[1:], leaves[0])


def adjust_loss_scale(loss_scale, num_nonfinite: jax.Array) -> tuple[Any, jax.Array]:
    """The loss scale for the next step and the overflow count it released.

    A ``PrivateDynamicLossScale`` decides from a noised count of the batch's
    overflowed examples and releases it; a ``DynamicLossScale`` decides from the
    exact count (not private); static scales stay. The released count is NaN
    when none was released.
    """
    if isinstance(loss_scale, PrivateDynamicLossScale):
        return loss_scale.adjust_private(num_nonfinite)
    nothing = jnp.float32(jnp.nan)
    if isinstance(loss_scale, DynamicLossScale):
        return loss_scale.adjust(num_nonfinite == 0), nothing
    return loss_scale, nothing


def private_grad(
    loss_fn: Callable,
    *,
    l2_clip_norm: float,
    policy: Policy | str,
    batch_argnums: int | Sequence[int] = 1,
    method: str = "auto",
    microbatch_size: int | None = None,
    keep_batch_dim: bool = True,
    allow_nonprivate_loss_scale: bool = False,
    accumulation: str = "float64",
) -> PrivateGradFn:
    """Sum of clipped per-example gradients, computed in the policy's precisions.

    Args:
      loss_fn: ``loss_fn(params, batch)`` returning the scalar loss of the batch
        it is given (jax-privacy's convention); the per-example machinery hands
        it batches of one (``keep_batch_dim=True``) or single examples.
      l2_clip_norm: C, the per-example clip norm (> 0; ``inf`` disables clipping
        and leaves the sensitivity unbounded).
      policy: a ``dpmp.Policy`` or its string form. ``loss_fn`` receives the
        params cast to ``policy.grad`` and the floating leaves of the batch cast
        to ``policy.compute``.
      batch_argnums: which positional arguments carry the batch axis.
      method: ``"auto"`` (the default), ``"vmap"`` (per-example gradients, as
        jax-privacy computes them),
        ``"ghost"`` (per layer, the cheaper of two: the norm from the layer's
        activations and output gradients followed by one clip-weighted
        contraction, or the layer's own per-example gradient formed inside the
        backward pass; no full per-example gradient is formed, and each
        ghost norm carries a bound on its rounding error so that it is never
        below the exact norm, see ``dpmp.clipping.ghost``), or ``"auto"``: ghost
        where every parameter sits in a supported layer (dense/einsum,
        convolution, embedding, bias, norm scale), else vmap. ``g.explain(params,
        *args)`` says which was chosen and why; ``g.resolved_method`` is the
        last traced choice. ``"ghost"`` on an unsupported model raises. Ghost
        clipping measures overflow differently: it forms per-example weight
        gradients in the clip dtype, from half-precision activations and output
        gradients, so an example overflows only if one of those does.
      microbatch_size: examples per vmapped microbatch; microbatches run
        sequentially and are summed in the accumulate dtype.
      keep_batch_dim: pass each example with a leading axis of size 1.
      allow_nonprivate_loss_scale: permit a plain ``DynamicLossScale``, whose
        decisions use the exact overflow count and are NOT differentially
        private (a diagnostic mode; a warning says so at every construction).
      accumulation: where the reductions the sensitivity depends on add up (a
        privacy setting: it changes ``g.sensitivity(...)``). ``"float64"`` (the
        default): every per-example squared norm and every sum over examples
        (and tokens) accumulates in float64, inside ``jax.enable_x64`` scopes
        around those reductions only, and the sum is rounded once to
        ``promote(clip, accumulate)``; its rounding is negligible
        (``sensitivity`` ~ C (1 + 2 n u32) for a batch of n). ``"policy"``: they
        accumulate in the policy's clip and accumulate dtypes themselves
        (faster where float64 is slow); the sensitivity then carries Higham's
        worst-case bound, large at large batches (about C (1 + 4 n^2 u32) for
        per-example gradients and far more for ghost layers with many tokens).
        Each squared norm is made an upper bound of its exact value in either
        case (a float32 norm over P entries grows by up to P u32 / 2).

    Returns:
      A ``PrivateGradFn`` ``g(params, *batch, loss_scale=NoOpLossScale(),
      is_padding_example=None) -> PrivateGrad``.

    Inside ``jax.shard_map``, parameters replicated over the mesh axes the batch
    is split over are first cast to vary over them (``jax.lax.pcast``), so that
    JAX does not all-reduce per-example gradients across devices before they
    are clipped. ``grads`` is then this device's clipped sum: ``psum`` it.

    Example::

      >>> import jax, jax.numpy as jnp, dpmp
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> g = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="bf16")
      >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros(8)}
      >>> out = g(jnp.ones(3), batch)
      >>> out.grads.dtype, int(out.stats.num_clipped)
      (dtype('float32'), 8)
    """
    policy = Policy.parse(policy)
    if method not in _METHODS:
        raise ValueError(f"method: unknown {method!r}; allowed: {', '.join(_METHODS)}")
    try:
        clip_norm = float(l2_clip_norm)
    except (TypeError, ValueError) as e:
        raise ValueError(f"l2_clip_norm: must be a number, got {l2_clip_norm!r}") from e
    if not clip_norm > 0:
        raise ValueError(f"l2_clip_norm: must be > 0 (or inf), got {l2_clip_norm!r}")
    if accumulation not in _ACCUMULATIONS:
        raise ValueError(
            f"accumulation: unknown {accumulation!r}; allowed: {', '.join(_ACCUMULATIONS)}"
        )
    if microbatch_size is not None and (
        int(microbatch_size) != microbatch_size or microbatch_size < 1
    ):
        raise ValueError(f"microbatch_size: must be a positive integer, got {microbatch_size!r}")
    if allow_nonprivate_loss_scale:
        warnings.warn(
            "private_grad(allow_nonprivate_loss_scale=True): a DynamicLossScale adjusted from "
            "the EXACT overflow count leaks private data and is not accounted. Use it only as a "
            "diagnostic; use dpmp.PrivateDynamicLossScale for private training.",
            UserWarning,
            stacklevel=2,
        )
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if not argnums or min(argnums) < 1:
        raise ValueError(f"batch_argnums: must be >= 1 (params come first), got {batch_argnums!r}")
    sum_dtype = jnp.promote_types(policy.clip, policy.accumulate)
    clip_dtype = policy.clip
    # The dtypes the reductions accumulate in (see ``accumulation``); the sum is
    # rounded to ``sum_dtype`` once, after every example and microbatch is in.
    wide64 = accumulation == "float64"
    acc_dtype = jnp.promote_types(sum_dtype, jnp.float64) if wide64 else sum_dtype
    norm_dtype = jnp.promote_types(clip_dtype, jnp.float64) if wide64 else clip_dtype
    n_batch = len(argnums)

    def example_loss(params, others, *example):
        """float32 loss of ONE example (no batch axis): the batch leaves are cast to
        ``policy.compute`` (and given a batch axis of 1 with ``keep_batch_dim``)."""
        args = dict(others)
        for pos, value in zip(argnums, example):
            value = cast_tree(value, policy.compute)
            if keep_batch_dim:
                value = jax.tree.map(lambda x: x[None], value)
            args[pos] = value
        args = [args[i] for i in range(1, len(args) + 1)]
        loss = jnp.asarray(loss_fn(params, *args))
        if loss.shape != ():
            raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}")
        return loss.astype(jnp.float32)

    def per_example(params, s, others, *example):
        """Scaled gradient of one example (grad dtype) and its float32 loss."""

        def scaled_loss(p):
            # Replayed, so that XLA:CPU sees no batch axis of 1 in its reductions
            # (see dpmp.clipping._replay: 15-20x slower product-and-reduce fusions).
            loss32 = replay.replayed(example_loss)(p, others, *example)
            return loss32 * s, loss32

        return jax.grad(scaled_loss, has_aux=True)(params)

    def example_sq_norm(grads, s):
        """Certified squared norm (clip dtype) of ONE example's unscaled gradient: the
        scale leaves before any norm (cast up, then divide: exact for powers of two);
        the squares are added up in the norm dtype (float64 by default) and the total
        made an upper bound of its exact value before it is rounded to the clip dtype.

        A non-finite entry makes the sum of squares inf or NaN, so ``isfinite`` of it
        covers every entry without a second pass over the per-example gradients (a
        finite gradient whose squared norm overflows is dropped too: safe)."""
        s_clip = s.astype(clip_dtype)
        leaves = [(g.astype(clip_dtype) / s_clip) for g in jax.tree.leaves(grads)]
        entries = sum(x.size for x in leaves)
        with wide(norm_dtype):
            sq = _global_sq_norm([x.astype(norm_dtype) for x in leaves])
            return certified_sum_of_squares(sq, entries, norm_dtype).astype(clip_dtype)

    def microbatch_sum(params, s, others, is_padding, *batch):
        """Clipped sum over one (micro)batch: the casts are fused into the reductions."""
        grads, losses = jax.vmap(per_example, in_axes=(None, None, None) + (0,) * n_batch)(
            params, s, others, *batch
        )
        # Per-example gradients are B x P values. Reduced in float32, XLA:CPU keeps
        # the products it reduces (squares, weighted gradients) at that size; reduced
        # in float64 its products would be twice as large, so there the gradients are
        # read a chunk of examples at a time (:func:`_by_example_chunks`).
        widened = jnp.dtype(acc_dtype) != jnp.dtype(sum_dtype)
        sq_norms = jax.vmap(example_sq_norm, in_axes=(0, None))
        if jnp.dtype(norm_dtype) != jnp.dtype(clip_dtype):
            sq = _by_example_chunks(lambda g: (None, sq_norms(g, s)), grads)[1]
        else:
            sq = sq_norms(grads, s)
        norms = jnp.sqrt(sq)
        finite = jnp.isfinite(sq)
        keep = finite & ~is_padding
        safe = jnp.where(keep, norms, jnp.ones_like(norms))
        factor = jnp.minimum(jnp.ones_like(safe), jnp.asarray(clip_norm, clip_dtype) / safe)
        factor = jnp.where(keep, factor, jnp.zeros_like(factor)) / s.astype(clip_dtype)

        def weighted_sums(chunk):
            g, f, k = chunk
            with wide(acc_dtype):
                sums = jax.tree.map(lambda x: weighted_example_sum(x, f, k, acc_dtype), g)
            return sums, None

        if widened:
            sums = _by_example_chunks(weighted_sums, (grads, factor, keep), acc_dtype)[0]
        else:
            sums = weighted_sums((grads, factor, keep))[0]
        return sums, (norms, finite, losses)

    chooser = _MethodChooser(method, example_loss)

    def split(args):
        """``(batch arguments, {position: other argument})`` of ``g(params, *args)``."""
        batch_args = [args[i - 1] for i in argnums]
        others = {j: a for j, a in enumerate(args, start=1) if j not in argnums}
        return batch_args, others

    def ghost_sum(plan, params, s, others, is_padding, *batch):
        """Clipped sum over one (micro)batch from activations and output gradients."""
        leaves, norms, finite, losses = ghost_lib.ghost_clipped_sum(
            plan,
            params_leaves=jax.tree.leaves(params),
            others_leaves=jax.tree.leaves(others),
            batch_leaves=jax.tree.leaves(batch),
            scale=s,
            is_padding=is_padding,
            clip_norm=clip_norm,
            clip_dtype=clip_dtype,
            sum_dtype=acc_dtype,
            norm_dtype=norm_dtype,
            out_dtype=sum_dtype,
        )
        return jax.tree.unflatten(jax.tree.structure(params), leaves), (norms, finite, losses)

    def summed_fn(plan):
        base = microbatch_sum if plan is None else functools.partial(ghost_sum, plan)
        if microbatch_size is None:
            return base
        return _microbatched(base, int(microbatch_size), acc_dtype)

    def fun(params, *args, loss_scale=None, is_padding_example=None) -> PrivateGrad:
        if loss_scale is None:
            loss_scale = NoOpLossScale()
        if isinstance(loss_scale, DynamicLossScale) and not allow_nonprivate_loss_scale:
            raise ValueError(
                "loss_scale: a DynamicLossScale decides from the exact overflow count, a "
                "function of private data. Use dpmp.PrivateDynamicLossScale (noised count, "
                "accounted), StaticLossScale or NoOpLossScale; or pass "
                "allow_nonprivate_loss_scale=True for a non-private diagnostic run."
            )
        if not isinstance(
            loss_scale,
            NoOpLossScale | StaticLossScale | DynamicLossScale | PrivateDynamicLossScale,
        ):
            raise ValueError(
                f"loss_scale: expected a dpmp loss scale, got {type(loss_scale).__name__}"
            )
        if len(args) < max(argnums):
            raise ValueError(
                f"expected batch arguments at positions {argnums}, got {len(args) + 1} arguments"
            )
        s = loss_scale.loss_scale.astype(jnp.float32)
        diff_params = cast_tree(params, policy.grad)
        batch_args, others = split(args)
        batch_size = _batch_size(batch_args, argnums)
        if is_padding_example is None:
            is_padding_example = jnp.zeros((batch_size,), jnp.bool_)
        is_padding_example = jnp.asarray(is_padding_example, jnp.bool_)
        if is_padding_example.shape != (batch_size,):
            raise ValueError(
                f"is_padding_example: expected shape ({batch_size},), got "
                f"{is_padding_example.shape}"
            )
        if microbatch_size is not None and batch_size % int(microbatch_size):
            raise ValueError(
                f"microbatch_size: {microbatch_size} does not divide the batch size {batch_size}"
            )
        # Inside shard_map, parameters replicated over the mesh axes the batch is
        # split over are made to vary over them. Otherwise JAX all-reduces the
        # per-example gradients of a replicated value across devices BEFORE they
        # are clipped: each "example" would mix examples of every device. The
        # clipped sums stay per device; psum them as usual.
        diff_params = replay.vary_like(diff_params, batch_args)
        plan = chooser.choose(diff_params, others, batch_args)
        wide_sums, (norms, finite, losses) = summed_fn(plan)(
            diff_params, s, others, is_padding_example, *batch_args
        )
        with wide(acc_dtype):  # the one rounding of the float64 sum
            sums = jax.tree.map(lambda x: x.astype(sum_dtype), wide_sums)
        real = ~is_padding_example
        ok = real & finite
        n_real = real.sum(dtype=jnp.int32)
        n_ok = ok.sum(dtype=jnp.int32)
        norms32 = norms.astype(jnp.float32)
        safe_norms = jnp.where(ok, norms32, 0.0)
        masked_for_median = jnp.where(ok, norms32, jnp.nan)
        stats = PrivateGradStats(
            num_examples=n_real,
            num_nonfinite=(real & ~finite).sum(dtype=jnp.int32),
            num_clipped=(ok & (norms32 > jnp.float32(clip_norm))).sum(dtype=jnp.int32),
            norm_mean=safe_norms.sum() / jnp.maximum(n_ok, 1).astype(jnp.float32),
            norm_max=safe_norms.max(),
            norm_median=jnp.nan_to_num(jnp.nanmedian(masked_for_median)),
            loss_mean=jnp.where(real, losses, 0.0).sum()
            / jnp.maximum(n_real, 1).astype(jnp.float32),
            loss_scale=s,
            noised_overflow_count=jnp.float32(jnp.nan),
        )
        next_scale, noised = adjust_loss_scale(loss_scale, stats.num_nonfinite)
        return PrivateGrad(sums, stats._replace(noised_overflow_count=noised), next_scale)

    def explain(params, *args):
        batch_args, others = split(args)
        diff_params = jax.eval_shape(lambda p: cast_tree(p, policy.grad), params)
        return chooser.explain(diff_params, others, batch_args)

    return PrivateGradFn(
        fun,
        l2_norm_bound=clip_norm,
        method=method,
        policy=policy,
        explain=explain,
        chooser=chooser,
        accumulation=accumulation,
        microbatched=microbatch_size is not None,
    )


# float64 reductions of per-example gradients: examples per chunk, at least 1/32 of
# the batch (and 2), and as many as fit in this many bytes of float64 values
_EXAMPLE_CHUNKS = 32
_CHUNK_BYTES = 2**20


def _by_example_chunks(fn: Callable, xs, acc_dtype=None):
    """``fn`` over consecutive chunks of the examples (leading axis) of ``xs``, one
    chunk at a time: ``fn(chunk) -> (sums, per_example)``; the sums (a pytree, or
    None) are added up in ``acc_dtype``, the per-example values concatenated.

    A chunk holds ``B / 32`` examples (at least 2), or as many as have 1 MiB of
    float64 values if that is more: XLA:CPU materialises the float64 products it
    reduces, and this bounds them to a chunk's. Compiled temp memory against the
    same step with float32 sums, for 1, 2, 4, ..., 128 chunks: the ReLU MLP of
    tests/test_ghost.py (batch 128) 2.00, 2.01, 1.51, 1.26, 1.14, 1.08, 1.05, 1.29
    (chunks of one example lay the gradients out anew); benchmarks/clipping.py's
    CNN 1.09, then 1.003 up to 32 chunks, 1.12 from 64; its ViT 1.004 from 2; its
    MLP (2.9M parameters, batch 256) 1.13 at 16, 1.07 at 32, 1.02 at 128 chunks.
    The last chunk takes the remainder."""
    leaves = jax.tree.leaves(xs)
    b = leaves[0].shape[0]
    per_example = max(1, sum(x.size for x in leaves) // max(b, 1)) * 8
    size = max(min(b, 2), b // _EXAMPLE_CHUNKS, min(b, _CHUNK_BYTES // per_example))
    count, rest = divmod(b, size)

    def add(acc, sums):
        if acc is None or sums is None:
            return sums if acc is None else acc
        with wide(acc_dtype):
            return jax.tree.map(lambda c, x: c + x.astype(acc_dtype), acc, sums)

    def widen(sums):
        if sums is None or acc_dtype is None:
            return sums
        with wide(acc_dtype):
            return jax.tree.map(lambda x: x.astype(acc_dtype), sums)

    head = jax.tree.map(lambda x: x[: count * size], xs)
    if count == 1:
        acc, per = fn(head)
        acc = widen(acc)
    else:
        parts = jax.tree.map(lambda x: jnp.reshape(x, (count, size) + jnp.shape(x)[1:]), head)

        def body(acc, chunk):
            sums, per = fn(chunk)
            return add(acc, sums), per

        init = None
        if acc_dtype is not None:
            shapes = jax.eval_shape(lambda c: fn(c)[0], jax.tree.map(lambda x: x[0], parts))
            with wide(acc_dtype):
                init = jax.tree.map(lambda a: jnp.zeros(a.shape, acc_dtype), shapes)
            init = replay.vary_like(init, xs)
        acc, per = jax.lax.scan(body, init, parts)
        if per is not None:
            per = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), per)
    if rest:
        tail_sums, tail_per = fn(jax.tree.map(lambda x: x[count * size :], xs))
        acc = add(acc, widen(tail_sums))
        if per is not None:
            per = jax.tree.map(lambda a, t: jnp.concatenate([a, t]), per, tail_per)
    return acc, per


def _microbatched(base: Callable, size: int, acc_dtype) -> Callable:
    """``base(params, s, others, is_padding, *batch)`` over consecutive microbatches of
    ``size`` examples, one at a time (``lax.scan``): the sums are carried in
    ``acc_dtype`` (float64 by default, so that microbatches add no rounding of their
    own), the per-example values concatenated back in batch order."""

    def fun(params, s, others, is_padding, *batch):
        count = is_padding.shape[0] // size

        def split(x):
            return jnp.reshape(x, (count, size) + jnp.shape(x)[1:])

        xs = (split(is_padding), tuple(jax.tree.map(split, b) for b in batch))
        with wide(acc_dtype):
            init = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype), params)
        init = replay.vary_like(init, batch)

        def body(acc, x):
            pad, part = x
            sums, aux = base(params, s, others, pad, *part)
            with wide(acc_dtype):
                acc = jax.tree.map(lambda c, x: c + x.astype(acc_dtype), acc, sums)
            return acc, aux

        total, aux = jax.lax.scan(body, init, xs)
        return total, jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), aux)

    return fun


class _MethodChooser:
    """Decides, per argument shapes, between per-example gradients and ghost clipping."""

    def __init__(self, method: str, example_loss: Callable):
        self.method = method
        self.example_loss = example_loss
        self.last: str | None = None
        self._cache: dict[Any, tuple[Any, str]] = {}

    def _key(self, params, others, batch_args):
        def sig(tree):
            leaves, treedef = jax.tree.flatten(tree)
            avals = [replay.aval(x) for x in leaves]
            # Inside shard_map a plan is traced with the mesh axes each leaf varies over.
            return treedef, tuple(
                (a.shape, str(a.dtype), str(getattr(a, "manual_axis_type", None))) for a in avals
            )

        return sig(params), sig(others), sig(batch_args)

    def _plan(self, params, others, batch_args):
        """``(plan or None, reason)`` for these shapes, cached."""
        if self.method == "vmap":
            return None, "method='vmap' requested"
        key = self._key(params, others, batch_args)
        if key not in self._cache:
            example = tuple(
                jax.tree.map(lambda x: replay.aval(x, drop_batch=True), b) for b in batch_args
            )
            try:
                plan = ghost_lib.plan_ghost(self.example_loss, params, others, example)
                self._cache[key] = (plan, "")
            except ghost_lib.Unsupported as e:
                if self.method == "ghost":
                    raise ValueError(f"method='ghost': {e}") from None
                self._cache[key] = (None, str(e))
        return self._cache[key]

    def rounding(self, clip_dtype, norm_dtype) -> tuple[int, float] | None:
        """``(rows, cancellation)`` of the sums traced or explained so far (the largest
        of each, see ``GhostPlan.sum_rounding``); None before any with ghost clipping."""
        if self.method == "vmap":
            return 1, 1.0
        if not self._cache:
            return None
        rows, cancellation = 1, 1.0
        for plan, _ in self._cache.values():
            if plan is not None:
                t, k = plan.sum_rounding(clip_dtype, norm_dtype)
                rows, cancellation = max(rows, t), max(cancellation, k)
        return rows, cancellation

    def choose(self, params, others, batch_args):
        plan, _ = self._plan(params, others, batch_args)
        self.last = "vmap" if plan is None else "ghost"
        return plan

    def explain(self, params, others, batch_args) -> dict[str, Any]:
        plan, reason = self._plan(params, others, batch_args)
        return {
            "requested": self.method,
            "method": "vmap" if plan is None else "ghost",
            "reason": reason,
            "layers": [] if plan is None else plan.layers(),
        }
