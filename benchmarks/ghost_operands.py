"""Ghost clipping under bf16: Gram matrices and per-example contractions on float32
operands (cast from the stored bf16 values, ``Precision.HIGHEST``) against the stored
bf16 operands themselves (float32 accumulation), in one process.

For each model it compiles ``dpmp.private_grad(method="ghost", policy="bf16")`` twice,
the same step traced inside ``dpmp.clipping.ghost._operands.operands("float32")``
(``f32_operands``: what dpmp did before, and its choice on CPUs) and inside
``operands("half")`` (``bf16_operands``: its choice on GPUs and TPUs), and
reports the compiled temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``), the
median step time over ``--repeats`` interleaved rounds (the conventions of
``benchmarks/clipping.py``), their ratios, and how far apart the two clipped sums
and the per-example norms are. The models are ``benchmarks/clipping.py``'s mlp, cnn
and vit (batch 256) and ``benchmarks/transformers.py``'s guide_vit and lm; ``gpt2``
(a GPT-2-shaped causal LM of ~98M parameters: 12 layers, width 768, MLP 3072,
vocabulary 8192, context 128, batch 8) is compiled only, for its memory.

On CPUs bf16 is emulated through float32: the times there say what it costs on
CPU, not what tensor cores gain. Run it on a GPU for that.

    python benchmarks/ghost_operands.py --json benchmarks/results/cpu_2core_ghost_operands.json
    python benchmarks/ghost_operands.py --models mlp,lm --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

import dpmp
from dpmp.clipping.ghost._operands import operands

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clipping as small  # noqa: E402  (mlp, cnn, vit; compile_step)
import transformers as tf  # noqa: E402  (guide_vit, lm)

MODELS = ("mlp", "cnn", "vit", "guide_vit", "lm", "gpt2")
COMPILE_ONLY = ("gpt2",)
GPT2 = dict(vocab=8192, context=128, width=768, mlp=3072, heads=12, depth=12, batch=8)
VARIANTS = ("f32_operands", "bf16_operands")


def build(model: str):
    """``(loss_fn, params, batch, parameter count)`` in bf16 compute."""
    if model in small.MODELS:
        loss_fn, params, batch = small.build(model, "bf16", 256)
    else:
        sizes = {"guide_vit": tf.VIT_FULL, "lm": tf.LM_FULL, "gpt2": GPT2}[model]
        name = "guide_vit" if model == "guide_vit" else "lm"
        loss_fn, params, batch, _ = tf.build(name, "bf16", sizes)
    return loss_fn, params, batch, int(sum(x.size for x in jax.tree.leaves(params)))


def step(loss_fn, variant: str):
    """The ghost step, traced with bf16 operands or (``f32_operands``) float32 ones."""
    g = dpmp.private_grad(loss_fn, l2_clip_norm=1.0, policy="bf16", method="ghost")

    def fn(p, b):
        with operands("half" if variant == "bf16_operands" else "float32"):
            r = g(p, b)
        return r.grads, r.stats.norm_mean

    return fn


def measure(model: str, repeats: int) -> dict:
    loss_fn, params, batch, n_params = build(model)
    row = {"model": model, "params": n_params}
    if model in COMPILE_ONLY:
        for v in VARIANTS:
            mem = jax.jit(step(loss_fn, v)).lower(params, batch).compile().memory_analysis()
            row[v] = {"temp_bytes": int(mem.temp_size_in_bytes)}
        return _ratios(row)
    compiled, info = {}, {}
    for v in VARIANTS:
        compiled[v], info[v] = small.compile_step(step(loss_fn, v), params, batch)
    calls = {v: info[v]["calls"] for v in VARIANTS}
    times = small.time_interleaved(compiled, calls, params, batch, repeats)
    for v in VARIANTS:
        row[v] = {"temp_bytes": info[v]["temp_bytes"], "median_s": statistics.median(times[v])}
        row[v]["times_s"] = times[v]
    outs = {v: jax.block_until_ready(compiled[v](params, batch)) for v in VARIANTS}
    a, b = (
        np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(outs[v][0])])
        for v in VARIANTS
    )
    row["sum_rel_diff"] = float(np.linalg.norm(b - a) / np.linalg.norm(a))
    row["norm_mean_ratio"] = float(outs["bf16_operands"][1]) / float(outs["f32_operands"][1])
    return _ratios(row)


def _ratios(row: dict) -> dict:
    f32, bf16 = row["f32_operands"], row["bf16_operands"]
    row["mem_ratio"] = bf16["temp_bytes"] / f32["temp_bytes"]
    if "median_s" in f32:
        row["time_ratio"] = bf16["median_s"] / f32["median_s"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {MODELS}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: unknown {m!r}; allowed: {', '.join(MODELS)}")
    out = {
        "device": f"{jax.default_backend()} {jax.devices()[0].device_kind}",
        "cpu": platform.machine(),
        "jax": jax.__version__,
        "repeats": args.repeats,
        "policy": "bf16",
        "runs": [],
    }
    print(
        f"{'model':10} {'params':>11} {'temp MB f32-ops':>16} {'bf16-ops':>9} {'mem x':>6}"
        f" {'ms f32-ops':>11} {'bf16-ops':>9} {'time x':>7} {'sum diff':>9}"
    )
    for m in models:
        t0 = time.perf_counter()
        row = measure(m, args.repeats)
        row["wall_s"] = time.perf_counter() - t0
        out["runs"].append(row)
        f32, bf16 = row["f32_operands"], row["bf16_operands"]
        ms = (
            f"{f32['median_s'] * 1e3:11.1f} {bf16['median_s'] * 1e3:9.1f} {row['time_ratio']:7.3f}"
            f" {row['sum_rel_diff']:9.1e}"
            if "median_s" in f32
            else f"{'(compiled only)':>39}"
        )
        print(
            f"{m:10} {row['params']:11,} {f32['temp_bytes'] / 1e6:16.1f}"
            f" {bf16['temp_bytes'] / 1e6:9.1f} {row['mem_ratio']:6.3f} {ms}",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
