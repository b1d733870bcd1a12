"""Data-flow analysis of a jaxpr for the sites that carry a privacy guarantee.

One walker (``Walker``) interprets the jaxpr abstractly: every variable
gets a ``dpmp.audit._values.Value`` (taint flags and the axes that index
examples), and each equation is handled by the rule registered for its
primitive in ``dpmp.audit.rules.RULES`` (reductions, contractions,
layout, norms, noise, additions, casts, collectives, control flow: one module
each under ``dpmp/audit/rules/``). Calls of sub-jaxprs (``jit``,
``custom_jvp_call``, ...) are entered by the walker itself; an equation no
rule knows is treated as an elementwise computation of its inputs.

Batch axes start at axis 0 of every batch leaf and follow the data through
reshapes, transposes, broadcasts, dot products, convolutions, slices,
``scan``/``while``/``cond`` and calls. A reduction over a batch axis of a
``GRAD`` value is a reduction over examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dpmp.audit import _source
from dpmp.audit._axes import elementwise, right_aligned
from dpmp.audit._values import (
    BATCH,
    CLIPPED,
    EMPTY,
    GRAD,
    IS_PARAM,
    NOISE,
    NORM,
    NORM_LINE,
    NOT_INHERITED,
    PARAM,
    REDUCED,
    RNG,
    SQSUM,
    RawFinding,
    Value,
    bits,
    dtype_of,
    is_float,
    is_key,
    is_literal,
    join,
    narrowest,
    open_jaxpr,
    shape_of,
)
from dpmp.audit.rules import Rule, Step, rule_for
from dpmp.audit.rules._correlated import stream_stage_call
from dpmp.audit.rules._noise import sampler_call

# Parameters under which call-like primitives hold the jaxpr they call.
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class Walker:
    """Abstract interpreter over a jaxpr; see the module docstring.

    Attributes:
      policy: the ``dpmp.Policy`` the sites are checked against.
      param_dtype: the dtype updates must reach (default: ``policy.param``).
      findings: the sites found, by key, in the order first recorded.
      recording: false while a loop body is iterated to its fixed point.
      envs: the last environment of each jaxpr walked (by ``id``), for the
        loop-carry analysis of ``scan``/``while``.
    """

    def __init__(self, policy, param_dtype=None):
        self.policy = policy
        self.param_dtype = param_dtype
        self.findings: dict[tuple, RawFinding] = {}
        self.recording = True
        self.envs: dict[int, dict] = {}
        self._parent_frame = ""

    def record(
        self,
        key: tuple,
        kind: str,
        primitive: str,
        *,
        in_dtype,
        acc_dtype,
        out_dtype,
        location: str,
        required,
        message: str,
        violation: bool = False,
    ) -> None:
        """Records a site under ``key`` (a later record of the same key replaces it
        in place). It is ok when every dtype given reaches ``required``, and not
        ``violation``."""
        if not self.recording:
            return
        dtypes = [d for d in (in_dtype, acc_dtype, out_dtype) if d is not None]
        ok = all(bits(d) >= bits(required) for d in dtypes) if required is not None else True
        self.findings[key] = RawFinding(
            kind=kind,
            primitive=primitive,
            in_dtype=None if in_dtype is None else np.dtype(in_dtype),
            acc_dtype=None if acc_dtype is None else np.dtype(acc_dtype),
            out_dtype=None if out_dtype is None else np.dtype(out_dtype),
            location=location,
            required=None if required is None else np.dtype(required),
            message=message,
            ok=ok and not violation,
        )

    # -- traversal -----------------------------------------------------------------
    def run(self, jaxpr, in_avs: Sequence[Value], path: str, in_transpose: bool = False):
        """Walks ``jaxpr`` from the values of its inputs; returns its outputs' values."""
        jaxpr, _ = open_jaxpr(jaxpr)
        env: dict = {}
        for var, av in zip(jaxpr.invars, in_avs, strict=True):
            env[var] = av

        def read(v):
            if is_literal(v):
                return EMPTY
            return env.get(v, EMPTY)

        parent = self._parent_frame
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            tr = in_transpose or _source.in_transpose(eqn)
            loc = f"{path}#{i}"
            frame = _source.location(eqn) or parent
            site = f"{loc} @ {frame}" if frame else loc
            self._parent_frame = frame
            outs = self.eqn(Step(self, eqn, ins, loc, site, tr))
            for v, av in zip(eqn.outvars, outs, strict=True):
                env[v] = av
        self._parent_frame = parent
        self.envs[id(jaxpr)] = env
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, step: Step) -> list[Value]:
        """The output values of one equation: its rule's ``walk`` stage, a call of
        a sub-jaxpr, or the primitive stages."""
        rule = rule_for(step.name)
        if rule.walk is not None:
            return rule.walk(step)
        for key in _CALL_PARAMS:
            sub = step.eqn.params.get(key)
            if sub is not None and hasattr(open_jaxpr(sub)[0], "eqns"):
                return self.call(step, sub)
        return self.primitive(rule, step.begin())

    def call(self, step: Step, sub) -> list[Value]:
        """Walks the called jaxpr ``sub``, matching batch axes at its boundary."""
        eqn, ins = step.eqn, step.ins
        jaxpr, _ = open_jaxpr(sub)
        inner = eqn.params.get("name")
        path = f"{step.loc}/{step.name}" + (f"({inner})" if isinstance(inner, str) else "")
        if len(jaxpr.invars) != len(eqn.invars):
            return self.opaque(step)
        inner_ins = [
            dataclasses.replace(av, bax=right_aligned(av.bax, shape_of(v), shape_of(w)))
            for av, v, w in zip(ins, eqn.invars, jaxpr.invars, strict=True)
        ]
        outs = self.run(jaxpr, inner_ins, path, step.in_transpose)
        if len(outs) != len(eqn.outvars):
            return self.opaque(step)
        outs = sampler_call(step, outs)
        stream_stage_call(step)
        return [
            dataclasses.replace(av, bax=right_aligned(av.bax, shape_of(w), shape_of(v)))
            for av, v, w in zip(outs, eqn.outvars, jaxpr.outvars, strict=True)
        ]

    def opaque(self, step: Step) -> list[Value]:
        """Outputs as a computation of all inputs, without batch axes."""
        flags = 0
        for av in step.ins:
            flags |= av.flags
        flags &= ~NOT_INHERITED
        outs = []
        for v in step.eqn.outvars:
            f = flags | (GRAD if step.in_transpose and is_float(dtype_of(v)) else 0)
            outs.append(Value(f))
        return outs

    def fixpoint(self, body_fn: Callable[[list[Value]], list[Value]], carry: list[Value]):
        """Iterates body_fn on the carry abstract values to a fixed point
        (without recording), then runs it once more recording findings."""
        saved = self.recording
        self.recording = False
        try:
            for _ in range(16):
                new = body_fn(carry)
                joined = [join(a, b) for a, b in zip(carry, new, strict=True)]
                if joined == list(carry):
                    break
                carry = joined
        finally:
            self.recording = saved
        return carry

    # -- primitives ----------------------------------------------------------------
    def primitive(self, rule: Rule, s: Step) -> list[Value]:
        """Runs the stages of ``rule`` on a primitive equation (``s`` after
        ``Step.begin``), with what holds for every primitive between them."""
        s.bax, s.reduces_examples = (rule.axes or elementwise)(s.eqn, s.ins)
        if any(is_key(d) for d in s.in_dtypes):
            s.flags |= RNG
        if rule.source is not None:
            rule.source(s)
        # NOISE survives only while it does not mix with a gradient.
        if s.flags & NOISE and s.flags & GRAD and not rule.keeps_noise:
            s.flags &= ~NOISE
        if rule.norm is not None and (outs := rule.norm(s)) is not None:
            return outs
        if any(av.has(NORM | SQSUM) for av in s.ins) and not any(s.grad_operands):
            # computed from norms alone: the norm itself, the clip factor
            if rule.of_norm is not None:
                rule.of_norm(s)
            if s.out_float:
                return s.outs(s.flags, narrowest(s.sq, s.out_dtype), s.src)
        if s.flags & NORM_LINE and s.flags & GRAD:
            s.flags &= ~NORM_LINE
        if rule.gradient is not None and (outs := rule.gradient(s)) is not None:
            return outs
        if s.reduces_examples and s.out_float and any(av.has(GRAD) for av in s.ins):
            gi = next(k for k, av in enumerate(s.ins) if av.has(GRAD))
            s.record(
                "batch_reduction",
                s.in_dtypes[gi],
                s.eqn.params.get("preferred_element_type") or s.out_dtype,
                s.policy.accumulate,
                "sum of gradients over the example axis"
                + (" (clipped)" if s.ins[gi].has(CLIPPED) else ""),
            )
            s.flags |= REDUCED
        return s.outs(s.flags, s.sq if s.flags & NORM_LINE else None, s.src)


