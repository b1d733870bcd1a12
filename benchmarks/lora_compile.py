"""The private LoRA step against the non-private LoRA step, as the base grows.

For the language model of ``configs/lm_lora.toml`` at several widths and
depths (a random base: what is compiled does not depend on its values), one
batch of ``--batch`` records: the StableHLO text size of each lowered step,
its compile time (the least of ``--rounds`` compiles from cold caches, the
steps in turn, and its ratio to the non-private step's; wall seconds of the
compile, and process CPU seconds of lower and compile, ``compile_cpu_s``), XLA's compiled
memory (arguments + outputs + temporaries - aliases, ``memory_analysis``)
and, with ``--time``, the median time of a call. ``closed-over`` is the
private step with the base closed over by the loss (a constant of the
program, as LoRA steps were built before the base became an argument), for
comparison; ``--no-closed-over`` leaves it out. Nothing but ``--time`` runs a
step. Prints one JSON row per model and step.

Run: ``python benchmarks/lora_compile.py [--sizes 128x4 256x4 512x4 768x12]
[--batch 32] [--rounds 3] [--time N] [--no-closed-over] [--json FILE]``
"""

import argparse
import json
import platform

import jax
from _compiled import least_compile_times, measure, step_pair  # benchmarks/_compiled.py

from dpmp.app.config import load_config
from dpmp.app.trainer import build_private_step
from dpmp.app.trainer.step import _make_optimizer
from dpmp.clipping._private_grad import private_grad
from dpmp.models._model import count_params
from dpmp.step._step import private_step


def steps(dim: int, depth: int, batch: int, closed_over: bool, sets) -> tuple[dict, dict]:
    """``({kind: (jittable fn, args)}, facts)`` of one model size."""
    config = load_config(
        "configs/lm_lora.toml",
        [
            f"model.dim={dim}",
            f"model.depth={depth}",
            "pretrain.dataset=none",
            f"training.expected_batch_size={batch}",
            *sets,
        ],
    )
    step = build_private_step(config)
    params, data, pad, opt_state, scale = step.example_args
    frozen = step.model.frozen_args()
    fns = step_pair(step, config)
    if closed_over and frozen:
        model = step.model
        old = private_grad(
            lambda p, b: model.loss_fn(p, b),  # reads model.frozen: a constant
            l2_clip_norm=config.privacy.l2_clip_norm,
            policy=config.precision,
            method=config.privacy.clip_method,
        )
        fn = private_step(
            old,
            _make_optimizer(config),
            params=params,
            batch=data,
            noise_multiplier=1.0,
            expected_batch_size=batch,
            padded_batch_size=len(pad),
        )
        fns["closed-over"] = (fn.step_fn, lambda: step.example_args)
    facts = {
        "dim": dim,
        "depth": depth,
        "base_params": count_params(step.model.frozen) if frozen else None,
        "trainable_params": count_params(params),
        "padded_batch": int(len(pad)),
        "policy": str(config.policy),
        "clip_method": step.clipping.get("method"),
    }
    return fns, facts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["128x4", "256x4", "512x4"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--time", type=int, default=0, help="timed calls per step (0: none)")
    parser.add_argument("--no-closed-over", dest="closed_over", action="store_false")
    parser.add_argument(
        "--rounds", type=int, default=3, help="compiles of each step, in turn (least kept)"
    )
    parser.add_argument("--set", action="append", default=[], help="config override")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        dim, depth = (int(v) for v in size.split("x"))
        fns, facts = steps(dim, depth, args.batch, args.closed_over, args.set)
        calls = {kind: (fn, make_args()) for kind, (fn, make_args) in fns.items()}
        size_rows = {
            kind: {**facts, "step": kind, **measure(fn, fn_args, args.time)}
            for kind, (fn, fn_args) in calls.items()
        }
        least_compile_times(calls, size_rows, args.rounds - 1)
        for row in size_rows.values():
            base = size_rows["non-private"]
            row["compile_vs_non_private"] = round(row["compile_s"] / base["compile_s"], 2)
            row["compile_cpu_vs_non_private"] = round(
                row["compile_cpu_s"] / base["compile_cpu_s"], 2
            )
            row["device"] = jax.devices()[0].device_kind
            row["host"] = platform.machine()
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
