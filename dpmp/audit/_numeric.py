"""Numeric audit: runs a clipped-sum function under its policy and in float64
on the same batch and measures what the precision costs.

The floating-point sensitivity bounds follow Casacuberta, Shoemate, Vadhan and
Wagaman 2022, "Widespread underestimation of sensitivity in differentially
private libraries and how to fix it" (CCS 2022). With ``k`` the significand
precision of the accumulate dtype INCLUDING the implicit bit (bf16: 8, f16: 11,
f32: 24, f64: 53) and ``u = 2**-k`` the unit roundoff of round-to-nearest, a
sum of ``n`` terms of norm at most ``M`` is off from the exact sum by at most
``gamma_m * n * M`` with ``gamma_m = m u / (1 - m u)`` (``m = n - 1`` for a
sequential sum, ``m = ceil(log2 n)`` for a pairwise one). Two neighbouring
batches can each be off in opposite directions, so the sensitivity of the
computed sum exceeds the ideal ``M`` by at most

* sequential: ``2 gamma_{n-1} n M``, which is ``~ n**2 M / 2**(k-1)``;
* pairwise:   ``2 (u log2 n) / (1 - u log2 n) n M``.

The same bounds hold for the L2 norm of a vector sum (the triangle inequality
gives ``||sum_i |x_i| ||_2 <= n M``). XLA does not promise a summation order,
so the sequential bound is the safe one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.precision._dtypes import canonical_dtype, dtype_name
from dpmp.precision._policy import Policy

__all__ = ["NumericReport", "fp_sum_sensitivity", "numeric_audit"]


def fp_sum_sensitivity(n: int, clip_norm: float, dtype: Any) -> dict[str, float]:
    """Extra L2 sensitivity of a floating-point sum of ``n`` terms of norm <= M.

    Returns ``{"k", "u", "sequential", "pairwise"}``: the significand bits
    (implicit bit included), the unit roundoff ``2**-k`` and the two bounds on
    how far the sensitivity of the computed sum can exceed ``clip_norm``
    (module docstring). The pairwise bound is ``inf`` when ``u log2 n >= 1``.

      >>> b = fp_sum_sensitivity(1024, 1.0, "float32")
      >>> b["k"], round(b["sequential"], 4)
      (24, 0.125)
    """
    if n < 1:
        raise ValueError(f"n: expected a positive number of terms, got {n}")
    k = int(jnp.finfo(_dt(dtype)).nmant) + 1
    u = 2.0**-k
    m = clip_norm
    sequential = float(n) ** 2 * m / 2.0 ** (k - 1)
    lg = math.log2(n) if n > 1 else 0.0
    pairwise = 2 * (u * lg) / (1 - u * lg) * n * m if u * lg < 1 else math.inf
    return {"k": k, "u": u, "sequential": sequential, "pairwise": pairwise}


def _dt(dtype):
    return canonical_dtype(dtype) if isinstance(dtype, str) else jnp.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class NumericReport:
    """Result of ``numeric_audit``.

    Attributes:
      batch_size: examples in the batch.
      clip_norm: the clip norm ``C``.
      accumulate_dtype: dtype of the clipped sum as returned by ``sum_fn``.
      reference_dtype: dtype of the reference sum (float64 unless the
        function forces a narrower one).
      abs_error: ``||s - s64||_2``.
      rel_error: ``||s - s64||_2 / ||s64||_2``.
      abs_error_over_clip: ``abs_error / C``.
      max_clipped_norm_ratio: largest ``||clip(g_i)||_2 / C`` over the examples
        checked (norms taken in float64 of the per-example clipped gradients
        as ``sum_fn`` computes them), or ``None`` when not measured.
      examples_checked: examples whose clipped norm was measured.
      sensitivity: ``fp_sum_sensitivity`` for ``accumulate_dtype``.
      ok: clipped norms stay within ``C (1 + 4 eps_clip)`` and the sum comes
        back in at least the accumulate dtype (float32 without a policy). The
        error against float64 is reported, not judged: it includes the
        (legitimate) rounding of the per-example gradients themselves.
    """

    batch_size: int
    clip_norm: float
    accumulate_dtype: str
    reference_dtype: str
    abs_error: float
    rel_error: float
    abs_error_over_clip: float
    max_clipped_norm_ratio: float | None
    examples_checked: int
    sensitivity: dict[str, float]
    clip_tolerance: float
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, **kwargs) -> str:
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        s = self.sensitivity
        ratio = "-" if self.max_clipped_norm_ratio is None else f"{self.max_clipped_norm_ratio:.8f}"
        rows = [
            ("status", "OK" if self.ok else "FAILED"),
            ("batch size", str(self.batch_size)),
            ("clip norm C", f"{self.clip_norm:g}"),
            ("sum dtype / reference", f"{self.accumulate_dtype} / {self.reference_dtype}"),
            ("|s - s64|", f"{self.abs_error:.3e}"),
            ("|s - s64| / |s64|", f"{self.rel_error:.3e}"),
            ("|s - s64| / C", f"{self.abs_error_over_clip:.3e}"),
            (
                "max |clip(g_i)| / C",
                f"{ratio} ({self.examples_checked} examples, tol {self.clip_tolerance:.1e})",
            ),
            (f"fp sensitivity excess, sequential (k={s['k']})", f"{s['sequential']:.3e}"),
            ("fp sensitivity excess, pairwise", f"{s['pairwise']:.3e}"),
        ]
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def _cast_floats(tree, dtype):
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x, dtype)
        return x

    return jax.tree.map(cast, tree)


def _flat64(tree) -> np.ndarray:
    leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0)


def _leaf_dtype(tree) -> str:
    dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(tree) if hasattr(x, "dtype")}
    narrow = min(dtypes, key=lambda d: jnp.finfo(d).bits) if dtypes else np.dtype("float32")
    try:
        return dtype_name(narrow)
    except ValueError:
        return narrow.name


def numeric_audit(
    sum_fn: Callable,
    params,
    batch,
    *,
    l2_clip_norm: float,
    policy: Policy | str | None = None,
    reference_fn: Callable | None = None,
    max_examples: int | None = 64,
) -> NumericReport:
    """Compares a clipped sum computed under a policy with a float64 run.

    Args:
      sum_fn: ``sum_fn(params, batch)`` returning the pytree ``sum_i
        clip_C(g_i)`` (e.g. ``lambda p, b: private_grad(p, b).grads`` or a
        jax-privacy ``clipped_grad``). It must clip per example, so that
        called on a batch of one it returns that example's clipped gradient.
      params: the parameters, ``sum_fn``'s first argument.
      batch: a pytree whose leaves have the example axis first.
      l2_clip_norm: the clip norm ``C``.
      policy: used for the clip tolerance (``4 eps`` of its clip dtype;
        default float32).
      reference_fn: the float64 version, called as ``reference_fn(params64,
        batch64)`` with floating inputs cast to float64 inside
        ``jax.enable_x64``. Default: ``sum_fn`` itself on float64 inputs. A
        function that casts to its policy's dtypes inside stays narrow; build
        its reference from an all-float64 policy (``Policy(param="f64", ...)``)
        and pass it here. ``reference_dtype`` in the report shows what ran.
      max_examples: how many examples to check for the largest clipped norm
        (each is a call on a batch of one, vmapped); ``0`` skips it, ``None``
        checks all.

    Returns:
      A ``NumericReport``.
    """
    if isinstance(policy, str):
        policy = Policy.parse(policy)
    clip_dtype = policy.clip if policy is not None else np.dtype(np.float32)
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch: expected a pytree with at least one array leaf")
    n = int(np.shape(leaves[0])[0])

    summed = jax.jit(sum_fn)(params, batch)
    acc_name = _leaf_dtype(summed)
    s = _flat64(summed)

    ref_fn = reference_fn if reference_fn is not None else sum_fn
    with jax.enable_x64(True):
        # the casts happen inside the jitted function: one compilation
        ref = jax.jit(
            lambda p, b: ref_fn(_cast_floats(p, jnp.float64), _cast_floats(b, jnp.float64))
        )(params, batch)
        ref_name = _leaf_dtype(ref)
        r = _flat64(ref)

    abs_err = float(np.linalg.norm(s - r))
    ref_norm = float(np.linalg.norm(r))
    rel_err = abs_err / ref_norm if ref_norm > 0 else (0.0 if abs_err == 0 else math.inf)

    m = n if max_examples is None else min(n, max_examples)
    ratio = None
    if m > 0:

        def per_example(p, b):
            ones = jax.tree.map(lambda x: x[:m, None], b)
            return jax.vmap(lambda one: sum_fn(p, one))(ones)

        per = jax.jit(per_example)(params, batch)
        flat = np.concatenate(
            [np.asarray(x, np.float64).reshape(m, -1) for x in jax.tree.leaves(per)], axis=1
        )
        ratio = float(np.max(np.linalg.norm(flat, axis=1)) / l2_clip_norm)

    sens = fp_sum_sensitivity(n, l2_clip_norm, acc_name)
    tol = 4 * float(jnp.finfo(clip_dtype).eps)
    acc_bits = jnp.finfo(_dt(acc_name)).bits
    need_bits = jnp.finfo(policy.accumulate).bits if policy is not None else 32
    ok = (ratio is None or ratio <= 1 + tol) and acc_bits >= need_bits
    return NumericReport(
        batch_size=n,
        clip_norm=float(l2_clip_norm),
        accumulate_dtype=acc_name,
        reference_dtype=ref_name,
        abs_error=abs_err,
        rel_error=rel_err,
        abs_error_over_clip=abs_err / l2_clip_norm,
        max_clipped_norm_ratio=ratio,
        examples_checked=m,
        sensitivity=sens,
        clip_tolerance=tol,
        ok=bool(ok),
    )
