"""What dpmp's snapped Gaussian costs at the sizes models are trained, side by side.

Measures in ONE process:

* **the noise stage** (``dpmp.gaussian_privatizer`` on a flat float32 gradient
  sum of ``--sizes`` coordinates), ``sampler="plain"`` (float32
  ``jax.random.normal``, as jax-privacy draws it) against ``"snapped"`` (the
  default): compiled temporary memory per coordinate
  (``jax.jit(update).lower(...).compile().memory_analysis()``, no run needed)
  and the median wall time per coordinate over ``--repeats`` interleaved samples
  (a sample is the mean of enough back-to-back calls to last ~0.5 s);
* **a whole step's memory**: an MLP of ``--step-params`` parameters (16M and
  100M by default; compiled only, never run), its non-private step (``jax.grad``
  of the mean loss, Adam) against its private step (``dpmp.private_grad`` with
  ghost clipping, the snapped noise, Adam): arguments + outputs + temporaries;
* **the default run's private step** with either sampler (timed);
* **dpmp's ndtri against JAX's** (``--only ndtri``): the snapped draw as it is
  (``dpmp.noise._ndtri.ndtri_lower``, the snap by ``value * (1 / grid)``) against
  the same draw with ``jax.scipy.special.ndtri`` and ``value / grid``, for the
  whole ``snapped_gaussian`` and for the inverse CDF alone on float64 uniforms in
  (0, 1/2], at ``--ndtri-sizes``: median wall time per coordinate over interleaved
  rounds, and compiled temporary bytes; with the load average before and after;
* **the accounted residual**: the epsilon the snapped noise adds to the exact
  Gaussian's (RDP, q 0.01, sigma 1, delta 1e-5), for 1M to 10B parameters and
  1k, 5k and 10k steps, beside the bound that summed every cell's (the
  previous analysis: linear in parameters x steps).

It prints tables and writes the raw numbers as JSON (``--json``).

    python benchmarks/noise.py --json benchmarks/results/cpu_2core_noise.json
    python benchmarks/noise.py --sizes 1000000 --step-params 16000000 --repeats 3
    python benchmarks/noise.py --only ndtri --json benchmarks/results/cpu_2core_ndtri.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import dpmp
from dpmp.app.config import load_config
from dpmp.app.trainer import build_private_step
from dpmp.noise import _snapped
from dpmp.noise._ndtri import ndtri_lower
from dpmp.noise._snapped import CONTRACT

SAMPLERS = ("plain", "snapped")
MIN_SAMPLE_S = 0.5
RESIDUAL_PARAMS = (10**6, 10**7, 10**8, 125 * 10**6, 10**9, 7 * 10**9, 10**10)
RESIDUAL_STEPS = (1_000, 5_000, 10_000)


def _calls_per_sample(fn, args) -> int:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return max(1, min(200, round(MIN_SAMPLE_S / max(time.perf_counter() - t, 1e-6))))


def time_interleaved(fns: dict, args: dict, repeats: int, clock=time.perf_counter) -> dict:
    """Median seconds per call of each function, sampled in interleaved rounds
    (``clock``: wall time, or ``time.process_time`` for the process's CPU time)."""
    calls = {k: _calls_per_sample(fns[k], args[k]) for k in fns}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = clock()
            for _ in range(calls[k]):
                out = fn(*args[k])
            jax.block_until_ready(out)
            times[k].append((clock() - t) / calls[k])
    return {k: statistics.median(v) for k, v in times.items()}


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "total": m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes,
    }


