"""The devices of a run: a data-parallel mesh, on one host or several.

With ``training.devices`` above 1 (or ``"all"``), every step's padded batch
(or each physical chunk of it) is split over the one axis ``"data"`` of a
``jax.sharding.Mesh``::

    on each device (shard_map):  out   = private_grad(...)(params, its rows,
                                                       static scale, its padding)
                                 grads = psum(out.grads, "data")   # accumulate dtype
    noise (dpmp.NoiseSharding):  each device draws its part from the run's key
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
Parameters and optimizer state stay replicated. Poisson sampling stays one
global draw: every process runs the same sampler (same
secret seed), and each reads only the rows its devices hold.

With ``training.shard_params`` the parameters and optimizer state are sharded
instead (``param_specs``, ``state_shardings``): each device gathers the whole
parameters for its passes, so every per-example norm is complete before it is
clipped, and the clipped sums are reduce-scattered (``psum_scatter``) to the
devices that own them; noise and update run on the shards.

Several processes (``jax.distributed``): ``initialize`` joins them;
``shared_keys`` hands every process process 0's secret keys, so the noise and
the batches are the same everywhere; ``put_batch`` builds each step's global
batch from the processes' local rows; ``local`` reads a value of the mesh back
whole on this process. Process 0 alone writes the run directory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dpmp.app.config import Config, ConfigError
from dpmp.clipping._private_grad import combine_stats
from dpmp.noise._entropy import SEED_BITS

__all__ = [
    "AXIS",
    "RunMesh",
    "initialize",
    "is_primary",
    "local",
    "make_mesh",
    "on_this_process",
    "primary_first",
    "same_everywhere",
    "shared_keys",
]

AXIS = "data"


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    named: str = "coordinator, num_processes and process_id",
) -> None:
    """Joins this process to a multi-process run (``jax.distributed.initialize``).

    What is not given JAX reads from the environment: a cluster it recognises
    (SLURM, Open MPI, mpi4py, Kubernetes, Cloud TPU) and
    ``JAX_COORDINATOR_ADDRESS``. On CPU the processes' collectives run over gloo.
    Must come before anything else uses JAX.

    Raises:
      ValueError: what is missing, naming the arguments that give it (``named``:
        how the caller names them).
    """
    # the CPU backend's collectives across processes (GPU and TPU have their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    except (ValueError, TypeError) as e:  # JAX names its own arguments
        raise ValueError(
            f"joining the processes: {e} (give {named}, or run under a cluster JAX "
            "recognises: SLURM, Open MPI, mpi4py, Kubernetes, Cloud TPU)"
        ) from None


def is_primary() -> bool:
    """Whether this process writes the run directory (process 0)."""
    return jax.process_index() == 0


class RunMesh:
    """The run's data-parallel mesh over ``devices`` (one axis, ``"data"``)."""

    def __init__(self, devices: list[Any]):
        self.devices = list(devices)
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.size = len(self.devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.split = NamedSharding(self.mesh, P(AXIS))

    def summed(self, grad_fn, specs: Any = None):
        """``sum_fn(params, batch, pad, scale) -> (grads, stats)``: each device clips its
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

        def per_device(params, batch, pad, scale):
            out = grad_fn(gather(params), batch, loss_scale=scale, is_padding_example=pad)
            return reduce(out.grads), jax.tree.map(lambda s: s[None], out.stats)

        sharded = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P() if specs is None else specs, P(AXIS), P(AXIS), P()),
            out_specs=(P() if specs is None else specs, P(AXIS)),
        )

        def sum_fn(params, batch, pad, scale):
            grads, stacked = sharded(params, batch, pad, scale)
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
        (``param_specs``) the parameters sharded, and every optimizer slot of a
        parameter's shape (Adam's moments) sharded as that parameter is."""
        if specs is None:
            return jax.tree.map(lambda _: self.replicated, state)
        by_shape = {}
        for leaf, spec in zip(
            jax.tree.leaves(state["params"]), jax.tree.leaves(specs, is_leaf=_is_spec)
        ):
            by_shape.setdefault(tuple(leaf.shape), spec)
        named = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        out = jax.tree.map(lambda _: self.replicated, state)
        out["params"] = jax.tree.map(named, specs, is_leaf=_is_spec)
        out["opt_state"] = jax.tree.map(
            lambda a: named(by_shape.get(tuple(jnp.shape(a)), P())), state["opt_state"]
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


def same_everywhere(value: int | str, what: str) -> None:
    """Every process of a multi-process run must hold the same ``value`` (an int32,
    or text compared by 31 bits of its sha256): a clear error on every process rather than
    processes that train on different things, or wait on each other forever."""
    if jax.process_count() == 1:
        return
    import hashlib

    from jax.experimental import multihost_utils

    if isinstance(value, str):  # 31 bits: JAX gathers int32 unless x64 is enabled
        value = int.from_bytes(hashlib.sha256(value.encode()).digest()[:4], "little") >> 1
    try:
        multihost_utils.assert_equal(np.int32(value), what)
    except AssertionError:
        raise ValueError(
            f"processes disagree on {what} (process {jax.process_index()} of {jax.process_count()})"
        ) from None


def primary_first(work):
    """``work()`` on process 0, then on the others (which may reuse what it wrote in
    the shared run directory); just ``work()`` in a one-process run."""
    if jax.process_count() == 1:
        return work()
    from jax.experimental import multihost_utils

    if is_primary():
        done = work()
        multihost_utils.sync_global_devices("dpmp: process 0 first")
        return done
    multihost_utils.sync_global_devices("dpmp: process 0 first")
    return work()


def make_mesh(config: Config) -> RunMesh | None:
    """The run's mesh, or None for one device in one process (no mesh at all)."""
    wanted = config.training.devices
    every = jax.devices()
    if wanted == "all":
        n = len(every)
    else:
        n = int(wanted)
        if jax.process_count() > 1 and n != len(every):
            raise ConfigError(
                f"training.devices: {n}; a run of {jax.process_count()} processes uses every "
                f'device of every process ({len(every)}): set it to "all"'
            )
        if n > len(every):
            hint = (
                " (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices)"
                if every[0].platform == "cpu"
                else ""
            )
            raise ConfigError(
                f"training.devices: {n}, but JAX sees {len(every)} "
                f"{every[0].platform} device(s){hint}"
            )
    if n == 1 and jax.process_count() == 1:
        return None
    return RunMesh(every[:n])


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


def shared_keys(keys):
    """Process 0's secret ``RunKeys`` on every process (each process draws its own
    from the OS; only one set may be used). Unchanged in a one-process run."""
    if jax.process_count() == 1:
        return keys
    words = SEED_BITS // 32
    seeds = [
        (s >> (32 * i)) & 0xFFFFFFFF
        for s in (keys.sampler_seed, keys.standardize_seed)
        for i in range(words)
    ]
    shared = _from_primary(
        {"noise": keys.noise, "scale": keys.loss_scale, "seeds": np.array(seeds, np.uint32)}
    )
    s = [int(x) for x in shared["seeds"]]
    return type(keys)(
        noise=shared["noise"],
        loss_scale=shared["scale"],
        sampler_seed=_join(s[:words]),
        standardize_seed=_join(s[words:]),
        reproducible=keys.reproducible,
    )


def _join(words: list[int]) -> int:
    return sum(w << (32 * i) for i, w in enumerate(words))
