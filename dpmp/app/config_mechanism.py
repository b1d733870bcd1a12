"""Checks of the config's noise mechanism: ``privacy.mechanism`` and ``privacy.bands``.

``check_mechanism`` is called by ``PrivacyConfig`` and ``check_bands`` by
``Config`` (it needs ``training.steps``) when a config is made. A mechanism
answers for itself whether its accounting needs b-cyclic Poisson sampling
(``NoiseMechanism.cyclic``); the choices are read from the registry
(``dpmp.noise._mechanisms``) when a config is checked.
"""

from __future__ import annotations

from typing import Any

from dpmp.noise._mechanisms import mechanism, mechanism_names

__all__ = ["MAX_BANDS", "check_bands", "check_mechanism"]

# privacy.bands: no more than training.steps can have (10^6).
MAX_BANDS = 10**6


def check_mechanism(privacy: Any, error: type[Exception]) -> None:
    """``privacy.mechanism`` is registered, ``privacy.bands`` an integer >= 1, and a
    mechanism whose accounting needs b-cyclic Poisson sampling has it: no shuffled
    batches, no user-level sampling (its accounting is of records).

    Raises:
      error: the first key that is wrong, named, in one line.
    """
    names = mechanism_names()
    if privacy.mechanism not in names:
        raise error(
            f"privacy.mechanism: {privacy.mechanism!r} is not allowed; allowed: {', '.join(names)}"
        )
    b = privacy.bands
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BANDS:
        raise error(f"privacy.bands: must be an integer in [1, 10^6], got {b!r}")
    if not mechanism(privacy.mechanism).cyclic:
        return
    what = f"privacy.mechanism = {privacy.mechanism!r} is accounted for b-cyclic Poisson sampling"
    if privacy.sampling != "poisson":
        raise error(f'privacy.sampling: {privacy.sampling!r}: {what}; use "poisson"')
    if privacy.unit != "record":
        raise error(f'privacy.unit: {privacy.unit!r}: {what} of records; use "record"')


def check_bands(config: Any, error: type[Exception]) -> None:
    """``privacy.bands`` is at most ``training.steps`` when the mechanism uses bands
    (on a mesh its ring buffers are laid out as the parameters are)."""
    p, steps = config.privacy, config.training.steps
    if not mechanism(p.mechanism).cyclic:
        return
    if p.bands > steps:
        raise error(
            f"privacy.bands: {p.bands} is more than training.steps = {steps}; a banded "
            f"strategy has at most one band per step"
        )