def noise_stage(size: int, repeats: int) -> dict:
    grads = jnp.zeros(size, jnp.float32)
    fns, args, temp = {}, {}, {}
    for sampler in SAMPLERS:
        priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16", sampler=sampler)
        fns[sampler] = jax.jit(priv.update)
        args[sampler] = (grads, priv.init(grads))
        temp[sampler] = _memory(fns[sampler].lower(*args[sampler]).compile())["temp"]
    seconds = time_interleaved(fns, args, repeats)
    return {
        "size": size,
        "seconds": seconds,
        "temp_bytes": temp,
        "ns_per_coordinate": {k: 1e9 * s / size for k, s in seconds.items()},
        "temp_bytes_per_coordinate": {k: b / size for k, b in temp.items()},
        "time_ratio": seconds["snapped"] / seconds["plain"],
    }


def _jax_snap_words(words, value, stddev):
    """``_snapped._snap_words`` with ``jax.scipy.special.ndtri`` and ``value / grid``."""
    grid = _snapped.snap_grid(stddev)
    with jax.enable_x64(True):
        u, negative = _snapped._half_uniform(words)
        z = jax.scipy.special.ndtri(u)
        z = jnp.where(negative, z, -z)
        scaled = value.astype(jnp.float64) / grid
        whole = jnp.round(scaled)
        cells = whole + jnp.round((scaled - whole) + (stddev / grid) * z)
        return (cells * grid).astype(value.dtype)


@contextlib.contextmanager
def _jax_ndtri_draw():
    """Trace ``snapped_gaussian`` with ``_jax_snap_words`` as its per-piece draw (the
    function every piece of ``_snapped._snap_flat`` calls)."""
    own = _snapped._snap_words
    _snapped._snap_words = _jax_snap_words
    try:
        yield
    finally:
        _snapped._snap_words = own


def _draw():
    return lambda key, value: dpmp.snapped_gaussian(key, value, 1.0)


def ndtri_stage(size: int, repeats: int) -> dict:
    """dpmp's ndtri against JAX's: the whole draw and the inverse CDF alone."""
    key = jax.random.key(0)
    value = jnp.zeros(size, jnp.float32)
    with jax.enable_x64(True):
        u = jnp.linspace(0.5, 0.0, size, endpoint=False, dtype=jnp.float64) ** 4 * 8
    fns, args = {}, {}
    with _jax_ndtri_draw():  # a function of its own: jit caches traces by function
        fns["draw_jax"] = jax.jit(_draw()).lower(key, value).compile()
    fns["draw_dpmp"] = jax.jit(_draw()).lower(key, value).compile()
    args["draw_jax"] = args["draw_dpmp"] = (key, value)
    with jax.enable_x64(True):
        fns["ndtri_jax"] = jax.jit(jax.scipy.special.ndtri).lower(u).compile()
        fns["ndtri_dpmp"] = jax.jit(ndtri_lower).lower(u).compile()
    args["ndtri_jax"] = args["ndtri_dpmp"] = (u,)
    temp = {k: f.memory_analysis().temp_size_in_bytes for k, f in fns.items()}
    load = os.getloadavg()
    seconds = time_interleaved(fns, args, repeats)
    cpu = time_interleaved(fns, args, repeats, clock=time.process_time)
    return {
        "size": size,
        "seconds": seconds,
        "ns_per_coordinate": {k: 1e9 * s / size for k, s in seconds.items()},
        "cpu_ns_per_coordinate": {k: 1e9 * s / size for k, s in cpu.items()},
        "temp_bytes": temp,
        "speedup": {
            "draw": seconds["draw_jax"] / seconds["draw_dpmp"],
            "ndtri": seconds["ndtri_jax"] / seconds["ndtri_dpmp"],
        },
        "cpu_speedup": {
            "draw": cpu["draw_jax"] / cpu["draw_dpmp"],
            "ndtri": cpu["ndtri_jax"] / cpu["ndtri_dpmp"],
        },
        "loadavg_before": load,
        "loadavg_after": os.getloadavg(),
    }


def _mlp_widths(params: int) -> tuple[int, ...]:
    """Hidden widths (784 inputs, 10 classes, 4 hidden layers of width w) with about
    ``params`` parameters."""
    # 784 w + 3 w^2 + 10 w ~ params
    w = int((-794 + math.sqrt(794**2 + 12 * params)) / 6)
    return (w,) * 4


