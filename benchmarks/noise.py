"""Cost of dpmp's snapped Gaussian next to the plain float32 sampler, side by side.

Measures in ONE process, each jitted, the median wall time over ``--repeats``
interleaved samples (a sample is the mean of enough back-to-back calls to last
~0.5 s):

* the noise stage alone, ``dpmp.gaussian_privatizer(sampler="plain")`` (float32
  ``jax.random.normal``, as jax-privacy draws it) against ``sampler="snapped"``
  (the default), on a flat gradient of ``--sizes`` coordinates;
* the whole private step of a config (default: the built-in default run) built
  with ``privacy.noise_sampler`` ``"plain"`` and ``"snapped"``.

It prints the ratios snapped / plain and writes the raw numbers as JSON
(``--json``).

    python benchmarks/noise.py
    python benchmarks/noise.py --sizes 100000 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import dpmp
from dpmp._src.config import load_config
from dpmp._src.trainer import build_private_step

SAMPLERS = ("plain", "snapped")
MIN_SAMPLE_S = 0.5


def _calls_per_sample(fn, args) -> int:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return max(1, min(200, round(MIN_SAMPLE_S / max(time.perf_counter() - t, 1e-6))))


def time_interleaved(fns: dict, args: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, sampled in interleaved rounds."""
    calls = {k: _calls_per_sample(fns[k], args[k]) for k in fns}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls[k]):
                out = fn(*args[k])
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t) / calls[k])
    return {k: statistics.median(v) for k, v in times.items()}


def noise_stage(size: int, repeats: int) -> dict:
    grads = jnp.zeros(size, jnp.float32)
    fns, args = {}, {}
    for sampler in SAMPLERS:
        priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="bf16", sampler=sampler)
        fns[sampler] = jax.jit(priv.update)
        args[sampler] = (grads, priv.init(grads))
    seconds = time_interleaved(fns, args, repeats)
    return {"size": size, "seconds": seconds, "ratio": seconds["snapped"] / seconds["plain"]}


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
        "ratio": seconds["snapped"] / seconds["plain"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[19_210, 1_000_000, 10_000_000])
    ap.add_argument("--config", default=None, help="TOML config of the step (default run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers here")
    args = ap.parse_args(argv)
    out = {
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "noise_stage": [noise_stage(n, args.repeats) for n in args.sizes],
        "private_step": private_step(args.config, args.repeats),
    }
    print(f"{'what':<28} {'plain ms':>10} {'snapped ms':>11} {'snapped/plain':>14}")
    rows = [(f"noise stage, {r['size']:,} coords", r) for r in out["noise_stage"]]
    rows.append((f"private step ({out['private_step']['config']})", out["private_step"]))
    for label, r in rows:
        s = r["seconds"]
        print(
            f"{label:<28} {1e3 * s['plain']:>10.3f} {1e3 * s['snapped']:>11.3f} {r['ratio']:>14.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
