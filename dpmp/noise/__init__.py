"""Noise: the snapped Gaussian sampler and plain samplers, the privatizer and
private optimizer that add them, and the OS-entropy keys that protect privacy.
"""

from dpmp.noise._entropy import fresh_key as fresh_key
from dpmp.noise._noise import NoiseSharding as NoiseSharding
from dpmp.noise._noise import gaussian_privatizer as gaussian_privatizer
from dpmp.noise._noise import private_optimizer as private_optimizer
from dpmp.noise._noise import snap_grid as snap_grid
from dpmp.noise._noise import snapped_gaussian as snapped_gaussian

__all__ = [
    "fresh_key",
    "NoiseSharding",
    "gaussian_privatizer",
    "private_optimizer",
    "snap_grid",
    "snapped_gaussian",
]
