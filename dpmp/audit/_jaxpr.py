"""Data-flow analysis of a jaxpr for the sites that carry a privacy guarantee.

Every jaxpr variable gets an abstract value (:class:`_AV`): a set of taint
flags and the set of its axes that index examples of the batch.

Taint flags and where they come from:

* ``BATCH``   derived from a batch argument;
* ``PARAM``   derived from a parameter argument; ``IS_PARAM`` marks the
  parameter leaves themselves (kept through sub-jaxpr boundaries and widening
  casts, dropped by any computation);
* ``GRAD``    computed by the backward pass (an equation whose name stack holds
  a ``transpose(...)`` scope, as written by ``jax.grad``/``jax.vjp``) or
  derived from such a value;
* ``RNG``     derived from random bits or a PRNG key;
* ``NOISE``   a float Gaussian sample (the ``erf_inv`` that ``jax.random.normal``
  lowers to, applied to random bits) or derived from one without mixing with a
  gradient;
* ``SQUARE``  elementwise squares of a gradient;
* ``SQSUM``   a sum of ``SQUARE`` values (a squared norm) and what is computed
  from it;
* ``NORM``    a square root of ``SQSUM`` and what is computed from it without a
  gradient: the norm and the clip factor;
* ``CLIPPED`` a gradient multiplied (or divided) by a clip factor;
* ``NOISY``   a gradient with noise added;
* ``REDUCED`` a sum of gradients over examples (before noise);
* ``UPDATED`` new parameters (a parameter plus/minus a gradient-derived update).

Batch axes start at axis 0 of every batch leaf and follow the data through
reshapes, transposes, broadcasts, dot products, convolutions, slices,
``scan``/``while``/``cond`` and calls. A reduction over a batch axis of a
``GRAD`` value is a reduction over examples.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jax_core

from dpmp.noise import sampler

# The named jit of dpmp.snapped_gaussian's normal draw (the snapped sampler's).
SNAPPED_SAMPLE = sampler("snapped").jit_name

# ---- flags -------------------------------------------------------------------
BATCH = 1
PARAM = 2
IS_PARAM = 4
GRAD = 8
RNG = 16
NOISE = 32
SQUARE = 64
NORM = 128
CLIPPED = 256
NOISY = 512
UPDATED = 1024
REDUCED = 2048
SQSUM = 4096
_NORM_LINE = SQUARE | SQSUM | NORM

_NOT_INHERITED = IS_PARAM


@dataclasses.dataclass(frozen=True)
class _AV:
    flags: int = 0
    bax: frozenset = frozenset()
    # Narrowest float dtype seen along a norm lineage (squares, sums, sqrt).
    sq: Any = None
    # Keys of the noise additions this value descends from (NOISY values only).
    src: tuple = ()

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)


_EMPTY = _AV()


def _narrowest(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a if _bits(a) <= _bits(b) else b


def _join(a: _AV, b: _AV) -> _AV:
    if a is b or b is _EMPTY:
        return a
    if a is _EMPTY:
        return b
    return _AV(
        a.flags | b.flags,
        a.bax | b.bax,
        _narrowest(a.sq, b.sq),
        tuple(dict.fromkeys(a.src + b.src)),
    )


def _bits(dtype) -> int:
    if dtype is not None and _is_float(dtype):
        return jnp.finfo(dtype).bits
    return 10**6  # non-float dtypes never count as narrow


def _is_float(dtype) -> bool:
    try:
        return jax.dtypes.issubdtype(dtype, jnp.floating)
    except TypeError:
        return False


def _dtype(v):
    aval = getattr(v, "aval", None)
    return getattr(aval, "dtype", None)


def _shape(v) -> tuple:
    aval = getattr(v, "aval", None)
    return tuple(getattr(aval, "shape", ()))


# ---- findings ----------------------------------------------------------------
@dataclasses.dataclass
class RawFinding:
    kind: str
    primitive: str
    in_dtype: Any
    acc_dtype: Any
    out_dtype: Any
    location: str
    required: Any  # dtype the site must reach, or None for "at least param"
    message: str
    ok: bool


_PSUM_LIKE = {
    "psum",
    "psum2",
    "psum_invariant",
    "reduce_scatter",
    "psum_scatter",
    "all_reduce",
    "pmean",
}
_RNG_SOURCES = {
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_split",
    "random_fold_in",
    "threefry2x32",
}
_ADDS = {"add", "add_any", "sub"}
_SQRTS = {"sqrt", "rsqrt"}
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _short_path(path: str) -> str:
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _frame(eqn) -> str:
    try:
        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # pragma: no cover - jax internals moved
        frame = None
    if frame is None:
        return ""
    return f"{_short_path(frame.file_name)}:{frame.start_line}"


def _is_transpose_scope(eqn) -> bool:
    return "transpose(" in str(eqn.source_info.name_stack)


def _open(jaxpr_like):
    """Returns (open jaxpr, consts) for a Jaxpr or ClosedJaxpr."""
    if isinstance(jaxpr_like, jax_core.ClosedJaxpr):
        return jaxpr_like.jaxpr, jaxpr_like.consts
    return jaxpr_like, ()


# ---- batch-axis propagation --------------------------------------------------
def _reshape_bax(bax, in_shape, out_shape, dimensions=None) -> frozenset:
    if not bax:
        return frozenset()
    if dimensions is not None:
        in_shape = tuple(in_shape[d] for d in dimensions)
        bax = frozenset(i for i, d in enumerate(dimensions) if d in bax)

    def intervals(shape):
        out, acc = [], 1
        for s in shape:
            out.append((acc, acc * s))
            acc *= s
        return out

    ins, outs = intervals(in_shape), intervals(out_shape)
    res = set()
    for a in bax:
        lo, hi = ins[a]
        if hi <= lo:  # size-1 axis carries nothing
            continue
        for j, (olo, ohi) in enumerate(outs):
            if ohi > olo and max(lo, olo) < min(hi, ohi):
                res.add(j)
    return frozenset(res)


def _right_aligned(bax, in_shape, out_shape) -> frozenset:
    if not bax:
        return frozenset()
    if len(in_shape) == len(out_shape):
        return frozenset(a for a in bax if a < len(out_shape))
    res = set()
    i, j = len(in_shape) - 1, len(out_shape) - 1
    while i >= 0 and j >= 0 and in_shape[i] == out_shape[j]:
        if i in bax:
            res.add(j)
        i, j = i - 1, j - 1
    return frozenset(res)


def _elementwise_bax(eqn, ins) -> frozenset:
    out_rank = len(_shape(eqn.outvars[0]))
    res = frozenset()
    for v, av in zip(eqn.invars, ins, strict=False):
        if av.bax and len(_shape(v)) == out_rank:
            res |= av.bax
    return res


def _dot_general_axes(eqn, ins):
    """Returns (output batch axes, contracted-over-a-batch-axis?)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    lr, rr = len(_shape(lhs)), len(_shape(rhs))
    lfree = [a for a in range(lr) if a not in lc and a not in lb]
    rfree = [a for a in range(rr) if a not in rc and a not in rb]
    la, ra = ins[0].bax, ins[1].bax
    out = set()
    for k, (a, b) in enumerate(zip(lb, rb, strict=True)):
        if a in la or b in ra:
            out.add(k)
    for k, a in enumerate(lfree):
        if a in la:
            out.add(len(lb) + k)
    for k, b in enumerate(rfree):
        if b in ra:
            out.add(len(lb) + len(lfree) + k)
    lshape, rshape = _shape(lhs), _shape(rhs)
    contracted = any(a in la and lshape[a] > 1 for a in lc) or any(
        b in ra and rshape[b] > 1 for b in rc
    )
    return frozenset(out), contracted


