"""Gaussian noise drawn and added in the noise dtype, then the optax update.

``jax_privacy.noise_addition.gaussian_privatizer`` draws noise in its
``dtype`` argument and casts the noisy result back to the *gradient's* dtype
(``(value + noise).astype(value.dtype)``): a bf16 gradient sum therefore gets
its noise rounded to bf16 — ~128 distinct values with no tail beyond ~2.9
sigma, so Gaussian accounting no longer describes the release (FACTS.md,
Mironov 2012). dpmp keeps jax-privacy's privatizer (its PRNG handling and
state) but lifts the incoming sum to at least the noise dtype first, so the
cast back is to the noise dtype and never below it.

Floating point breaks the Gaussian too: ``jax.random.normal`` in float32 is
``sqrt(2) erfinv`` of a 23-bit uniform, 2^23 values within about 5.4 sigma,
and ``x + noise`` rounds onto a lattice that depends on ``x``; an observer of
exact outputs tells neighbours apart (Mironov 2012; ``dpmp.privacy_audit``
measures 89% of outputs impossible under the neighbour). So the default noise
is ``snapped_gaussian``: a float64 inverse-CDF normal from 160 random bits per
coordinate (tails to 11.3 sigma), added to ``x`` and rounded to a power-of-two
grid of about sigma/32 (Mironov's snapping; the grid is fixed by sigma alone).
Its deviation from the exact Gaussian is bounded per grid cell and accounted
(``dpmp.accounting.noise_residual``). ``sampler="plain"`` keeps jax-privacy's
``jax.random.normal`` noise.

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

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax_privacy import noise_addition as jp_noise

from dpmp._src.accounting import SNAP_CELLS_PER_STDDEV
from dpmp._src.entropy import key_from
from dpmp._src.policy import Policy

__all__ = ["SAMPLERS", "gaussian_privatizer", "private_optimizer", "snap_grid", "snapped_gaussian"]

SAMPLERS = ("snapped", "plain")


def snap_grid(stddev: float) -> float:
    """The grid step of ``snapped_gaussian``: ``2**floor(log2(stddev / 32))``."""
    return 2.0 ** math.floor(math.log2(stddev / SNAP_CELLS_PER_STDDEV[0]))


def _half_uniform(bits):
    """Float64 uniforms on (0, 1/2] and signs from 5 uint32 words per value.

    The exponent is geometric from the leading zeros of 96 bits (down to
    2^-97); the fraction has 51 bits and takes its cell's midpoint, so
    P(U <= u) is within a relative 2^-51 of u. The sign is a separate bit.
    """
    w0, w1, w2, w3, w4 = bits
    clz = jax.lax.clz
    zeros = jnp.where(w0 != 0, clz(w0), jnp.where(w1 != 0, 32 + clz(w1), 64 + clz(w2)))
    fraction = w3.astype(jnp.float64) * 2.0**19 + (w4 >> 13).astype(jnp.float64)
    u = jnp.ldexp(1.0 + (2.0 * fraction + 1.0) * 2.0**-52, -(zeros.astype(jnp.int32) + 2))
    return u, (w4 & 1) == 1


@jax.jit
def snapped_normal_sample(bits: jax.Array) -> jax.Array:
    """Float64 standard normals, sign-symmetric ``ndtri`` of ``_half_uniform(bits)``.

    A named jit so that the precision audit finds the noise sample by name
    (``dpmp.audit_precision`` records it as a ``noise_sample`` site).
    """
    u, negative = _half_uniform(bits)
    z = jax.scipy.special.ndtri(u)  # <= 0
    return jnp.where(negative, z, -z)


def snapped_gaussian(key: jax.Array, value: jax.Array, stddev: float) -> jax.Array:
    """``value`` plus N(0, stddev^2) noise, snapped to the grid ``snap_grid(stddev)``.

    Each coordinate is ``grid * (n + round(f + r z))`` where ``value / grid =
    n + f`` (exact: the grid is a power of two), ``r = stddev / grid`` in
    [32, 64) and ``z = ndtri(U)`` with a random sign, all in float64 (scoped
    with ``jax.enable_x64``; the rest of the program keeps its dtypes). Given
    an exactly normal ``z`` this is a post-processing of the Gaussian
    mechanism: the output cell's probability is the Gaussian mass of that
    cell, whatever the float32 spacing of ``value``. The drawn ``z`` differs
    from an exact one by a bounded relative error (``SNAP_NDTRI_REL_ERROR``),
    which ``dpmp.accounting.noise_residual`` turns into an accounted epsilon
    and delta. The result has ``value``'s dtype; rounding the grid value to
    it is post-processing too.

    Costs five uint32 random words and one float64 ``ndtri`` per coordinate.
    """
    stddev = float(stddev)
    if stddev == 0:
        return value
    grid = snap_grid(stddev)
    bits = jax.random.bits(key, (5, *value.shape), jnp.uint32)
    with jax.enable_x64(True):
        z = snapped_normal_sample(bits)
        scaled = value.astype(jnp.float64) / grid
        whole = jnp.round(scaled)
        cells = whole + jnp.round((scaled - whole) + (stddev / grid) * z)
        return (cells * grid).astype(value.dtype)


def _lift_to(tree, dtype):
    """Each leaf in at least ``dtype`` (arrays, or ``jax.ShapeDtypeStruct`` specs)."""

    def lift(x):
        wide = jnp.promote_types(x.dtype, dtype)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, wide)
        return x.astype(wide)

    return jax.tree.map(lift, tree)


def draws_snapped(sampler: str, policy: Policy) -> bool:
    """Whether ``gaussian_privatizer(sampler=sampler, policy=policy)`` draws
    ``snapped_gaussian`` noise: the snapped sampler with noise of at least float32
    (half-precision noise, an unsafe opt-in, is drawn plain in that dtype)."""
    return sampler == "snapped" and jnp.finfo(policy.noise).bits >= 32


def _snap_tree(key, tree, stddev: float):
    """``snapped_gaussian`` on every leaf, the leaves of one dtype drawn as one flat
    vector (one sampler in the compiled program instead of one per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    dtypes = sorted({leaf.dtype.name for leaf in leaves})
    for k, dtype in zip(jax.random.split(key, max(len(dtypes), 1)), dtypes, strict=False):
        idx = [i for i, leaf in enumerate(leaves) if leaf.dtype.name == dtype]
        flat = jnp.concatenate([leaves[i].ravel() for i in idx])
        noisy = snapped_gaussian(k, flat, stddev)
        offsets = np.cumsum([0] + [leaves[i].size for i in idx])
        for j, i in enumerate(idx):
            out[i] = noisy[offsets[j] : offsets[j + 1]].reshape(leaves[i].shape)
    return jax.tree.unflatten(treedef, out)


def gaussian_privatizer(
    *, stddev: float, prng_key: Any = None, policy: Policy | str, sampler: str = "snapped"
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

    ``sampler="snapped"`` (default) draws ``snapped_gaussian`` noise, whose
    floating-point residual the accountant adds when told the number of noised
    coordinates; ``"plain"`` draws ``jax.random.normal`` in ``policy.noise``
    (jax-privacy's privatizer): right for observers of rounded outputs, not of
    exact ones (see ``dpmp.privacy_audit``). A policy with half-precision noise
    (an unsafe opt-in) always gets the plain sampler in that dtype.

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
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler: must be one of {SAMPLERS}, got {sampler!r}")
    inner = jp_noise.gaussian_privatizer(
        stddev=stddev, prng_key=key_from(prng_key), dtype=policy.noise
    )
    snapped = draws_snapped(sampler, policy)

    def init(params):
        return inner.init(_lift_to(params, policy.noise))

    def update(sum_of_clipped_grads, noise_state, params=None):
        # ``noise_state`` is jax-privacy's name for it: callers may pass it by keyword.
        del params
        state = noise_state
        grads = _lift_to(sum_of_clipped_grads, policy.noise)
        if not snapped:
            return inner.update(grads, state)
        # jax-privacy's state layout (key, inner), so both samplers checkpoint alike.
        key, rest = state
        key, sub = jax.random.split(key)
        return _snap_tree(sub, grads, stddev), (key, rest)

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
) -> optax.GradientTransformation:
    """``optax.chain(noise, scale(1 / expected_batch_size), optimizer)`` for DP-SGD.

    Feed it the SUM of clipped per-example gradients (``PrivateGrad.grads``);
    it adds N(0, (noise_multiplier * l2_clip_norm)^2) in the noise dtype,
    divides by the expected batch size and runs ``optimizer``. The updates
    are cast to each parameter's dtype, which must be at least float32
    (master params). ``prng_key`` is the secret noise key, as in
    ``gaussian_privatizer``: leave it None for fresh OS entropy; ``sampler``
    too (``"snapped"``, the default, or ``"plain"``).
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
    privatizer = gaussian_privatizer(
        stddev=stddev, prng_key=prng_key, policy=policy, sampler=sampler
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
        updates, state = chained.update(grads, state, params)
        if params is not None:
            updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
        return updates, state

    return optax.GradientTransformation(chained.init, update)
