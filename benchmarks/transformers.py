"""Cost of a private gradient on two transformers, next to the non-private one.

Two transformers, as flax linen modules:

* ``guide_vit``  the ViT of the mixed-precision guide: 32x32x3 images, 4x4
  patches (64 tokens), width 384, MLP 1536, 8 heads, 6 pre-LN blocks, mean-pool
  head over 10 classes; batch 64;
* ``lm``  a small causal transformer language model: byte vocabulary (256),
  context 128, token and learned positional embeddings, 4 pre-LN blocks of
  causal self-attention (4 heads) and an MLP (1024), a final LayerNorm and an
  untied output projection; batch 32. The loss is per-token cross-entropy under
  a padding mask, and each record's loss is the mean over its own tokens (the
  privacy unit is the record).

In float32 and bf16 compute (params float32), it measures in ONE process, with
the conventions of ``benchmarks/clipping.py`` (whose helpers it imports):

* ``nonprivate``  ``jax.grad`` of the batch's mean loss, same compute dtype;
* ``jaxprivacy``  ``jax_privacy.clipping.clipped_grad`` (per-example gradients);
* ``dpmp_vmap``   ``dpmp.private_grad(method="vmap")``;
* ``dpmp_ghost``  ``dpmp.private_grad(method="ghost")`` (a model ghost clipping
  cannot handle is recorded with the reason, and the run goes on);

each jitted: the compiled temporary memory
(``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``) and
the median wall time over ``--repeats`` samples, timed in interleaved rounds; a
sample is the mean of enough back-to-back calls to last ~0.5 s and ends with
``jax.block_until_ready``. It prints each model's per-layer ghost rules
(``explain()``), a table of ratios to the non-private step, the bf16-vs-f32
speed-up of each method, and checks in float32 (on GPUs at
``Precision.HIGHEST``, so that TF32 does not blur it) that ``dpmp_ghost`` and
``dpmp_vmap`` agree: the unclipped sums (``l2_clip_norm=inf``) within 1e-4
relative, and ghost's per-example norms at least vmap's and at most 0.1% above
them. Ghost clips by certified norms (the computed norm plus a bound on its
rounding error, see ``dpmp.clipping.ghost``), so its clipped sum is smaller than
vmap's by that margin: at the full sizes on CPU 0.026% (guide_vit) and 0.035%
(lm), with the unclipped sums within 3e-7. A failed check exits with status 1.
The JSON
(``--json``, rewritten after every model and policy) records the device kind,
the jax version, the parameter count and the tokens per example.

    python benchmarks/transformers.py                         # both models, f32 and bf16
    python benchmarks/transformers.py --models lm --repeats 3 --json out.json
    python benchmarks/transformers.py --quick                 # tiny sizes: a smoke test

On CPUs bf16 is emulated (XLA computes it through float32): bf16 times and
memory there say nothing about accelerators; run it on a GPU for those.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import statistics
import sys
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dpmp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clipping as bench  # noqa: E402  (benchmarks/clipping.py: compile_step, time_interleaved)

try:
    from jax_privacy import clipping as jp_clipping
except ImportError:  # pragma: no cover - dpmp itself needs jax_privacy
    jp_clipping = None

METHODS = ("nonprivate", "jaxprivacy", "dpmp_vmap", "dpmp_ghost")
POLICIES = {"f32": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
CHECK_RTOL = 1e-4
MAX_MARGIN = 1e-3  # certified ghost norms may exceed the exact ones by this much
CLIP = 1.0

# Sizes: the full defaults, and the tiny ones of --quick. A flag given on the
# command line wins over both.
VIT_FULL = dict(image=32, patch=4, width=384, mlp=1536, heads=8, depth=6, classes=10, batch=64)
VIT_QUICK = dict(image=16, patch=4, width=32, mlp=64, heads=4, depth=1, classes=10, batch=8)
LM_FULL = dict(vocab=256, context=128, width=256, mlp=1024, heads=4, depth=4, batch=32)
LM_QUICK = dict(vocab=64, context=16, width=32, mlp=64, heads=2, depth=1, batch=8)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x)) with GELU."""

    heads: int
    mlp: int
    causal: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d = self.dtype
        y = nn.LayerNorm(dtype=d)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32)) if self.causal else None
        x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=d)(y, y, mask=mask)
        y = nn.LayerNorm(dtype=d)(x)
        y = nn.Dense(x.shape[-1], dtype=d)(nn.gelu(nn.Dense(self.mlp, dtype=d)(y)))
        return x + y


