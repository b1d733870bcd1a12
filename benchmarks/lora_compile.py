"""The private LoRA step against the non-private LoRA step, as the base grows.

For the language model of ``configs/lm_lora.toml`` at several widths and
depths (a random base: what is compiled does not depend on its values), one
batch of ``--batch`` records: the StableHLO text size of each lowered step,
its compile time (the least of ``--rounds`` compiles from cold caches, the
steps in turn, and its ratio to the non-private step's), XLA's compiled
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
import statistics
import time

import jax

from dpmp.app.config import load_config
from dpmp.app.trainer import build_private_step
from dpmp.app.trainer.compare import _nonprivate_step
from dpmp.app.trainer.step import _make_optimizer
from dpmp.clipping._private_grad import private_grad
from dpmp.models._model import count_params
from dpmp.step._step import WithFrozen, private_step


def measure(fn, args, repeats: int) -> dict:
    """Text size, compile time, compiled bytes (and with ``repeats`` the median call)."""
    tic = time.perf_counter()
    lowered = fn.lower(*args)
    text = lowered.as_text()
    lower_s = time.perf_counter() - tic
    tic = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - tic
    m = compiled.memory_analysis()
    row = {
        "hlo_text_mb": round(len(text) / 1e6, 3),
        "lower_s": round(lower_s, 2),
        "compile_s": round(compile_s, 2),
        "argument_mb": round(m.argument_size_in_bytes / 1e6, 2),
        "temp_mb": round(m.temp_size_in_bytes / 1e6, 2),
        "compiled_mb": round(
            (
                m.argument_size_in_bytes
                + m.output_size_in_bytes
                + m.temp_size_in_bytes
                - m.alias_size_in_bytes
            )
            / 1e6,
            2,
        ),
    }
    if repeats:
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(repeats):
            tic = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - tic)
        row["step_s"] = round(statistics.median(times), 4)
    return row


def retime(fns: dict, rows: dict, rounds: int) -> None:
    """Lower and compile every step ``rounds`` more times, in turn, from cold caches
    (``jax.clear_caches``): each row keeps its least ``lower_s`` and ``compile_s``
    (the machine is shared, so one compile can take 2-3x another of the same)."""
    for _ in range(rounds):
        for kind, (fn, fn_args) in fns.items():
            jax.clear_caches()
            tic = time.perf_counter()
            lowered = fn.lower(*fn_args)
            lower_s = time.perf_counter() - tic
            tic = time.perf_counter()
            lowered.compile()
            compile_s = time.perf_counter() - tic
            rows[kind]["lower_s"] = round(min(rows[kind]["lower_s"], lower_s), 2)
            rows[kind]["compile_s"] = round(min(rows[kind]["compile_s"], compile_s), 2)


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
    optimizer = _make_optimizer(config)
    private = step.step_fn.jitted if isinstance(step.step_fn, WithFrozen) else step.step_fn
    fns = {
        "private": (private, (*step.example_args, *frozen)),
        "non-private": (
            jax.jit(_nonprivate_step(step, optimizer)),
            (params, data, pad, optimizer.init(params), scale, *frozen),
        ),
    }
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
            optimizer,
            params=params,
            batch=data,
            noise_multiplier=1.0,
            expected_batch_size=batch,
            padded_batch_size=len(pad),
        )
        fns["closed-over"] = (fn.step_fn, (*step.example_args,))
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
        size_rows = {
            kind: {**facts, "step": kind, **measure(fn, fn_args, args.time)}
            for kind, (fn, fn_args) in fns.items()
        }
        retime(fns, size_rows, args.rounds - 1)
        for row in size_rows.values():
            row["compile_vs_non_private"] = round(
                row["compile_s"] / size_rows["non-private"]["compile_s"], 2
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
