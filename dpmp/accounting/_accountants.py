"""Accountants: what turns a run's releases into epsilon.

An accountant is a configured object: a frozen record of its settings (the
PLD's discretisation, the RDP's orders) with a name. The registered ``"rdp"``
and ``"pld"`` are default-configured instances (``register_accountant``);
every function that takes ``accountant=`` takes a registered name or such an
object. It makes a dp-accounting ``PrivacyAccountant`` for one-shot questions
and calibration, and a ``Curve`` for the budget tracker: epsilon as a function
of how many releases of each kind a run has made, cheap to ask again step
after step. A new accountant is a new module with such an object and one
registration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import dp_accounting
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from dpmp.accounting._events import GaussianRelease, Release
from dpmp.accounting._groups import has_mixture, rdp_compatible
from dpmp.accounting._registry import ACCOUNTANT_REGISTRY
from dpmp.accounting._validate import MAX_EPSILON, NEIGHBORING_RELATIONS

__all__ = [
    "Accountant",
    "Curve",
    "EpsilonAt",
    "as_accountant",
    "composing_curve",
    "get_accountant",
    "register_accountant",
]

NEIGHBORING = {
    "add_or_remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": dp_accounting.NeighboringRelation.REPLACE_ONE,
}

# epsilon at a delta, of one composition.
EpsilonAt = Callable[[float], float]
# epsilon of a run with ``counts[kind]`` releases of each kind, as a function of
# delta; None when the plan spends more than ``MAX_EPSILON`` (it is not composed).
Curve = Callable[[Mapping[Release, int]], EpsilonAt | None]


@runtime_checkable
class Accountant(Protocol):
    """What dpmp needs of an accountant: a configured object, asked for itself.

    Attributes:
      name: the name it is registered and chosen by (``privacy.accountant``).
      neighboring_relations: the relations it analyses Poisson sampling under
        (a subset of ``NEIGHBORING_RELATIONS``).
      bounded_first: a plan is first bounded with RDP and refused beyond
        ``MAX_EPSILON`` before this accountant composes it (its cost runs away
        with epsilon, as the PLD's does).
    """

    name: str
    neighboring_relations: tuple[str, ...]
    bounded_first: bool

    def make(self, neighboring: str) -> dp_accounting.PrivacyAccountant:
        """A fresh dp-accounting accountant at this object's settings."""
        ...

    def curve(
        self, releases: Mapping[Release, GaussianRelease], *, neighboring: str, delta: float
    ) -> Curve:
        """Epsilon of runs of ``releases``, one function of the release counts, at
        the same settings as ``make``."""
        ...

    def for_tracking(self) -> Accountant:
        """The accountant a ``BudgetTracker`` runs in this one's place: the same
        analysis, at settings cheap enough to ask at every step (an upper bound
        still), or ``self``."""
        ...


def register_accountant(obj: Accountant) -> Accountant:
    """Makes ``obj`` available as ``accountant=obj.name`` everywhere; returns it."""
    if not isinstance(obj, Accountant):
        raise TypeError(f"accountant: {obj!r} does not implement dpmp.accounting.Accountant")
    return ACCOUNTANT_REGISTRY.register(obj)


def get_accountant(name: Any) -> Accountant:
    """The accountant registered as ``name`` (``ValueError`` naming the known ones)."""
    return ACCOUNTANT_REGISTRY.get(name)


def as_accountant(value: Any) -> Accountant:
    """``value`` if it is an ``Accountant``, else the one registered by that name."""
    if isinstance(value, str):
        return get_accountant(value)
    if not isinstance(value, Accountant):
        raise TypeError(
            f"accountant must be a registered name {ACCOUNTANT_REGISTRY.names()} or a "
            f"dpmp.accounting.Accountant, got {value!r}."
        )
    return value


def accountant_record(acct: Accountant) -> str | dict[str, Any]:
    """``acct`` as JSON: its name when it is the accountant registered by that name,
    else its fields (a frozen dataclass), restored by ``accountant_from_record``."""
    if acct.name in ACCOUNTANT_REGISTRY and get_accountant(acct.name) == acct:
        return acct.name
    if not dataclasses.is_dataclass(acct):
        raise TypeError(f"accountant: {acct!r} is not registered and not a dataclass: no record")
    record = {f.name: getattr(acct, f.name) for f in dataclasses.fields(acct)}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in record.items()}


