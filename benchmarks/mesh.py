"""The default config on a data-parallel mesh against one device, step by step.

Trains the default config (``configs/default.toml``, reproducible keys so that
the runs can be compared) three ways in one process: on 1 device, on
``--devices`` devices (``training.devices``), and on 1 device with the batch
summed in physical chunks of 128 (another float32 summation order, no mesh).
After some steps it records the largest parameter difference to the 1-device
run (and to the chunked one), relative to the largest parameter, so that the
mesh's difference can be read against what reordering the same float32 sum
does on one device. Also the
epsilon of each and the median step time. Then, for a wider MLP (hidden
1024, 1024), the compiled per-device memory of the step with the state
replicated and sharded (``training.shard_params``). Prints JSON.

Run on CPU with forced devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/mesh.py

(the forced devices share the host's cores: the times say nothing of a real
mesh's speed).
"""

import argparse
import json
import platform
import statistics
import time

import jax
import numpy as np

from dpmp.app.config import load_config
from dpmp.app.trainer import build_private_step
from dpmp.app.trainer.mesh import local

CHECKPOINTS = (1, 2, 5, 10, 20, 50, 100, 200, 300)


def train(overrides: list[str], steps: int) -> tuple[list[list[np.ndarray]], float, float]:
    """The parameters after each step in ``CHECKPOINTS``, sigma and the median step time."""
    config = load_config("configs/default.toml", ["privacy.reproducible_noise=true", *overrides])
    step = build_private_step(config)
    s = dict(step.init_state)
    kept, times = [], []
    for t in range(steps):
        batch, pad = step.batch(step.sampler.batch(t))
        tic = time.perf_counter()
        s["params"], s["opt_state"], s["loss_scale"], stats = step.step_fn(
            s["params"], batch, pad, s["opt_state"], s["loss_scale"]
        )
        jax.block_until_ready(s["params"])
        times.append(time.perf_counter() - tic)
        if t + 1 in CHECKPOINTS:
            kept.append([np.asarray(x, np.float64) for x in jax.tree.leaves(local(s["params"]))])
    return kept, step.plan.noise_multiplier, statistics.median(times[1:])


WIDE = ["model.hidden=[1024,1024]"]


def memory(devices: int) -> dict[str, dict[str, float]]:
    """Per-device MB of the compiled step (arguments: parameters, optimizer state
    and the batch; temporaries) with the state replicated and sharded."""
    out = {}
    for name, shard in (("replicated", "false"), ("sharded", "true")):
        overrides = [*WIDE, f"training.devices={devices}", f"training.shard_params={shard}"]
        config = load_config("configs/default.toml", overrides)
        step = build_private_step(config)
        m = step.step_fn.lower(*step.example_args).compile().memory_analysis()
        out[name] = {
            "argument_mb": m.argument_size_in_bytes / 1e6,
            "temp_mb": m.temp_size_in_bytes / 1e6,
        }
    return out


def relative_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    scale = max(float(np.abs(x).max()) for x in a)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args()
    steps = [c for c in CHECKPOINTS if c <= args.steps]
    runs = {
        "one_device": [],
        f"{args.devices}_devices": [f"training.devices={args.devices}"],
        "one_device_chunks_128": ["training.physical_batch_size=128"],
    }
    results = {name: train(extra, args.steps) for name, extra in runs.items()}
    reference = results["one_device"][0]
    chunked = results["one_device_chunks_128"][0]
    out = {
        "device": f"{jax.devices()[0].platform} x {jax.device_count()} ({platform.processor()})",
        "jax": jax.__version__,
        "steps": steps,
        "runs": {
            name: {
                "overrides": runs[name],
                "noise_multiplier": sigma,
                "median_step_s": seconds,
                "max_param_diff_relative": [
                    relative_diff(reference[i], p) for i, p in enumerate(kept)
                ],
                "max_param_diff_relative_to_chunks": [
                    relative_diff(chunked[i], p) for i, p in enumerate(kept)
                ],
            }
            for name, (kept, sigma, seconds) in results.items()
        },
        "memory_per_device_mlp_1024x1024": memory(args.devices),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
