"""Per-example clipped gradients in half precision, with fp32 norms and sums.

The data path of ``private_grad`` for one example ``i`` of a batch:

    loss_i   = loss_fn(params in grad dtype, batch_i in compute dtype)
    g_i      = grad(float32(loss_i) * S)          # grad dtype (bf16/fp16 possible)
    u_i      = clip_dtype(g_i) / S                 # the loss scale leaves FIRST
    finite_i = every entry of u_i is finite and ||u_i|| is finite
    u_i      = u_i if finite_i and not padding_i else 0    # whole example zeroed
    c_i      = u_i * min(1, C / ||u_i||)          # norm and factor in clip dtype
    grads    = sum_i c_i                           # accumulate dtype, across
                                                   # microbatches too

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
  factors in ``policy.clip`` and sums in ``promote(clip, accumulate)``.

Formal guarantees (add/remove-one adjacency; replace-one doubles the bound):
  * every clipped per-example gradient has L2 norm at most ``l2_clip_norm``
    (up to the rounding of one float32 multiply, < C * (1 + 2^-20));
  * the sum has L2 sensitivity ``l2_clip_norm`` in exact arithmetic; in float32
    with batch size n the extra rounding is bounded as in Casacuberta et al.
    2022 (see ``dpmp.audit_precision``'s numeric audit);
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
import optax

from dpmp._src import ghost as ghost_lib
from dpmp._src import replay
from dpmp._src.casting import cast_tree
from dpmp._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from dpmp._src.policy import Policy
from dpmp._src.private_loss_scale import PrivateDynamicLossScale

__all__ = [
    "PrivateGrad",
    "PrivateGradFn",
    "PrivateGradStats",
    "adjust_loss_scale",
    "combine_stats",
    "private_grad",
]

_METHODS = ("auto", "vmap", "ghost")


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
        error added, see ``dpmp._src.ghost``).
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
    ):
        self._fun = fun
        self._explain = explain
        self._chooser = chooser
        self.l2_norm_bound = l2_norm_bound
        self.method = method
        self.policy = policy

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
    ) -> float:
        """L2 sensitivity of ``grads`` under ``neighboring_relation``."""
        rel = dp_accounting.NeighboringRelation
        match neighboring_relation:
            case rel.ADD_OR_REMOVE_ONE | rel.REPLACE_SPECIAL:
                return self.l2_norm_bound
            case rel.REPLACE_ONE:
                return 2 * self.l2_norm_bound
            case _:
                raise ValueError(f"unsupported neighboring relation {neighboring_relation}")

    @property
    def resolved_method(self) -> str | None:
        """The method the last traced call used (``None`` before the first call)."""
        return self._chooser.last

    def __repr__(self):
        return (
            f"PrivateGradFn(l2_norm_bound={self.l2_norm_bound}, method={self.method!r}, "
            f"policy='{self.policy}')"
        )


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
        below the exact norm, see ``dpmp._src.ghost``), or ``"auto"``: ghost
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
        """Scaled gradient of one example (grad dtype), its unscaled norm and finiteness."""

        def scaled_loss(p):
            # Replayed, so that XLA:CPU sees no batch axis of 1 in its reductions
            # (see dpmp._src.replay: 15-20x slower product-and-reduce fusions).
            loss32 = replay.replayed(example_loss)(p, others, *example)
            return loss32 * s, loss32

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        # The scale leaves before any norm: cast up, then divide (exact for powers of two).
        s_clip = s.astype(clip_dtype)
        sq = _global_sq_norm(jax.tree.map(lambda g: g.astype(clip_dtype) / s_clip, grads))
        # A non-finite entry makes the sum of squares inf or NaN, so this one test
        # covers every entry without a second pass over the per-example gradients
        # (a finite gradient whose squared norm overflows is dropped too: safe).
        finite = jnp.isfinite(sq)
        return grads, jnp.sqrt(sq), finite, loss

    def microbatch_sum(params, s, others, is_padding, *batch):
        """Clipped sum over one (micro)batch: the cast to float32 is fused into the sum."""
        grads, norms, finite, losses = jax.vmap(
            per_example, in_axes=(None, None, None) + (0,) * n_batch
        )(params, s, others, *batch)
        keep = finite & ~is_padding
        safe = jnp.where(keep, norms, jnp.ones_like(norms))
        factor = jnp.minimum(jnp.ones_like(safe), jnp.asarray(clip_norm, clip_dtype) / safe)
        factor = jnp.where(keep, factor, jnp.zeros_like(factor)) / s.astype(clip_dtype)

        def weighted_sum(g):
            return ghost_lib.weighted_example_sum(g, factor, keep, sum_dtype)

        return jax.tree.map(weighted_sum, grads), (norms, finite, losses)

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
            sum_dtype=sum_dtype,
        )
        return jax.tree.unflatten(jax.tree.structure(params), leaves), (norms, finite, losses)

    acc = optax.microbatching.AccumulationType

    def summed_fn(plan):
        base = microbatch_sum if plan is None else functools.partial(ghost_sum, plan)
        if microbatch_size is None:
            return base
        return optax.microbatching.microbatch(
            base,
            argnums=tuple(range(3, 4 + n_batch)),
            microbatch_size=int(microbatch_size),
            accumulator=(acc.SUM, (acc.CONCAT, acc.CONCAT, acc.CONCAT)),
        )

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
        sums, (norms, finite, losses) = summed_fn(plan)(
            diff_params, s, others, is_padding_example, *batch_args
        )
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
    )


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