def accountant_from_record(record: Any) -> Accountant:
    """The accountant of ``accountant_record``: a name, or the fields that configure
    the accountant registered by ``record["name"]`` differently."""
    if isinstance(record, dict):
        fields = dict(record)
        return dataclasses.replace(get_accountant(fields.pop("name", None)), **fields)
    return as_accountant(record)


def check_neighboring(value: Any, acct: Accountant) -> str:
    if value not in NEIGHBORING_RELATIONS:
        raise ValueError(f"neighboring must be one of {NEIGHBORING_RELATIONS}, got {value!r}.")
    if value not in acct.neighboring_relations:
        able = [
            name
            for name in ACCOUNTANT_REGISTRY.names()
            if value in get_accountant(name).neighboring_relations
        ]
        needs = " or ".join(f'accountant="{name}"' for name in able) or "another accountant"
        raise ValueError(
            f'neighboring="{value}" needs {needs}: the {acct.name} accountant has no '
            f"{value.replace('_', '-')} analysis of Poisson sampling."
        )
    return value


def composing_curve(
    acct: Accountant, releases: Mapping[Release, GaussianRelease], neighboring: str
) -> Curve:
    """A ``Curve`` that composes every query afresh with ``acct.make(...)``: right
    for any accountant, fast for none (a run's tracker asks at every step)."""

    def curve(counts: Mapping[Release, int]) -> EpsilonAt | None:
        composed = acct.make(neighboring)
        for kind, n in counts.items():
            if n > 0:
                composed.compose(dp_accounting.SelfComposedDpEvent(releases[kind].event(), n))
        return composed.get_epsilon

    return curve


# ---------------------------------------------------------------------------
# The RDP bound that refuses a plan beyond MAX_EPSILON.
# ---------------------------------------------------------------------------

BOUND_ORDERS = (1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)


@contextlib.contextmanager
def _absl_quiet() -> Iterator[None]:
    """Silences dp-accounting's absl warnings (e.g. an RDP order that did not
    converge, which the bound simply leaves out) while bounding a plan."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def rdp_curve(event: dp_accounting.DpEvent) -> Any:
    """``event``'s RDP at ``BOUND_ORDERS`` (add-or-remove adjacency); inf where
    dp-accounting's arithmetic overflows."""
    try:
        with _absl_quiet():
            accountant = dp_accounting.rdp.RdpAccountant(orders=BOUND_ORDERS)
            return accountant.compose(rdp_compatible(event)).rdp
    except ArithmeticError:  # ZeroDivisionError, OverflowError at extreme sigmas
        return np.full(len(BOUND_ORDERS), np.inf)


def rdp_bound(rdp: Any, delta: float) -> float:
    """An upper bound on the epsilon at ``delta`` of the RDP curve ``rdp`` (at
    ``BOUND_ORDERS``: any set of orders gives a valid bound), cheap at any
    number of steps; inf where it overflows."""
    try:
        with _absl_quiet():
            return float(rdp_privacy_accountant.compute_epsilon(BOUND_ORDERS, rdp, delta)[0])
    except ArithmeticError:
        return math.inf


def check_within_limit(event: dp_accounting.DpEvent, delta: float) -> None:
    """Refuses a plan whose RDP bound exceeds ``MAX_EPSILON`` (see there); a plan of
    units of several records is not bounded so (``has_mixture``)."""
    if has_mixture(event):
        return
    bound = rdp_bound(rdp_curve(event), delta)
    if bound > MAX_EPSILON:
        raise ValueError(
            f"this plan spends more than epsilon {MAX_EPSILON:g} (its RDP bound is "
            f"{bound:.4g} at delta {delta:g}), which dpmp does not account: such a guarantee "
            "promises nothing, and its PLD would take minutes and gigabytes; add noise, "
            "sample less or take fewer steps."
        )
