"""The choice between per-example gradients and ghost clipping, per argument shapes
and device (``dpmp.clipping._cost``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from dpmp.clipping import _replay as replay
from dpmp.clipping import ghost as ghost_lib
from dpmp.clipping._cost import modelled_choice
from dpmp.clipping.ghost._operands import device_reads_half

__all__ = ["MethodChooser"]


class MethodChooser:
    """Decides, per argument shapes and device, between per-example gradients and ghost
    clipping. ``dtypes``: ``(grad, clip, accumulate)``, the dtypes the modelled costs
    of ``"auto"`` read (per-example gradients, Gram matrices, clip-weighted sums)."""

    def __init__(self, method: str, example_loss: Callable, dtypes: tuple):
        self.method = method
        self.example_loss = example_loss
        self.dtypes = dtypes
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

        device = (jax.default_backend(), device_reads_half())
        return sig(params), sig(others), sig(batch_args), device

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
                batch = jax.tree.leaves(batch_args)[0].shape[0]
                self._cache[key] = self._by_cost(plan, batch)
            except ghost_lib.Unsupported as e:
                if self.method == "ghost":
                    raise ValueError(f"method='ghost': {e}") from None
                self._cache[key] = (None, str(e))
        return self._cache[key]

    def _by_cost(self, plan, batch_size: int) -> tuple[Any, str]:
        """``(plan, "")`` for ``method="ghost"``; for ``"auto"`` the plan or None (vmap),
        whichever the modelled cost on this device prefers, and why."""
        if self.method == "ghost":
            return plan, ""
        grad, clip, acc = self.dtypes
        method, reason = modelled_choice(
            plan, batch_size, grad_dtype=grad, clip_dtype=clip, acc_dtype=acc
        )
        return (plan if method == "ghost" else None), f"{method}: {reason}"

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
