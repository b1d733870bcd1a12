"""A data-parallel mesh for the private step, on one host or several.

With a ``DataParallelMesh`` every step's padded batch (or each physical chunk
of it) is split over the one axis ``"data"`` of a ``jax.sharding.Mesh``::

    on each device (shard_map):  out   = private_grad(...)(params, its rows,
                                                       static scale, its padding)
                                 grads = psum(out.grads, "data")   # accumulate dtype
    noise (dpmp.NoiseSharding):  each device draws its part from the step's key
                                 (the values one device would draw), gathered
    replicated (jit):            optax update, loss scale adjusted from the
                                 global overflow count

Every device clips its own examples (``private_grad`` makes the replicated
parameters vary over the axis, so no per-example gradient is summed across
devices before it is clipped); the clipped sums meet in one float32 (the
accumulate dtype) all-reduce, which the precision audit reads as its
``all_reduce`` site. That all-reduce adds in whatever order XLA picks; the
step's sensitivity counts each device's sum as one of the partial sums whose
float32 addition it bounds (``PrivateGradFn.sensitivity(parts=...)``).

With sharded parameters (``param_specs``, ``state_shardings``) each device
gathers the whole parameters for its passes, so every per-example norm is
complete before it is clipped, and the clipped sums are reduce-scattered
(``psum_scatter``) to the devices that own them; noise and update run on the
shards.

Several processes (``jax.distributed``): ``put`` places process 0's value on
every process, ``put_batch`` builds each step's global batch from the
processes' local rows, ``local`` reads a value of the mesh back whole on this
process.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpmp.clipping._private_grad import combine_stats

__all__ = ["AXIS", "DataParallelMesh", "local", "on_this_process"]

AXIS = "data"


class DataParallelMesh:
    """A data-parallel mesh over ``devices``: one axis, ``"data"``, that every
    step's padded batch (or each physical chunk of it) is split over.

    Args:
      devices: the devices, ``jax.devices()[:n]`` say (on CPU,
        ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` makes N); in a
        run of several processes, every device of every process.
    """

    def __init__(self, devices: list[Any]):
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.size = len(self.devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(AXIS))

    def summed(self, grad_fn, specs: Any = None, frozen: int = 0):
        """``sum_fn(params, batch, pad, scale, *frozen) -> (grads, stats)``, with
        ``frozen`` trailing arguments (frozen arrays, replicated on every device,
        given to ``grad_fn`` after the batch): each device clips its
        rows, the clipped sums are all-reduced (in their own dtype, the accumulate
        dtype), the statistics of the devices combined. ``scale`` must be static over
        the step (its adjustment needs the global overflow count).

        With ``specs`` (``param_specs``: sharded parameters) each device first
        gathers the whole parameters, so that it computes every per-example
        gradient, and so every per-example norm, in full before clipping; the
        clipped sums are then reduce-scattered (``psum_scatter``, accumulate dtype),
        each device keeping the shard it owns."""

        def gather(params):
            if specs is None:
                return params
            return jax.tree.map(_gathered, params, specs, is_leaf=_is_spec)

        def reduce(grads):
            if specs is None:
                return jax.tree.map(lambda g: jax.lax.psum(g, AXIS), grads)
            return jax.tree.map(_scattered, grads, specs, is_leaf=_is_spec)

        def per_device(params, batch, pad, scale, *fixed):
            out = grad_fn(gather(params), batch, *fixed, loss_scale=scale, is_padding_example=pad)
            return reduce(out.grads), jax.tree.map(lambda s: s[None], out.stats)

        sharded = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P() if specs is None else specs, P(AXIS), P(AXIS), P()) + (P(),) * frozen,
            out_specs=(P() if specs is None else specs, P(AXIS)),
        )

        def sum_fn(params, batch, pad, scale, *fixed):
            grads, stacked = sharded(params, batch, pad, scale, *fixed)
            return grads, combine_stats(stacked)

        return sum_fn

    def param_specs(self, shapes: Any) -> Any:
        """Where each parameter lives when they are sharded (FSDP): split over the
        devices along its largest dimension they divide; replicated if none does."""

        def spec(leaf):
            dims = [d for d, n in enumerate(leaf.shape) if n % self.size == 0]
            if not dims:
                return P()
            d = max(dims, key=lambda d: leaf.shape[d])
            return P(*([None] * d), AXIS)

        return jax.tree.map(spec, shapes)

    def state_shardings(self, state: dict[str, Any], specs: Any = None) -> dict[str, Any]:
        """The sharding of every leaf of a run's state: replicated, or with ``specs``
        (``param_specs``) the parameters sharded, every optimizer slot of a
        parameter's shape (Adam's moments) sharded as that parameter is, and every
        stack of such slots (a correlated stream's ring buffers, ``[b - 1, *shape]``)
        sharded as it along the parameter's axes: each device keeps its rows."""
        if specs is None:
            return jax.tree.map(lambda _: self.replicated, state)
        by_shape: dict[tuple, P] = {}
        for leaf, spec in zip(
            jax.tree.leaves(state["params"]), jax.tree.leaves(specs, is_leaf=_is_spec)
        ):
            by_shape.setdefault(tuple(leaf.shape), spec)

        def slot_spec(shape: tuple) -> P:
            if shape in by_shape:
                return by_shape[shape]
            if len(shape) > 1 and shape[1:] in by_shape:  # a stack of slots
                return P(None, *by_shape[shape[1:]])
            return P()

        named = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        out = jax.tree.map(lambda _: self.replicated, state)
        out["params"] = jax.tree.map(named, specs, is_leaf=_is_spec)
        out["opt_state"] = jax.tree.map(
            lambda a: named(slot_spec(tuple(jnp.shape(a)))), state["opt_state"]
        )
        return out

    def put(self, tree: Any, shardings: Any = None) -> Any:
        """``tree`` on the devices of the mesh (replicated, or as ``shardings`` says):
        process 0's value, on every process (a state each process built or read for
        itself must not diverge)."""
        tree = _from_primary(tree)
        if shardings is None:
            return jax.tree.map(lambda a: _global(a, self.replicated), tree)
        return jax.tree.map(_global, tree, shardings)

    def put_batch(self, read_rows, size: int, chunk: int | None = None) -> tuple[Any, Any]:
        """The step's global ``(batch, pad)`` of ``size`` rows, split over the mesh;
        ``read_rows(start, stop)`` reads rows ``[start, stop)`` of it as ``(batch,
        pad)`` numpy arrays. Each process reads only the rows its devices hold.

        With physical chunks of ``chunk`` rows the arrays are ``[size // chunk,
        chunk, ...]``, each chunk split over the devices (``chunks`` yields them)."""
        chunk = size if chunk is None else chunk
        index = self.split.addressable_devices_indices_map((chunk,))
        start = min(s[0].start or 0 for s in index.values())
        stop = max(chunk if s[0].stop is None else s[0].stop for s in index.values())
        parts = [read_rows(c + start, c + stop) for c in range(0, size, chunk)]
        batch, pad = jax.tree.map(lambda *p: np.stack(p), *parts)

        def place(a):  # [chunks, local rows, ...] -> [chunks, chunk, ...] over the mesh
            lead = (a.shape[0],) if chunk < size else ()
            a = a if lead else a[0]
            spec = P(*([None] * len(lead)), AXIS, *([None] * (a.ndim - len(lead) - 1)))
            shape = (*lead, chunk, *a.shape[len(lead) + 1 :])
            return jax.make_array_from_process_local_data(NamedSharding(self.mesh, spec), a, shape)

        return jax.tree.map(place, batch), place(pad)

    @staticmethod
    def chunks(batch: Any, pad: Any):
        """The physical chunks of a batch ``put_batch`` made (``[chunks, chunk, ...]``)."""
        for c in range(pad.shape[0]):
            yield jax.tree.map(lambda v, c=c: v[c], batch), pad[c]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _axis_dim(spec: P) -> int | None:
    return None if AXIS not in spec else tuple(spec).index(AXIS)


def _gathered(shard: jax.Array, spec: P) -> jax.Array:
    d = _axis_dim(spec)
    return shard if d is None else jax.lax.all_gather(shard, AXIS, axis=d, tiled=True)


def _scattered(grad: jax.Array, spec: P) -> jax.Array:
    d = _axis_dim(spec)
    if d is None:
        return jax.lax.psum(grad, AXIS)
    return jax.lax.psum_scatter(grad, AXIS, scatter_dimension=d, tiled=True)


def _unwrapped(a: Any) -> tuple[Any, Any]:
    """``(array, impl)``: a PRNG key array as its key data and its implementation
    (``_rewrapped`` makes it a key again); any other value as itself and None."""
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(a), jax.random.key_impl(a)
    return a, None


def _rewrapped(data: Any, impl: Any) -> Any:
    return data if impl is None else jax.random.wrap_key_data(data, impl=impl)


def _global(a: Any, sharding: NamedSharding) -> jax.Array:
    """``a`` (the same on every process) as one array over ``sharding``'s devices."""
    data, impl = _unwrapped(a)
    data = np.asarray(data)
    placed = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    return _rewrapped(placed, impl)


def _from_primary(tree: Any) -> Any:
    """Process 0's ``tree`` (numpy arrays; PRNG keys stay keys) on every process."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    unwrapped = [_unwrapped(a) for a in leaves]
    sent = multihost_utils.broadcast_one_to_all([_whole(data) for data, _ in unwrapped])
    out = [_rewrapped(np.asarray(r), impl) for r, (_, impl) in zip(sent, unwrapped)]
    return jax.tree.unflatten(treedef, out)


def on_this_process(tree: Any) -> Any:
    """``tree`` as a jitted function of this process alone can take it: unchanged in
    a one-process run (its devices are all here), else gathered whole (``local``:
    every process must call this on the same tree)."""
    return tree if jax.process_count() == 1 else local(tree)


def local(tree: Any) -> Any:
    """A value of the mesh, whole, on this process: numpy arrays (PRNG keys stay
    keys). Sharded arrays of several processes are gathered: every process must
    call this on the same tree."""

    def read(a):
        data, impl = _unwrapped(a)
        return _rewrapped(_whole(data), impl)

    return jax.tree.map(read, tree)


def _whole(a: Any) -> np.ndarray:
    """An array (not a key) of the mesh as one numpy array on this process."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        if a.is_fully_replicated:
            return np.asarray(a.addressable_data(0))
        from jax.experimental import multihost_utils

        # a collective: every process must read the same tree at the same time
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)
