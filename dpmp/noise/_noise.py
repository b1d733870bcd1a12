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
is ``snapped_gaussian``: a float64 inverse-CDF normal from 128 random bits per
coordinate (tails to 10 sigma), added to ``x`` and rounded to a power-of-two
grid of about sigma/32 (Mironov's snapping; the grid is fixed by sigma alone).
Its deviation from the exact Gaussian is bounded per grid cell and accounted
(``dpmp.accounting.noise_residual``). ``sampler="plain"`` keeps jax-privacy's
``jax.random.normal`` noise.

At the sizes models are trained (10^8 to 10^10 coordinates) the noise stage
must not hold per-coordinate temporaries of the whole model: a coordinate's
noise is a function of the key, its leaf and its index alone
(``_noise_words``), so each leaf is drawn in one fused pass without
temporaries, in bounded pieces written back in place (``chunk_size``), and on
a mesh each device draws only its own part (``NoiseSharding``) with the same
result as one device.

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

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax_privacy import noise_addition as jp_noise

from dpmp.accounting._accounting import SNAP_CELLS_PER_STDDEV
from dpmp.noise._entropy import key_from
from dpmp.precision._policy import Policy

__all__ = [
    "SAMPLERS",
    "SNAP_CHUNK",
    "NoiseSharding",
    "chunk_size",
    "gaussian_privatizer",
    "snap_extremes",
    "private_optimizer",
    "snap_grid",
    "snapped_gaussian",
]

SAMPLERS = ("snapped", "plain")
# The most coordinates drawn at once. The draw is elementwise and XLA fuses a
# piece (words, uniform, ndtri, snapping) into one pass with no temporaries; the
# pieces bound what it would cost otherwise (~90 bytes per coordinate unfused,
# 40 when a whole-array draw feeds several consumers, as Adam's moments).
SNAP_CHUNK = 1 << 22


def snap_grid(stddev: float) -> float:
    """The grid step of ``snapped_gaussian``: ``2**floor(log2(stddev / 32))``."""
    return 2.0 ** math.floor(math.log2(stddev / SNAP_CELLS_PER_STDDEV[0]))


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds; Salmon et al. 2011, Random123), written out.

    The same function as JAX's ``threefry2x32`` primitive (bit for bit,
    tests/test_noise.py), which XLA:CPU lowers as a rolled loop of 5 passes over
    the whole array to keep compile times short (jax/_src/random/threefry2x32.py):
    written out, the 20 rounds fuse with the sampler's arithmetic into one pass,
    4-7x faster for the draw's two calls on 2 CPU cores.
    """
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _noise_words(key_words: jax.Array, index: jax.Array) -> tuple[jax.Array, ...]:
    """Four uint32 words for each coordinate ``index`` (uint32): Threefry-2x32 of
    the counters ``(0, index)`` and ``(1, index)`` under ``key_words`` (uint32[2]).

    The words of a coordinate depend on the key and its index alone, not on the
    array's shape, on how it is cut into chunks or on the devices it lies on: a
    chunked or sharded draw equals the draw of the whole array on one device.
    (``jax.random.bits`` fixes its counters by the shape it is asked for, and in
    its partitionable mode keeps 32 of each call's 64 bits.)
    """
    k0, k1 = key_words[0], key_words[1]
    w0, w1 = _threefry2x32(k0, k1, jnp.zeros_like(index), index)
    w2, w3 = _threefry2x32(k0, k1, jnp.ones_like(index), index)
    return w0, w1, w2, w3


def _half_uniform(words):
    """Float64 uniforms on (0, 1/2] and signs from four uint32 words per value.

    ``L`` is the number of leading zeros of 76 bits (``w0``, ``w1`` and the top 12
    bits of ``w2``), geometric as for an exact uniform, capped at 76; the fraction
    has 51 bits (the low 20 of ``w2``, the top 31 of ``w3``) and takes its cell's
    midpoint; the sign is the last bit of ``w3``. The value is
    ``2^-(L+2) (1 + (2 F + 1) 2^-52)``, built from its bits. Down to ``2^-77``,
    ``P(U <= u)`` is within a relative ``2^-51`` of ``2 u``; the mass below is
    drawn in ``[2^-78, 2^-77)`` (|z| from 10.01 to 10.08: ``SNAP_TAIL`` stays
    below).
    """
    w0, w1, w2, w3 = words
    clz = jax.lax.clz
    top = w2 >> 20
    zeros = jnp.where(
        w0 != 0,
        clz(w0),
        jnp.where(w1 != 0, 32 + clz(w1), jnp.where(top != 0, 44 + clz(top), 76)),
    )
    with jax.enable_x64(True):
        u64 = jnp.uint64
        fraction = ((w2 & 0xFFFFF).astype(u64) << 32) | ((w3 >> 1).astype(u64) << 1) | u64(1)
        exponent = (u64(1021) - zeros.astype(u64)) << 52
        u = jax.lax.bitcast_convert_type(exponent | fraction, jnp.float64)
    return u, (w3 & 1) == 1


@jax.jit
def snapped_normal_sample(w0, w1, w2, w3) -> jax.Array:
    """Float64 standard normals, sign-symmetric ``ndtri`` of ``_half_uniform(words)``.

    A named jit so that the precision audit finds the noise sample by name
    (``dpmp.audit_precision`` records it as a ``noise_sample`` site).
    """
    with jax.enable_x64(True):
        u, negative = _half_uniform((w0, w1, w2, w3))
        z = jax.scipy.special.ndtri(u)  # <= 0
        return jnp.where(negative, z, -z)


def _snap_values(key_words, value: jax.Array, index: jax.Array, stddev: float) -> jax.Array:
    """``value`` (any shape) plus snapped noise, coordinate ``i`` drawn by ``index[i]``."""
    return _snap_words(_noise_words(key_words, index), value, stddev)


def _snap_words(words, value: jax.Array, stddev: float) -> jax.Array:
    """``value`` plus the snapped noise of the random ``words`` (``_half_uniform``'s)."""
    grid = snap_grid(stddev)
    z = snapped_normal_sample(*words)
    with jax.enable_x64(True):
        scaled = value.astype(jnp.float64) / grid
        whole = jnp.round(scaled)
        cells = whole + jnp.round((scaled - whole) + (stddev / grid) * z)
        return (cells * grid).astype(value.dtype)


def snap_extremes(value: jax.Array, stddev: float) -> tuple[jax.Array, jax.Array]:
    """The smallest and the largest release of ``value`` that ``snapped_gaussian`` can
    make with any key: the noise of the uniform's floor (every geometric and
    fraction bit zero) with either sign. Every grid point between them is possible
    (the sampler's steps in z are far finer than a cell), nothing outside is."""
    value = jnp.asarray(value)
    zero = jnp.zeros(value.shape, jnp.uint32)
    low = _snap_words((zero, zero, zero, zero + 1), value, stddev)
    high = _snap_words((zero, zero, zero, zero), value, stddev)
    return low, high


def chunk_size(n: int) -> int:
    """Coordinates per piece of a chunked draw of ``n``: one piece up to 4,096, else
    a power of two between ``2^9`` and ``SNAP_CHUNK``, at most an eighth of ``n``."""
    if n <= 4096:
        return max(n, 1)
    return min(SNAP_CHUNK, 1 << (n // 8).bit_length() - 1)


def _snap_flat(key_words, flat: jax.Array, stddev: float, index_of: Callable, chunk: int):
    """``flat`` (1-D) with snapped noise added in place, ``chunk`` coordinates at a
    time: a loop over pieces read and written back with dynamic slices (XLA updates
    the loop's carry in place), then the remainder. ``index_of(positions)`` gives
    the draw index (uint32) of positions (int32) of ``flat``.

    Each piece is drawn inside a ``lax.cond`` whose predicate is always true (but
    not known to XLA): XLA:CPU runs the body of a while loop on one thread and the
    branches of a conditional on all of them (2 cores, 16.8M coordinates in pieces
    of 2^22: 283 ms without the conditional, 166 ms with it; the plain float32
    sampler 194 ms)."""
    n = flat.shape[0]
    full, rest = divmod(n, chunk)
    always = (key_words[0] | np.uint32(1)) != 0

    def piece(start, size, x):
        part = jax.lax.dynamic_slice(x, (start,), (size,))

        def draw(part):
            index = index_of(start + jax.lax.iota(jnp.int32, size))
            return _snap_values(key_words, part, index, stddev)

        noisy = jax.lax.cond(always, draw, lambda part: part, part)
        return jax.lax.dynamic_update_slice(x, noisy, (start,))

    if full:
        flat = jax.lax.fori_loop(0, full, lambda c, x: piece(c * chunk, chunk, x), flat)
    if rest:
        flat = piece(full * chunk, rest, flat)
    return flat


def _check_size(n: int) -> None:
    if n >= 2**32:
        raise ValueError(
            f"snapped_gaussian: an array of {n:,} coordinates; the draw indexes a leaf's "
            "coordinates with 32 bits (split the parameter into leaves of fewer than 2^32)"
        )


def _key_words(key: jax.Array) -> jax.Array:
    """64 bits of key for the draw (``_noise_words``), from a typed PRNG key."""
    return jax.random.bits(key, (2,), jnp.uint32)


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

    Costs 128 random bits (two Threefry-2x32 calls, ``_threefry2x32``) and one
    float64 ``ndtri`` per coordinate. Coordinate ``i`` (in row-major order) is
    drawn from ``key`` and ``i`` alone, so the array is drawn in pieces of
    ``chunk_size(value.size)`` coordinates, written back in place: the temporary
    memory is bounded by the piece, not the array.
    """
    stddev = float(stddev)
    if stddev == 0:
        return value
    value = jnp.asarray(value)
    _check_size(value.size)
    flat = _snap_flat(_key_words(key), value.reshape(-1), stddev, _as_index, chunk_size(value.size))
    return flat.reshape(value.shape)


def _as_index(positions: jax.Array) -> jax.Array:
    return positions.astype(jnp.uint32)


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


@dataclasses.dataclass(frozen=True)
class NoiseSharding:
    """How the snapped noise of a gradient tree is drawn over the devices of a mesh.

    Each device draws only its own part, and the result equals the draw of the
    whole tree on one device (a coordinate's noise depends on the key, its leaf
    and its index alone, see ``snapped_gaussian``):

    * a leaf whose spec in ``specs`` splits it over ``axis`` (the parameters
      and their gradient sums sharded, FSDP): each device draws its shard;
    * a replicated leaf (spec ``P()``, or ``specs=None``): device ``d`` draws the
      ``d``-th of ``D`` equal ranges of its coordinates (row-major), the ranges
      are all-gathered, and the last ``size mod D`` coordinates are drawn on
      every device.

    Attributes:
      mesh: the ``jax.sharding.Mesh``.
      axis: the name of the mesh axis the draw is split over.
      specs: a ``PartitionSpec`` per leaf of the gradient tree (a pytree of
        them, as the parameters are sharded), or None: every leaf replicated.
    """

    mesh: Mesh
    axis: str
    specs: Any = None

    def __post_init__(self):
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"axis: {self.axis!r} is not an axis of the mesh {self.mesh.axis_names}"
            )

    def leaf_specs(self, tree) -> list[P]:
        """One ``PartitionSpec`` per leaf of ``tree``."""
        leaves = jax.tree.leaves(tree)
        if self.specs is None:
            return [P()] * len(leaves)
        specs = jax.tree.leaves(self.specs, is_leaf=lambda x: isinstance(x, P))
        if len(specs) != len(leaves):
            raise ValueError(
                f"specs: {len(specs)} partition specs for a gradient tree of {len(leaves)} leaves"
            )
        return specs

    def draw(self, key_words, leaf: jax.Array, spec: P, stddev: float) -> jax.Array:
        """``leaf`` (laid out as ``spec`` says) with snapped noise, drawn over the mesh."""
        dim = tuple(spec).index(self.axis) if self.axis in tuple(spec) else None
        if dim is None:
            return self._draw_replicated(key_words, leaf, stddev)
        return self._draw_sharded(key_words, leaf, spec, dim, stddev)

    def _draw_sharded(self, key_words, leaf, spec: P, dim: int, stddev: float):
        shape = leaf.shape
        devices = self.mesh.shape[self.axis]
        local = shape[dim] // devices
        inner = math.prod(shape[dim + 1 :])
        axis = self.axis

        def index_of(positions):  # local row-major positions -> global ones
            outer, rest = jnp.divmod(positions, local * inner)
            row, col = jnp.divmod(rest, inner)
            row = row + jax.lax.axis_index(axis) * local
            return ((outer * shape[dim] + row) * inner + col).astype(jnp.uint32)

        def body(k, shard):
            flat = _snap_flat(k, shard.reshape(-1), stddev, index_of, chunk_size(shard.size))
            return flat.reshape(shard.shape)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(P(), spec), out_specs=spec)(
            key_words, leaf
        )

    def _draw_replicated(self, key_words, leaf, stddev: float):
        n = leaf.size
        devices = self.mesh.shape[self.axis]
        part = n // devices
        if part == 0:  # fewer coordinates than devices: every device draws them all
            return snapped_leaf(key_words, leaf, stddev)
        axis = self.axis

        def body(k, whole):
            flat = whole.reshape(-1)
            start = jax.lax.axis_index(axis) * part
            mine = jax.lax.dynamic_slice(flat, (start,), (part,))
            drawn = _snap_flat(
                k, mine, stddev, lambda pos: _as_index(start + pos), chunk_size(part)
            )
            pieces = [jax.lax.all_gather(drawn, axis, tiled=True)]
            if n > part * devices:  # the rest, the same on every device
                tail = flat[part * devices :]
                index = _as_index(part * devices + jax.lax.iota(jnp.int32, tail.size))
                pieces.append(_snap_values(k, tail, index, stddev))
            out = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
            return out.reshape(whole.shape)

        # The all-gathered ranges and the tail are the same on every device; JAX's
        # replication check types an all_gather's result as varying, so it is off.
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
        )(key_words, leaf)


def snapped_leaf(key_words, leaf: jax.Array, stddev: float) -> jax.Array:
    """``snapped_gaussian`` of one leaf, from the draw's key words (uint32[2])."""
    _check_size(leaf.size)
    flat = _snap_flat(key_words, leaf.reshape(-1), stddev, _as_index, chunk_size(leaf.size))
    return flat.reshape(leaf.shape)


def _snap_tree(key, tree, stddev: float, sharding: NoiseSharding | None = None):
    """``snapped_gaussian`` on every leaf; leaf ``i`` is drawn from ``fold_in(key, i)``,
    one leaf after another in bounded pieces (over ``sharding``'s mesh when given)."""
    if stddev == 0:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    specs = [None] * len(leaves) if sharding is None else sharding.leaf_specs(tree)
    out = []
    for i, (leaf, spec) in enumerate(zip(leaves, specs, strict=True)):
        _check_size(leaf.size)
        words = _key_words(jax.random.fold_in(key, i))
        if sharding is None:
            out.append(snapped_leaf(words, leaf, stddev))
        else:
            out.append(sharding.draw(words, leaf, spec, stddev))
    return jax.tree.unflatten(treedef, out)


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

    ``sampler="snapped"`` (default) draws ``snapped_gaussian`` noise, whose
    floating-point residual the accountant adds when told the number of noised
    coordinates; ``"plain"`` draws ``jax.random.normal`` in ``policy.noise``
    (jax-privacy's privatizer): right for observers of rounded outputs, not of
    exact ones (see ``dpmp.privacy_audit``). A policy with half-precision noise
    (an unsafe opt-in) always gets the plain sampler in that dtype.

    The snapped noise is drawn leaf by leaf, in bounded pieces written back in
    place (``chunk_size``), each in one fused pass that needs no temporaries:
    its temporary memory does not grow with the model. ``sharding`` (a
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
        return _snap_tree(sub, grads, stddev, sharding), (key, rest)

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
) -> optax.GradientTransformation:
    """``optax.chain(noise, scale(1 / expected_batch_size), optimizer)`` for DP-SGD.

    Feed it the SUM of clipped per-example gradients (``PrivateGrad.grads``);
    it adds N(0, (noise_multiplier * l2_clip_norm)^2) in the noise dtype,
    divides by the expected batch size and runs ``optimizer``. The updates
    are cast to each parameter's dtype, which must be at least float32
    (master params). ``prng_key`` is the secret noise key, as in
    ``gaussian_privatizer``: leave it None for fresh OS entropy; ``sampler``
    too (``"snapped"``, the default, or ``"plain"``), and ``sharding`` (a
    ``NoiseSharding``: the draw split over the devices of a mesh).
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
        updates, state = chained.update(grads, state, params)
        if params is not None:
            updates = jax.tree.map(lambda u, p: u.astype(p.dtype), updates, params)
        return updates, state

    return optax.GradientTransformation(chained.init, update)
