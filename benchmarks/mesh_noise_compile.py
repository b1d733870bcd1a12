"""The compile time of the snapped noise stage on a mesh: small leaves drawn
together against leaf by leaf, side by side in one process.

The tree is a GPT-2-small LoRA's adapters (``--adapters`` replicated float32
leaves, half 768 x 8, half 8 x 768) beside ``--large`` leaves of 768 x 3072
split over the mesh (alternately along either axis). The noise stage alone
(``dpmp.noise._snapped._snap_tree`` with a ``NoiseSharding``, jitted) is lowered
and compiled two ways: as dpmp draws it (the small replicated leaves of a dtype
as one vector over the mesh, ``GROUP_MAX``) and leaf by leaf (``GROUP_MAX = 0``:
each leaf its own draw over the mesh, as before the small leaves were drawn
together there). Each is compiled ``--rounds`` times from cold caches, in turns;
the least wall time of lowering and of compiling, and the least process CPU time
of both, are kept (a shared machine moves one compile by 2-3x). Then each
compiled function runs ``--calls`` times in turns (median wall time), and the two
draws are checked to be the same bits. Prints JSON (``--json`` writes it too).

Run on CPU with forced devices (the script asks for 4 if ``XLA_FLAGS`` is unset)::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/mesh_noise_compile.py \\
        --json benchmarks/results/mesh_noise_compile.json

(the forced devices share the host's cores: the times say nothing of a real
mesh's speed, only of the two programs against each other).
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _compiled import timed_compile  # noqa: E402  (benchmarks/_compiled.py)
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dpmp  # noqa: E402
from dpmp.noise import _snapped  # noqa: E402

STDDEV = 0.5


def tree_and_specs(adapters: int, large: int) -> tuple[dict, dict]:
    """The adapters (replicated) and the large leaves (split over ``"data"``)."""
    tree, specs = {}, {}
    for i in range(adapters):
        shape = (768, 8) if i % 2 == 0 else (8, 768)
        tree[f"adapter_{i:03d}"] = jnp.full(shape, 0.01 * i, jnp.float32)
        specs[f"adapter_{i:03d}"] = P()
    for i in range(large):
        tree[f"large_{i}"] = jnp.full((768, 3072), 0.1 * i, jnp.float32)
        specs[f"large_{i}"] = P(None, "data") if i % 2 == 0 else P("data", None)
    return tree, specs


@contextlib.contextmanager
def group_max(value: int):
    """``_snapped.GROUP_MAX`` set to ``value`` while tracing."""
    saved = _snapped.GROUP_MAX
    _snapped.GROUP_MAX = value
    try:
        yield
    finally:
        _snapped.GROUP_MAX = saved


def compile_once(fn, args, limit: int) -> tuple[dict, object]:
    """Lower and compile ``fn(*args)`` from cold caches with ``GROUP_MAX = limit``."""
    jax.clear_caches()
    with group_max(limit):
        lowered, compiled, seconds = timed_compile(fn, args)
    text = lowered.as_text()
    row = {
        "lower_s": seconds["lower_s"],
        "compile_s": seconds["compile_s"],
        "cpu_s": seconds["compile_cpu_s"],
        "hlo_text_mb": round(len(text) / 1e6, 3),
        "samples": text.count("call @snapped_normal_sample"),
    }
    return row, compiled


def ratio(rows: dict, field: str) -> float:
    """Leaf by leaf against together."""
    return round(rows["leaf_by_leaf"][field] / rows["together"][field], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=96)
    parser.add_argument("--large", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=21)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    devices = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tree, specs = tree_and_specs(args.adapters, args.large)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)
    sharding = dpmp.NoiseSharding(mesh, "data", specs)
    fn = jax.jit(lambda k, t: _snapped._snap_tree(k, t, STDDEV, sharding))
    key = jax.random.key(0)
    ways = {"together": _snapped.GROUP_MAX, "leaf_by_leaf": 0}

    rows: dict[str, dict] = {}
    compiled: dict[str, object] = {}
    for _ in range(args.rounds):
        for name, limit in ways.items():
            row, compiled[name] = compile_once(fn, (key, placed), limit)
            best = rows.setdefault(name, row)
            for field in ("lower_s", "compile_s", "cpu_s"):
                best[field] = min(best[field], row[field])
    times: dict[str, list[float]] = {name: [] for name in ways}
    outs = {}
    for _ in range(args.calls):
        for name in ways:
            tic = time.perf_counter()
            outs[name] = jax.block_until_ready(compiled[name](key, placed))
            times[name].append(time.perf_counter() - tic)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(outs["together"]), jax.tree.leaves(outs["leaf_by_leaf"]))
    )
    for name in ways:
        row = rows[name]
        for field in ("lower_s", "compile_s", "cpu_s"):
            row[field] = round(row[field], 2)
        row["draw_ms"] = round(1e3 * statistics.median(times[name][1:] or times[name]), 1)
    result = {
        "devices": devices,
        "adapters": args.adapters,
        "large": args.large,
        "coordinates": int(sum(x.size for x in jax.tree.leaves(tree))),
        "rounds": args.rounds,
        "calls": args.calls,
        "same_bits": same,
        "together": rows["together"],
        "leaf_by_leaf": rows["leaf_by_leaf"],
        "compile_ratio": ratio(rows, "compile_s"),
        "cpu_ratio": ratio(rows, "cpu_s"),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "jax": jax.__version__,
        "machine": platform.machine(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
