"""``sampler="snapped"``: dpmp's default Gaussian noise, safe for exact outputs.

Floating point breaks the Gaussian: ``jax.random.normal`` in float32 is
``sqrt(2) erfinv`` of a 23-bit uniform, 2^23 values within about 5.4 sigma,
and ``x + noise`` rounds onto a lattice that depends on ``x``; an observer of
exact outputs tells neighbours apart (Mironov 2012, "On significance of the
least significant bits for differential privacy"; ``dpmp.privacy_audit``
measures 89% of outputs impossible under the neighbour). So the default noise
is ``snapped_gaussian``: a float64 inverse-CDF normal from 128 random bits per
coordinate (tails to 10 sigma), added to ``x`` and rounded to a power-of-two
grid of about sigma/32 (Mironov's snapping; the grid is fixed by sigma alone).
Its deviation from the exact Gaussian is bounded per grid cell and accounted:
``CONTRACT`` holds the sampler's measured constants, which
``dpmp.accounting.GridNoiseContract`` turns into an epsilon and a delta.

At the sizes models are trained (10^8 to 10^10 coordinates) the noise stage
must not hold per-coordinate temporaries of the whole model: a coordinate's
noise is a function of the key, its leaf and its index alone
(``_noise_words``), so a leaf is drawn in one fused pass, in bounded pieces
written back in place (``chunk_size``). Each copy of that pass in a program
costs XLA:CPU about half a second to compile, so leaves share one: the small
leaves of a tree are drawn together as one vector (``GROUP_MAX``), and on one
device compiled for XLA:CPU the larger leaves of one size and dtype are drawn
together too, piece ``c`` of each of them in one pass (``_snap_same_size``);
on a mesh each device draws only its own part of a leaf or of the small
leaves' vector (``NoiseSharding``). The result is the same however the leaves
are grouped, pieced or sharded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.accounting import GridNoiseContract
from dpmp.noise import _key128 as key128
from dpmp.noise._ndtri import ndtri_lower
from dpmp.noise._threefry import threefry2x32, threefry4x32
from dpmp.precision._opaque import always_true, opaque_ints, traced_for_cpu

if TYPE_CHECKING:
    from dpmp.noise._sharding import NoiseSharding

__all__ = [
    "CONTRACT",
    "SNAPPED",
    "SNAP_CHUNK",
    "SnappedSampler",
    "chunk_size",
    "snap_extremes",
    "snap_grid",
    "snapped_gaussian",
    "snapped_leaf",
]

# The accounting contract of the draw below (tests/test_noise.py and
# tests/test_accounting.py measure each constant). Each coordinate's noisy value
# is ``grid * K``, ``grid = 2**floor(log2(stddev / 32))``, so a grid cell is a
# ``1 / r`` of the noise stddev with ``r = stddev / grid`` in [32, 64). The
# relative error of the float64 inverse normal CDF (``_ndtri.ndtri_lower``, Wichura's
# AS241 on (0, 1/2]) on |z| <= 8 and on 8 < |z| <= 11: the largest measured against
# a 40-digit mpmath reference are 6.8e-16 and 4.3e-16 (jax.scipy.special.ndtri on
# the same points: 6.4e-16 and 2.2e-16); the bounds are 4e-15 and 1e-13. The
# uniforms are exact (to a relative 2^-51) down to 2^-77, |z| = 10.01; below,
# the last 2^-77 of mass is drawn in [2^-78, 2^-77). Cells within the tail, 9.9
# stddevs of the mean, are accurate; the rest of the mass is delta.
CONTRACT = GridNoiseContract(
    sampler="snapped",
    cells_per_stddev=(32, 64),
    ndtri_rel_error=((8.0, 4e-15), (11.0, 1e-13)),
    tail=9.9,
    uniform_rel_error=2.0**-51,
)

# The most coordinates drawn at once. The draw is elementwise and XLA fuses a
# piece (words, uniform, ndtri, snapping) into one pass with no temporaries; the
# pieces bound what it would cost otherwise (~90 bytes per coordinate unfused,
# 40 when a whole-array draw feeds several consumers, as Adam's moments).
SNAP_CHUNK = 1 << 22


def snap_grid(stddev: float) -> float:
    """The grid step of ``snapped_gaussian``: ``2**floor(log2(stddev / 32))``."""
    return 2.0 ** math.floor(math.log2(stddev / CONTRACT.cells_per_stddev[0]))


def _noise_words(key_words: jax.Array, index: jax.Array) -> tuple[jax.Array, ...]:
    """Four uint32 words for each coordinate ``index`` (uint32): the Threefry-4x32
    block of the counter ``(index, 0, 0, NOISE)`` under ``key_words`` (uint32[4]:
    a 128-bit key, ``dpmp.noise._key128``).

    The words of a coordinate depend on the key and its index alone, not on the
    array's shape, on how it is cut into chunks or on the devices it lies on: a
    chunked or sharded draw equals the draw of the whole array on one device.
    (``jax.random.bits`` fixes its counters by the shape it is asked for, and in
    its partitionable mode keeps 32 of each call's 64 bits.)
    """
    zero = jnp.zeros_like(index)
    return threefry4x32(
        tuple(key_words[w] for w in range(4)), (index, zero, zero, zero + key128.NOISE)
    )


def _half_uniform(words):
    """Float64 uniforms on (0, 1/2] and signs from four uint32 words per value.

    ``L`` is the number of leading zeros of 76 bits (``w0``, ``w1`` and the top 12
    bits of ``w2``), geometric as for an exact uniform, capped at 76; the fraction
    has 51 bits (the low 20 of ``w2``, the top 31 of ``w3``) and takes its cell's
    midpoint; the sign is the last bit of ``w3``. The value is
    ``2^-(L+2) (1 + (2 F + 1) 2^-52)``, built from its bits. Down to ``2^-77``,
    ``P(U <= u)`` is within a relative ``2^-51`` of ``2 u``; the mass below is
    drawn in ``[2^-78, 2^-77)`` (|z| from 10.01 to 10.08: ``CONTRACT.tail`` stays
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
    """Float64 standard normals, sign-symmetric ``ndtri`` of ``_half_uniform(words)``
    (``ndtri_lower``: Wichura's AS241 on the uniforms' domain (0, 1/2]).

    A named jit so that the precision audit finds the noise sample by name
    (``dpmp.audit_precision`` records it as a ``noise_sample`` site).
    """
    with jax.enable_x64(True):
        u, negative = _half_uniform((w0, w1, w2, w3))
        z = ndtri_lower(u)  # <= 0
        return jnp.where(negative, z, -z)


def _snap_values(key_words, value: jax.Array, index: jax.Array, stddev: float) -> jax.Array:
    """``value`` (any shape) plus snapped noise, coordinate ``i`` drawn by ``index[i]``."""
    return _snap_words(_noise_words(key_words, index), value, stddev)


def _snap_words(words, value: jax.Array, stddev: float) -> jax.Array:
    """``value`` plus the snapped noise of the random ``words`` (``_half_uniform``'s).

    The grid is a power of two: ``value * (1 / grid)`` is ``value / grid`` exactly,
    without a division."""
    grid = snap_grid(stddev)
    z = snapped_normal_sample(*words)
    with jax.enable_x64(True):
        scaled = value.astype(jnp.float64) * (1.0 / grid)
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


def _snap_flat(flat: jax.Array, stddev: float, words_of: Callable, chunk: int, secret):
    """``flat`` (1-D) with snapped noise added in place, in pieces: a loop over
    pieces read and written back with dynamic slices (XLA updates the loop's carry
    in place), then the remainder. ``words_of(positions)`` gives the four random
    words (``_noise_words``) of positions (int32) of ``flat``; ``secret`` is a
    uint32 word of the key. The result does not depend on the pieces.

    The pieces depend on the backend the draw is traced for (JAX's default):

    - XLA:CPU: ``chunk`` coordinates (``chunk_size``), each piece drawn inside a
      ``lax.cond`` whose predicate is always true (but not known to XLA: it reads
      ``secret``). XLA:CPU runs the body of a while loop on one thread and the
      branches of a conditional on all of them (2 cores, 16.8M coordinates in
      pieces of 2^22: 283 ms without the conditional, 166 ms with it; the plain
      float32 sampler 194 ms).
    - Elsewhere: pieces of ``SNAP_CHUNK`` (a leaf up to that size in one kernel),
      without the conditional. XLA:GPU runs a while loop from the host, one
      iteration's kernels at a time, and reads a conditional's predicate back to
      the host (the guide ViT's step on an H100: 37 loops and 37 conditionals,
      10.8 ms of kernels a step; without them 7.7 ms).

    The choice is made when the draw is traced (``jax.default_backend()``), not by
    ``lax.platform_dependent``, whose program holds both forms: the precision
    audit would read every draw twice."""
    n = flat.shape[0]
    if traced_for_cpu():
        return _snap_pieces(flat, stddev, words_of, chunk, secret)
    return _snap_pieces(flat, stddev, words_of, max(chunk, min(n, SNAP_CHUNK)))


def _snap_pieces(flat: jax.Array, stddev: float, words_of: Callable, size: int, secret=None):
    """``_snap_flat`` in pieces of ``size``, each inside an always-true ``lax.cond``
    on ``secret`` if one is given."""
    n = flat.shape[0]
    always = None if secret is None else always_true(secret)

    def draw(start, part):
        positions = start + jax.lax.iota(jnp.int32, part.shape[0])
        return _snap_words(words_of(positions), part, stddev)

    def piece(start, size, x):
        part = jax.lax.dynamic_slice(x, (start,), (size,))
        if always is None:
            noisy = draw(start, part)
        else:
            noisy = jax.lax.cond(always, lambda part: draw(start, part), lambda part: part, part)
        return jax.lax.dynamic_update_slice(x, noisy, (start,))

    full, rest = divmod(n, size)
    if full == 1:
        flat = piece(0, size, flat)
    elif full:
        flat = jax.lax.fori_loop(0, full, lambda c, x: piece(c * size, size, x), flat)
    if rest:
        flat = piece(full * size, rest, flat)
    return flat


def _words_by_index(key_words, index_of: Callable | None = None) -> Callable:
    """``words_of`` for ``_snap_flat``: one leaf's key words, the draw index of a
    position given by ``index_of`` (the position itself by default)."""
    index_of = index_of or _as_index
    return lambda positions: _noise_words(key_words, index_of(positions))


def _check_size(n: int) -> None:
    if n >= 2**32:
        raise ValueError(
            f"snapped_gaussian: an array of {n:,} coordinates; the draw indexes a leaf's "
            "coordinates with 32 bits (split the parameter into leaves of fewer than 2^32)"
        )


def _key_words(key: jax.Array) -> jax.Array:
    """The draw's key words (uint32[4], ``_noise_words``) of a typed PRNG key: a
    128-bit key's own data (``dpmp.noise._key128``: a secret run's keys); of any
    other key, ``jax.random.bits(key, (4,), jnp.uint32)`` (a key of 64 bits, as
    JAX's default Threefry, gives noise that a search of its 2^64 keys can
    find: such keys are for reproducible, public-seeded runs)."""
    return _leaf_key_words(key, None)


def _threefry_data(key: jax.Array) -> jax.Array | None:
    """The uint32[2] data of a typed key of JAX's default Threefry in its
    partitionable mode (the one whose ``bits``, ``split`` and ``fold_in``
    ``_leaf_key_words`` and ``_split`` write out), or None for any other key."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not (typed and key.shape == () and jax.config.jax_threefry_partitionable):
        return None
    if str(jax.random.key_impl(key)) != "threefry2x32":
        return None
    return jax.random.key_data(key)


# Padded to a multiple of 64 keys: how long LLVM takes over an elementwise pass of
# keys depends on its length (2 CPU cores: 0.1 s for 64 or 128 keys, 0.4 s for 50 or
# 1,000, and 1 s for the 50 adapters of a private LoRA step, fused with its split).
_KEY_PAD = 64


def _leaf_key_words(key: jax.Array, ids) -> jax.Array:
    """``_key_words(jax.random.fold_in(key, i))`` for each ``i`` of ``ids`` (uint32,
    shape ``(m,)``; uint32[m, 4]), or ``_key_words(key)`` for ``ids=None`` (uint32[4]).

    Written out as one elementwise pass for a 128-bit key (its ``fold_in`` is the
    block of ``(i, 0, 0, FOLD)``) and for a Threefry-2x32 key, where JAX emits a
    rolled Threefry loop for each call (compile time, not run time: a handful of
    keys): there ``fold_in(k, i)`` is the key ``threefry2x32(k, (0, i))`` and
    ``bits(k, (4,), uint32)`` is ``a ^ b`` of ``(a, b) = threefry2x32(k, (0, j))``
    for ``j = 0..3`` (jax/_src/random/threefry2x32.py)."""
    if key128.is_key128(key):
        data = jax.random.key_data(key)
        if ids is None:
            return data
        n = ids.shape[0]
        return key128.block(data, jnp.pad(ids, (0, -n % _KEY_PAD)), key128.FOLD)[:n]
    data = _threefry_data(key)
    if data is None:
        if ids is None:
            return jax.random.bits(key, (4,), jnp.uint32)
        return jax.vmap(lambda i: _key_words(jax.random.fold_in(key, i)))(ids)
    if ids is None:
        return _bits_words(data[0], data[1])
    n = ids.shape[0]
    padded = jnp.pad(ids, (0, -n % _KEY_PAD))
    k0, k1 = threefry2x32(data[0], data[1], jnp.zeros_like(padded), padded)
    return _bits_words(k0, k1)[:n]


def _bits_words(k0, k1) -> jax.Array:
    """``bits(k, (4,), uint32)`` of the Threefry-2x32 keys ``(k0, k1)`` (uint32, any
    shape; uint32 [..., 4]): the words from one written-out call, the counters
    ``(0, j)`` side by side on a last axis (each call is compiled on its own)."""
    k0, k1 = (jnp.broadcast_to(k[..., None], k.shape + (4,)) for k in (k0, k1))
    j = jnp.broadcast_to(jnp.arange(4, dtype=jnp.uint32), k0.shape)
    a, b = threefry2x32(k0, k1, jnp.zeros_like(k0), j)
    return a ^ b


def _split(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``jax.random.split(key)`` as two keys; for a Threefry-2x32 key written out:
    key ``j`` is ``threefry2x32(k, (0, j))`` (see ``_leaf_key_words``). A 128-bit
    key's ``split`` is written out already (``dpmp.noise._key128``)."""
    data = _threefry_data(key)
    if data is None:
        key, sub = jax.random.split(key)
        return key, sub
    k0, k1 = data[0], data[1]
    x0, x1 = threefry2x32(k0, k1, jnp.zeros((2,), jnp.uint32), jnp.arange(2, dtype=jnp.uint32))
    keys = jax.random.wrap_key_data(jnp.stack([x0, x1], axis=-1), impl=jax.random.key_impl(key))
    return keys[0], keys[1]


def snapped_gaussian(key: jax.Array, value: jax.Array, stddev: float) -> jax.Array:
    """``value`` plus N(0, stddev^2) noise, snapped to the grid ``snap_grid(stddev)``.

    Each coordinate is ``grid * (n + round(f + r z))`` where ``value / grid =
    n + f`` (exact: the grid is a power of two), ``r = stddev / grid`` in
    [32, 64) and ``z = ndtri(U)`` with a random sign, all in float64 (scoped
    with ``jax.enable_x64``; the rest of the program keeps its dtypes). Given
    an exactly normal ``z`` this is a post-processing of the Gaussian
    mechanism: the output cell's probability is the Gaussian mass of that
    cell, whatever the float32 spacing of ``value``. The drawn ``z`` differs
    from an exact one by a bounded relative error (``CONTRACT.ndtri_rel_error``),
    which ``dpmp.accounting.noise_residual`` turns into an accounted epsilon
    and delta. The result has ``value``'s dtype; rounding the grid value to
    it is post-processing too.

    Costs 128 random bits (one Threefry-4x32 block, ``_noise_words``) and one
    float64 ``ndtri`` per coordinate. Coordinate ``i`` (in row-major order) is
    drawn from ``key`` and ``i`` alone, so the array is drawn in pieces of
    ``chunk_size(value.size)`` coordinates, written back in place: the temporary
    memory is bounded by the piece, not the array.
    """
    stddev = float(stddev)
    if stddev == 0:
        return value
    return snapped_leaf(_key_words(key), jnp.asarray(value), stddev)


def _as_index(positions: jax.Array) -> jax.Array:
    return positions.astype(jnp.uint32)


def snapped_leaf(key_words, leaf: jax.Array, stddev: float) -> jax.Array:
    """``snapped_gaussian`` of one leaf, from the draw's key words (uint32[4])."""
    _check_size(leaf.size)
    flat = _snap_flat(
        leaf.reshape(-1), stddev, _words_by_index(key_words), chunk_size(leaf.size), key_words[0]
    )
    return flat.reshape(leaf.shape)


# Leaves of at most this many coordinates are drawn together (``_snap_small``).
GROUP_MAX = 1 << 16


def _snap_tree(key, tree, stddev: float, sharding: NoiseSharding | None = None):
    """``snapped_gaussian`` on every leaf; leaf ``i`` is drawn from ``fold_in(key, i)``
    in bounded pieces (over ``sharding``'s mesh when given), the small leaves of a
    dtype together, and on one device compiled for XLA:CPU the larger leaves of a
    size and dtype together (``_snap_leaves``)."""
    if stddev == 0:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        _check_size(leaf.size)
    specs = None if sharding is None else sharding.leaf_specs(tree)
    return jax.tree.unflatten(treedef, _snap_leaves(key, leaves, stddev, sharding, specs))


def _snap_leaves(
    key, leaves: list, stddev: float, sharding: NoiseSharding | None = None, specs=None
) -> list:
    """The leaves with noise. The small ones (at most ``GROUP_MAX`` coordinates, and
    on a mesh whole on every device) in one draw per dtype, over the mesh when there
    is one (``_snap_small``: the same values, fewer programs). The larger ones: on
    one device traced for XLA:CPU, those of one size and dtype together
    (``_snap_same_size``); elsewhere each on its own, and on a mesh each split over
    it (``specs``: one ``PartitionSpec`` a leaf)."""
    out = list(leaves)
    groups: dict[Any, list[int]] = {}
    same_size: dict[Any, list[int]] = {}
    together = sharding is None and traced_for_cpu()
    for i, leaf in enumerate(leaves):
        if leaf.size <= GROUP_MAX and (sharding is None or sharding.replicates(specs[i])):
            groups.setdefault(jnp.dtype(leaf.dtype), []).append(i)
        elif together:
            same_size.setdefault((leaf.size, jnp.dtype(leaf.dtype)), []).append(i)
        elif sharding is None:
            # Not traced for XLA:CPU: one leaf at a time, as measured on GPUs (a
            # piece of up to SNAP_CHUNK, no loop); grouping is not measured there.
            out[i] = snapped_leaf(_key_words(jax.random.fold_in(key, i)), leaf, stddev)
        else:
            out[i] = sharding.draw(_key_words(jax.random.fold_in(key, i)), leaf, specs[i], stddev)
    if same_size:
        ids = [i for group in same_size.values() for i in group]
        table = _key_table(key, ids)
        row = {i: r for r, i in enumerate(ids)}
        for group in same_size.values():
            rows = table[np.asarray([row[i] for i in group])]
            drawn = _snap_same_size(rows, [leaves[i] for i in group], stddev)
            for i, leaf in zip(group, drawn, strict=True):
                out[i] = leaf
    draw = _draw_group if sharding is None else sharding.draw_group
    for ids in groups.values():
        drawn = _snap_small(key, ids, [leaves[i] for i in ids], stddev, draw)
        for i, leaf in zip(ids, drawn, strict=True):
            out[i] = leaf
    return out


def _key_table(key, ids: list[int]) -> jax.Array:
    """``_key_words(jax.random.fold_in(key, i))`` for each ``i`` of ``ids`` (uint32[m,
    4]): written out in one pass (``_leaf_key_words``) for a 128-bit or a Threefry
    key; for any other key (e.g. ``rbg``, whose bits under ``vmap`` are not its
    bits one key at a time) key by key, as a leaf drawn alone takes them."""
    if key128.is_key128(key) or _threefry_data(key) is not None:
        return _leaf_key_words(key, jnp.asarray(ids, jnp.uint32))
    return jnp.stack([_key_words(jax.random.fold_in(key, i)) for i in ids])


def _same_size_piece(leaves: int, n: int) -> int:
    """Coordinates ``C`` per leaf in a piece of ``_snap_same_size``'s draw of
    ``leaves`` leaves of ``n`` coordinates each: the largest power of two with
    ``leaves * C`` within ``chunk_size(leaves * n)``, the piece of one leaf of all
    their coordinates (at most ``SNAP_CHUNK``, an eighth of them)."""
    return 1 << max(chunk_size(leaves * n) // leaves, 1).bit_length() - 1


def _snap_same_size(table: jax.Array, leaves: list, stddev: float) -> list:
    """Leaves of one size and dtype with snapped noise, leaf ``j`` drawn with the key
    words ``table[j]`` (uint32[G, 4] for G leaves): each coordinate gets what
    ``snapped_leaf`` of its own leaf gives it (tests), from one copy of the draw.

    One loop over pieces of ``C = _same_size_piece(G, n)`` coordinates: piece ``c``
    of every leaf (dynamic slices of the flat leaves, the loop's carry) read as the
    rows of a [G, C] array, drawn in one elementwise pass (row ``j`` with
    ``table[j]``, coordinates ``c C`` to ``c C + C - 1``) inside an always-true
    ``lax.cond`` (``_snap_flat`` says why, on XLA:CPU), and each row written back
    into its own leaf in place. When ``C`` does not divide ``n`` the last piece is
    the leaves' last ``C`` coordinates, and it keeps the ones an earlier piece drew
    (the same loop body: no second copy of the draw for a remainder). The
    temporary memory is the drawn piece, [G, C] (at most ``chunk_size(G n)``
    coordinates); the slices fuse into the draw.

    The rows are written back at offsets XLA cannot fold (``opaque_ints``): the G
    writes compile to one kernel. The key words are carried through the loop, so
    that XLA does not fuse their Threefry computation into each of their readers.

    Each copy of the draw (a Threefry-4x32 block, the float64 ``ndtri``, the
    snapping: one fusion of ~600 operations) costs XLA:CPU ~0.4-0.5 s to compile.
    48 leaves of 256 x 1024 (2 CPU cores): 22-27 s to compile leaf by leaf, 3.0-3.4 s
    together; GPT-2-small's 48 weight matrices (4 shapes, 3 sizes, 12 layers): 27-32 s
    and 4.6-5.4 s; a draw no slower (the 48 matrices: 1.6 s, 1.8 s leaf by leaf).
    Selecting a leaf by the loop index (``lax.switch``) instead of reading them all
    makes XLA copy the whole carry every iteration."""
    g, n = len(leaves), leaves[0].size
    size = _same_size_piece(g, n)
    pieces, rest = -(-n // size), n % size

    def draw(table, start, low, part):
        positions = start + jax.lax.iota(jnp.int32, size)
        keys = tuple(table[:, w, None] for w in range(4))  # uint32[G, 1] each
        noisy = _snap_words(_noise_words(keys, _as_index(positions)), part, stddev)
        return noisy if not rest else jnp.where(positions >= low, noisy, part)

    def read(start, flats):
        if g == 1:
            return jax.lax.dynamic_slice(flats[0], (start,), (size,))[None]
        row = jax.lax.broadcasted_iota(jnp.int32, (g, size), 0)
        part = None
        for j, x in enumerate(flats):  # a chain of selects fuses into the draw, a stack
            # (concatenate) would be one more [G, C] temporary
            own = jnp.broadcast_to(jax.lax.dynamic_slice(x, (start,), (size,)), (g, size))
            part = own if part is None else jnp.where(row == j, own, part)
        return part

    def piece(c, carry):
        table, flats = carry
        low = c * size
        start = low if not rest else jnp.minimum(low, n - size)
        always = always_true(table)
        noisy = jax.lax.cond(
            always,
            lambda t, f: draw(t, start, low, read(start, f)),
            lambda t, f: read(start, f),
            table,
            flats,
        )
        zero = jnp.zeros((), jnp.int32)
        rows = opaque_ints(range(g), always)
        flats = tuple(
            jax.lax.dynamic_update_slice(
                x, jax.lax.dynamic_slice(noisy, (r, zero), (1, size))[0], (start,)
            )
            for r, x in zip(rows, flats, strict=True)
        )
        return table, flats

    flats = tuple(leaf.reshape(-1) for leaf in leaves)
    _, flats = jax.lax.fori_loop(0, pieces, piece, (table, flats))
    return [x.reshape(leaf.shape) for x, leaf in zip(flats, leaves, strict=True)]


def _snap_small(key, ids: list[int], leaves: list, stddev: float, draw: Callable) -> list:
    """Leaves ``ids`` of a tree (small, one dtype) with snapped noise, drawn as one
    concatenated vector by ``draw(flat, table, starts, stddev)`` (``_draw_group`` on
    one device, ``NoiseSharding.draw_group`` on a mesh) with ``_group_words``: a
    position finds its leaf ``j`` among the leaves' ``starts`` and takes leaf
    ``ids[j]``'s key words (``table[j]``) and its index within that leaf, so every
    coordinate gets what ``snapped_leaf`` of its own leaf gives it (tests).

    One program for many leaves: drawn one by one, each leaf adds its own copy of
    the draw (a Threefry-4x32 block, the float64 ``ndtri``) to the compiled step. The
    96 rank-8 adapters of a GPT-2-small LoRA (1.18M coordinates; 2 CPU cores):
    23-29 s to compile leaf by leaf, 2.7-3.2 s together, 22-26 ms a draw either
    way (the leaf search is a few gathers a coordinate, ``scan_unrolled``)."""
    sizes = [leaf.size for leaf in leaves]
    starts = np.cumsum([0, *sizes[:-1]]).astype(np.int32)
    table = _leaf_key_words(key, jnp.asarray(ids, jnp.uint32))
    flat = jnp.concatenate([leaf.reshape(-1) for leaf in leaves])
    noisy = draw(flat, table, starts, stddev)
    # Each leaf's part at an offset XLA cannot fold (on XLA:CPU): the optimizer's
    # updates of same-shaped leaves read it fused in and compile to one kernel (the
    # GPT-2 shape's 146 LoRA adapters: 297 update kernels at constant offsets, 2.4 s
    # of its compile, against 19 for the non-private step's updates).
    offsets = opaque_ints(starts, always_true(table))
    parts = [
        jax.lax.dynamic_slice(noisy, (o,), (leaf.size,), allow_negative_indices=False)
        for o, leaf in zip(offsets, leaves, strict=True)
    ]
    return [part.reshape(leaf.shape) for part, leaf in zip(parts, leaves, strict=True)]


def _group_words(table: jax.Array, starts: np.ndarray) -> Callable:
    """``words_of`` (``_snap_flat``) for positions (int32) of leaves concatenated:
    leaf ``j`` starts at ``starts[j]`` and is drawn with the key words ``table[j]``
    (uint32[4]). Positions past the end count as the last leaf's (padding)."""

    def words_of(positions):
        j = jnp.searchsorted(starts, positions, side="right", method="scan_unrolled") - 1
        index = (positions - jnp.asarray(starts)[j]).astype(jnp.uint32)
        return _noise_words(tuple(table[j, w] for w in range(4)), index)

    return words_of


def _whole_pieces(n: int) -> tuple[int, int]:
    """``(pieces, chunk)``: ``n`` coordinates padded to whole pieces of a multiple of
    128 (as many as ``chunk_size(n)`` makes), so that no second copy of the draw is
    compiled for a remainder."""
    pieces = -(-n // chunk_size(n))
    return pieces, -(-n // pieces // 128) * 128


def _draw_group(flat: jax.Array, table: jax.Array, starts: np.ndarray, stddev: float):
    """``_snap_small``'s draw on one device: ``flat`` padded to whole pieces, the
    padding drawn (as the last leaf's) and dropped."""
    n = flat.shape[0]
    pieces, chunk = _whole_pieces(n)
    padded = jnp.pad(flat, (0, pieces * chunk - n))
    return _snap_flat(padded, stddev, _group_words(table, starts), chunk, table[0, 0])[:n]


@dataclasses.dataclass(frozen=True)
class SnappedSampler:
    """``snapped_gaussian`` noise on every leaf, the small ones of a dtype together
    and, on XLA:CPU, the larger ones of a size and dtype together (``_snap_tree``;
    ``dpmp.noise.NoiseSampler``).

    Its normals are drawn by the named jit ``snapped_normal_sample``, which the
    precision audit records as the ``noise_sample`` site; it draws in float64,
    so a policy's noise dtype of at least float32 is kept (narrower noise is an
    unsafe opt-in, drawn plain in that dtype).
    """

    name: str = "snapped"
    contract: GridNoiseContract | None = CONTRACT
    jit_name: str | None = snapped_normal_sample.__name__
    min_noise_bits: int = 32
    privacy_warning: str | None = None

    def release_grid(self, value: Any, stddev: float) -> tuple[float, float, float]:
        """``(smallest, largest, grid)``: the releases of ``value`` (float[1]) are the
        multiples of ``snap_grid(stddev)`` between ``snap_extremes``' (every one of
        them possible: the sampler's steps in z are far finer than a cell)."""
        low, high = jax.jit(snap_extremes, static_argnums=1)(jnp.asarray(value), stddev)
        as_float = (float(np.asarray(v, np.float64)[0]) for v in (low, high))
        return (*as_float, snap_grid(stddev))

    def update(self, inner, grads, state, *, stddev: float, sharding: Any) -> tuple[Any, Any]:
        del inner  # only its state layout (key, inner) is kept
        key, rest = state
        key, sub = _split(key)
        return _snap_tree(sub, grads, stddev, sharding), (key, rest)


SNAPPED = SnappedSampler()