def _mlp(widths):
    def init(key):
        sizes = (784, *widths, 10)
        keys = jax.random.split(key, len(sizes) - 1)
        return [
            {
                "w": jax.random.normal(k, (a, b), jnp.float32) / math.sqrt(a),
                "b": jnp.zeros(b, jnp.float32),
            }
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])
        ]

    def loss(params, batch):
        x = batch["x"].astype(jnp.bfloat16)
        for i, layer in enumerate(params):
            x = x @ layer["w"].astype(x.dtype) + layer["b"].astype(x.dtype)
            if i < len(params) - 1:
                x = jax.nn.relu(x)
        logits = x.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return init, loss


def step_memory(params_target: int, batch_size: int) -> dict:
    """Compiled memory of the non-private and the private step of an MLP (no run)."""
    widths = _mlp_widths(params_target)
    init, loss = _mlp(widths)
    params = jax.eval_shape(init, jax.random.key(0))
    count = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
    batch = {
        "x": jax.ShapeDtypeStruct((batch_size, 784), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }
    adam = optax.adam(1e-3)

    def nonprivate(p, state, b):
        grads = jax.grad(loss)(p, b)
        updates, state = adam.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    grad_fn = dpmp.private_grad(loss, l2_clip_norm=1.0, policy="bf16", method="ghost")
    opt = dpmp.private_optimizer(
        adam,
        noise_multiplier=1.0,
        l2_clip_norm=1.0,
        expected_batch_size=batch_size,
        prng_key=0,
        policy="bf16",
    )

    def private(p, state, b):
        out = grad_fn(p, b)
        updates, state = opt.update(out.grads, state, p)
        return optax.apply_updates(p, updates), state

    memory = {}
    for name, fn, o in (("nonprivate", nonprivate, adam), ("private", private, opt)):
        state = jax.eval_shape(o.init, params)
        memory[name] = _memory(jax.jit(fn).lower(params, state, batch).compile())
    return {
        "params": count,
        "widths": list(widths),
        "batch_size": batch_size,
        "policy": "bf16",
        "memory": memory,
        "ratio": memory["private"]["total"] / memory["nonprivate"]["total"],
    }


def private_step(config_path: str | None, repeats: int) -> dict:
    base = load_config(config_path)
    fns, args = {}, {}
    for sampler in SAMPLERS:
        privacy = dataclasses.replace(base.privacy, noise_sampler=sampler, noise_multiplier=1.0)
        step = build_private_step(dataclasses.replace(base, privacy=privacy))
        fns[sampler] = step.step_fn
        args[sampler] = step.example_args
    seconds = time_interleaved(fns, args, repeats)
    return {
        "config": config_path or "default",
        "seconds": seconds,
        "time_ratio": seconds["snapped"] / seconds["plain"],
    }


def residual_table() -> list[dict]:
    """The residual epsilon (total minus exact, RDP) for each size and length."""
    eta = CONTRACT.cell_log_ratio(*CONTRACT.ndtri_rel_error[0])  # one core cell's bound
    rows = []
    for params in RESIDUAL_PARAMS:
        for steps in RESIDUAL_STEPS:
            parts = dpmp.accounting.epsilon(
                noise_multiplier=1.0,
                sampling_prob=0.01,
                steps=steps,
                delta=1e-5,
                accountant="rdp",
                noised_coordinates=params,
                breakdown=True,
            )
            rows.append(
                {
                    "params": params,
                    "steps": steps,
                    "epsilon_exact": parts.dpsgd,
                    "epsilon": parts.total,
                    "residual": parts.noise_residual,
                    "summed_cells_bound": 2 * eta * params * steps,
                }
            )
    return rows


def _print_ndtri(rows: list[dict]) -> None:
    print(f"{'ns/coordinate, wall | CPU':<26} {'JAX ndtri':>15} {'dpmp ndtri':>15} {'speedup':>13}")
    for r in rows:
        ns, cpu, up, cup = (
            r["ns_per_coordinate"],
            r["cpu_ns_per_coordinate"],
            r["speedup"],
            r["cpu_speedup"],
        )
        for part in ("draw", "ndtri"):
            cells = [
                f"{ns[f'{part}_{k}']:6.2f} | {cpu[f'{part}_{k}']:6.2f}" for k in ("jax", "dpmp")
            ]
            print(
                f"{r['size']:>13,} {part:<12} {cells[0]:>15} {cells[1]:>15} "
                f"{up[part]:>5.2f}x|{cup[part]:>5.2f}x"
            )
        temp = ", ".join(f"{k} {b / 2**20:.1f}" for k, b in r["temp_bytes"].items())
        print(f"{'':>14}temp MiB: {temp}")
        load = ", ".join(f"{x:.2f}" for x in r["loadavg_before"] + r["loadavg_after"])
        print(f"{'':>14}load average before, after: {load}")


def _print(out: dict) -> None:
    print(f"{'noise stage':<26} {'plain':>22} {'snapped':>22} {'time ratio':>11}")
    for r in out["noise_stage"]:
        ns, b = r["ns_per_coordinate"], r["temp_bytes_per_coordinate"]
        cells = [f"{ns[k]:6.2f} ns, {b[k]:5.2f} B/coord" for k in SAMPLERS]
        print(
            f"{r['size']:>14,} coordinates {cells[0]:>22} {cells[1]:>22} {r['time_ratio']:>10.2f}x"
        )
    print(f"\n{'step memory (bf16, MiB)':<32} {'non-private':>12} {'private':>12} {'ratio':>7}")
    for r in out["step_memory"]:
        m = r["memory"]
        print(
            f"MLP {r['params']:>13,} params, B {r['batch_size']:<4} "
            f"{m['nonprivate']['total'] / 2**20:>10,.1f} {m['private']['total'] / 2**20:>12,.1f} "
            f"{r['ratio']:>6.2f}x"
        )
    s = out["private_step"]
    print(
        f"\nprivate step ({s['config']}): plain {1e3 * s['seconds']['plain']:.2f} ms, snapped "
        f"{1e3 * s['seconds']['snapped']:.2f} ms, {s['time_ratio']:.2f}x"
    )
    print("\nresidual epsilon (RDP, q 0.01, sigma 1, delta 1e-5); summed per-cell bound")
    for r in out["residual"]:
        print(
            f"{r['params']:>15,} x {r['steps']:>6,} steps: {r['residual']:.3g} "
            f"(summed cells: {r['summed_cells_bound']:.3g})"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**6, 16 * 2**20, 100 * 10**6])
    ap.add_argument(
        "--step-params", type=int, nargs="+", default=[16_000_000, 100_000_000], metavar="N"
    )
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--config", default=None, help="TOML config of the timed step (default run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("all", "ndtri"), default="all", help="run one section")
    ap.add_argument(
        "--ndtri-sizes", type=int, nargs="+", default=[2_900_000, 100_000_000], metavar="N"
    )
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    args = ap.parse_args(argv)
    out = {
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
    }
    if args.only == "ndtri":
        out["ndtri"] = [ndtri_stage(n, args.repeats) for n in args.ndtri_sizes]
        _print_ndtri(out["ndtri"])
        return _write(out, args.json)
    out |= {
        "noise_stage": [noise_stage(n, args.repeats) for n in args.sizes],
        "step_memory": [step_memory(n, args.batch_size) for n in args.step_params],
        "private_step": private_step(args.config, args.repeats),
        "residual": residual_table(),
    }
    _print(out)
    return _write(out, args.json)


def _write(out: dict, path: str | None) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
