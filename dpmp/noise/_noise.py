"""Gaussian noise drawn and added in the noise dtype, then the optax update.

``jax_privacy.noise_addition.gaussian_privatizer`` draws noise in its
``dtype`` argument and casts the noisy result back to the *gradient's* dtype
(``(value + noise).astype(value.dtype)``): a bf16 gradient sum therefore gets
its noise rounded to bf16 -- bf16 keeps 8 significant bits, so a draw takes
~128 distinct values with no tail beyond ~2.9 sigma (tests/test_noise.py
counts them) and Gaussian accounting no longer describes the release (Mironov
2012, "On significance of the least significant bits for differential
privacy"). dpmp keeps jax-privacy's privatizer (its PRNG handling and state)
but lifts the incoming sum to at least the noise dtype first, so the cast back
is to the noise dtype and never below it.

The noise itself is drawn by a registered sampler (``dpmp.noise._registry``):
``"snapped"`` by default (``dpmp.noise._snapped``: floating-point safe, its
residual accounted), or ``"plain"`` (``dpmp.noise._plain``).

Formal guarantees:
  * noise is drawn by ``snapped_gaussian`` (or, with ``sampler="plain"``, by
    ``jax.random.normal`` in ``policy.noise``, >= float32 unless the policy
    opts in to unsafe precision);
  * the noisy sum has dtype ``promote(sum dtype, policy.noise)``: it is never
    narrower than the noise;
  * ``private_optimizer`` divides the noisy sum by the *expected* batch size
    (a constant, as Poisson-sampled DP-SGD requires: dividing by the realised
    batch size would leak it) and applies the optimizer to the float32 master
    parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_privacy import noise_addition as jp_noise

from dpmp.noise._entropy import key_from
from dpmp.noise._registry import drawn_sampler
from dpmp.noise._sharding import NoiseSharding
from dpmp.precision._policy import Policy
from dpmp.precision._stages import STAGES

__all__ = ["gaussian_privatizer", "private_optimizer"]


def _lift_to(tree, dtype):
    """Each leaf in at least ``dtype`` (arrays, or ``jax.ShapeDtypeStruct`` specs)."""

    def lift(x):
        wide = jnp.promote_types(x.dtype, dtype)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, wide)
        return x.astype(wide)

    return jax.tree.map(lift, tree)


def gaussian_privatizer(
    *,
    stddev: float,
    prng_key: Any = None,
    policy: Policy | str,
    sampler: str = "snapped",
    sharding: NoiseSharding | None = None,
) -> optax.GradientTransformation:
    """Adds N(0, stddev^2) noise to every entry, drawn and added in ``policy.noise``.

    An optax ``GradientTransformation`` over jax-privacy's privatizer: ``init``
    takes the params (or a gradient-shaped tree); ``update(sum_of_clipped_grads,
    state)`` returns the noisy sum in at least the noise dtype. For DP-SGD,
    ``stddev = noise_multiplier * l2_clip_norm``.

    The noise key is secret: with ``prng_key=None`` (the default) it is drawn
    from the operating system's entropy (``os.urandom``, every bit of the key).
    The key then lives only in the optimizer state: checkpoint that state to
    resume, and keep the checkpoint as secret as the data. An int derives the
    key from a public number: reproducible, for tests and debugging, and then
    NOT differentially private (anyone who knows the number and the other
    records can rerun the training and tell which dataset it was).

    ``sampler`` names a registered ``NoiseSampler`` (``dpmp.noise``):
    ``"snapped"`` (default) draws ``snapped_gaussian`` noise, whose
    floating-point residual the accountant adds when told the number of noised
    coordinates; ``"plain"`` draws ``jax.random.normal`` in ``policy.noise``
    (jax-privacy's privatizer): right for observers of rounded outputs, not of
    exact ones (see ``dpmp.privacy_audit``). A policy with half-precision noise
    (an unsafe opt-in) always gets the plain sampler in that dtype.

    The snapped noise is drawn leaf by leaf (the small leaves of a dtype as one
    vector; on XLA:CPU, the larger leaves of a size and dtype in one loop, a
    piece of each in one pass), in bounded pieces written back in place
    (``chunk_size``), each in one fused pass: its temporary memory does not
    grow with the model. ``sharding`` (a
    ``NoiseSharding``) splits the draw over the devices of a mesh, each device
    drawing only its part; the result is the same as on one device.

    Example::

      >>> import jax, jax.numpy as jnp, dpmp
      >>> priv = dpmp.gaussian_privatizer(stddev=1.0, policy="bf16")
      >>> g = jnp.zeros(4, jnp.bfloat16)            # even a bf16 sum ...
      >>> noisy, _ = priv.update(g, priv.init(g))
      >>> noisy.dtype                                # ... gets float32 noise
      dtype('float32')
    """
    policy = Policy.parse(policy)
    try:
        stddev = float(stddev)
    except (TypeError, ValueError) as e:
        raise ValueError(f"stddev: must be a number, got {stddev!r}") from e
    if not stddev >= 0:
        raise ValueError(f"stddev: must be >= 0, got {stddev!r}")
    drawn = drawn_sampler(sampler, policy)
    inner = jp_noise.gaussian_privatizer(
        stddev=stddev, prng_key=key_from(prng_key), dtype=policy.noise
    )

    def init(params):
        return inner.init(_lift_to(params, policy.noise))

    def update(sum_of_clipped_grads, noise_state, params=None):
        # ``noise_state`` is jax-privacy's name for it: callers may pass it by keyword.
        del params
        with jax.named_scope(STAGES["noise"]):
            grads = _lift_to(sum_of_clipped_grads, policy.noise)
            return drawn.update(inner, grads, noise_state, stddev=stddev, sharding=sharding)

    return optax.GradientTransformation(init, update)


def private_optimizer(
    optimizer: optax.GradientTransformation,
    *,
    noise_multiplier: float,
    l2_clip_norm: float,
    expected_batch_size: float,
    prng_key: Any = None,
    policy: Policy | str,
    sampler: str = "snapped",
    sharding: NoiseSharding | None = None,
    strategy: Any = None,
) -> optax.GradientTransformation:
    """``optax.chain(noise, scale(1 / expected_batch_size), optimizer)`` for DP-SGD.

    Feed it the SUM of clipped per-example gradients (``PrivateGrad.grads``);
    it adds N(0, (noise_multiplier * l2_clip_norm)^2) in the noise dtype,
    divides by the expected batch size and runs ``optimizer``. The updates
    are cast to each parameter's dtype, which must be at least float32
    (master params). ``prng_key`` is the secret noise key, as in
    ``gaussian_privatizer``: leave it None for fresh OS entropy; ``sampler``
    too (a registered sampler's name: ``"snapped"``, the default, or ``"plain"``),
    and ``sharding`` (a
    ``NoiseSharding``: the draw split over the devices of a mesh). ``strategy``
    (a noise mechanism's, e.g. ``dpmp.noise._banded_mf.BandedMF``) correlates the
    noise across steps through its ``privatizer``; None: independent (DP-SGD).
    """
    policy = Policy.parse(policy)
    if not float(expected_batch_size) > 0:
        raise ValueError(f"expected_batch_size: must be > 0, got {expected_batch_size!r}")
    if not float(noise_multiplier) >= 0:
        raise ValueError(f"noise_multiplier: must be >= 0, got {noise_multiplier!r}")
    # noise_multiplier = 0 means no noise, whatever the clip norm (also C = inf).
    nm, clip = float(noise_multiplier), float(l2_clip_norm)
    if nm > 0 and not np.isfinite(clip):
        raise ValueError(
            "l2_clip_norm: must be finite when noise_multiplier > 0 (the noise is "
            "noise_multiplier * l2_clip_norm)"
        )
    stddev = 0.0 if nm == 0 else nm * clip
    make = gaussian_privatizer if strategy is None else strategy.privatizer
    privatizer = make(
        stddev=stddev, prng_key=prng_key, policy=policy, sampler=sampler, sharding=sharding
    )
    chained = optax.chain(privatizer, optax.scale(1.0 / float(expected_batch_size)), optimizer)

    def update(grads, state, params=None):
        if params is not None:
            for p in jax.tree.leaves(params):
                if jnp.finfo(p.dtype).bits < 32:
                    raise ValueError(
                        f"params: master parameters must be float32 or wider, got {p.dtype}; "
                        "keep params in policy.param and cast to the compute dtype in the loss"
                    )
        with jax.named_scope(STAGES["optimizer"]):
            updates, state = chained.update(grads, state, params)
            if params is not None:
                updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
            return updates, state

    return optax.GradientTransformation(chained.init, update)
