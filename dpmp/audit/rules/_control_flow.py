"""Control-flow rules: ``scan``, ``while`` and ``cond`` walk their sub-jaxprs.

A loop body is walked until the abstract values of its carry reach a fixed
point (without recording), then once more recording its sites. A scan over
the example axis maps it to axis 0 of the stacked outputs. A loop-carried
running sum of gradients (``carry + g``, through casts and copies) is a
``batch_reduction`` site whose accumulation dtype is the carry's: a sum over
examples for a scan over examples, a sum over microbatches otherwise. The
branches of a ``cond`` are joined.
"""

from __future__ import annotations

import dataclasses

from dpmp.audit._values import (
    GRAD,
    IS_PARAM,
    NOISE,
    NORM_LINE,
    REDUCED,
    Value,
    dtype_of,
    is_float,
    is_literal,
    join,
    open_jaxpr,
)
from dpmp.audit.rules._registry import Outs, Step, register

_COPIES = ("convert_element_type", "copy", "copy_p")


def _mark_reduced(avs: Outs, indices: set[int]) -> Outs:
    return [
        dataclasses.replace(av, flags=av.flags | REDUCED) if k in indices else av
        for k, av in enumerate(avs)
    ]


def _scan_counts(params: dict, num_inputs: int) -> tuple[int, int]:
    """A scan's numbers of constants and carried values among its inputs.

    jax before 0.11 names them (``num_consts``, ``num_carry``); jax 0.11 gives
    the inputs' groups instead (``ft_in``, a flat tree of three groups:
    constants, carry, scanned; iterating a group yields its values).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, xs = (len(list(group)) for group in params["ft_in"].unpack())
    if consts + carry + xs != num_inputs:
        raise ValueError(
            f"a scan's ft_in {params['ft_in']!r} does not describe its {num_inputs} inputs"
        )
    return consts, carry


def _scan(s: Step) -> Outs:
    p, walker, tr = s.eqn.params, s.walker, s.in_transpose
    jaxpr, _ = open_jaxpr(p["jaxpr"])
    nc, ncarry = _scan_counts(p, len(s.ins))
    consts, init, xs = s.ins[:nc], s.ins[nc : nc + ncarry], s.ins[nc + ncarry :]
    over_batch = any(0 in av.bax for av in xs)
    x_avs = [dataclasses.replace(av, bax=frozenset(a - 1 for a in av.bax if a > 0)) for av in xs]
    path = f"{s.loc}/scan"

    def body(carry):
        return walker.run(jaxpr, list(consts) + list(carry) + x_avs, path, tr)[:ncarry]

    carry = walker.fixpoint(body, list(init))
    outs = walker.run(jaxpr, list(consts) + list(carry) + x_avs, path, tr)
    loop = _Loop(s, jaxpr, nc, path, "scan", over_batch)
    reduced = loop.carried_sums(carry, outs[:ncarry])
    ys = [
        dataclasses.replace(
            av,
            bax=frozenset(a + 1 for a in av.bax) | (frozenset({0}) if over_batch else frozenset()),
        )
        for av in outs[ncarry:]
    ]
    final = [join(a, b) for a, b in zip(carry, outs[:ncarry], strict=True)]
    return _mark_reduced(final, reduced) + ys


def _while(s: Step) -> Outs:
    p, walker, tr = s.eqn.params, s.walker, s.in_transpose
    cnc, bnc = p["cond_nconsts"], p["body_nconsts"]
    body_jaxpr, _ = open_jaxpr(p["body_jaxpr"])
    bconsts, init = s.ins[cnc : cnc + bnc], s.ins[cnc + bnc :]
    path = f"{s.loc}/while"

    def body(carry):
        return walker.run(body_jaxpr, list(bconsts) + list(carry), path, tr)

    carry = walker.fixpoint(body, list(init))
    outs = walker.run(body_jaxpr, list(bconsts) + list(carry), path, tr)
    reduced = _Loop(s, body_jaxpr, bnc, path, "while", False).carried_sums(carry, outs)
    return _mark_reduced([join(a, b) for a, b in zip(carry, outs, strict=True)], reduced)


def _cond(s: Step) -> Outs:
    ops = s.ins[1:]
    result = None
    for k, br in enumerate(s.eqn.params["branches"]):
        outs = s.walker.run(br, ops, f"{s.loc}/cond[{k}]", s.in_transpose)
        result = outs if result is None else [join(a, b) for a, b in zip(result, outs, strict=True)]
    return result


@dataclasses.dataclass
class _Loop:
    """A walked loop body: ``nconsts`` constants, then the carry."""

    step: Step
    jaxpr: object
    nconsts: int
    path: str
    kind: str  # "scan" or "while"
    over_batch: bool

    def carried_sums(self, carry_in: Outs, carry_out: Outs) -> set[int]:
        """Finds loop-carried accumulators, ``carry_out[k] = carry_in[k] + g`` with
        ``g`` a gradient, records them, and returns their indices."""
        jaxpr, _ = open_jaxpr(self.jaxpr)
        producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        env_in = jaxpr.invars[self.nconsts : self.nconsts + len(carry_in)]
        env = self.step.walker.envs.get(id(jaxpr), {})
        reduced: set[int] = set()
        for k, carry_var in enumerate(env_in):
            out_var = jaxpr.outvars[k]
            if is_literal(out_var):
                continue
            e = producer.get(_strip(out_var, producer))
            if e is None or e.primitive.name not in ("add", "add_any"):
                continue
            operands = [_strip(v, producer) for v in e.invars]
            if not any(o is carry_var for o in operands):
                continue
            other = e.invars[1 - next(i for i, o in enumerate(operands) if o is carry_var)]
            if is_literal(other) or not self._accumulates(carry_in[k], env.get(other), carry_var):
                continue
            self._record(k, e, other, carry_var, out_var)
            reduced.add(k)
        return reduced

    @staticmethod
    def _accumulates(carried: Value, added: Value | None, carry_var) -> bool:
        """The carry is a float running sum (not a parameter, not noise) and the
        added value a gradient (not noise, not a norm)."""
        if carried.has(IS_PARAM) or carried.has(NOISE) or added is None:
            return False
        if not added.has(GRAD) or added.has(NOISE) or added.has(NORM_LINE):
            return False
        return is_float(dtype_of(carry_var))

    def _record(self, k: int, e, other, carry_var, out_var) -> None:
        site = self.step.site
        frame = site.split(" @ ", 1)[1] if " @ " in site else ""
        location = f"{self.path}:carry[{k}]" + (f" @ {frame}" if frame else "")
        what = "examples" if self.over_batch else "microbatches"
        self.step.walker.record(
            ("batch_reduction", location),
            "batch_reduction",
            f"{self.kind}+{e.primitive.name}",
            in_dtype=dtype_of(other),
            acc_dtype=dtype_of(carry_var),
            out_dtype=dtype_of(out_var),
            location=location,
            required=self.step.policy.accumulate,
            message=f"running sum of gradients across {what} carried by a {self.kind} loop",
        )


def _strip(v, producer: dict):
    """Follows casts and copies back to their source (at most 8)."""
    seen = 0
    while not is_literal(v) and v in producer and seen < 8:
        e = producer[v]
        if e.primitive.name in _COPIES:
            v = e.invars[0]
            seen += 1
            continue
        break
    return v


register("scan", walk=_scan)
register("while", walk=_while)
register("cond", walk=_cond)