def example_axes(shape: tuple, batch_size: int | None) -> tuple[int, ...]:
    """Leading axes of a batch leaf that index examples.

    Axis 0, or, when ``batch_size`` is given and the leaf is laid out as
    ``(devices, per_device, ...)`` (pmap), the leading axes whose sizes
    multiply to ``batch_size``. Axes of size 1 carry no example index.
    """
    if not shape:
        return ()
    if batch_size is None or shape[0] == batch_size:
        return (0,) if shape[0] > 1 else ()
    prod = 1
    for k, size in enumerate(shape):
        prod *= size
        if prod == batch_size:
            return tuple(i for i in range(k + 1) if shape[i] > 1)
        if prod > batch_size:
            break
    return ()


def initial_avs(
    leaves: Sequence[Any],
    roles: Sequence[str],
    batch_size: int | None,
) -> list[Value]:
    """Abstract values for the flattened arguments.

    roles: per leaf, "param", "batch" or "other".
    """
    avs = []
    for leaf, role in zip(leaves, roles, strict=True):
        shape = tuple(getattr(leaf, "shape", ()))
        flags = RNG if is_key(getattr(leaf, "dtype", None)) else 0
        bax = frozenset()
        if role == "param":
            flags |= PARAM | IS_PARAM
        elif role == "batch":
            flags |= BATCH
            bax = frozenset(example_axes(shape, batch_size))
        avs.append(Value(flags, bax))
    return avs


def analyze(closed_jaxpr, avs, policy, *, param_dtype=None, root="") -> list[RawFinding]:
    """Runs the analysis and returns the findings in traversal order."""
    walker = Walker(policy, param_dtype=param_dtype)
    walker.run(closed_jaxpr.jaxpr, avs, root)
    return list(walker.findings.values())
