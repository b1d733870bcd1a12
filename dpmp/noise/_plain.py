"""``sampler="plain"``: jax-privacy's ``jax.random.normal`` noise in the noise dtype.

Right for observers of rounded outputs, not of exact ones: in float32,
``jax.random.normal`` is ``sqrt(2) erfinv`` of a 23-bit uniform, 2^23 values
within about 5.4 sigma, and ``x + noise`` rounds onto a lattice that depends on
``x`` (Mironov 2012; ``dpmp.privacy_audit`` measures what it leaks). It is
accounted as the exact Gaussian (no contract), and draws in any noise dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dpmp.accounting import NoiseContract

__all__ = ["PLAIN", "PlainSampler"]


@dataclasses.dataclass(frozen=True)
class PlainSampler:
    """jax-privacy's privatizer, unchanged (``dpmp.noise.NoiseSampler``)."""

    name: str = "plain"
    contract: NoiseContract | None = None
    jit_name: str | None = None  # the audit knows erf_inv
    min_noise_bits: int = 0
    privacy_warning: str | None = (
        "privacy.noise_sampler = 'plain': the gradient noise is float32 jax.random.normal, "
        "2^23 values within about 5.4 sigma on a lattice that depends on the gradient sum. "
        "The epsilon holds for observers of rounded outputs; an observer of the exact noisy "
        "values can tell neighbouring datasets apart (dpmp audit --privacy measures it). This "
        "run is NOT differentially private against such an observer; use noise_sampler = "
        "'snapped'."
    )

    def update(self, inner, grads, state, *, stddev: float, sharding: Any) -> tuple[Any, Any]:
        del stddev, sharding  # inner was built with the stddev; it draws on one device
        return inner.update(grads, state)

    def release_grid(self, value: Any, stddev: float) -> None:
        """None: its releases are the float values its 2^23 uniforms reach, which
        the audit enumerates."""
        del value, stddev


PLAIN = PlainSampler()
