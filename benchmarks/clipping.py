"""Cost of a private gradient next to the non-private one, measured side by side.

For an MLP, two small CNNs and a small ViT at one batch size, in float32 and in
bf16 compute, this measures in ONE process:

* ``nonprivate``  ``jax.grad`` of the batch's mean loss;
* ``jaxprivacy``  ``jax_privacy.clipping.clipped_grad`` (per-example gradients
  under ``vmap``);
* ``dpmp_vmap``   ``dpmp.private_grad(method="vmap")``;
* ``dpmp_ghost``  ``dpmp.private_grad(method="ghost")`` (per layer, the ghost
  norm from activations and output gradients or the layer's own per-example
  gradient, whichever is smaller);

each jitted: the compiled temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``) and
the median wall time over ``--repeats`` samples after a warm-up call. A sample
is the mean of enough back-to-back calls to last ~0.5 s, and the methods of
one model and policy are timed in interleaved rounds, so that load drift on a
shared machine hits them alike (those that take seconds per call in rounds of
their own, after the others).
It prints a table of ratios to the non-private step and writes the raw
numbers as JSON (``--json``).

    python benchmarks/clipping.py                      # all models, f32 and bf16
    python benchmarks/clipping.py --models mlp --policies f32 --repeats 3

On CPUs bf16 is emulated (XLA computes it through float32), so bf16 times and
memory there say nothing about accelerators; run it on a GPU for those.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax_privacy import clipping as jp_clipping

import dpmp

METHODS = ("nonprivate", "jaxprivacy", "dpmp_vmap", "dpmp_ghost")


class MLP(nn.Module):
    """784-1024-1024-1024-10, ReLU."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in (1024, 1024, 1024):
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


class CNN(nn.Module):
    """Two 3x3 convolutions (16, 32 channels) with average pooling, a linear head."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        for channels in (16, 32):
            x = nn.relu(nn.Conv(channels, (3, 3), dtype=self.dtype)(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10, dtype=self.dtype)(x.reshape((x.shape[0], -1)))


class CNN3(nn.Module):
    """Three 3x3 convolutions (16, 32, 64 channels), average pooling after the first
    two, a linear head."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i, channels in enumerate((16, 32, 64)):
            x = nn.relu(nn.Conv(channels, (3, 3), dtype=self.dtype)(x))
            if i < 2:
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(10, dtype=self.dtype)(x.reshape((x.shape[0], -1)))


class ViT(nn.Module):
    """4x4 patches of a 32x32 image (64 tokens), dim 64, 2 pre-LN blocks, 4 heads."""

    dtype: jnp.dtype = jnp.float32
    dim: int = 64
    depth: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        d = self.dtype
        x = nn.Conv(self.dim, (4, 4), strides=(4, 4), padding="VALID", dtype=d)(x)
        x = x.reshape((x.shape[0], -1, self.dim))
        pos = self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
        x = x + pos.astype(x.dtype)
        for _ in range(self.depth):
            y = nn.LayerNorm(dtype=d)(x)
            x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=d)(y, y)
            y = nn.LayerNorm(dtype=d)(x)
            x = x + nn.Dense(self.dim, dtype=d)(nn.gelu(nn.Dense(2 * self.dim, dtype=d)(y)))
        x = nn.LayerNorm(dtype=d)(x).mean(axis=1)
        return nn.Dense(10, dtype=d)(x)


MODELS = {
    "mlp": (MLP, (28, 28, 1)),
    "cnn": (CNN, (32, 32, 3)),
    "cnn3": (CNN3, (28, 28, 1)),
    "vit": (ViT, (32, 32, 3)),
}


