"""Noise samplers as strategies, registered by name (a ``dpmp._registry.Registry``).

A sampler is a small object (``NoiseSampler``): how it adds its noise to a
gradient sum, the accounting contract of what it draws, and what the precision
audit needs to recognise its draw. ``"snapped"`` (``dpmp.noise._snapped``) and
``"plain"`` (``dpmp.noise._plain``) are built in; a new sampler is a new module
with such an object and one registration (``register_sampler``). Listing the
names imports no JAX: the built-in samplers load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Protocol, runtime_checkable

from dpmp._registry import Registry
from dpmp.accounting._contract import NoiseContract, register_noise_contract

if TYPE_CHECKING:
    import jax
    import optax

    from dpmp.precision._policy import Policy

__all__ = [
    "SAMPLER_REGISTRY",
    "NoiseSampler",
    "drawn_sampler",
    "register_sampler",
    "sampler",
    "sampler_names",
]


@runtime_checkable
class NoiseSampler(Protocol):
    """What a Gaussian noise sampler is to dpmp.

    Attributes:
      name: the name it is registered and chosen by (``privacy.noise_sampler``,
        ``gaussian_privatizer(sampler=...)``).
      contract: its accounting contract: what its floating-point output costs
        beyond the exact Gaussian the accountant assumes
        (``dpmp.accounting.NoiseContract``), or None: accounted as exact.
      jit_name: the name of the jitted function that draws its normals, by which
        the precision audit records the draw as a ``noise_sample`` site; None
        when the draw is a primitive the audit knows (``erf_inv``).
      min_noise_bits: the narrowest noise dtype it draws in (its bits); a
        policy with narrower noise (an unsafe opt-in) is drawn by the first
        registered sampler that draws in it (``drawn_sampler``).
      privacy_warning: why a run that draws with it is NOT differentially
        private against some observer (the report, the log and the summary say
        it), or None.
    """

    name: str
    contract: NoiseContract | None
    jit_name: str | None
    min_noise_bits: int
    privacy_warning: str | None

    def release_grid(
        self, value: Annotated[jax.Array, "float[1]"], stddev: float
    ) -> tuple[float, float, float] | None:
        """Every release of ``value`` it can make, for the privacy audit:
        ``(smallest, largest, grid)`` when they are the multiples of ``grid``
        between the two; None when the audit must enumerate its draws instead."""
        ...

    def update(
        self,
        inner: optax.GradientTransformation,
        grads: Annotated[Any, "a pytree of float arrays"],
        state: tuple[Any, Any],
        *,
        stddev: float,
        sharding: Any,
    ) -> tuple[Annotated[Any, "grads' pytree"], tuple[Any, Any]]:
        """``grads`` (lifted to the noise dtype) plus N(0, stddev^2) noise, and the new
        state. ``inner`` is jax-privacy's Gaussian privatizer in the noise dtype,
        whose state layout ``(key, inner)`` every sampler keeps, so that all of them
        checkpoint alike; ``sharding`` is a ``NoiseSharding`` or None."""
        ...


SAMPLER_REGISTRY: Registry[NoiseSampler] = Registry(
    "sampler",
    {"snapped": "dpmp.noise._snapped:SNAPPED", "plain": "dpmp.noise._plain:PLAIN"},
    protocol=NoiseSampler,
)


def sampler_names() -> tuple[str, ...]:
    """The names of the registered samplers (no import of JAX)."""
    return SAMPLER_REGISTRY.names()


def sampler(name: Any) -> NoiseSampler:
    """The sampler registered as ``name``; its contract is handed to the accounting.

    Raises:
      ValueError: no sampler is registered as ``name`` (the message lists them).
    """
    obj = SAMPLER_REGISTRY.get(name)
    register_noise_contract(obj.name, obj.contract)
    return obj


def register_sampler(obj: NoiseSampler, *, replace: bool = False) -> NoiseSampler:
    """Makes ``obj`` available as ``sampler=obj.name`` (the privatizer, the config,
    the accounting's ``noise_sampler``); returns it.

    Raises:
      TypeError: ``obj`` lacks a member of ``NoiseSampler`` (named).
      ValueError: the name is taken and ``replace`` is false.
    """
    SAMPLER_REGISTRY.register(obj, replace=replace)
    register_noise_contract(obj.name, obj.contract)
    return obj


def drawn_sampler(name: str, policy: Policy) -> NoiseSampler:
    """The sampler that ``gaussian_privatizer(sampler=name, policy=policy)`` draws
    with: ``name``'s, unless the policy's noise is narrower than it draws in
    (its ``min_noise_bits``); then the first registered sampler that draws in that
    dtype (half-precision noise, an unsafe opt-in, is drawn by the built-in
    ``plain``, which draws in any dtype and is registered before any of yours).

    Raises:
      ValueError: no sampler is registered as ``name``, or none draws in the
        policy's noise dtype.
    """
    import jax.numpy as jnp

    bits = jnp.finfo(policy.noise).bits
    chosen = sampler(name)
    if bits >= chosen.min_noise_bits:
        return chosen
    for other in SAMPLER_REGISTRY:
        if bits >= other.min_noise_bits:
            return sampler(other.name)
    raise ValueError(
        f"sampler: none of {sampler_names()} draws in {jnp.dtype(policy.noise).name} noise"
    )
