"""The accounting contract of a noise sampler, handed down to the accounting.

The accountants assume exactly Gaussian noise; no floating-point program draws
it. Each sampler (``dpmp.noise``) carries its *accounting contract*: ``None``
for a sampler accounted as the exact Gaussian, or a ``NoiseContract`` whose
``residual`` bounds the drawn noise's deviation and composes it over a run.
The samplers sit above the accounting and register their contracts here by
name: the accounting imports no sampler. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
import math
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = [
    "DEFAULT_NOISE_SAMPLER",
    "NoiseContract",
    "NoiseResidual",
    "noise_contract",
    "register_noise_contract",
]

# The sampler whose contract ``noised_coordinates`` accounts when none is named:
# the one dpmp draws by default.
DEFAULT_NOISE_SAMPLER = "snapped"
# Where the samplers are registered. They sit above the accounting and hand their
# contracts down (``register_noise_contract``) when they load; a contract asked for
# by a name not yet handed down loads that registry by name, not by import.
_SAMPLERS_MODULE = "dpmp.noise._registry"


class NoiseResidual(NamedTuple):
    """What the drawn noise costs beyond the exact Gaussian the accountant assumes.

    Attributes:
      epsilon: added to the accountant's epsilon (``2 lambda`` in the derivation).
      log_ratio: ``lambda``, the bound on the log-ratio of drawn to exact
        likelihood of the run's outputs (under either neighbour) outside a set
        of probability ``delta_tail``.
      delta_tail: ``beta``, the probability of that set: added to delta.
    """

    epsilon: float
    log_ratio: float
    delta_tail: float

    def ideal_delta(self, delta: float) -> float:
        """The delta to ask the exact mechanism's accountant for, so that the drawn
        noise is ``(epsilon + self.epsilon, delta)``-DP: ``e^-lambda (delta - beta)``."""
        return math.exp(-self.log_ratio) * (delta - self.delta_tail)


@runtime_checkable
class NoiseContract(Protocol):
    """The accounting contract of a sampler that is not exactly Gaussian.

    Attributes:
      sampler: the sampler's name (for messages).
      tail: how many stddevs from the mean its draw is accurate; a noise
        multiplier so small that the run's residual delta exceeds half of
        delta is refused, naming it.
    """

    sampler: str
    tail: float

    def residual(
        self,
        *,
        coordinates: int,
        releases: int,
        noise_multiplier: float,
        delta: float,
        neighboring: str,
        records_per_unit: int = 1,
    ) -> NoiseResidual:
        """The accounted cost of ``releases`` draws of ``coordinates`` coordinates each
        (``records_per_unit``: a privacy unit's records, each sampled on its own; it
        is passed only when above 1, so a contract without it serves record units)."""
        ...


_CONTRACTS: dict[str, NoiseContract | None] = {}


def register_noise_contract(sampler: str, contract: NoiseContract | None) -> None:
    """Hands the accounting the contract of ``sampler`` (``None``: exact Gaussian)."""
    if contract is not None and not isinstance(contract, NoiseContract):
        raise TypeError(f"{sampler}: {contract!r} does not implement NoiseContract")
    _CONTRACTS[sampler] = contract


def noise_contract(sampler: str) -> NoiseContract | None:
    """The contract registered for the sampler named ``sampler``."""
    if sampler not in _CONTRACTS:
        importlib.import_module(_SAMPLERS_MODULE).sampler(sampler)  # hands it down
    return _CONTRACTS[sampler]
