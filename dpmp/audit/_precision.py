"""Precision audit: finds the sites of a training step that carry the privacy
guarantee and checks the dtype each one runs in.

``audit_precision`` traces a function to a jaxpr and follows the data
through it (see ``dpmp.audit._jaxpr``). It reports, as
``Finding``s, every

============== ===============================================================
kind           site
============== ===============================================================
batch_reduction sum of gradients over the example axis (``reduce_sum``,
               ``dot_general`` or ``conv`` contracting it, ``cumsum``) and
               running sums of gradients carried by ``scan``/``while`` loops
norm           per-example norm: squares and their sum, the square root, the
               clip factor and its application to the gradient
all_reduce     cross-device sum (``psum``, ``psum_scatter``) of gradients
noise_sample   the Gaussian draw (``erf_inv`` of random bits, or dpmp's snapped draw)
noise_add      the addition of noise to the gradient, and any later cast of
               the noisy gradient below the noise dtype
update         the parameter update (parameter +/- update), and any later cast
               of the new parameters below the parameter dtype
============== ===============================================================

and checks it against a ``dpmp.Policy``: ``batch_reduction`` and
``all_reduce`` sites must run in at least the ``accumulate`` dtype, ``norm``
sites in at least ``clip``, ``noise_*`` in at least ``noise``, and ``update``
in at least ``param``. "Runs in" means every dtype of the site: a
``reduce_sum`` of bf16 values returns bf16 even where XLA accumulates in f32
internally, so its total is rounded to bf16 and it is a violation.

A correlated-noise stream (banded matrix factorization) adds sites of these kinds
at its stages (``dpmp/audit/rules/_correlated.py``): its ring buffer of kept sums
(``batch_reduction``, at least ``accumulate``), the release query it forms from
them (float64: the accounted rounding bound's), its ring of kept outputs and the
decoding (``noise_add``, at least ``noise``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.audit import _jaxpr as audit_jaxpr
from dpmp.precision._dtypes import dtype_name
from dpmp.precision._policy import Policy

__all__ = [
    "KINDS",
    "Finding",
    "PrecisionAuditError",
    "PrecisionReport",
    "audit_precision",
]

KINDS = ("batch_reduction", "norm", "all_reduce", "noise_sample", "noise_add", "update")


def _name(dtype) -> str:
    if dtype is None:
        return "-"
    try:
        return dtype_name(dtype)
    except ValueError:
        return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class Finding:
    """One privacy-relevant site of the audited function.

    Attributes:
      kind: one of ``KINDS``.
      primitive: the jaxpr primitive (``scan+add`` for a loop-carried sum).
      in_dtype: dtype of the operand (for ``norm``: of the squares).
      acc_dtype: dtype partial results are held in, as far as the jaxpr says
        (``preferred_element_type`` of a ``dot_general``, the carry of a loop,
        the noise operand of a ``noise_add``, the clip factor of a clip), or
        ``None``.
      out_dtype: dtype of the result.
      location: ``<sub-jaxpr path>#<equation index> @ <file>:<line>``.
      ok: all dtypes of the site reach ``required``.
      required: the dtype the policy asks for at this site.
      message: what the site is.
    """

    kind: str
    primitive: str
    in_dtype: np.dtype | None
    acc_dtype: np.dtype | None
    out_dtype: np.dtype | None
    location: str
    ok: bool
    message: str
    required: np.dtype | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "primitive": self.primitive,
            "in_dtype": None if self.in_dtype is None else _name(self.in_dtype),
            "acc_dtype": None if self.acc_dtype is None else _name(self.acc_dtype),
            "out_dtype": None if self.out_dtype is None else _name(self.out_dtype),
            "required": None if self.required is None else _name(self.required),
            "location": self.location,
            "ok": self.ok,
            "message": self.message,
        }

    def __str__(self) -> str:
        status = "ok" if self.ok else "VIOLATION"
        return (
            f"[{status}] {self.kind} {self.primitive} in={_name(self.in_dtype)} "
            f"acc={_name(self.acc_dtype)} out={_name(self.out_dtype)} "
            f"(needs {_name(self.required)}) at {self.location}: {self.message}"
        )


class PrecisionAuditError(AssertionError):
    """Raised by ``PrecisionReport.raise_if_failed``; lists the violations."""

    def __init__(self, report: PrecisionReport):
        self.report = report
        lines = [f"precision audit of {report.name} failed under policy {report.policy}:"]
        lines += [f"  {f}" for f in report.violations]
        lines += [f"  missing: no {k} site found" for k in report.missing]
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """Result of ``audit_precision``.

    ``ok`` is true when no finding violates the policy and every kind named in
    ``expect`` was found. ``str(report)`` is a fixed-width table;
    ``to_dict()``/``to_json()`` serialise it.
    """

    name: str
    policy: Policy
    findings: tuple[Finding, ...]
    batch_size: int | None = None
    expect: tuple[str, ...] = ()
    trace_seconds: float = 0.0
    analysis_seconds: float = 0.0
    requested: Policy | None = None  # the policy given, where it differs from ``policy``

    @property
    def violations(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if not f.ok)

    @property
    def missing(self) -> tuple[str, ...]:
        found = {f.kind for f in self.findings}
        return tuple(k for k in self.expect if k not in found)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.missing

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for f in self.findings if f.kind == k) for k in KINDS}

    def of_kind(self, kind: str) -> tuple[Finding, ...]:
        if kind not in KINDS:
            raise ValueError(f"kind: unknown {kind!r}; allowed: {', '.join(KINDS)}")
        return tuple(f for f in self.findings if f.kind == kind)

    def raise_if_failed(self) -> PrecisionReport:
        if not self.ok:
            raise PrecisionAuditError(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "policy": str(self.policy),
            "batch_size": self.batch_size,
            "counts": self.counts(),
            "violations": len(self.violations),
            "missing": list(self.missing),
            "trace_seconds": round(self.trace_seconds, 4),
            "analysis_seconds": round(self.analysis_seconds, 4),
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self, **kwargs) -> str:
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def _raised(self) -> str:
        """What the checked policy raised from the one given, in words ("" if nothing)."""
        if self.requested is None:
            return ""
        raised = [
            f"{role}={_name(getattr(self.requested, role))}"
            for role in ("clip", "accumulate", "noise")
            if getattr(self.requested, role) != getattr(self.policy, role)
        ]
        if not raised:
            return ""
        return f"; the policy given asks for {', '.join(raised)} (unsafe), held to float32 here"

    def __str__(self) -> str:
        head = "OK" if self.ok else "FAILED"
        counts = ", ".join(f"{k}={n}" for k, n in self.counts().items())
        lines = [
            f"precision audit of {self.name}: {head} ({len(self.violations)} violation(s)"
            + (f", missing: {', '.join(self.missing)}" if self.missing else "")
            + ")",
            # not the step's own policy where that opted in to unsafe dtypes: the audit
            # holds clip, accumulate and noise to float32 whatever it allows
            f"checked against: {self.policy} (clip, accumulate, noise: float32 or wider)"
            + self._raised(),
            f"sites: {counts}",
        ]
        cols = ("ok", "kind", "primitive", "in", "acc", "out", "need", "location", "message")
        rows = [
            (
                "ok" if f.ok else "FAIL",
                f.kind,
                f.primitive,
                _name(f.in_dtype),
                _name(f.acc_dtype),
                _name(f.out_dtype),
                _name(f.required),
                _clip_left(f.location, 64),
                f.message,
            )
            for f in self.findings
        ]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
        lines.append(fmt.format(*cols))
        lines.append("  ".join("-" * w for w in widths))
        lines += [fmt.format(*r) for r in rows]
        return "\n".join(lines)


def _clip_left(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def _argnums(value, n: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        value = (value,)
    out = tuple(int(v) for v in value)
    for v in out:
        if not -n <= v < n:
            raise ValueError(f"argnum {v} out of range for {n} positional argument(s)")
    return tuple(v % n for v in out)


def audit_precision(
    fn: Callable,
    *args,
    policy: Policy | str = "fp32",
    params_argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    batch_size: int | None = None,
    expect: Sequence[str] = (),
    name: str | None = None,
) -> PrecisionReport:
    """Audits the precision of the privacy-relevant sites of ``fn(*args)``.

    Example::

      report = dpmp.audit_precision(step, params, batch, opt_state, policy="bf16",
                                    batch_argnums=1, expect=dpmp.audit.KINDS)
      print(report)
      report.raise_if_failed()

    Args:
      fn: any JAX-traceable function (a jitted function is fine); it is traced
        with ``jax.make_jaxpr``, not run.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      policy: a ``dpmp.Policy`` or its string form.
      params_argnums: positional arguments holding the (master) parameters:
        their leaves are where updates are applied.
      batch_argnums: positional arguments whose leaves have the example axis
        first. Default: argument 1, or, when ``batch_size`` is given, every leaf
        outside ``params_argnums`` whose leading dimension is ``batch_size``.
      batch_size: number of examples. Default: the leading dimension of the
        batch leaves. Batch leaves laid out ``(devices, per_device, ...)`` for
        ``pmap`` are understood when ``batch_size`` is the total.
      expect: kinds (from ``KINDS``) that must be found; a missing kind
        makes the report fail (guards against a site the audit cannot see).
      name: name shown in the report (default: ``fn.__name__``).

    Returns:
      A ``PrecisionReport``.

    Limits: sums that XLA inserts on its own (automatic sharding of a jitted
    function over devices) are not in the jaxpr; write cross-device sums with
    ``shard_map``/``pmap``. Noise is recognised as Gaussian draws from
    ``jax.random.normal`` (``erf_inv`` of random bits) and from
    ``dpmp.snapped_gaussian`` (its named float64 ``ndtri`` draw).
    """
    requested = Policy.parse(policy) if isinstance(policy, str) else policy
    policy = _audit_policy(policy)
    for k in expect:
        if k not in KINDS:
            raise ValueError(f"expect: unknown kind {k!r}; allowed: {', '.join(KINDS)}")
    leaves, roles = _leaf_roles(args, params_argnums, batch_argnums, batch_size)
    if batch_size is None:
        batch_size = _leading_batch_size(leaves, roles)

    t0 = time.perf_counter()
    closed = jax.make_jaxpr(fn)(*args)
    t1 = time.perf_counter()
    if len(closed.jaxpr.invars) != len(leaves):
        raise ValueError(
            f"traced {len(closed.jaxpr.invars)} inputs but the arguments have {len(leaves)} "
            "leaves; pass static values by closing over them (functools.partial)"
        )
    avs = audit_jaxpr.initial_avs(leaves, roles, batch_size)
    fn_name = name or getattr(fn, "__name__", None) or type(fn).__name__
    raw = audit_jaxpr.analyze(closed, avs, policy, root=fn_name)
    t2 = time.perf_counter()
    findings = tuple(
        Finding(
            kind=r.kind,
            primitive=r.primitive,
            in_dtype=r.in_dtype,
            acc_dtype=r.acc_dtype,
            out_dtype=r.out_dtype,
            location=r.location,
            ok=r.ok,
            message=r.message,
            required=r.required,
        )
        for r in raw
    )
    return PrecisionReport(
        name=fn_name,
        policy=policy,
        findings=findings,
        batch_size=batch_size,
        expect=tuple(expect),
        trace_seconds=t1 - t0,
        analysis_seconds=t2 - t1,
        requested=None if requested == policy else requested,
    )


def _audit_policy(policy: Policy | str) -> Policy:
    """``policy`` with clip, accumulate and noise raised to float32 where narrower.

    The audit judges privacy, not obedience to the policy: a policy that opted in
    to unsafe (sub-float32) clip, accumulate or noise dtypes is still held to
    float32.
    """
    policy = Policy.parse(policy) if isinstance(policy, str) else policy
    if not isinstance(policy, Policy):
        raise ValueError(f"policy: expected a dpmp.Policy or a string, got {policy!r}")
    floor = {
        role: np.dtype(np.float32)
        for role in ("clip", "accumulate", "noise")
        if jnp.finfo(getattr(policy, role)).bits < 32
    }
    return policy.replace(**floor, allow_unsafe=False) if floor else policy


def _leaf_roles(args, params_argnums, batch_argnums, batch_size) -> tuple[list, list[str]]:
    """The flattened leaves of ``args`` and, per leaf, "param", "batch" or "other"
    (see ``audit_precision`` for how the arguments are chosen)."""
    n = len(args)
    p_nums = _argnums(params_argnums, n) if n else ()
    if batch_argnums is None:
        if batch_size is not None:
            b_nums = tuple(i for i in range(n) if i not in p_nums)
            by_size = True
        else:
            b_nums = (1,) if n > 1 and 1 not in p_nums else ()
            by_size = False
    else:
        b_nums = _argnums(batch_argnums, n)
        by_size = False
        overlap = set(b_nums) & set(p_nums)
        if overlap:
            raise ValueError(f"batch_argnums and params_argnums overlap: {sorted(overlap)}")

    roles: list[str] = []
    leaves: list[Any] = []
    for i, arg in enumerate(args):
        arg_leaves = jax.tree.leaves(arg)
        leaves += arg_leaves
        for leaf in arg_leaves:
            if i in p_nums:
                roles.append("param")
            elif i in b_nums:
                shape = tuple(getattr(leaf, "shape", ()))
                if by_size and not audit_jaxpr.example_axes(shape, batch_size):
                    roles.append("other")
                else:
                    roles.append("batch")
            else:
                roles.append("other")
    return leaves, roles


def _leading_batch_size(leaves, roles) -> int | None:
    """Without a batch size, the example axis is the leading one: its size, which
    the batch leaves must agree on."""
    sizes = {
        tuple(getattr(leaf, "shape", ()))[0]
        for leaf, role in zip(leaves, roles, strict=True)
        if role == "batch" and tuple(getattr(leaf, "shape", ()))
    }
    if len(sizes) > 1:
        raise ValueError(
            f"batch leaves disagree on the batch size: {sorted(sizes)}; pass batch_size="
        )
    return sizes.pop() if sizes else None
