"""What banded matrix factorization costs beside DP-SGD: the private step's compiled
memory (state and total, bytes per parameter) and, where it fits, its time.

For each MLP (784 inputs, ReLU layers, 10 classes; a 2.9M-parameter one and a
104M-parameter one) this builds dpmp's default private step (Adam, snapped noise,
bf16 policy, the state donated) from the parameters' shapes, once with
independent noise (DP-SGD) and once with a banded strategy of ``--bands`` bands
(``privacy.mechanism = "banded_mf"``; the coefficients do not change the cost:
jax-privacy's max-error ones, normalised), and prints XLA's ``memory_analysis``
per parameter: the optimizer state (noise key, Adam's moments, and the banded
stream's two ring buffers of ``b - 1`` float32 vectors and the previous step's
sum and output), the arguments and the total the step holds at once. For the
small model it also runs both steps, in turns (one call of each per round, so
that a slow spell of a shared machine falls on both), and reports each one's
median of ``--repeats`` calls and their ratio, with the machine's load average
when they ran.

    python benchmarks/banded_mf.py --json benchmarks/results/cpu_2core_banded_mf.json
    python benchmarks/banded_mf.py --quick        # a small model: a smoke run

With ``--rmse`` it instead tables the expected error at equal epsilon: jax-privacy's
optimised strategy for ``--steps`` steps and ``--bands`` bands (and how long it
takes to optimise and evaluate), the noise multipliers calibrated for banded MF
(b-cyclic Poisson, ``expected batch / (n // b)``) and DP-SGD (Poisson,
``expected batch / n``) at each epsilon, and the RMSE of the prefix sums in units
of the sum's sensitivity (``BandedMF.prefix_rmse`` times sigma; DP-SGD's
``sqrt((steps + 1) / 2)`` times sigma).

    python benchmarks/banded_mf.py --rmse --json benchmarks/results/cpu_2core_banded_mf_rmse.json

With ``--stream`` it times the noise alone on the small model's parameters, each
compiled with its state donated and all taking turns: DP-SGD's snapped draw (in
float32) and the banded stream at 1 band (no ring: the snapped draw of a float64
query, and the decoding), 2 bands and ``--bands`` bands (where the step's extra
time goes).

    python benchmarks/banded_mf.py --stream --json benchmarks/results/cpu_2core_banded_mf_noise.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _mlp import mlp_loss, mlp_shapes  # benchmarks/_mlp.py

import dpmp
from dpmp.noise._banded_mf import BandedMF

# (name, hidden widths, batch, timed)
MODELS = (
    ("mlp 784-1024x3-10", (1024,) * 3, 256, True),
    ("mlp 784-4096x7-10", (4096,) * 7, 64, False),
)
QUICK = (("mlp 784-64x2-10", (64,) * 2, 16, True),)


def strategy(steps: int, bands: int) -> BandedMF | None:
    """A banded strategy of ``bands`` bands (None for 0: DP-SGD)."""
    if not bands:
        return None
    k = np.arange(bands)
    coefs = np.cumprod(np.where(k == 0, 1.0, (2 * k - 1) / np.maximum(2 * k, 1)))
    coefs = (coefs / np.linalg.norm(coefs)).astype(np.float32)
    return BandedMF(steps=steps, coefs=tuple(float(c) for c in coefs))


def build(hidden, batch: int, policy: str, mf: BandedMF | None):
    params, data = mlp_shapes(hidden, batch)
    grad_fn = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy=policy)
    return dpmp.private_step(
        grad_fn,
        optax.adam(1e-3),
        params=params,
        batch=data,
        noise_multiplier=1.0,
        noise_key=jax.random.key(0),
        expected_batch_size=batch,
        padded_batch_size=batch,
        donate=True,
        strategy=mf,
    )


def memory(step, hidden, batch: int) -> dict:
    """``memory_analysis`` of the compiled step and the optimizer state, in bytes."""
    params, data = mlp_shapes(hidden, batch)
    opt_state = jax.eval_shape(step.optimizer.init, params)
    pad = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    args = (params, data, pad, opt_state, dpmp.NoOpLossScale())
    t0 = time.perf_counter()
    m = step.step_fn.lower(*args).compile().memory_analysis()
    out = {
        "compile_s": time.perf_counter() - t0,
        "state": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state)),
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
    }
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def step_times(steps: dict, hidden, batch: int, repeats: int) -> dict[str, float]:
    """Median seconds of one call of each step, run on zeros (after one warm-up call
    each); the steps take turns, one call of each per round."""
    params, data = mlp_shapes(hidden, batch)
    zeros = lambda s: jnp.zeros(s.shape, s.dtype)  # noqa: E731
    batch_arrays = jax.tree.map(zeros, data)
    pad = jnp.zeros((batch,), jnp.bool_)
    states = {}
    for label, step in steps.items():
        states[label], _ = step(step.init(jax.tree.map(zeros, params)), batch_arrays, pad)
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(repeats):
        for label, step in steps.items():
            t0 = time.perf_counter()
            states[label], stats = step(states[label], batch_arrays, pad)
            jax.block_until_ready((states[label], stats))
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(t) for label, t in times.items()}


def stream_times(hidden, bands: int, policy: str, repeats: int) -> dict:
    """Median seconds of the noise alone (see the docstring), in turns."""
    from dpmp.noise._noise import gaussian_privatizer

    params, _ = mlp_shapes(hidden, 1)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    noises = {"dpsgd": gaussian_privatizer(stddev=1.0, prng_key=0, policy=policy)}
    for b in sorted({1, 2, bands}):
        noises[f"banded_{b}"] = strategy(2000, b).privatizer(stddev=1.0, prng_key=0, policy=policy)
    calls = {name: jax.jit(priv.update, donate_argnums=1) for name, priv in noises.items()}
    states = {name: priv.init(zeros) for name, priv in noises.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats + 1):  # the first round warms up
        for name, update in calls.items():
            t0 = time.perf_counter()
            x, states[name] = update(zeros, states[name])
            jax.block_until_ready((x, states[name]))
            if round_:
                times[name].append(time.perf_counter() - t0)
    n = sum(math.prod(s.shape) for s in jax.tree.leaves(params))
    out = {"params": n, "policy": policy, "load": os.getloadavg()[0]}
    out["seconds"] = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps(out))
    return out


def rmse_table(steps: int, bands: int, num_examples: int, batch: int, delta: float) -> dict:
    """The expected error of banded MF and DP-SGD at equal epsilon (see the docstring)."""
    import dpmp.accounting as accounting
    from dpmp.noise._mechanisms import dpsgd_prefix_rmse

    t0 = time.perf_counter()
    mf = BandedMF.optimized(steps, bands)
    optimize_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    per = mf.prefix_rmse()
    out = {
        "steps": steps,
        "bands": bands,
        "num_examples": num_examples,
        "expected_batch_size": batch,
        "delta": delta,
        "optimize_s": optimize_s,
        "prefix_rmse_s": time.perf_counter() - t0,
        "prefix_rmse_per_stddev": per,
        "dpsgd_prefix_rmse_per_stddev": dpsgd_prefix_rmse(steps),
        "rows": [],
    }
    for eps in (1.0, 3.0, 8.0):
        common = dict(target_epsilon=eps, steps=steps, delta=delta, noised_coordinates=None)
        q_mf = batch / (num_examples // bands)
        s_mf = accounting.calibrate_noise_multiplier(sampling_prob=q_mf, bands=bands, **common)
        s_dp = accounting.calibrate_noise_multiplier(sampling_prob=batch / num_examples, **common)
        row = {
            "epsilon": eps,
            "sigma_banded_mf": s_mf,
            "sigma_dpsgd": s_dp,
            "rmse_banded_mf": s_mf * per,
            "rmse_dpsgd": s_dp * dpsgd_prefix_rmse(steps),
        }
        row["rmse_ratio"] = row["rmse_banded_mf"] / row["rmse_dpsgd"]
        print(json.dumps(row))
        out["rows"].append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bands", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2000, help="the strategy's steps")
    ap.add_argument("--policy", default="bf16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="a small model only")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rmse", action="store_true", help="the error table instead")
    ap.add_argument("--stream", action="store_true", help="the noise alone, timed")
    ap.add_argument("--examples", type=int, default=60000, help="--rmse: n")
    ap.add_argument("--batch", type=int, default=512, help="--rmse: expected batch")
    args = ap.parse_args(argv)
    if args.rmse or args.stream:
        if args.rmse:
            out = rmse_table(args.steps, args.bands, args.examples, args.batch, 1e-5)
        else:
            out = stream_times(MODELS[0][1], args.bands, args.policy, args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    device = jax.devices()[0]
    out = {
        "device": f"{device.platform} {device.device_kind}",
        "jax": jax.__version__,
        "bands": args.bands,
        "policy": args.policy,
        "rows": [],
    }
    print(f"{out['device']}, jax {jax.__version__}; bytes per parameter, {args.bands} bands")
    for name, hidden, batch, timed in QUICK if args.quick else MODELS:
        n = sum(math.prod(s.shape) for s in jax.tree.leaves(mlp_shapes(hidden, batch)[0]))
        row = {"model": name, "params": n, "batch": batch}
        steps = {}
        for label, bands in (("dpsgd", 0), ("banded_mf", args.bands)):
            steps[label] = build(hidden, batch, args.policy, strategy(args.steps, bands))
            mem = row[label] = memory(steps[label], hidden, batch)
            print(
                f"{name:20} {n:12,} {label:10} state {mem['state'] / n:6.2f} "
                f"args {mem['arguments'] / n:6.2f} temp {mem['temporaries'] / n:6.2f} "
                f"total {mem['total'] / n:6.2f} compile {mem['compile_s']:.1f} s"
            )
        row["state_extra_bytes_per_param"] = (row["banded_mf"]["state"] - row["dpsgd"]["state"]) / n
        row["total_ratio"] = row["banded_mf"]["total"] / row["dpsgd"]["total"]
        if timed:
            row["load_before"] = os.getloadavg()[0]
            for label, seconds in step_times(steps, hidden, batch, args.repeats).items():
                row[label]["step_s"] = seconds
            row["load_after"] = os.getloadavg()[0]
            row["step_ratio"] = row["banded_mf"]["step_s"] / row["dpsgd"]["step_s"]
            print(
                f"{name:20} step {row['dpsgd']['step_s'] * 1e3:.1f} ms (DP-SGD), "
                f"{row['banded_mf']['step_s'] * 1e3:.1f} ms (banded): {row['step_ratio']:.2f}x "
                f"(load {row['load_before']:.1f} to {row['load_after']:.1f})"
            )
        out["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
