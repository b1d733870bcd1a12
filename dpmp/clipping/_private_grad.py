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
    many tokens (``K`` >= 64): see ``PrivateGradFn.sensitivity``;
  * padding and non-finite examples contribute exactly zero;
  * ``stats`` are per-batch functions of private data, for monitoring only —
    except ``noised_overflow_count``, which is a privatized release accounted
    by ``dpmp.accounting``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.clipping import _replay as replay
from dpmp.clipping import ghost as ghost_lib
from dpmp.clipping._chooser import MethodChooser
from dpmp.clipping._chunks import microbatched
from dpmp.clipping._grad_fn import PrivateGradFn as PrivateGradFn
from dpmp.clipping._private_loss_scale import PrivateDynamicLossScale
from dpmp.clipping._results import PrivateGrad as PrivateGrad
from dpmp.clipping._results import PrivateGradStats as PrivateGradStats
from dpmp.clipping._results import batch_stats
from dpmp.clipping._results import combine_stats as combine_stats
from dpmp.clipping._rounding import wide
from dpmp.clipping._setup import Setup, reduction_dtypes
from dpmp.clipping._vmap import vmap_clipped_sum
from dpmp.precision._casting import cast_tree
from dpmp.precision._loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from dpmp.precision._policy import Policy
from dpmp.precision._stages import STAGES

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
        convolution, embedding, bias, norm scale) and its modelled cost on the
        device is below vmap's (``dpmp.clipping._cost``), else vmap. ``g.explain(params,
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
    clip_norm, argnums = _validate(
        method,
        l2_clip_norm,
        accumulation,
        microbatch_size,
        batch_argnums,
        allow_nonprivate_loss_scale,
    )
    # The dtypes the reductions accumulate in (see ``accumulation``); the sum is
    # rounded to ``sum_dtype`` once, after every example and microbatch is in.
    sum_dtype, acc_dtype, norm_dtype = reduction_dtypes(policy, accumulation)
    setup = Setup(
        loss_fn=loss_fn,
        policy=policy,
        argnums=argnums,
        clip_norm=clip_norm,
        keep_batch_dim=keep_batch_dim,
        microbatch_size=microbatch_size,
        allow_nonprivate_loss_scale=allow_nonprivate_loss_scale,
        clip_dtype=policy.clip,
        sum_dtype=sum_dtype,
        acc_dtype=acc_dtype,
        norm_dtype=norm_dtype,
    )
    chooser = MethodChooser(
        method, setup.example_loss, (policy.grad, setup.clip_dtype, setup.acc_dtype)
    )
    return PrivateGradFn(
        functools.partial(_clipped_grad, setup, chooser),
        l2_norm_bound=clip_norm,
        method=method,
        policy=policy,
        explain=functools.partial(_explain, setup, chooser),
        chooser=chooser,
        accumulation=accumulation,
        microbatched=microbatch_size is not None,
    )


def _validate(
    method, l2_clip_norm, accumulation, microbatch_size, batch_argnums, allow_nonprivate_loss_scale
) -> tuple[float, tuple[int, ...]]:
    """``(clip_norm, argnums)`` from ``private_grad``'s arguments; a ``ValueError`` names
    the first one that is wrong. Warns (at the caller of ``private_grad``) when a
    non-private loss scale is allowed."""
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
            stacklevel=3,
        )
    argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if not argnums or min(argnums) < 1:
        raise ValueError(f"batch_argnums: must be >= 1 (params come first), got {batch_argnums!r}")
    return clip_norm, argnums


