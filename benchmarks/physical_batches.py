"""Logical batches in physical chunks: compiled memory and step time, side by side.

The default config's step (digits MLP) with an expected logical batch of 1024
(Poisson, padded to 1152) in one device call, and in physical chunks of 128:
the compiled temporary memory of each jitted function (XLA's
``memory_analysis``), the largest the chunked step needs at once, and the
median step time of both. Prints JSON.

Run: ``python benchmarks/physical_batches.py [--policy bf16] [--repeats 10]``
"""

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from dpmp.app.config import load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer import build_private_step, run_keys
from dpmp.app.trainer.batches import physical_chunks


def temp_bytes(compiled) -> int:
    return int(compiled.memory_analysis().temp_size_in_bytes)


def median_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="fp32")
    parser.add_argument("--logical", type=int, default=1024)
    parser.add_argument("--physical", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    base = [
        f"policy={args.policy}",
        f"training.expected_batch_size={args.logical}",
        "privacy.noise_multiplier=1.0",
        "privacy.reproducible_noise=true",
    ]
    data = load_data(load_config(None, base).data, 0)
    one_cfg = load_config(None, base)
    chunk_cfg = load_config(None, [*base, f"training.physical_batch_size={args.physical}"])
    keys = run_keys(one_cfg)
    one = build_private_step(one_cfg, data, keys=keys)
    chunked = build_private_step(chunk_cfg, data, keys=keys)

    params, batch, pad, opt_state, scale = chunked.example_args
    chunk, chunk_pad = next(physical_chunks(batch, pad, args.physical))
    acc = jax.tree.map(jnp.zeros_like, params)
    parts = chunked.fn.chunked
    chunk_temp = temp_bytes(parts.chunk_fn.lower(params, chunk, chunk_pad, scale, acc).compile())
    apply_temp = temp_bytes(
        parts.apply_fn.lower(params, acc, opt_state, scale, jnp.int32(0)).compile()
    )
    one_temp = temp_bytes(one.step_fn.lower(*one.example_args).compile())
    one_time = median_time(one.step_fn, one.example_args, args.repeats)
    chunk_time = median_time(chunked.step_fn, chunked.example_args, args.repeats)
    print(
        json.dumps(
            {
                "device": jax.devices()[0].device_kind,
                "machine": platform.machine(),
                "policy": args.policy,
                "model": one.model.name,
                "expected_logical_batch": args.logical,
                "padded_batch": one.sampler.padded_batch_size,
                "physical_batch": args.physical,
                "chunks_per_step": chunked.sampler.padded_batch_size // args.physical,
                "one_shot_temp_bytes": one_temp,
                "chunk_temp_bytes": chunk_temp,
                "apply_temp_bytes": apply_temp,
                "chunked_over_one_shot_temp": max(chunk_temp, apply_temp) / one_temp,
                "one_shot_step_s": one_time,
                "chunked_step_s": chunk_time,
                "chunked_over_one_shot_time": chunk_time / one_time,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
