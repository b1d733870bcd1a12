"""Noise: Gaussian samplers as registered strategies (``"snapped"``, ``"plain"``),
each carrying its accounting contract; the mechanisms that correlate the noise
over steps (``"dpsgd"``, ``"banded_mf"``), registered too; the privatizer and
private optimizer that add their noise; and the OS-entropy keys that protect
privacy.

The names are imported on first use (PEP 562): listing the samplers (the
config's choices, ``dpmp --help``) imports no JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, attribute)
_PUBLIC = {
    "fresh_key": ("dpmp.noise._entropy", "fresh_key"),
    "NoiseSampler": ("dpmp.noise._registry", "NoiseSampler"),
    "drawn_sampler": ("dpmp.noise._registry", "drawn_sampler"),
    "register_sampler": ("dpmp.noise._registry", "register_sampler"),
    "sampler": ("dpmp.noise._registry", "sampler"),
    "sampler_names": ("dpmp.noise._registry", "sampler_names"),
    "NoiseMechanism": ("dpmp.noise._mechanisms", "NoiseMechanism"),
    "mechanism": ("dpmp.noise._mechanisms", "mechanism"),
    "mechanism_names": ("dpmp.noise._mechanisms", "mechanism_names"),
    "register_mechanism": ("dpmp.noise._mechanisms", "register_mechanism"),
    "NoiseSharding": ("dpmp.noise._sharding", "NoiseSharding"),
    "gaussian_privatizer": ("dpmp.noise._noise", "gaussian_privatizer"),
    "private_optimizer": ("dpmp.noise._noise", "private_optimizer"),
    "snap_grid": ("dpmp.noise._snapped", "snap_grid"),
    "snapped_gaussian": ("dpmp.noise._snapped", "snapped_gaussian"),
}

if TYPE_CHECKING:
    from dpmp.noise._entropy import fresh_key as fresh_key
    from dpmp.noise._mechanisms import NoiseMechanism as NoiseMechanism
    from dpmp.noise._mechanisms import mechanism as mechanism
    from dpmp.noise._mechanisms import mechanism_names as mechanism_names
    from dpmp.noise._mechanisms import register_mechanism as register_mechanism
    from dpmp.noise._noise import gaussian_privatizer as gaussian_privatizer
    from dpmp.noise._noise import private_optimizer as private_optimizer
    from dpmp.noise._registry import NoiseSampler as NoiseSampler
    from dpmp.noise._registry import drawn_sampler as drawn_sampler
    from dpmp.noise._registry import register_sampler as register_sampler
    from dpmp.noise._registry import sampler as sampler
    from dpmp.noise._registry import sampler_names as sampler_names
    from dpmp.noise._sharding import NoiseSharding as NoiseSharding
    from dpmp.noise._snapped import snap_grid as snap_grid
    from dpmp.noise._snapped import snapped_gaussian as snapped_gaussian


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'dpmp.noise' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "NoiseMechanism",
    "NoiseSampler",
    "NoiseSharding",
    "drawn_sampler",
    "fresh_key",
    "gaussian_privatizer",
    "mechanism",
    "mechanism_names",
    "private_optimizer",
    "register_mechanism",
    "register_sampler",
    "sampler",
    "sampler_names",
    "snap_grid",
    "snapped_gaussian",
]