def _clipped_grad(
    setup: Setup,
    chooser: MethodChooser,
    params,
    *args,
    loss_scale=None,
    is_padding_example=None,
) -> PrivateGrad:
    """``g(params, *args, loss_scale=..., is_padding_example=...)`` of ``private_grad``."""
    loss_scale = _checked_loss_scale(loss_scale, setup.allow_nonprivate_loss_scale)
    argnums = setup.argnums
    if len(args) < max(argnums):
        raise ValueError(
            f"expected batch arguments at positions {argnums}, got {len(args) + 1} arguments"
        )
    s = loss_scale.loss_scale.astype(jnp.float32)
    diff_params = cast_tree(params, setup.policy.grad)
    batch_args, others = _split(args, argnums)
    batch_size = _batch_size(batch_args, argnums)
    is_padding_example = _padding_mask(is_padding_example, batch_size)
    if setup.microbatch_size is not None and batch_size % int(setup.microbatch_size):
        raise ValueError(
            f"microbatch_size: {setup.microbatch_size} does not divide the batch size {batch_size}"
        )
    # Inside shard_map, parameters replicated over the mesh axes the batch is
    # split over are made to vary over them. Otherwise JAX all-reduces the
    # per-example gradients of a replicated value across devices BEFORE they
    # are clipped: each "example" would mix examples of every device. The
    # clipped sums stay per device; psum them as usual.
    diff_params = replay.vary_like(diff_params, batch_args)
    plan = chooser.choose(diff_params, others, batch_args)
    wide_sums, (norms, finite, losses) = _summed_fn(setup, plan)(
        diff_params, s, others, is_padding_example, *batch_args
    )
    with wide(setup.acc_dtype), jax.named_scope(STAGES["clipped_sum"]):
        # the one rounding of the float64 sum
        sums = jax.tree.map(lambda x: x.astype(setup.sum_dtype), wide_sums)
    stats = batch_stats(norms, finite, losses, is_padding_example, s, setup.clip_norm)
    next_scale, noised = adjust_loss_scale(loss_scale, stats.num_nonfinite)
    return PrivateGrad(sums, stats._replace(noised_overflow_count=noised), next_scale)


def _explain(setup: Setup, chooser: MethodChooser, params, *args):
    batch_args, others = _split(args, setup.argnums)
    diff_params = jax.eval_shape(lambda p: cast_tree(p, setup.policy.grad), params)
    return chooser.explain(diff_params, others, batch_args)


def _checked_loss_scale(loss_scale, allow_nonprivate: bool):
    """``loss_scale`` (``NoOpLossScale()`` for None), or a ``ValueError`` for one that is
    not a dpmp loss scale or decides from the exact overflow count unasked."""
    if loss_scale is None:
        loss_scale = NoOpLossScale()
    if isinstance(loss_scale, DynamicLossScale) and not allow_nonprivate:
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
        raise ValueError(f"loss_scale: expected a dpmp loss scale, got {type(loss_scale).__name__}")
    return loss_scale


def _padding_mask(is_padding_example, batch_size: int):
    """The ``[batch_size]`` boolean padding mask (all False for None)."""
    if is_padding_example is None:
        is_padding_example = jnp.zeros((batch_size,), jnp.bool_)
    is_padding_example = jnp.asarray(is_padding_example, jnp.bool_)
    if is_padding_example.shape != (batch_size,):
        raise ValueError(
            f"is_padding_example: expected shape ({batch_size},), got {is_padding_example.shape}"
        )
    return is_padding_example


def _split(args, argnums):
    """``(batch arguments, {position: other argument})`` of ``g(params, *args)``."""
    batch_args = [args[i - 1] for i in argnums]
    others = {j: a for j, a in enumerate(args, start=1) if j not in argnums}
    return batch_args, others


def _summed_fn(setup: Setup, plan) -> Callable:
    """``fn(params, s, others, is_padding, *batch) -> (sums, (norms, finite, losses))``
    over the whole batch: per-example gradients (``plan`` None) or ghost clipping,
    microbatch after microbatch with ``microbatch_size``."""
    if plan is None:
        base = functools.partial(vmap_clipped_sum, setup)
    else:
        base = functools.partial(_ghost_sum, setup, plan)
    if setup.microbatch_size is None:
        return base
    return microbatched(base, int(setup.microbatch_size), setup.acc_dtype)


def _ghost_sum(setup: Setup, plan, params, s, others, is_padding, *batch):
    """Clipped sum over one (micro)batch from activations and output gradients."""
    leaves, norms, finite, losses = ghost_lib.ghost_clipped_sum(
        plan,
        params_leaves=jax.tree.leaves(params),
        others_leaves=jax.tree.leaves(others),
        batch_leaves=jax.tree.leaves(batch),
        scale=s,
        is_padding=is_padding,
        clip_norm=setup.clip_norm,
        clip_dtype=setup.clip_dtype,
        sum_dtype=setup.acc_dtype,
        norm_dtype=setup.norm_dtype,
        out_dtype=setup.sum_dtype,
    )
    return jax.tree.unflatten(jax.tree.structure(params), leaves), (norms, finite, losses)


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
