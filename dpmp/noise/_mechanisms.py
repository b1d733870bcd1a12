"""Noise mechanisms as strategies, registered by name (``privacy.mechanism``).

A mechanism says how the noise of successive steps is related: ``"dpsgd"``
draws every step's noise independently (the samplers of
``dpmp.noise._registry`` do that alone); ``"banded_mf"`` correlates it across
steps (``dpmp.noise._banded_mf``). A mechanism answers for itself: whether its
accounting needs b-cyclic Poisson sampling (``cyclic``) and the strategy it
uses for a run (``strategy(steps, bands)``: an object with ``bands``,
``privatizer(...)``, ``sensitivity_factor(batch_size)``, ``prefix_rmse()`` and
``describe()``, or None for independent noise). BLT is a new module with such an
object and one registration (``register_mechanism``). Listing the names imports
no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

from dpmp._registry import Registry

__all__ = [
    "BANDED_MF",
    "DPSGD",
    "MECHANISM_REGISTRY",
    "NoiseMechanism",
    "dpsgd_prefix_rmse",
    "mechanism",
    "mechanism_names",
    "register_mechanism",
]


@runtime_checkable
class NoiseMechanism(Protocol):
    """What a noise mechanism is to dpmp.

    Attributes:
      name: the name it is chosen by (``privacy.mechanism``).
      cyclic: its accounting assumes b-cyclic Poisson sampling (the records split
        once into ``bands`` groups, step ``t`` sampling group ``t mod bands``);
        False: plain Poisson sampling, as DP-SGD's.
    """

    name: str
    cyclic: bool

    def strategy(self, steps: int, bands: int) -> Any:
        """The run's strategy for ``steps`` steps and ``bands`` bands, or None
        (independent noise: DP-SGD)."""
        ...


@dataclasses.dataclass(frozen=True)
class _Independent:
    """``privacy.mechanism = "dpsgd"``: independent noise at every step."""

    name: str = "dpsgd"
    cyclic: bool = False

    def strategy(self, steps: int, bands: int) -> None:
        del steps, bands


DPSGD = _Independent()


@dataclasses.dataclass(frozen=True)
class _BandedMF:
    """``privacy.mechanism = "banded_mf"``: jax-privacy's optimised banded Toeplitz
    strategy (``dpmp.noise._banded_mf.BandedMF``) on b-cyclic Poisson samples."""

    name: str = "banded_mf"
    cyclic: bool = True

    def strategy(self, steps: int, bands: int) -> Any:
        from dpmp.noise._banded_mf import BandedMF

        return BandedMF.optimized(steps, bands)


BANDED_MF = _BandedMF()

MECHANISM_REGISTRY: Registry[NoiseMechanism] = Registry(
    "mechanism",
    {"dpsgd": "dpmp.noise._mechanisms:DPSGD", "banded_mf": "dpmp.noise._mechanisms:BANDED_MF"},
    protocol=NoiseMechanism,
)


def mechanism_names() -> tuple[str, ...]:
    """The names of the registered mechanisms (no import of JAX)."""
    return MECHANISM_REGISTRY.names()


def mechanism(name: Any) -> NoiseMechanism:
    """The mechanism registered as ``name`` (a ``ValueError`` lists them otherwise)."""
    return MECHANISM_REGISTRY.get(name)


def register_mechanism(obj: NoiseMechanism, *, replace: bool = False) -> NoiseMechanism:
    """Makes ``obj`` available as ``privacy.mechanism = obj.name``; returns it."""
    return MECHANISM_REGISTRY.register(obj, replace=replace)


def dpsgd_prefix_rmse(steps: int) -> float:
    """DP-SGD's root mean squared error of the ``steps`` prefix sums per unit of noise
    stddev: the prefix sum ``t`` adds ``t + 1`` independent draws, so
    ``sqrt(mean_t (t + 1)) = sqrt((steps + 1) / 2)``."""
    return math.sqrt((steps + 1) / 2)
