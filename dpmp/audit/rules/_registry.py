"""The table of primitive rules and the record a rule works on.

The walker (``dpmp.audit._jaxpr.Walker``) takes each equation of a jaxpr
and looks its primitive's name up in ``RULES``. A ``Rule`` is a set of
optional stages; the walker runs them in this order, and a stage that returns
output values ends the equation:

========== ==================================================================
stage      what it does (signature)
========== ==================================================================
walk       an equation holding sub-jaxprs (``scan``, ``while``, ``cond``):
           walks them and returns the outputs; no other stage runs
           (``walk(step) -> list[Value]``)
axes       where the output's example axes are, and whether the equation
           sums over examples (``axes(eqn, ins) -> (frozenset, bool)``;
           default ``dpmp.audit._axes.elementwise``)
source     randomness: random bits, Gaussian draws (``source(step) -> None``)
norm       the norm lineage: squares of a gradient, their sum, its root, the
           clip factor applied to the gradient (``norm(step) -> outs | None``)
of_norm    a site on a value computed from norms alone (a division by a
           norm, a cast of one) (``of_norm(step) -> None``)
gradient   sites on gradients: noise addition, the parameter update, casts
           of protected values, cross-device sums
           (``gradient(step) -> outs | None``)
========== ==================================================================

Between the stages the walker applies what holds for every primitive (see
``dpmp.audit._jaxpr.Walker.primitive``). A new rule is a new module in
this package that calls ``register``, and one import line in
``dpmp/audit/rules/__init__.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpmp._registry import Registry
from dpmp.audit._values import (
    FLOAT_ONLY,
    GRAD,
    NOISY,
    NORM_LINE,
    NOT_INHERITED,
    Value,
    dtype_of,
    is_float,
    narrowest,
    shape_of,
)

if TYPE_CHECKING:  # the walker imports this module
    from dpmp.audit._jaxpr import Walker

Outs = list[Value]
AxesFn = Callable[[Any, list[Value]], tuple[frozenset, bool]]
StageFn = Callable[["Step"], "Outs | None"]

_UNSET = object()


@dataclasses.dataclass
class Step:
    """One equation where the walker stands, and the value its outputs are getting.

    Attributes:
      walker: the walker (its ``policy``, ``param_dtype``, ``record``, ``run``).
      eqn: the jaxpr equation.
      ins: abstract values of its inputs.
      loc: ``<sub-jaxpr path>#<equation index>``; keys the site's findings.
      site: ``loc`` followed by `` @ file:line`` of the user code, where known.
      in_transpose: the equation belongs to a backward pass.
      flags, bax, reduces_examples, sq, src: the output's value under
        construction (filled by ``begin`` for primitives; see
        ``dpmp.audit._values.Value``).
      name, in_dtypes, out_dtype, out_float: of the equation.
    """

    walker: Walker
    eqn: Any
    ins: list[Value]
    loc: str
    site: str
    in_transpose: bool
    flags: int = 0
    bax: frozenset = frozenset()
    reduces_examples: bool = False
    sq: Any = None
    src: tuple = ()

    # the equation's primitive name and dtypes (set in __post_init__)
    name: str = dataclasses.field(init=False)
    in_dtypes: list = dataclasses.field(init=False)
    out_dtype: Any = dataclasses.field(init=False)
    out_float: bool = dataclasses.field(init=False)

    def __post_init__(self):
        eqn = self.eqn
        self.name = eqn.primitive.name
        self.in_dtypes = [dtype_of(v) for v in eqn.invars]
        self.out_dtype = dtype_of(eqn.outvars[0]) if eqn.outvars else None
        self.out_float = is_float(self.out_dtype)

    @property
    def policy(self):
        return self.walker.policy

    @property
    def grad_operands(self) -> list[bool]:
        """Per input: a gradient that is not on a norm's lineage."""
        return [av.has(GRAD) and not av.has(NORM_LINE) for av in self.ins]

    def begin(self) -> Step:
        """Fills the output's value as a computation of the inputs: their flags
        (less ``IS_PARAM``), narrowest norm dtype and noise sources; ``GRAD`` for a
        float output of a backward pass."""
        flags = 0
        for av in self.ins:
            flags |= av.flags
        self.flags = flags & ~NOT_INHERITED
        sq = None
        for av in self.ins:
            sq = narrowest(sq, av.sq)
        self.sq = sq
        self.src = tuple(dict.fromkeys(s for av in self.ins for s in av.src))
        if self.in_transpose and self.out_float:
            self.flags |= GRAD
        return self

    def outs(self, flags: int, sq, src: tuple) -> Outs:
        """Output values: the first output (and those of its shape) get the batch
        axes; non-float outputs drop the flags only floats carry."""
        eqn = self.eqn
        outs = []
        for k, v in enumerate(eqn.outvars):
            b = self.bax if k == 0 or shape_of(v) == shape_of(eqn.outvars[0]) else frozenset()
            b = frozenset(a for a in b if a < len(shape_of(v)))
            f = flags
            if not is_float(dtype_of(v)):
                f &= ~FLOAT_ONLY
            outs.append(Value(f, b, sq, src if f & NOISY else ()))
        return outs

    def record(
        self,
        kind: str,
        in_dtype,
        acc_dtype,
        required,
        message: str,
        *,
        out_dtype=_UNSET,
        key: tuple | None = None,
        violation: bool = False,
    ) -> None:
        """Records a finding of this equation at ``site`` (see ``Walker.record``)."""
        self.walker.record(
            (kind, self.loc) if key is None else key,
            kind,
            self.name,
            in_dtype=in_dtype,
            acc_dtype=acc_dtype,
            out_dtype=self.out_dtype if out_dtype is _UNSET else out_dtype,
            location=self.site,
            required=required,
            message=message,
            violation=violation,
        )


@dataclasses.dataclass(frozen=True)
class Rule:
    """The stages of one primitive (see the module docstring); all optional.

    ``keeps_noise``: noise that meets a gradient here stays noise (additions,
    where the ``gradient`` stage looks for the noise being added); everywhere
    else noise mixed with a gradient stops being noise.
    """

    walk: StageFn | None = None
    axes: AxesFn | None = None
    source: StageFn | None = None
    norm: StageFn | None = None
    of_norm: StageFn | None = None
    gradient: StageFn | None = None
    keeps_noise: bool = False


NO_RULE = Rule()
# primitive name -> its rule (the stages registered for it)
RULES: Registry[Rule] = Registry("audit rule", protocol=Rule)
_STAGES = tuple(f.name for f in dataclasses.fields(Rule))


def register(*primitives: str, **stages: StageFn | AxesFn | bool) -> None:
    """Adds stages to the rules of ``primitives`` (names as in
    ``eqn.primitive.name``).

    Stages of one primitive may come from different modules (``reduce_sum``
    has its axes from the reductions and its ``norm`` stage from the norms),
    but each stage of a primitive is registered once: a second registration
    raises ``ValueError`` instead of silently replacing the first (and then
    nothing is registered).
    """
    unknown = set(stages) - set(_STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; allowed: {', '.join(_STAGES)}")
    for name in primitives:
        rule = rule_for(name)
        taken = [s for s in stages if getattr(rule, s) not in (None, False)]
        if taken:
            raise ValueError(f"audit rule {name!r}: stage(s) {taken} already registered")
    for name in primitives:
        RULES.register(dataclasses.replace(rule_for(name), **stages), name=name, replace=True)


def rule_for(primitive: str) -> Rule:
    """The rule of ``primitive`` (a rule without stages when none is registered)."""
    return RULES.find(primitive) or NO_RULE
