"""``accountant="rdp"``: Renyi DP of the sampled Gaussian mechanism.

Mironov 2017 ("Renyi differential privacy"); Mironov, Talwar & Zhang 2019
("Renyi differential privacy of the sampled Gaussian mechanism"), converted to
(epsilon, delta) by dp-accounting. An upper bound; typically loose by 5-20
percent. Add-or-remove adjacency only: dp-accounting has no replace-one
analysis of Poisson sampling in RDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from dpmp.accounting._accountants import NEIGHBORING, Curve, EpsilonAt
from dpmp.accounting._events import GaussianRelease, Release

__all__ = ["RDP", "RdpAccountant"]


@dataclasses.dataclass(frozen=True)
class RdpAccountant:
    """dp-accounting's ``RdpAccountant`` at its default orders.

    Its tracker curve computes each kind's per-release RDP once and adds
    ``n`` times it (what the accountant does for a ``SelfComposedDpEvent``),
    converted with dp-accounting's ``compute_epsilon``.
    """

    name: str = "rdp"
    neighboring_relations: tuple[str, ...] = ("add_or_remove",)
    bounded_first: bool = False

    def make(self, neighboring: str, interval: float) -> dp_accounting.PrivacyAccountant:
        del interval  # RDP has no discretisation
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=NEIGHBORING[neighboring])

    def curve(
        self,
        releases: Mapping[Release, GaussianRelease],
        *,
        neighboring: str,
        interval: float,
        delta: float,
    ) -> Curve:
        del interval, delta
        per_release: dict[Release, tuple[Any, Any]] = {}

        def single(kind: Release) -> tuple[Any, Any]:
            if kind not in per_release:
                acct = self.make(neighboring, 0.0)
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
