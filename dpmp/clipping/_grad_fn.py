"""A clipped-sum function that knows its sensitivity, floating-point rounding included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dp_accounting
import jax.numpy as jnp
import numpy as np

from dpmp.clipping._chooser import MethodChooser
from dpmp.clipping._results import PrivateGrad
from dpmp.clipping._rounding import higham_gamma, unit_roundoff
from dpmp.clipping._setup import reduction_dtypes
from dpmp.precision._policy import Policy

__all__ = ["PrivateGradFn"]


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
        chooser: MethodChooser,
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
        self._sum_dtype, self._acc_dtype, self._norm_dtype = reduction_dtypes(policy, accumulation)

    def explain(self, params, *args) -> dict[str, Any]:
        """Which method computes ``g(params, *args)`` and why.

        Returns ``{"requested", "method", "reason", "layers"}``: ``method`` is
        ``"vmap"`` or ``"ghost"``; ``reason`` says why ``"auto"`` chose it: the
        model ghost clipping cannot handle, or the modelled cost of both on this
        device and the term that decided (``dpmp.clipping._cost``); empty for a
        method that was requested. ``layers`` lists each
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
        ``dpmp.clipping.ghost._gram.cancellation_floor``, over the float32 rounding of the
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
        (see ``sensitivity``): ``clip_norm``, ``per_example`` (B),
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
    """The bound of ``PrivateGradFn.sensitivity``, term by term (all in L2)."""
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
