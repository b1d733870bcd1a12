"""What ``private_grad`` was built with, resolved once: the loss of one example and
the dtypes each reduction runs in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.precision._casting import cast_tree
from dpmp.precision._dtypes import dtype_name
from dpmp.precision._policy import Policy

__all__ = ["Setup", "reduction_dtypes"]


def reduction_dtypes(policy: Policy, accumulation: str) -> tuple[Any, Any, Any]:
    """``(sum_dtype, acc_dtype, norm_dtype)``: the dtype the sum is returned in
    (``promote(clip, accumulate)``), the one the sums over examples accumulate in and
    the one squared norms are added up in (both float64 with ``accumulation="float64"``,
    the policy's own with ``"policy"``). An accumulate dtype that is not at least as
    wide as the clip dtype is refused: the sum could not be formed in it."""
    sum_dtype = jnp.promote_types(policy.clip, policy.accumulate)
    if sum_dtype != jnp.dtype(policy.accumulate):
        acc, clip, wide = (dtype_name(d) for d in (policy.accumulate, policy.clip, sum_dtype))
        raise ValueError(
            f"policy: accumulate={acc} is not at least as wide as clip={clip}: the clipped "
            f"sum would be formed in {wide}, so the setting would do nothing; use "
            f"accumulate={wide} (or a clip dtype that accumulate={acc} can hold)"
        )
    wide64 = accumulation == "float64"
    acc_dtype = jnp.promote_types(sum_dtype, jnp.float64) if wide64 else sum_dtype
    norm_dtype = jnp.promote_types(policy.clip, jnp.float64) if wide64 else jnp.dtype(policy.clip)
    return sum_dtype, acc_dtype, norm_dtype


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
    """The validated arguments of ``private_grad`` and the dtypes they resolve to.

    ``argnums``: the positions (from 1; params are 0) of the batch arguments;
    ``clip_dtype``: the policy's; ``sum_dtype``, ``acc_dtype``, ``norm_dtype``: see
    ``reduction_dtypes``. The sum is rounded to ``sum_dtype`` once, after every
    example and microbatch is in.
    """

    loss_fn: Callable
    policy: Policy
    argnums: tuple[int, ...]
    clip_norm: float
    keep_batch_dim: bool
    microbatch_size: int | None
    allow_nonprivate_loss_scale: bool
    clip_dtype: Any
    sum_dtype: Any
    acc_dtype: Any
    norm_dtype: Any

    def example_loss(self, params, others, *example):
        """float32 loss of ONE example (no batch axis): the batch leaves are cast to
        ``policy.compute`` (and given a batch axis of 1 with ``keep_batch_dim``)."""
        args = dict(others)
        for pos, value in zip(self.argnums, example):
            value = cast_tree(value, self.policy.compute)
            if self.keep_batch_dim:
                value = jax.tree.map(lambda x: x[None], value)
            args[pos] = value
        args = [args[i] for i in range(1, len(args) + 1)]
        loss = jnp.asarray(self.loss_fn(params, *args))
        if loss.shape != ():
            raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}")
        return loss.astype(jnp.float32)
