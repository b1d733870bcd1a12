"""The snapped noise of a gradient tree, drawn over the devices of a mesh."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dpmp.noise._snapped import (
    _as_index,
    _group_words,
    _snap_flat,
    _snap_values,
    _whole_pieces,
    _words_by_index,
    chunk_size,
    snapped_leaf,
)

__all__ = ["NoiseSharding"]


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
      every device;
    * the small replicated leaves of a dtype (at most ``GROUP_MAX`` coordinates,
      no mesh axis in their spec) are drawn as one vector, as on one device
      (``_snap_small``): device ``d`` draws the ``d``-th of ``D`` equal ranges of
      their concatenation (padded to whole pieces), and the ranges are
      all-gathered. One program for all of them, not one per leaf (GPT-2-small's
      96 LoRA adapters beside 4 split 768 x 3072 leaves, 4 forced CPU devices:
      the noise stage compiles in 5.8 s, 40.4 s leaf by leaf, and draws in the
      same time; ``benchmarks/mesh_noise_compile.py``).

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

    def replicates(self, spec: P) -> bool:
        """Whether a leaf laid out as ``spec`` is whole on every device (no mesh axis)."""
        return all(entry is None for entry in tuple(spec))

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
            words_of = _words_by_index(k, index_of)
            flat = _snap_flat(shard.reshape(-1), stddev, words_of, chunk_size(shard.size), k[0])
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
            words_of = _words_by_index(k, lambda pos: _as_index(start + pos))
            drawn = _snap_flat(mine, stddev, words_of, chunk_size(part), k[0])
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

    def draw_group(
        self, flat: jax.Array, table: jax.Array, starts: np.ndarray, stddev: float
    ) -> jax.Array:
        """``_snap_small``'s draw over the mesh: ``flat`` (small replicated leaves
        concatenated, each drawn with its key words ``table[j]`` from ``starts[j]``,
        ``_group_words``) padded to ``D`` equal ranges of whole pieces; device ``d``
        draws the ``d``-th, the ranges are all-gathered and the padding dropped."""
        n = flat.shape[0]
        devices = self.mesh.shape[self.axis]
        pieces, chunk = _whole_pieces(-(-n // devices))
        part = pieces * chunk
        axis = self.axis

        def body(table, whole):
            start = jax.lax.axis_index(axis) * part
            mine = jax.lax.dynamic_slice(whole, (start,), (part,))
            words_of = _group_words(table, starts)
            drawn = _snap_flat(mine, stddev, lambda pos: words_of(start + pos), chunk, table[0, 0])
            return jax.lax.all_gather(drawn, axis, tiled=True)

        padded = jnp.pad(flat, (0, part * devices - n))
        # all-gathered: the same on every device (see _draw_replicated)
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False
        )(table, padded)[:n]