class GuideViT(nn.Module):
    """The mixed-precision guide's ViT: patch embedding (a strided convolution),
    learned positions, ``depth`` pre-LN blocks, final LayerNorm, mean pool, linear head."""

    patch: int = 4
    width: int = 384
    mlp: int = 1536
    heads: int = 8
    depth: int = 6
    classes: int = 10
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        d, p = self.dtype, self.patch
        x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID", dtype=d)(x)
        x = x.reshape((x.shape[0], -1, self.width))
        pos = self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.width))
        x = x + pos.astype(x.dtype)
        for _ in range(self.depth):
            x = Block(self.heads, self.mlp, dtype=d)(x)
        x = nn.LayerNorm(dtype=d)(x).mean(axis=1)
        return nn.Dense(self.classes, dtype=d)(x)


class CausalLM(nn.Module):
    """Token embedding + learned positional embedding, ``depth`` pre-LN blocks with
    causal self-attention, final LayerNorm, untied output projection to the vocabulary."""

    vocab: int = 256
    context: int = 128
    width: int = 256
    mlp: int = 1024
    heads: int = 4
    depth: int = 4
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens):
        d = self.dtype
        x = nn.Embed(self.vocab, self.width, dtype=d)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (1, self.context, self.width))
        x = x + pos[:, : tokens.shape[1]].astype(x.dtype)
        for _ in range(self.depth):
            x = Block(self.heads, self.mlp, causal=True, dtype=d)(x)
        x = nn.LayerNorm(dtype=d)(x)
        return nn.Dense(self.vocab, dtype=d)(x)