def build(model: str, policy: str, batch_size: int):
    cls, shape = MODELS[model]
    compute = dpmp.Policy.parse(policy).compute
    module = cls(dtype=compute)
    kx, ky, kp = jax.random.split(jax.random.key(0), 3)
    batch = {
        "x": jax.random.normal(kx, (batch_size, *shape), jnp.float32),
        "y": jax.random.randint(ky, (batch_size,), 0, 10),
    }
    params = module.init(kp, batch["x"][:1])["params"]

    def loss_fn(p, b):
        logits = module.apply({"params": p}, b["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    return loss_fn, params, batch


def step_fns(loss_fn, policy: str):
    grad = jax.grad(loss_fn)
    jp = jp_clipping.clipped_grad(loss_fn, l2_clip_norm=1.0, batch_argnums=1)
    vm = dpmp.private_grad(loss_fn, l2_clip_norm=1.0, policy=policy, method="vmap")
    gh = dpmp.private_grad(loss_fn, l2_clip_norm=1.0, policy=policy, method="ghost")
    return {
        "nonprivate": lambda p, b: grad(p, b),
        "jaxprivacy": lambda p, b: jp(p, b),
        "dpmp_vmap": lambda p, b: vm(p, b).grads,
        "dpmp_ghost": lambda p, b: gh(p, b).grads,
    }


MIN_SAMPLE_S = 0.5  # a fast step is timed as the mean of enough calls to last this long


def compile_step(fn, params, batch) -> tuple[Callable, dict]:
    """Compile, read the temporary memory, run twice (warm-up, then a calibration call)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(params, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(params, batch))  # warm-up
    t = time.perf_counter()
    jax.block_until_ready(compiled(params, batch))
    calls = max(1, min(100, round(MIN_SAMPLE_S / (time.perf_counter() - t))))
    info = {"temp_bytes": int(mem.temp_size_in_bytes), "compile_s": compile_s, "calls": calls}
    return compiled, info


def time_interleaved(compiled: dict, calls: dict, params, batch, repeats: int) -> dict:
    """``repeats`` rounds, each timing every method in turn: ``calls[m]`` back-to-back
    calls of method ``m``, recorded as seconds per call.

    Interleaving spreads any drift of a shared machine's load over all methods
    alike, so the ratios of medians compare like with like; several calls per
    sample keep a 20 ms step from being one scheduler tick away from 30 ms.

    Methods that take seconds per call (per-example gradients of the MLP, ~3 GB
    each) are timed in rounds of their own, after the fast ones: the kernel
    reclaims what such a call frees while the next method runs, and the MLP's
    ghost step read 1.3-1.5x when timed right after them, 0.99x beside the
    non-private step alone. Their ratios are in the hundreds; a few percent of
    drift does not change them.
    """
    fast = {m: f for m, f in compiled.items() if calls[m] > 1}
    slow = {m: f for m, f in compiled.items() if calls[m] == 1}
    times = {m: [] for m in compiled}
    for group in (fast, slow):
        for _ in range(repeats):
            for m, f in group.items():
                t = time.perf_counter()
                for _ in range(calls[m]):
                    out = f(params, batch)
                jax.block_until_ready(out)
                times[m].append((time.perf_counter() - t) / calls[m])
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = ", ".join(MODELS)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {names}")
    ap.add_argument("--policies", default="f32,bf16", help="comma-separated policy strings")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls after warm-up")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    methods = args.methods.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: unknown {m!r}; allowed: {', '.join(MODELS)}")
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown {m!r}; allowed: {', '.join(METHODS)}")
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")

    device = jax.devices()[0]
    results = {
        "device": f"{device.platform} {device.device_kind}",
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "runs": [],
    }
    header = f"{'model':6} {'policy':6} {'method':11} {'median ms':>10} {'x time':>8} "
    header += f"{'temp MB':>9} {'x mem':>8}"
    print(header)
    print("-" * len(header))
    for model in models:
        for policy in args.policies.split(","):
            loss_fn, params, batch = build(model, policy, args.batch_size)
            fns = step_fns(loss_fn, policy)
            compiled, info = {}, {}
            for method in methods:
                print(f"  {model} {policy} {method} ...", end="\r", file=sys.stderr, flush=True)
                compiled[method], info[method] = compile_step(fns[method], params, batch)
            calls = {m: info[m]["calls"] for m in methods}
            times = time_interleaved(compiled, calls, params, batch, args.repeats)
            base = statistics.median(times["nonprivate"]), info["nonprivate"]["temp_bytes"]
            for method in methods:
                r = dict(info[method], median_s=statistics.median(times[method]))
                r.update(
                    times_s=times[method],
                    model=model,
                    policy=policy,
                    method=method,
                    time_ratio=r["median_s"] / base[0],
                    mem_ratio=r["temp_bytes"] / max(base[1], 1),
                )
                results["runs"].append(r)
                print(
                    f"{model:6} {policy:6} {method:11} {r['median_s'] * 1e3:10.1f} "
                    f"{r['time_ratio']:8.2f} {r['temp_bytes'] / 1e6:9.2f} {r['mem_ratio']:8.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