def _conv_axes(eqn, ins):
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    grouped = eqn.params.get("feature_group_count", 1) > 1 or (
        eqn.params.get("batch_group_count", 1) > 1
    )
    la, ra = ins[0].bax, ins[1].bax
    out = set()
    if lhs_spec[0] in la:
        out.add(out_spec[1] if eqn.params.get("batch_group_count", 1) > 1 else out_spec[0])
    if rhs_spec[0] in ra or (grouped and lhs_spec[1] in la):
        out.add(out_spec[1])
    contracted = not grouped and (lhs_spec[1] in la or rhs_spec[1] in ra)
    return frozenset(out), contracted


def _reduce_axes(eqn) -> tuple:
    p = eqn.params
    if "axes" in p:
        return tuple(p["axes"])
    if "axis" in p:
        return (p["axis"],)
    return ()


def _reduced_bax(bax, axes) -> frozenset:
    axes = set(axes)
    res = set()
    for a in bax:
        if a in axes:
            continue
        res.add(a - sum(1 for r in axes if r < a))
    return frozenset(res)


def _mark_reduced(avs, indices):
    return [
        dataclasses.replace(av, flags=av.flags | REDUCED) if k in indices else av
        for k, av in enumerate(avs)
    ]


# ---- the analyzer ------------------------------------------------------------
class Analyzer:
    """Abstract interpreter over a jaxpr; see the module docstring."""

    def __init__(self, policy, param_dtype=None):
        self.policy = policy
        self.param_dtype = param_dtype
        self.findings: dict[tuple, RawFinding] = {}
        self.recording = True
        # Last environment of each jaxpr run (by id), for loop-carry analysis.
        self._envs: dict[int, dict] = {}
        self._parent_frame = ""

    # -- recording -------------------------------------------------------------
    def _record(
        self, key, kind, primitive, in_dtype, acc_dtype, out_dtype, location, required, message
    ):
        if not self.recording:
            return
        dtypes = [d for d in (in_dtype, acc_dtype, out_dtype) if d is not None]
        ok = all(_bits(d) >= _bits(required) for d in dtypes) if required is not None else True
        self.findings[key] = RawFinding(
            kind=kind,
            primitive=primitive,
            in_dtype=None if in_dtype is None else np.dtype(in_dtype),
            acc_dtype=None if acc_dtype is None else np.dtype(acc_dtype),
            out_dtype=None if out_dtype is None else np.dtype(out_dtype),
            location=location,
            required=None if required is None else np.dtype(required),
            message=message,
            ok=ok,
        )

    # -- traversal -------------------------------------------------------------
    def run(self, jaxpr, in_avs: Sequence[_AV], path: str, in_transpose: bool = False):
        jaxpr, _ = _open(jaxpr)
        env: dict = {}
        for var, av in zip(jaxpr.invars, in_avs, strict=True):
            env[var] = av

        def read(v):
            if isinstance(v, jax_core.Literal):
                return _EMPTY
            return env.get(v, _EMPTY)

        parent = self._parent_frame
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            tr = in_transpose or _is_transpose_scope(eqn)
            loc = f"{path}#{i}"
            frame = _frame(eqn) or parent
            site = f"{loc} @ {frame}" if frame else loc
            self._parent_frame = frame
            outs = self.eqn(eqn, ins, loc, site, tr)
            for v, av in zip(eqn.outvars, outs, strict=True):
                env[v] = av
        self._parent_frame = parent
        self._envs[id(jaxpr)] = env
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins, loc, site, tr) -> list[_AV]:
        name = eqn.primitive.name
        if name == "scan":
            return self._scan(eqn, ins, loc, site, tr)
        if name == "while":
            return self._while(eqn, ins, loc, site, tr)
        if name == "cond":
            return self._cond(eqn, ins, loc, tr)
        for key in _CALL_PARAMS:
            sub = eqn.params.get(key)
            if sub is not None and hasattr(_open(sub)[0], "eqns"):
                return self._call(eqn, ins, sub, loc, tr)
        return self._primitive(eqn, ins, loc, site, tr)

    def _sub_name(self, eqn) -> str:
        name = eqn.primitive.name
        inner = eqn.params.get("name")
        return f"{name}({inner})" if isinstance(inner, str) else name

    def _call(self, eqn, ins, sub, loc, tr):
        jaxpr, _ = _open(sub)
        path = f"{loc}/{self._sub_name(eqn)}"
        if len(jaxpr.invars) != len(eqn.invars):
            return self._opaque(eqn, ins, tr)
        inner_ins = [
            dataclasses.replace(av, bax=_right_aligned(av.bax, _shape(v), _shape(w)))
            for av, v, w in zip(ins, eqn.invars, jaxpr.invars, strict=True)
        ]
        outs = self.run(jaxpr, inner_ins, path, tr)
        if len(outs) != len(eqn.outvars):
            return self._opaque(eqn, ins, tr)
        if eqn.params.get("name") == SNAPPED_SAMPLE and any(av.has(RNG) for av in ins):
            # dpmp's snapped Gaussian: float64 ndtri of random bits, no erf_inv.
            out_dtype = _dtype(eqn.outvars[0])
            self._record(
                ("noise_sample", loc),
                "noise_sample",
                SNAPPED_SAMPLE,
                _dtype(eqn.invars[0]),
                None,
                out_dtype,
                loc,
                self.policy.noise,
                "Gaussian sample (dpmp.snapped_gaussian: float64 ndtri of random bits)",
            )
            outs = [dataclasses.replace(av, flags=(av.flags | NOISE) & ~GRAD) for av in outs]
        return [
            dataclasses.replace(av, bax=_right_aligned(av.bax, _shape(w), _shape(v)))
            for av, v, w in zip(outs, eqn.outvars, jaxpr.outvars, strict=True)
        ]

    def _opaque(self, eqn, ins, tr):
        flags = 0
        for av in ins:
            flags |= av.flags
        flags &= ~_NOT_INHERITED
        outs = []
        for v in eqn.outvars:
            f = flags | (GRAD if tr and _is_float(_dtype(v)) else 0)
            outs.append(_AV(f))
        return outs

    def _fixpoint(self, body_fn, carry):
        """Iterates body_fn on the carry abstract values to a fixed point
        (without recording), then runs it once more recording findings."""
        saved = self.recording
        self.recording = False
        try:
            for _ in range(16):
                new = body_fn(carry)
                joined = [_join(a, b) for a, b in zip(carry, new, strict=True)]
                if joined == list(carry):
                    break
                carry = joined
        finally:
            self.recording = saved
        return carry

    def _scan(self, eqn, ins, loc, site, tr):
        p = eqn.params
        jaxpr, _ = _open(p["jaxpr"])
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
        over_batch = any(0 in av.bax for av in xs)
        x_avs = [
            dataclasses.replace(av, bax=frozenset(a - 1 for a in av.bax if a > 0)) for av in xs
        ]
        path = f"{loc}/scan"

        def body(carry):
            return self.run(jaxpr, list(consts) + list(carry) + x_avs, path, tr)[:ncarry]

        carry = self._fixpoint(body, list(init))
        outs = self.run(jaxpr, list(consts) + list(carry) + x_avs, path, tr)
        reduced = self._carried_sums(
            jaxpr, nc, ncarry, carry, outs[:ncarry], path, site, "scan", over_batch
        )
        ys = [
            dataclasses.replace(
                av,
                bax=frozenset(a + 1 for a in av.bax)
                | (frozenset({0}) if over_batch else frozenset()),
            )
            for av in outs[ncarry:]
        ]
        final = [_join(a, b) for a, b in zip(carry, outs[:ncarry], strict=True)]
        return _mark_reduced(final, reduced) + ys

    def _while(self, eqn, ins, loc, site, tr):
        p = eqn.params
        cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
        body_jaxpr, _ = _open(p["body_jaxpr"])
        bconsts, init = ins[cnc : cnc + bnc], ins[cnc + bnc :]
        path = f"{loc}/while"

        def body(carry):
            return self.run(body_jaxpr, list(bconsts) + list(carry), path, tr)

        carry = self._fixpoint(body, list(init))
        outs = self.run(body_jaxpr, list(bconsts) + list(carry), path, tr)
        reduced = self._carried_sums(
            body_jaxpr, bnc, len(init), carry, outs, path, site, "while", False
        )
        return _mark_reduced([_join(a, b) for a, b in zip(carry, outs, strict=True)], reduced)

    def _cond(self, eqn, ins, loc, tr):
        branches = eqn.params["branches"]
        ops = ins[1:]
        result = None
        for k, br in enumerate(branches):
            outs = self.run(br, ops, f"{loc}/cond[{k}]", tr)
            result = (
                outs if result is None else [_join(a, b) for a, b in zip(result, outs, strict=True)]
            )
        return result

    def _carried_sums(
        self, jaxpr, nconsts, ncarry, carry_in, carry_out, path, site, loop, over_batch
    ):
        """Finds loop-carried accumulators: carry_out[k] = carry_in[k] + g."""
        jaxpr, _ = _open(jaxpr)
        producer = {}
        for eqn in jaxpr.eqns:
            for v in eqn.outvars:
                producer[v] = eqn

        def strip(v):
            # Follows casts and copies back to their source.
            seen = 0
            while not isinstance(v, jax_core.Literal) and v in producer and seen < 8:
                e = producer[v]
                if e.primitive.name in ("convert_element_type", "copy", "copy_p"):
                    v = e.invars[0]
                    seen += 1
                    continue
                break
            return v

        env_in = jaxpr.invars[nconsts : nconsts + ncarry]
        reduced: set[int] = set()
        for k in range(ncarry):
            out_var = jaxpr.outvars[k]
            if isinstance(out_var, jax_core.Literal):
                continue
            e = producer.get(strip(out_var))
            if e is None or e.primitive.name not in ("add", "add_any"):
                continue
            operands = [strip(v) for v in e.invars]
            if not any(o is env_in[k] for o in operands):
                continue
            other = e.invars[1 - next(i for i, o in enumerate(operands) if o is env_in[k])]
            if isinstance(other, jax_core.Literal):
                continue
            cav = carry_in[k]
            if cav.has(IS_PARAM) or cav.has(NOISE):
                continue
            # The added value must be a gradient (not noise, not a norm).
            added = self._envs.get(id(jaxpr), {}).get(other)
            if added is None:
                continue
            if not added.has(GRAD) or added.has(NOISE) or added.has(_NORM_LINE):
                continue
            carry_dtype = _dtype(env_in[k])
            if not _is_float(carry_dtype):
                continue
            frame = site.split(" @ ", 1)[1] if " @ " in site else ""
            location = f"{path}:carry[{k}]" + (f" @ {frame}" if frame else "")
            what = "examples" if over_batch else "microbatches"
            self._record(
                ("batch_reduction", location),
                "batch_reduction",
                f"{loop}+{e.primitive.name}",
                _dtype(other),
                carry_dtype,
                _dtype(out_var),
                location,
                self.policy.accumulate,
                f"running sum of gradients across {what} carried by a {loop} loop",
            )
            reduced.add(k)
        return reduced

    # -- single primitives -----------------------------------------------------
    def _primitive(self, eqn, ins, loc, site, tr) -> list[_AV]:
        name = eqn.primitive.name
        out_vars = eqn.outvars
        out_dtype = _dtype(out_vars[0]) if out_vars else None
        out_float = _is_float(out_dtype)

        flags = 0
        for av in ins:
            flags |= av.flags
        flags &= ~_NOT_INHERITED
        sq = None
        for av in ins:
            sq = _narrowest(sq, av.sq)
        src = tuple(dict.fromkeys(s for av in ins for s in av.src))
        if tr and out_float:
            flags |= GRAD

        # batch axes of the (first) output
        bax = frozenset()
        batch_reduced = False
        if name in (
            "reduce_sum",
            "reduce_max",
            "reduce_min",
            "reduce_prod",
            "argmax",
            "argmin",
            "reduce_and",
            "reduce_or",
        ):
            axes = _reduce_axes(eqn)
            shape = _shape(eqn.invars[0])
            batch_reduced = name == "reduce_sum" and any(
                a in ins[0].bax and shape[a] > 1 for a in axes
            )
            bax = _reduced_bax(ins[0].bax, axes)
        elif name in ("cumsum", "cumlogsumexp", "cumprod", "cummax", "cummin"):
            bax = ins[0].bax
            batch_reduced = name == "cumsum" and eqn.params["axis"] in ins[0].bax
        elif name == "dot_general":
            bax, batch_reduced = _dot_general_axes(eqn, ins)
        elif name == "conv_general_dilated":
            bax, batch_reduced = _conv_axes(eqn, ins)
        elif name == "transpose":
            perm = eqn.params["permutation"]
            bax = frozenset(j for j, a in enumerate(perm) if a in ins[0].bax)
        elif name == "broadcast_in_dim":
            dims = eqn.params["broadcast_dimensions"]
            in_shape = _shape(eqn.invars[0])
            bax = frozenset(dims[a] for a in ins[0].bax if a < len(dims) and in_shape[a] > 1)
        elif name == "reshape":
            bax = _reshape_bax(
                ins[0].bax,
                _shape(eqn.invars[0]),
                _shape(out_vars[0]),
                eqn.params.get("dimensions"),
            )
        elif name == "squeeze":
            bax = _reduced_bax(ins[0].bax, eqn.params["dimensions"])
        elif name == "expand_dims":
            bax = _right_aligned(ins[0].bax, _shape(eqn.invars[0]), _shape(out_vars[0]))
        elif out_vars:
            if len(_shape(eqn.invars[0]) if eqn.invars else ()) == len(_shape(out_vars[0])):
                bax = _elementwise_bax(eqn, ins)
            elif eqn.invars:
                bax = _right_aligned(ins[0].bax, _shape(eqn.invars[0]), _shape(out_vars[0]))

        pol = self.policy
        in_dtypes = [_dtype(v) for v in eqn.invars]

        # -- randomness --------------------------------------------------------
        if name in _RNG_SOURCES or any(
            jax.dtypes.issubdtype(d, jax.dtypes.prng_key) for d in in_dtypes if d is not None
        ):
            flags |= RNG
        if name == "erf_inv" and ins[0].has(RNG) and not ins[0].has(GRAD):
            self._record(
                ("noise_sample", loc),
                "noise_sample",
                name,
                in_dtypes[0],
                None,
                out_dtype,
                site,
                pol.noise,
                "Gaussian sample (erf_inv of random bits)",
            )
            flags |= NOISE
        # NOISE survives only while it does not mix with a gradient.
        if flags & NOISE and flags & GRAD and name not in _ADDS:
            flags &= ~NOISE

        # -- norms ---------------------------------------------------------------
        squaring = (
            (name in ("square",) and ins[0].has(GRAD))
            or (name == "integer_pow" and eqn.params.get("y") == 2 and ins[0].has(GRAD))
            or (
                name == "mul"
                and len(eqn.invars) == 2
                and eqn.invars[0] is eqn.invars[1]
                and not isinstance(eqn.invars[0], jax_core.Literal)
                and ins[0].has(GRAD)
            )
        )
        self_dot = (
            name == "dot_general"
            and eqn.invars[0] is eqn.invars[1]
            and not isinstance(eqn.invars[0], jax_core.Literal)
            and ins[0].has(GRAD)
        )
        if squaring:
            flags = (flags & ~(GRAD | CLIPPED | NOISY | REDUCED | _NORM_LINE)) | SQUARE
            sq = _narrowest(_narrowest(sq, in_dtypes[0]), out_dtype)
            return self._outs(eqn, flags, bax, sq, ())
        if out_float and (self_dot or (name == "reduce_sum" and ins[0].has(SQUARE))):
            in_d = _narrowest(ins[0].sq, in_dtypes[0]) if not self_dot else in_dtypes[0]
            acc = eqn.params.get("preferred_element_type") or out_dtype
            self._record(
                ("norm", loc),
                "norm",
                name,
                in_d,
                acc,
                out_dtype,
                site,
                pol.clip,
                "sum of squares of a gradient (norm)",
            )
            flags = (flags & ~(GRAD | CLIPPED | NOISY | REDUCED | _NORM_LINE)) | SQSUM
            return self._outs(eqn, flags, bax, _narrowest(sq, out_dtype), ())
        if name in _SQRTS and ins[0].has(SQUARE) and not ins[0].has(SQSUM | NORM):
            # elementwise root of squares (e.g. Adam's second moment): not a norm
            return self._outs(eqn, flags & ~SQUARE, bax, None, src)
        if name in _SQRTS and ins[0].has(SQSUM):
            self._record(
                ("norm", loc),
                "norm",
                name,
                in_dtypes[0],
                None,
                out_dtype,
                site,
                pol.clip,
                "square root of a sum of squares (norm)",
            )
            flags = (flags & ~(SQUARE | SQSUM)) | NORM
            return self._outs(eqn, flags, bax, _narrowest(sq, out_dtype), ())
        norm_ops = [av.has(NORM) for av in ins]
        grad_ops = [av.has(GRAD) and not av.has(_NORM_LINE) for av in ins]
        if any(norm_ops) and any(grad_ops) and name in ("mul", "div"):
            gi = grad_ops.index(True)
            ni = norm_ops.index(True)
            self._record(
                ("norm", loc),
                "norm",
                name,
                in_dtypes[gi],
                in_dtypes[ni],
                out_dtype,
                site,
                pol.clip,
                "clip factor applied to a gradient",
            )
            flags = (flags & ~_NORM_LINE) | GRAD | CLIPPED
            return self._outs(eqn, flags, bax, None, src)
        if any(av.has(NORM | SQSUM) for av in ins) and not any(grad_ops):
            if name == "div" and ins[1].has(NORM) and len(ins) == 2:
                self._record(
                    ("norm", loc),
                    "norm",
                    name,
                    in_dtypes[1],
                    None,
                    out_dtype,
                    site,
                    pol.clip,
                    "division by a norm (clip factor)",
                )
            if (
                name == "convert_element_type"
                and out_float
                and _bits(out_dtype) < _bits(pol.clip)
                and _bits(out_dtype) < _bits(in_dtypes[0])
            ):
                self._record(
                    ("norm", loc),
                    "norm",
                    name,
                    in_dtypes[0],
                    None,
                    out_dtype,
                    site,
                    pol.clip,
                    "norm or clip factor cast below the clip dtype",
                )
            if out_float:
                return self._outs(eqn, flags, bax, _narrowest(sq, out_dtype), src)
        if flags & _NORM_LINE and flags & GRAD:
            flags &= ~_NORM_LINE

        # -- noise addition --------------------------------------------------------
        if name in _ADDS and len(ins) == 2:
            a, b = ins
            noise_i = [av.has(NOISE) and not av.has(GRAD) for av in (a, b)]
            grad_i = [av.has(GRAD) and not av.has(NOISE) for av in (a, b)]
            if (noise_i[0] and grad_i[1]) or (noise_i[1] and grad_i[0]):
                ni = 0 if noise_i[0] else 1
                gi = 1 - ni
                key = ("noise_add", loc)
                self._record(
                    key,
                    "noise_add",
                    name,
                    in_dtypes[gi],
                    in_dtypes[ni],
                    out_dtype,
                    site,
                    pol.noise,
                    "noise added to the gradient sum",
                )
                flags = (flags & ~(NOISE | REDUCED)) | GRAD | NOISY
                return self._outs(eqn, flags, bax, None, (site,))
            # -- parameter update ---------------------------------------------------
            pi = [av.has(IS_PARAM) for av in (a, b)]
            if any(pi) and not all(pi):
                p_i = pi.index(True)
                other = ins[1 - p_i]
                if other.has(GRAD):
                    required = self.param_dtype or pol.param
                    self._record(
                        ("update", loc),
                        "update",
                        name,
                        in_dtypes[1 - p_i],
                        in_dtypes[p_i],
                        out_dtype,
                        site,
                        required,
                        "optimizer update applied to the parameters",
                    )
                    flags = (flags & ~(NOISE | NOISY)) | UPDATED
                    return self._outs(eqn, flags, bax, None, ())

        # -- casts of protected values -----------------------------------------------
        if name == "convert_element_type" and out_float and in_dtypes[0] is not None:
            narrowing = _bits(out_dtype) < _bits(in_dtypes[0])
            if narrowing and ins[0].has(NOISY) and _bits(out_dtype) < _bits(pol.noise):
                origin = ", ".join(ins[0].src) if ins[0].src else "?"
                self._record(
                    ("noise_add", loc),
                    "noise_add",
                    name,
                    in_dtypes[0],
                    None,
                    out_dtype,
                    site,
                    pol.noise,
                    f"noisy gradient cast below the noise dtype after the noise addition at "
                    f"{origin}",
                )
                flags &= ~NOISY
                src = ()
            if (
                narrowing
                and ins[0].has(REDUCED)
                and not ins[0].has(NOISY)
                and _bits(out_dtype) < _bits(pol.accumulate)
            ):
                self._record(
                    ("batch_reduction", loc),
                    "batch_reduction",
                    name,
                    in_dtypes[0],
                    None,
                    out_dtype,
                    site,
                    pol.accumulate,
                    "sum of gradients over examples rounded below the accumulate dtype",
                )
                flags &= ~REDUCED
            if narrowing and ins[0].has(UPDATED) and not ins[0].has(IS_PARAM):
                required = self.param_dtype or pol.param
                if _bits(out_dtype) < _bits(required):
                    self._record(
                        ("update", loc),
                        "update",
                        name,
                        in_dtypes[0],
                        None,
                        out_dtype,
                        site,
                        required,
                        "new parameters cast below the parameter dtype",
                    )
            if ins[0].has(IS_PARAM) and not narrowing:
                flags |= IS_PARAM

        # -- all-reduce ----------------------------------------------------------------
        if name in _PSUM_LIKE:
            outs = []
            for k, (v, av) in enumerate(zip(eqn.invars, ins, strict=False)):
                if av.has(GRAD) and _is_float(_dtype(v)) and not av.has(_NORM_LINE):
                    # psum names its axes "axes"; psum_scatter (reduce_scatter) "axis_name"
                    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
                    axes = tuple(axes) if isinstance(axes, tuple | list) else (axes,)
                    per_example = bool(av.bax) and not av.has(CLIPPED | REDUCED)
                    self._record(
                        ("all_reduce", loc, k),
                        "all_reduce",
                        name,
                        _dtype(v),
                        None,
                        _dtype(eqn.outvars[k]),
                        site,
                        pol.accumulate,
                        f"cross-device sum over axes {axes}"
                        + (
                            " of PER-EXAMPLE gradients before clipping (examples on different "
                            "devices are mixed: the clip bound no longer holds per example)"
                            if per_example
                            else ""
                        ),
                    )
                    if per_example and self.recording:
                        f = self.findings[("all_reduce", loc, k)]
                        self.findings[("all_reduce", loc, k)] = dataclasses.replace(f, ok=False)
            for v, av in zip(eqn.outvars, ins, strict=False):
                f = (av.flags & ~_NOT_INHERITED) | (GRAD if tr and _is_float(_dtype(v)) else 0)
                outs.append(_AV(f, av.bax, av.sq, av.src))
            return outs

        # -- reductions over examples --------------------------------------------------
        if batch_reduced and any(av.has(GRAD) for av in ins) and out_float:
            acc = eqn.params.get("preferred_element_type") or out_dtype
            gi = next(k for k, av in enumerate(ins) if av.has(GRAD))
            self._record(
                ("batch_reduction", loc),
                "batch_reduction",
                name,
                in_dtypes[gi],
                acc,
                out_dtype,
                site,
                pol.accumulate,
                "sum of gradients over the example axis"
                + (" (clipped)" if ins[gi].has(CLIPPED) else ""),
            )
            flags |= REDUCED

        return self._outs(eqn, flags, bax, sq if flags & _NORM_LINE else None, src)

    def _outs(self, eqn, flags, bax, sq, src):
        outs = []
        for k, v in enumerate(eqn.outvars):
            b = bax if k == 0 or _shape(v) == _shape(eqn.outvars[0]) else frozenset()
            b = frozenset(a for a in b if a < len(_shape(v)))
            f = flags
            if not _is_float(_dtype(v)):
                f &= ~(GRAD | _NORM_LINE | NOISE | NOISY | CLIPPED | REDUCED | UPDATED)
            outs.append(_AV(f, b, sq, src if f & NOISY else ()))
        return outs


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
) -> list[_AV]:
    """Abstract values for the flattened arguments.

    roles: per leaf, "param", "batch" or "other".
    """
    avs = []
    for leaf, role in zip(leaves, roles, strict=True):
        dtype = getattr(leaf, "dtype", None)
        shape = tuple(getattr(leaf, "shape", ()))
        flags = 0
        bax = frozenset()
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            flags |= RNG
        if role == "param":
            flags |= PARAM | IS_PARAM
        elif role == "batch":
            flags |= BATCH
            bax = frozenset(example_axes(shape, batch_size))
        avs.append(_AV(flags, bax))
    return avs


def analyze(closed_jaxpr, avs, policy, *, param_dtype=None, root="") -> list[RawFinding]:
    """Runs the analysis and returns the findings in traversal order."""
    analyzer = Analyzer(policy, param_dtype=param_dtype)
    analyzer.run(closed_jaxpr.jaxpr, avs, root)
    return list(analyzer.findings.values())
