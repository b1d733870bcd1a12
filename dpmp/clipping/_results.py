"""What ``private_grad`` returns: the clipped sum and the batch's statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PrivateGrad", "PrivateGradStats", "batch_stats", "combine_stats"]


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


def batch_stats(norms, finite, losses, is_padding, loss_scale, clip_norm: float):
    """The ``PrivateGradStats`` of one batch from its per-example norms (clip dtype),
    finiteness and float32 losses; ``noised_overflow_count`` NaN (none released yet)."""
    real = ~is_padding
    ok = real & finite
    n_real = real.sum(dtype=jnp.int32)
    n_ok = ok.sum(dtype=jnp.int32)
    norms32 = norms.astype(jnp.float32)
    safe_norms = jnp.where(ok, norms32, 0.0)
    masked_for_median = jnp.where(ok, norms32, jnp.nan)
    return PrivateGradStats(
        num_examples=n_real,
        num_nonfinite=(real & ~finite).sum(dtype=jnp.int32),
        num_clipped=(ok & (norms32 > jnp.float32(clip_norm))).sum(dtype=jnp.int32),
        norm_mean=safe_norms.sum() / jnp.maximum(n_ok, 1).astype(jnp.float32),
        norm_max=safe_norms.max(),
        norm_median=jnp.nan_to_num(jnp.nanmedian(masked_for_median)),
        loss_mean=jnp.where(real, losses, 0.0).sum() / jnp.maximum(n_real, 1).astype(jnp.float32),
        loss_scale=loss_scale,
        noised_overflow_count=jnp.float32(jnp.nan),
    )
