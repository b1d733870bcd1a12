"""The devices of a run: which mesh it uses, and the glue of several processes.

``make_mesh(config)`` is the ``dpmp.step.DataParallelMesh`` of
``training.devices`` (None on one device); what a step does on it is said in
``dpmp.step``. Poisson sampling stays one global draw: every process runs the
same sampler (same secret seed), and each reads only the rows its devices hold.

Several processes (``jax.distributed``): ``initialize`` joins them;
``shared_keys`` hands every process process 0's secret keys, so the noise and
the batches are the same everywhere; ``same_everywhere`` refuses processes that
disagree; ``primary_first`` lets process 0 do shared work first. Process 0
alone writes the run directory.
"""

from __future__ import annotations

import jax
import numpy as np

from dpmp.app.config import Config, ConfigError
from dpmp.noise._entropy import SEED_BITS
from dpmp.step._mesh import AXIS, DataParallelMesh, _from_primary, local, on_this_process

__all__ = [
    "AXIS",
    "DataParallelMesh",
    "initialize",
    "is_primary",
    "local",
    "make_mesh",
    "on_this_process",
    "primary_first",
    "same_everywhere",
    "shared_keys",
]


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


def make_mesh(config: Config) -> DataParallelMesh | None:
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
    return DataParallelMesh(every[:n])


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
