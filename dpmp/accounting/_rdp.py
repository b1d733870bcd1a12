"""``accountant="rdp"``: Renyi DP of the sampled Gaussian mechanism.

Mironov 2017 ("Renyi differential privacy"); Mironov, Talwar & Zhang 2019
("Renyi differential privacy of the sampled Gaussian mechanism"), converted to
(epsilon, delta) by dp-accounting. An upper bound at any set of orders;
typically loose by 5-20 percent at dp-accounting's default orders. Add-or-remove
adjacency only: dp-accounting has no replace-one analysis of Poisson sampling
in RDP.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from dpmp.accounting._accountants import NEIGHBORING, Curve, EpsilonAt
from dpmp.accounting._events import GaussianRelease, Release
from dpmp.accounting._groups import rdp_compatible
from dpmp.accounting._validate import name as check_name

__all__ = ["RDP", "RdpAccountant"]


def _orders(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"RdpAccountant.orders must be a sequence of reals > 1, got {value!r}.")
    orders = tuple(value)
    bad = [
        o
        for o in orders
        if isinstance(o, bool)
        or not isinstance(o, numbers.Real)
        or not (math.isfinite(o) and o > 1)
    ]
    if not orders or bad:
        raise ValueError(
            "RdpAccountant.orders must be a non-empty sequence of finite reals > 1, got "
            f"{value!r}" + (f" (not: {bad})." if bad else ".")
        )
    return tuple(float(o) for o in orders)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RdpAccountant:
    """dp-accounting's ``RdpAccountant``, at the orders given.

    Its tracker curve computes each kind's per-release RDP once and adds
    ``n`` times it (what the accountant does for a ``SelfComposedDpEvent``),
    converted with dp-accounting's ``compute_epsilon``.

    Example:
      >>> import dpmp.accounting as acc
      >>> coarse = acc.RdpAccountant(orders=(2, 4, 8, 16, 32, 64))
      >>> plan = dict(noise_multiplier=1.2, sampling_prob=0.02, steps=300, delta=1e-5,
      ...             noised_coordinates=None)
      >>> # fewer orders: a looser upper bound
      >>> acc.epsilon(**plan, accountant=coarse) > acc.epsilon(**plan, accountant="rdp")
      True

    Attributes:
      orders: the Renyi orders (finite, > 1) the bound is minimised over; None
        (default) for dp-accounting's ``DEFAULT_RDP_ORDERS``. Any set gives an
        upper bound; more orders, a tighter one.
      name: the name it is registered and recorded by.
    """

    neighboring_relations: ClassVar[tuple[str, ...]] = ("add_or_remove",)
    bounded_first: ClassVar[bool] = False

    orders: tuple[float, ...] | None = None
    name: str = "rdp"

    def __post_init__(self):
        object.__setattr__(self, "orders", _orders(self.orders))
        object.__setattr__(self, "name", check_name("RdpAccountant.name", self.name))

    def make(self, neighboring: str) -> dp_accounting.PrivacyAccountant:
        return _MixtureBounding(orders=self.orders, neighboring_relation=NEIGHBORING[neighboring])

    def for_tracking(self) -> RdpAccountant:
        return self  # RDP is as cheap at every step as once

    def curve(
        self, releases: Mapping[Release, GaussianRelease], *, neighboring: str, delta: float
    ) -> Curve:
        del delta
        per_release: dict[Release, tuple[Any, Any]] = {}

        def single(kind: Release) -> tuple[Any, Any]:
            if kind not in per_release:
                acct = self.make(neighboring)
                acct.compose(releases[kind].event())
                per_release[kind] = (acct.orders, acct.rdp)
            return per_release[kind]

        def curve(counts: Mapping[Release, int]) -> EpsilonAt:
            rdp = 0
            for kind, n in counts.items():
                if n > 0:
                    orders, one = single(kind)
                    rdp = rdp + n * one

            def eps_at(delta: float) -> float:
                return rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0]

            return eps_at

        return curve


RDP = RdpAccountant()


class _MixtureBounding(dp_accounting.rdp.RdpAccountant):
    """dp-accounting's RDP accountant, composing a mixture of Gaussians (a unit of
    several records, each sampled on its own) as the Poisson-subsampled Gaussian
    that dominates it (``dpmp.accounting._groups``): dp-accounting's RDP has no
    analysis of the mixture itself, and the bound is looser than the PLD's."""

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int, do_compose: bool):
        return super()._maybe_compose(rdp_compatible(event), count, do_compose)
