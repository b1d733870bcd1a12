"""Feature standardisation, before training: none, private (accounted) or non-private.

Scaling every example by the training set's mean and std makes every example's
input -- and so its gradient -- depend on every other record: the per-example
sensitivity that DP-SGD's accounting assumes no longer holds. So the default
(``data.standardize = "none"``) computes no statistic of the training data.
The two opt-ins:

``"private"`` -- the Gaussian mechanism on clipped features (float64)::

    x_i   = example i's features, flattened (d values)
    c_i   = x_i * min(1, B / ||x_i||)                   clip to L2 norm B
    s1    = sum_i c_i     + N(0, (sigma * B)^2 I_d)
    s2    = sum_i c_i**2  + N(0, (sigma * B^2)^2 I_d)   (element-wise squares)
    mean  = s1 / n
    var   = max(s2 / n - mean**2, floor)
    floor = max(sigma * B^2 / n, 1e-6 * B^2 / d)        public: the noise on s2 / n
    std   = sqrt(var)

``"nonprivate"`` -- the exact mean and std of the training features (a
constant feature gets std 1). The run is then NOT differentially private.

Test features are scaled with the same statistics; the test split never
informs them.

Formal guarantees (``"private"``):
  Neighbours are zero-out neighbours: one record is replaced by a null record
  that contributes nothing (to these sums: zero). ``||c_i|| <= B`` and
  ``||c_i**2|| <= ||c_i||**2 <= B**2``, so ``(s1 / B, s2 / B**2)`` has L2
  sensitivity ``sqrt(2)`` and gets noise of stddev ``sigma`` per coordinate:
  one Gaussian mechanism with noise multiplier ``sigma / sqrt(2)``
  (``release_noise_multiplier``), which ``dpmp.accounting`` composes with the
  training run (``preprocessing_noise_multiplier``). ``n`` is public under
  zero-out adjacency; mean, var and std are post-processing. The noise is
  drawn by numpy's PCG64 generator in float64 from a secret 128-bit seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dpmp.data._dataset import Dataset

__all__ = [
    "FeatureStats",
    "exact_feature_stats",
    "private_feature_stats",
    "release_noise_multiplier",
    "standardize",
]


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureStats:
    """The mean and std that scale the features, and how they were made.

    Attributes:
      mode: ``"private"`` or ``"nonprivate"``.
      mean, std: float32 arrays of the shape of one example.
      clip, noise_multiplier: the private mechanism's ``B`` and ``sigma``
        (None for ``"nonprivate"``).
    """

    mode: str
    mean: np.ndarray
    std: np.ndarray
    clip: float | None = None
    noise_multiplier: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (kept in checkpoints, so a resumed run uses the same)."""
        return {
            "mode": self.mode,
            "shape": list(self.mean.shape),
            "mean": self.mean.ravel().tolist(),
            "std": self.std.ravel().tolist(),
            "clip": self.clip,
            "noise_multiplier": self.noise_multiplier,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FeatureStats:
        shape = tuple(d["shape"])
        return cls(
            mode=d["mode"],
            mean=np.asarray(d["mean"], np.float32).reshape(shape),
            std=np.asarray(d["std"], np.float32).reshape(shape),
            clip=d.get("clip"),
            noise_multiplier=d.get("noise_multiplier"),
        )


def release_noise_multiplier(noise_multiplier: float) -> float:
    """The noise multiplier of the one Gaussian mechanism the two noised sums form."""
    return float(noise_multiplier) / math.sqrt(2.0)


def private_feature_stats(
    x: np.ndarray, *, clip: float, noise_multiplier: float, seed: int
) -> FeatureStats:
    """The mean and std of ``x`` ([n, ...]) by the Gaussian mechanism (module docstring).

    Args:
      x: the training features.
      clip: ``B``, the L2 norm each example's features are clipped to.
      noise_multiplier: ``sigma``, noise stddev relative to each sum's sensitivity.
      seed: seeds the noise; secret (OS entropy) unless the run is reproducible.
    """
    if not (clip > 0 and noise_multiplier > 0):
        raise ValueError(
            f"clip and noise_multiplier must be > 0, got {clip!r} and {noise_multiplier!r}"
        )
    n = x.shape[0]
    flat = np.asarray(x, np.float64).reshape(n, -1)
    d = flat.shape[1]
    norms = np.linalg.norm(flat, axis=1, keepdims=True)
    clipped = flat * np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
    rng = np.random.Generator(np.random.PCG64(seed))
    s1 = clipped.sum(0) + rng.standard_normal(d) * (noise_multiplier * clip)
    s2 = (clipped**2).sum(0) + rng.standard_normal(d) * (noise_multiplier * clip**2)
    mean = s1 / n
    floor = max(noise_multiplier * clip**2 / n, 1e-6 * clip**2 / d)
    var = np.maximum(s2 / n - mean**2, floor)
    shape = x.shape[1:]
    return FeatureStats(
        mode="private",
        mean=mean.astype(np.float32).reshape(shape),
        std=np.sqrt(var).astype(np.float32).reshape(shape),
        clip=float(clip),
        noise_multiplier=float(noise_multiplier),
    )


def exact_feature_stats(x: np.ndarray) -> FeatureStats:
    """The exact mean and std of ``x`` (NOT private); a constant feature gets std 1."""
    mean = x.mean(axis=0, dtype=np.float64)
    std = x.std(axis=0, dtype=np.float64)
    std = np.where(std > 1e-8, std, 1.0)
    return FeatureStats(mode="nonprivate", mean=mean.astype(np.float32), std=std.astype(np.float32))


def standardize(data: Dataset, stats: FeatureStats) -> Dataset:
    """``(x - mean) / std`` on both splits; the ``Dataset`` records the mode."""
    mean = stats.mean.astype(np.float64)
    std = stats.std.astype(np.float64)
    return dataclasses.replace(
        data,
        x_train=((data.x_train - mean) / std).astype(np.float32),
        x_test=((data.x_test - mean) / std).astype(np.float32),
        standardize=stats.mode,
    )