def build(model: str, policy: str, sizes: dict):
    """``(loss_fn, params, batch, info)`` for one model in one policy's compute dtype."""
    compute = dpmp.Policy.parse(POLICIES[policy]).compute
    kx, ky, kp, kl = jax.random.split(jax.random.key(0), 4)
    b = sizes["batch"]
    if model == "guide_vit":
        s = sizes
        module = GuideViT(
            s["patch"], s["width"], s["mlp"], s["heads"], s["depth"], s["classes"], dtype=compute
        )
        batch = {
            "x": jax.random.normal(kx, (b, s["image"], s["image"], 3), jnp.float32),
            "y": jax.random.randint(ky, (b,), 0, s["classes"]),
        }
        params = module.init(kp, batch["x"][:1])["params"]

        def loss_fn(p, bt):
            logits = module.apply({"params": p}, bt["x"]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, bt["y"]).mean()

        tokens = (s["image"] // s["patch"]) ** 2
        info = {"tokens_per_example": tokens, "mean_valid_tokens": float(tokens)}
    elif model == "lm":
        s = sizes
        module = CausalLM(
            s["vocab"], s["context"], s["width"], s["mlp"], s["heads"], s["depth"], dtype=compute
        )
        t = s["context"]
        seq = jax.random.randint(kx, (b, t + 1), 0, s["vocab"])
        # Records of different lengths (half the context to all of it), padded at the end.
        lengths = jax.random.randint(kl, (b, 1), t // 2, t + 1)
        batch = {
            "tokens": seq[:, :-1],
            "targets": seq[:, 1:],
            "mask": jnp.arange(t)[None, :] < lengths,  # bool: not cast to the compute dtype
        }
        params = module.init(kp, batch["tokens"][:1])["params"]

        def loss_fn(p, bt):
            logits = module.apply({"params": p}, bt["tokens"]).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, bt["targets"])
            m = bt["mask"].astype(jnp.float32)
            # Each record's loss is the mean over its own tokens; the batch's, the mean of those.
            per_record = (ce * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
            return per_record.mean()

        info = {"tokens_per_example": t, "mean_valid_tokens": float(batch["mask"].sum(1).mean())}
    else:
        raise ValueError(model)
    info["params"] = int(sum(x.size for x in jax.tree.leaves(params)))
    info["param_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(params)))
    return loss_fn, params, batch, info


def step_fns(loss_fn, policy: str, methods) -> dict:
    pol = POLICIES[policy]
    fns = {"nonprivate": jax.grad(loss_fn)}
    if "jaxprivacy" in methods:
        fns["jaxprivacy"] = jp_clipping.clipped_grad(loss_fn, l2_clip_norm=CLIP, batch_argnums=1)
    vm = dpmp.private_grad(loss_fn, l2_clip_norm=CLIP, policy=pol, method="vmap")
    gh = dpmp.private_grad(loss_fn, l2_clip_norm=CLIP, policy=pol, method="ghost")
    # The stats ride along (scalars dpmp computes anyway), for the ghost-vs-vmap check.
    fns["dpmp_vmap"] = lambda p, b: (lambda r: (r.grads, r.stats))(vm(p, b))
    fns["dpmp_ghost"] = lambda p, b: (lambda r: (r.grads, r.stats))(gh(p, b))
    return {m: fns[m] for m in methods}


def compile_all(fns: dict, params, batch):
    """``benchmarks/clipping.py``'s ``compile_step`` for each method: compile, read the
    temporary memory, a warm-up call and a calibration call that sets how many
    back-to-back calls make a sample of ``bench.MIN_SAMPLE_S``.

    Returns ``(compiled, info, errors)``; ``errors[m] = (message, traceback)`` for a
    method that failed to trace or compile (e.g. ghost on a model it cannot handle).
    """
    compiled, info, errors = {}, {}, {}
    for m, fn in fns.items():
        try:
            compiled[m], info[m] = bench.compile_step(fn, params, batch)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            errors[m] = (f"{type(e).__name__}: {e}", traceback.format_exc(limit=-3))
    return compiled, info, errors


def explain(loss_fn, params, batch, policy: str) -> dict:
    """``private_grad(method="auto").explain``: which method, and each parameter's rule."""
    g = dpmp.private_grad(loss_fn, l2_clip_norm=CLIP, policy=POLICIES[policy], method="auto")
    try:
        return g.explain(params, batch)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return {"method": "error", "reason": f"{type(e).__name__}: {e}", "layers": []}


def print_explain(model: str, policy: str, ex: dict) -> None:
    """The per-layer rules, with repeated blocks folded into one ``Block_*`` row."""
    print(
        f"\n{model} ({policy}): private_grad(method='auto') -> {ex['method']}"
        + (f" ({ex['reason']})" if ex.get("reason") else "")
    )
    rows: dict[tuple, list[str]] = {}
    for layer in ex.get("layers", []):
        path = str(layer["param"])
        key = (re.sub(r"Block_\d+", "Block_*", path), layer["layer"], layer["rule"])
        rows.setdefault(key, []).append(path)
    if not rows:
        return
    w = max(len(k[0]) for k in rows)
    for (path, kind, rule), paths in rows.items():
        n = f"x{len(paths)}" if len(paths) > 1 else ""
        print(f"  {path:{w}} {n:>3}  {kind:12} {rule}")


def rel_err(a, b) -> tuple[float, float, str]:
    """``||a - b|| / ||b||`` over the whole tree, and the worst leaf's own relative error
    with its path, among leaves holding at least 1e-3 of ``||b||`` (a leaf whose exact
    gradient is ~0, such as attention's key bias, has a relative error of noise/noise)."""
    la = [
        (jax.tree_util.keystr(k), np.asarray(x, np.float64))
        for k, x in jax.tree_util.tree_leaves_with_path(a)
    ]
    lb = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    diff = sum(float(np.sum((x - y) ** 2)) for (_, x), y in zip(la, lb))
    ref = math.sqrt(sum(float(np.sum(y**2)) for y in lb))
    worst, where = 0.0, ""
    for (path, x), y in zip(la, lb):
        ny = float(np.linalg.norm(y))
        if ny >= 1e-3 * ref and float(np.linalg.norm(x - y)) / ny >= worst:
            worst, where = float(np.linalg.norm(x - y)) / ny, path
    return math.sqrt(diff) / max(ref, 1e-300), worst, where


def private_sums(loss_fn, params, batch, policy: str, clip: float, highest: bool) -> dict:
    """``{"vmap": (grads, stats), "ghost": (grads, stats)}`` from freshly compiled
    ``private_grad``s; with ``highest``, every matmul at Precision.HIGHEST (no TF32)."""
    pol = POLICIES[policy]
    out = {}
    with jax.default_matmul_precision("highest") if highest else contextlib.nullcontext():
        for m in ("vmap", "ghost"):
            g = dpmp.private_grad(loss_fn, l2_clip_norm=clip, policy=pol, method=m)
            r = jax.block_until_ready(jax.jit(g)(params, batch))
            out[m] = r.grads, r.stats
    return out


def compare(ghost, vmap) -> dict:
    """``ghost`` and ``vmap`` are ``(summed clipped grads, PrivateGradStats)``.

    ``norm_mean_ratio`` is ghost's mean per-example norm over vmap's: ghost clips by
    a certified norm (the computed one plus a bound on its rounding error), so it
    is >= 1, and every clipped example is clipped that much harder.
    """
    total, leaf, where = rel_err(ghost[0], vmap[0])
    return {
        "rel_err": total,
        "max_leaf_rel_err": leaf,
        "max_leaf": where,
        "num_clipped": int(vmap[1].num_clipped),
        "norm_mean_ratio": float(ghost[1].norm_mean) / float(vmap[1].norm_mean),
        "norm_max_ratio": float(ghost[1].norm_max) / float(vmap[1].norm_max),
    }


def check(loss_fn, params, batch, policy: str, timed: dict | None, cpu: bool) -> dict:
    """dpmp_ghost against dpmp_vmap in float32.

    ``ok``: the unclipped sums (``l2_clip_norm=inf``) agree within ``CHECK_RTOL``, and
    ghost's norms are vmap's or above by at most ``MAX_MARGIN`` (certified norms).
    The clipped sums then differ by the clip factors alone, and ``rel_err`` says by
    how much. XLA:CPU computes float32 matmuls in full float32, so there the timed
    outputs (``timed``) are compared; elsewhere (TF32 on GPUs) both are compiled
    again at Precision.HIGHEST.
    """
    if cpu and timed is not None:
        c = dict(
            compare(timed["dpmp_ghost"], timed["dpmp_vmap"]),
            precision="default (full float32 on CPU)",
        )
    else:
        out = private_sums(loss_fn, params, batch, policy, CLIP, highest=True)
        c = dict(compare(out["ghost"], out["vmap"]), precision="highest")
    out = private_sums(loss_fn, params, batch, policy, math.inf, highest=not cpu)
    c["unclipped_rel_err"] = compare(out["ghost"], out["vmap"])["rel_err"]
    margin_ok = 1 - 1e-6 <= c["norm_mean_ratio"] <= 1 + MAX_MARGIN
    c["ok"] = bool(c["unclipped_rel_err"] <= CHECK_RTOL and margin_ok)
    return c


def resolve_sizes(args) -> dict:
    sizes = {}
    for model, full, quick in (("guide_vit", VIT_FULL, VIT_QUICK), ("lm", LM_FULL, LM_QUICK)):
        prefix = "vit" if model == "guide_vit" else "lm"
        s = dict(quick if args.quick else full)
        for k in s:
            v = getattr(args, f"{prefix}_{k}")
            if v is not None:
                s[k] = v
        sizes[model] = s
    v, lm = sizes["guide_vit"], sizes["lm"]
    if v["image"] % v["patch"] or v["width"] % v["heads"] or lm["width"] % lm["heads"]:
        raise SystemExit("sizes: the patch must divide the image and the heads the width")
    return sizes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="guide_vit,lm", help="comma-separated: guide_vit, lm")
    ap.add_argument("--policies", default="f32,bf16", help="comma-separated: f32, bf16 (fp16)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    ap.add_argument("--repeats", type=int, default=None, help="timed samples (default 5; 1 quick)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, 1 repeat, ~0.05 s samples, XLA backend optimisation level 0: "
        "a smoke test",
    )
    ap.add_argument("--no-check", action="store_true", help="skip the ghost-vs-vmap check")
    ap.add_argument("--json", default=None, help="write the results here")
    for k in VIT_FULL:
        ap.add_argument(
            f"--vit-{k}",
            type=int,
            default=None,
            help=f"guide_vit {k} (default {VIT_FULL[k]}; quick {VIT_QUICK[k]})",
        )
    for k in LM_FULL:
        ap.add_argument(
            f"--lm-{k}",
            type=int,
            default=None,
            help=f"lm {k} (default {LM_FULL[k]}; quick {LM_QUICK[k]})",
        )
    args = ap.parse_args(argv)
    models, policies = args.models.split(","), args.policies.split(",")
    methods = [m for m in args.methods.split(",") if m]
    for m in models:
        if m not in ("guide_vit", "lm"):
            ap.error(f"--models: unknown {m!r}; allowed: guide_vit, lm")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown {p!r}; allowed: {', '.join(POLICIES)}")
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown {m!r}; allowed: {', '.join(METHODS)}")
    if "jaxprivacy" in methods and jp_clipping is None:
        methods.remove("jaxprivacy")
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    if args.quick:
        bench.MIN_SAMPLE_S = 0.05  # read by clipping.compile_step when it calibrates a sample
        # A smoke test: let XLA compile without LLVM's optimisations (about halves the
        # compile time on CPU). Set before the first jax call creates the backend.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_backend_optimization_level" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
    sizes = resolve_sizes(args)

    device = jax.devices()[0]
    results = {
        "device": f"{device.platform} {device.device_kind}",
        "device_kind": device.device_kind,
        "platform": device.platform,
        "num_devices": jax.device_count(),
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
        "repeats": repeats,
        "quick": args.quick,
        "clip_norm": CLIP,
        "sizes": {m: sizes[m] for m in models},
        "models": {},
        "runs": [],
        "checks": [],
    }
    print(
        f"device: {results['device']} x{results['num_devices']}, jax {jax.__version__}, "
        f"repeats {repeats}{', quick' if args.quick else ''}"
    )

    def dump():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    header = f"{'model':9} {'policy':6} {'method':11} {'median ms':>10} {'x time':>8} "
    header += f"{'temp MB':>9} {'x mem':>8} {'ex/s':>9} {'compile s':>9}"
    medians: dict[tuple, float] = {}
    failed_checks = 0
    for model in models:
        for policy in policies:
            loss_fn, params, batch, minfo = build(model, policy, sizes[model])
            ex = explain(loss_fn, params, batch, policy)
            mrec = results["models"].setdefault(model, dict(minfo, sizes=sizes[model], explain={}))
            mrec["explain"][policy] = ex
            if policy == policies[0] or ex != mrec["explain"][policies[0]]:
                print(
                    f"\n{model}: {minfo['params']:,} params, batch {sizes[model]['batch']}, "
                    f"{minfo['tokens_per_example']} tokens per example "
                    f"(mean valid {minfo['mean_valid_tokens']:.1f})",
                    end="",
                )
                print_explain(model, policy, ex)
            fns = step_fns(loss_fn, policy, methods)
            print(f"  {model} {policy}: compiling ...", end="\r", file=sys.stderr, flush=True)
            compiled, info, errors = compile_all(fns, params, batch)
            for method, (err, tb) in errors.items():
                if method == "nonprivate":
                    raise RuntimeError(f"nonprivate step failed: {err}\n{tb}")
                print(f"  {model} {policy} {method}: FAILED {err}\n{tb}", flush=True)
            errors = {m: e for m, (e, _) in errors.items()}
            calls = {m: info[m]["calls"] for m in compiled}
            times = bench.time_interleaved(compiled, calls, params, batch, repeats)
            base = statistics.median(times["nonprivate"]), info["nonprivate"]["temp_bytes"]
            print("\n" + header + "\n" + "-" * len(header))
            for method in methods:
                if method in errors:
                    results["runs"].append(
                        dict(model=model, policy=policy, method=method, error=errors[method])
                    )
                    print(f"{model:9} {policy:6} {method:11} {'failed':>10}")
                    continue
                r = dict(info[method], median_s=statistics.median(times[method]))
                medians[model, policy, method] = r["median_s"]
                r.update(
                    times_s=times[method],
                    model=model,
                    policy=policy,
                    method=method,
                    batch_size=sizes[model]["batch"],
                    time_ratio=r["median_s"] / base[0],
                    mem_ratio=r["temp_bytes"] / max(base[1], 1),
                    examples_per_s=sizes[model]["batch"] / r["median_s"],
                )
                results["runs"].append(r)
                print(
                    f"{model:9} {policy:6} {method:11} {r['median_s'] * 1e3:10.2f} "
                    f"{r['time_ratio']:8.2f} {r['temp_bytes'] / 1e6:9.2f} {r['mem_ratio']:8.2f} "
                    f"{r['examples_per_s']:9.1f} {r['compile_s']:9.1f}",
                    flush=True,
                )
            dump()
            # Same sum of clipped gradients from both dpmp paths (float32 only: bf16
            # rounds the activations differently in the two).
            both = {"dpmp_vmap", "dpmp_ghost"} <= set(compiled)
            if not args.no_check and POLICIES[policy] == "fp32" and both:
                timed = {m: compiled[m](params, batch) for m in ("dpmp_vmap", "dpmp_ghost")}
                c = check(loss_fn, params, batch, policy, timed, device.platform == "cpu")
                c.update(model=model, policy=policy, batch=sizes[model]["batch"])
                results["checks"].append(c)
                failed_checks += not c["ok"]
                print(
                    f"check {model} {policy} ({c['precision']} precision): unclipped sums "
                    f"differ by {c['unclipped_rel_err']:.2e} (<= {CHECK_RTOL:g}); ghost's "
                    f"certified norms are {100 * (c['norm_mean_ratio'] - 1):.3f}% above vmap's "
                    f"(<= {100 * MAX_MARGIN:g}%), so the clipped sums differ by "
                    f"{c['rel_err']:.2e} ({c['num_clipped']}/{c['batch']} clipped) -> "
                    + ("OK" if c["ok"] else "FAIL"),
                    flush=True,
                )
            elif not args.no_check and POLICIES[policy] == "fp32":
                print(f"check {model} {policy}: skipped (needs dpmp_vmap and dpmp_ghost)")
            del compiled
            dump()

    # The bf16-vs-f32 speed-up of each method (ratios from this one run).
    if "f32" in policies or "fp32" in policies:
        f32 = "f32" if "f32" in policies else "fp32"
        lines = []
        for model in models:
            for method in methods:
                a, b = medians.get((model, f32, method)), medians.get((model, "bf16", method))
                if a and b:
                    lines.append(f"  {model:9} {method:11} {a / b:6.2f}x")
                    results.setdefault("bf16_speedup", {}).setdefault(model, {})[method] = a / b
        if lines:
            print("\nbf16 speed-up over f32 (f32 median / bf16 median):")
            print("\n".join(lines))
    dump()
    if args.json:
        print(f"wrote {args.json}")
    if failed_checks:
        print(f"{failed_checks} ghost-vs-vmap check(s) FAILED")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
