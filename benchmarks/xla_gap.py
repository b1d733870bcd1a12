"""Where XLA:CPU's non-private step loses to PyTorch's, and what XLA:CPU's options change.

The CNN, the ViT and the byte LM of ``benchmarks/peers.py`` train slower in JAX
(flax linen on XLA:CPU) than in PyTorch on a 2-core CPU. Four parts, each
timed like ``peers.py`` (``prepare`` and ``time_interleaved``: interleaved
rounds, a sample the mean of enough calls to last ~0.5 s, both frameworks on
the same 2 CPUs, JAX and torch side by side in one process):

* ``components``: forward + backward of each piece of the models at their
  shapes, in JAX and in torch (the gradients the model needs: parameters, and
  the input where it is not the model's input), and Adam's update over each
  model's parameters. JAX's images are NHWC (flax), torch's NCHW; the ``nchw``
  rows are the same JAX convolution in torch's layout. Attention is flax's
  ``MultiHeadDotProductAttention`` (projections included) against the twin of
  ``peers.py`` (four ``nn.Linear`` around ``F.scaled_dot_product_attention``),
  and flax's module with ``jax.nn.dot_product_attention(implementation="xla")``
  as its ``attention_fn``.
* ``profile``: a ``jax.profiler`` trace of the compiled non-private step (XLA:CPU
  reports each thunk's time), each thunk put in a category by the ``op_name``
  of its HLO instruction (the flax module path): ms per step and share.
* ``options``: the non-private steps of the CNN, the ViT and the LM, each in a
  process of its own per XLA:CPU option (``XLA_FLAGS`` is read when jax starts)
  with torch's step timed in the same process as the reference; the gradient
  at the initial parameters is compared with the default's (max relative
  difference). A hash of the compiled HLO text (metadata stripped) is recorded;
  an option whose hash equals the default's is not timed (the hash also
  differed between processes with the same flags, so a different hash does not
  prove a different program). Three options are model changes instead of
  flags: ``dpa_xla`` (attention through ``jax.nn.dot_product_attention``),
  ``cnn_nchw`` (the CNN's convolutions in NCHW) and ``cnn_reshape_pool`` (its
  average pooling as a reshape and a mean).
* ``steps``: the same model changes timed side by side with the unchanged
  step and torch's in one process (what separate processes cannot resolve on
  a loaded machine).

Needs the ``bench`` extra (``pip install -e '.[bench]'``).

    python benchmarks/xla_gap.py --json benchmarks/results/cpu_2core_xla_gap.json
    python benchmarks/xla_gap.py --parts components --repeats 3 --json gap.json  # only that part
                                                            # of an existing gap.json rewritten
    python benchmarks/xla_gap.py --parts options --options default,fast_math
    python benchmarks/xla_gap.py --tables benchmarks/results/cpu_2core_xla_gap.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch or XLA load OpenMP

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Callable  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = ("cnn", "vit", "lm")
PARTS = ("components", "profile", "options", "steps")
# model changes timed side by side in one process by the ``steps`` part
STEP_CHANGES = {"cnn": ("cnn_reshape_pool", "cnn_nchw"), "vit": ("dpa_xla",), "lm": ("dpa_xla",)}
# name -> (XLA_FLAGS, what it is)
OPTIONS = {
    "default": ("", "XLA:CPU as installed (YNNPACK for dots and convolutions)"),
    "fast_math": ("--xla_cpu_enable_fast_math=true", "fast math"),
    "eigen_dot_conv": (
        "--xla_cpu_experimental_ynn_fusion_type=-individual_dot,-individual_convolution",
        "dots and convolutions by Eigen instead of YNNPACK",
    ),
    "eigen_conv": (
        "--xla_cpu_experimental_ynn_fusion_type=-individual_convolution",
        "convolutions by Eigen instead of YNNPACK",
    ),
    "ynn_fusions": (
        "--xla_cpu_experimental_ynn_fusion_type=+dot,+eltwise,+reduce",
        "YNNPACK fusions of dots, elementwise ops and reductions",
    ),
    "xnn_fusions": (
        "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce",
        "XNNPACK fusions of dots, elementwise ops and reductions",
    ),
    "xnn_graph": (
        "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
        "XNNPACK graph fusion, greedy",
    ),
    "onednn": (
        "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
        "oneDNN rewrites and custom calls",
    ),
    "onednn_fusions": (
        "--xla_cpu_experimental_onednn_fusion_type=dot,eltwise,reduce",
        "oneDNN fusions of dots, elementwise ops and reductions",
    ),
    "vector_512": ("--xla_cpu_prefer_vector_width=512", "512-bit vectors in XLA's own kernels"),
    "dpa_xla": ("", 'attention by jax.nn.dot_product_attention(implementation="xla")'),
    "cnn_nchw": ("", "the CNN's convolutions and pooling in NCHW"),
    "cnn_reshape_pool": ("", "the CNN's 2x2 average pooling as a reshape and a mean"),
}
VIT = dict(batch=256, tokens=64, dim=64, heads=4, mlp=128)
LM = dict(batch=32, tokens=128, dim=256, heads=4, mlp=1024, vocab=256)


# ------------------------------------------------------------------------ components


def _dpa(query, key, value, bias=None, mask=None, **_):
    """flax ``attention_fn`` over ``jax.nn.dot_product_attention`` (XLA). In these
    models a mask, where there is one, is the LM's causal mask: it is passed as
    ``is_causal``."""
    import jax

    return jax.nn.dot_product_attention(
        query, key, value, bias=bias, is_causal=mask is not None, implementation="xla"
    )


def jax_vjp(fn: Callable, params, x, wrt_x: bool) -> Callable:
    """``call()``: jitted forward and backward of ``fn(params, x)`` for a fixed random
    cotangent: the gradient of the parameters (and of ``x`` if ``wrt_x``)."""
    import jax

    out = jax.eval_shape(fn, params, x)
    g = jax.random.normal(jax.random.key(1), out.shape, out.dtype)

    @jax.jit
    def run(params, x, g):  # g an argument: XLA would fold a constant's backward away
        if wrt_x:
            y, back = jax.vjp(fn, params, x)
        else:
            y, back = jax.vjp(lambda p: fn(p, x), params)
        return y, back(g)

    return lambda: run(params, x, g)


def torch_vjp(fn: Callable, leaves: list, x, wrt_x: bool) -> Callable:
    """``call()``: ``fn(x)`` and ``backward`` of a fixed random cotangent into ``leaves``
    (and ``x`` if ``wrt_x``); gradients set to None before each call."""
    import torch

    x = x.detach().clone().requires_grad_(wrt_x)
    with torch.no_grad():
        g = torch.randn_like(fn(x))
    leaves = list(leaves) + ([x] if wrt_x else [])

    def call():
        for t in leaves:
            t.grad = None
        fn(x).backward(g)

    return call


def components(quick: bool) -> dict[str, dict[str, Callable]]:
    """``{component: {"jax": call, "torch": call, ...}}`` at the models' shapes."""
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import peers
    import torch
    from torch.nn import functional as F

    s = 8 if quick else 1
    vit = dict(VIT, batch=VIT["batch"] // s)
    lm = dict(LM, batch=max(1, LM["batch"] // s))
    rng = np.random.default_rng(0)

    def data(*shape):
        a = rng.standard_normal(shape, np.float32)
        return jnp.asarray(a), torch.from_numpy(a.copy())

    def flax_pair(module, x, wrt_x=True):
        params = module.init(jax.random.key(0), x)["params"]
        return jax_vjp(lambda p, v: module.apply({"params": p}, v), params, x, wrt_x)

    out = {}
    b = vit["batch"]
    tcnn = peers.torch_module("cnn", {})
    tvit = peers.torch_module("vit", {})
    tlm = peers.torch_module("lm", {**lm, "width": lm["dim"], "context": lm["tokens"], "depth": 1})

    def conv_row(name, x_shape, feats, kernel, stride, padding, tconv, wrt_x):
        xj, xt = data(b, *x_shape)
        conv = fnn.Conv(feats, kernel, strides=stride, padding=padding)
        row = {"jax": flax_pair(conv, xj, wrt_x)}
        params = conv.init(jax.random.key(0), xj)["params"]
        pad = padding if isinstance(padding, str) else "SAME"

        def nchw(p, v):
            y = jax.lax.conv_general_dilated(
                v, p["kernel"], stride, pad, dimension_numbers=("NCHW", "HWIO", "NCHW")
            )
            return y + p["bias"][:, None, None]

        row["jax_nchw"] = jax_vjp(nchw, params, jnp.transpose(xj, (0, 3, 1, 2)), wrt_x)
        xt = xt.permute(0, 3, 1, 2).contiguous()
        row["torch"] = torch_vjp(tconv, list(tconv.parameters()), xt, wrt_x)
        out[name] = row

    conv_row("cnn conv 3x3, 3->16, 32x32", (32, 32, 3), 16, (3, 3), (1, 1), "SAME", tcnn[0], False)
    conv_row("cnn conv 3x3, 16->32, 16x16", (16, 16, 16), 32, (3, 3), (1, 1), "SAME", tcnn[3], True)
    conv_row(
        "vit patch conv 4x4/4, 3->64", (32, 32, 3), 64, (4, 4), (4, 4), "VALID", tvit.embed, False
    )

    xj, xt = data(b, 32, 32, 16)
    out["cnn relu + 2x2 avg pool, 32x32x16"] = {
        "jax": jax_vjp(lambda p, v: fnn.avg_pool(fnn.relu(v), (2, 2), (2, 2)), {}, xj, True),
        "torch": torch_vjp(
            lambda v: F.avg_pool2d(F.relu(v), 2), [], xt.permute(0, 3, 1, 2).contiguous(), True
        ),
    }

    for tag, sz, tmod, causal in (("vit", vit, tvit, False), ("lm", lm, tlm, True)):
        shape = (sz["batch"], sz["tokens"], sz["dim"])
        xj, xt = data(*shape)
        mask = fnn.make_causal_mask(jnp.ones(shape[:2], jnp.int32)) if causal else None
        what = f"{sz['tokens']} tokens x {sz['dim']}, {sz['heads']} heads" + (
            ", causal" if causal else ""
        )
        row = {}
        for key, kw in (("jax", {}), ("jax_dpa", {"attention_fn": _dpa})):
            att = fnn.MultiHeadDotProductAttention(sz["heads"], **kw)
            params = att.init(jax.random.key(0), xj, xj, mask=mask)["params"]
            row[key] = jax_vjp(
                lambda p, v, att=att, m=mask: att.apply({"params": p}, v, v, mask=m),
                params,
                xj,
                True,
            )
        blk = tmod.blocks[0]
        row["torch"] = torch_vjp(blk.attn, list(blk.attn.parameters()), xt, True)
        out[f"{tag} attention, {what}"] = row
        out[f"{tag} layer norm, {shape}"] = {
            "jax": flax_pair(fnn.LayerNorm(), xj),
            "torch": torch_vjp(blk.ln1, list(blk.ln1.parameters()), xt, True),
        }
        hj, ht = data(*shape[:2], sz["mlp"])
        out[f"{tag} tanh-GELU, {(*shape[:2], sz['mlp'])}"] = {
            "jax": jax_vjp(lambda p, v: fnn.gelu(v), {}, hj, True),
            "torch": torch_vjp(lambda v: F.gelu(v, approximate="tanh"), [], ht, True),
        }

        class MLP(fnn.Module):
            @fnn.compact
            def __call__(self, v, sz=sz):
                return fnn.Dense(sz["dim"])(fnn.gelu(fnn.Dense(sz["mlp"])(v)))

        out[f"{tag} MLP {sz['dim']}-{sz['mlp']}-{sz['dim']}"] = {
            "jax": flax_pair(MLP(), xj),
            "torch": torch_vjp(blk.mlp, list(blk.mlp.parameters()), xt, True),
        }

    import optax

    lj, lt = data(lm["batch"], lm["tokens"], lm["vocab"])
    targets = rng.integers(0, lm["vocab"], (lm["batch"], lm["tokens"]))
    valid = (
        np.arange(lm["tokens"])[None]
        < rng.integers(lm["tokens"] // 2, lm["tokens"] + 1, (lm["batch"], 1))
    ).astype(np.float32)
    tj, mj = jnp.asarray(targets), jnp.asarray(valid)
    tt, mt = torch.from_numpy(targets), torch.from_numpy(valid)

    def ce_jax(p, logits):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tj)
        return ((ce * mj).sum(1) / jnp.maximum(mj.sum(1), 1.0)).mean()

    def ce_torch(logits):
        ce = F.cross_entropy(logits.flatten(0, 1), tt.flatten(), reduction="none").view_as(mt)
        return ((ce * mt).sum(1) / mt.sum(1).clamp(min=1.0)).mean()

    out[f"lm softmax cross-entropy, vocab {lm['vocab']}"] = {
        "jax": jax_vjp(ce_jax, {}, lj, True),
        "torch": torch_vjp(ce_torch, [], lt, True),
    }

    for model, tmod in (
        ("cnn", tcnn),
        ("vit", tvit),
        ("lm", peers.torch_module("lm", dict(LM_SIZES))),
    ):
        out[f"{model} Adam update ({sum(p.numel() for p in tmod.parameters()):,} params)"] = (
            adam_pair(tmod)
        )
    return out


LM_SIZES = dict(vocab=256, context=128, width=256, mlp=1024, heads=4, depth=4)


def adam_pair(tmod) -> dict[str, Callable]:
    """``optax.adam`` update and ``apply_updates`` (jitted) against ``torch.optim.Adam.step``
    over parameters of the torch module's shapes with fixed gradients."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    ps = [p.detach().numpy() for p in tmod.parameters()]
    params = [jnp.asarray(p) for p in ps]
    grads = [jnp.full_like(p, 1e-3) for p in params]
    opt = optax.adam(peers_lr())
    state = opt.init(params)

    @jax.jit
    def update(params, state, grads):
        u, state = opt.update(grads, state, params)
        return optax.apply_updates(params, u), state

    for p in tmod.parameters():
        p.grad = torch.full_like(p, 1e-3)
    topt = torch.optim.Adam(tmod.parameters(), lr=peers_lr())
    return {"jax": lambda: update(params, state, grads), "torch": topt.step}


def peers_lr() -> float:
    import peers

    return peers.LEARNING_RATE


def run_components(args) -> dict:
    import peers

    rows = {}
    for name, calls in components(args.quick).items():
        fns = {f"{name} | {k}": f for k, f in calls.items()}
        fns, info, errors = peers.prepare(fns)
        times = peers.time_interleaved(fns, {v: info[v]["calls"] for v in fns}, args.repeats)
        med = {v.split(" | ")[1]: statistics.median(t) * 1e3 for v, t in times.items()}
        rows[name] = {"ms": med, "errors": errors}
        line = "  ".join(f"{k} {v:8.2f}" for k, v in med.items())
        ratio = f"{med['jax'] / med['torch']:.2f}x" if {"jax", "torch"} <= med.keys() else "-"
        print(f"{name:48} {line}  jax/torch {ratio}", flush=True)
    return rows


# --------------------------------------------------------------------------- steps


def model(name: str, quick: bool, option: str = "default"):
    """``(loss_fn, params, batch)`` of ``peers.py``'s model, changed as ``option`` says."""
    import flax.linen as fnn
    import peers

    if option == "dpa_xla":
        # Both models look the class up when they build and when they apply: replaced
        # for the rest of this process (one process per option).
        class DPA(fnn.MultiHeadDotProductAttention):
            attention_fn: Callable = _dpa

        DPA.__name__ = DPA.__qualname__ = "MultiHeadDotProductAttention"  # same param names
        fnn.MultiHeadDotProductAttention = DPA
    loss_fn, params, batch, _ = peers.jax_model(name, _batch(name, quick), quick)
    if option in ("cnn_nchw", "cnn_reshape_pool") and name == "cnn":
        import functools

        import jax.numpy as jnp

        if option == "cnn_reshape_pool":
            return functools.partial(_cnn_loss, nchw=False), params, batch
        x = jnp.transpose(batch["x"], (0, 3, 1, 2))
        return functools.partial(_cnn_loss, nchw=True), params, {"x": x, "y": batch["y"]}
    return loss_fn, params, batch


def _cnn_loss(p, b, nchw: bool):
    """``benchmarks/clipping.py``'s CNN with its own (flax) parameters: on NCHW images
    with ``reduce_window`` pooling, or on NHWC images with each 2x2 average pool a
    reshape and a mean."""
    import jax
    import jax.numpy as jnp
    import optax

    x = b["x"]
    for layer in ("Conv_0", "Conv_1"):
        k = p[layer]
        dims = ("NCHW", "HWIO", "NCHW") if nchw else ("NHWC", "HWIO", "NHWC")
        x = jax.lax.conv_general_dilated(x, k["kernel"], (1, 1), "SAME", dimension_numbers=dims)
        x = jax.nn.relu(x + (k["bias"][:, None, None] if nchw else k["bias"]))
        if nchw:
            x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4
        else:
            n, h, w, c = x.shape
            x = x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
    if nchw:
        x = jnp.transpose(x, (0, 2, 3, 1))  # flax's (h, w, c) order for the head
    x = x.reshape(x.shape[0], -1)
    logits = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _batch(name: str, quick: bool) -> int:
    import peers

    return (peers.QUICK_BATCH if quick else peers.BATCH)[name]


def compiled_step(loss_fn, params):
    """``(compiled, state)``: ``jax.grad`` of the mean loss and ``optax.adam``, as
    ``peers.py``'s ``jax_nonprivate`` (the batch a closed-over constant there: an
    argument here, which changes nothing XLA sees but the parameter list)."""
    import jax
    import optax
    import peers

    opt = optax.adam(peers.LEARNING_RATE)

    def step(state, batch):
        p, s = state
        updates, s = opt.update(jax.grad(loss_fn)(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    return jax.jit(step), (params, opt.init(params))


def hlo_fingerprint(text: str) -> str:
    """Hash of a compiled HLO text without its metadata (names of source lines)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ------------------------------------------------------------------------- profile

# (category, pattern, whether it is matched against the instruction's name rather
# than its op_name); the first match wins.
CATEGORIES = (
    ("layout copies (transpose/copy)", r"^(transpose|copy|wrapped_copy)", True),
    ("broadcast constants", r"^wrapped_broadcast", True),
    ("attention projections", r"MultiHeadDotProductAttention_\d+/(query|key|value|out)", False),
    ("attention core", r"MultiHeadDotProductAttention", False),
    ("convolution", r"Conv_\d+", False),
    ("layer norm", r"LayerNorm", False),
    ("GELU", r"gelu", False),
    ("dense", r"Dense|DenseGeneral|Embed", False),
    ("cross-entropy", r"softmax_cross_entropy|log_softmax|logsumexp", False),
    ("pooling", r"avg_pool|reduce_window", False),
)


def categorize(instr: str, op_name: str) -> str:
    for cat, pattern, by_name in CATEGORIES:
        if re.search(pattern, instr if by_name else op_name):
            return cat
    if op_name and "jvp(" not in op_name:
        return "Adam (optax)"
    return "other" if op_name else "other (no op_name)"


def profile_step(name: str, args) -> dict:
    """Thunk times of the compiled non-private step, per category, from a profiler trace."""
    import time

    import jax

    loss_fn, params, batch = model(name, args.quick)
    step, state = compiled_step(loss_fn, params)
    compiled = step.lower(state, batch).compile()
    ops = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = .*", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            ops[m.group(1)] = op.group(1) if op else ""
    for _ in range(3):
        state = jax.block_until_ready(compiled(state, batch))
    n = 3 if args.quick else 5
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t = time.perf_counter()
        for _ in range(n):
            state = compiled(state, batch)
        jax.block_until_ready(state)
        wall = (time.perf_counter() - t) / n
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(
            glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
        )
    per = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                if ev.name in ops:
                    per[categorize(ev.name, ops[ev.name])] += ev.duration_ns / 1e6 / n
    total = sum(per.values())
    cats = {c: {"ms": round(v, 2), "share": round(v / total, 3)} for c, v in per.most_common()}
    print(f"\n{name}: {wall * 1e3:.0f} ms/step while traced, thunks {total:.0f} ms (both threads)")
    for c, v in cats.items():
        print(f"  {c:32} {v['ms']:8.1f} ms  {v['share']:6.1%}")
    return {
        "traced_ms_per_step": round(wall * 1e3, 1),
        "thunk_ms_per_step": round(total, 1),
        "categories": cats,
    }


# ------------------------------------------------------------------------- options


def one_option(option: str, args) -> dict:
    """This process's XLA_FLAGS (set by the caller) or model change: each model's JAX and
    torch non-private steps timed side by side, the initial gradient saved for comparison."""
    import jax
    import numpy as np
    import peers

    rec = {}
    for name in args.models:
        loss_fn, params, batch = model(name, args.quick, option)
        step, state = compiled_step(loss_fn, params)
        compiled = step.lower(state, batch).compile()
        g = jax.jit(jax.grad(loss_fn))(params, batch)
        leaves = jax.tree_util.tree_leaves_with_path(g)
        np.savez(
            f"{args.grads}/{option}_{name}.npz",
            **{jax.tree_util.keystr(k): np.asarray(x) for k, x in leaves},
        )
        hlo = hlo_fingerprint(compiled.as_text())
        default = f"{args.grads}/default_{name}.hlo"
        if os.path.exists(default) and open(default).read() == hlo:
            rec[name] = {"hlo": hlo}  # the default's program: nothing to time
            continue
        with open(f"{args.grads}/{option}_{name}.hlo", "w") as f:
            f.write(hlo)
        box = [state]

        def jstep(compiled=compiled, batch=batch, box=box):
            box[0] = compiled(box[0], batch)
            return box[0]

        _, tparams, tbatch, sizes = peers.jax_model(name, _batch(name, args.quick), args.quick)
        tfns, _ = peers.torch_steps(
            ["torch_nonprivate"], name, sizes, peers.torch_batch(name, tbatch)
        )
        fns, info, errors = peers.prepare({"jax": jstep, "torch": tfns["torch_nonprivate"]})
        times = peers.time_interleaved(fns, {v: info[v]["calls"] for v in fns}, args.repeats)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        rec[name] = {
            "jax_ms": round(med["jax"], 2),
            "torch_ms": round(med["torch"], 2),
            "jax_over_torch": round(med["jax"] / med["torch"], 3),
            "hlo": hlo,
            "errors": errors,
        }
    return rec


def run_options(args) -> dict:
    """Each option in a process of its own; gradients compared with the default's."""
    import numpy as np

    out = {}
    options = ["default"] + [o for o in args.options if o != "default"]
    with tempfile.TemporaryDirectory() as grads:
        for option in options:
            flags, what = OPTIONS[option]
            env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
            cmd = [sys.executable, __file__, "--one-option", option, "--grads", grads]
            cmd += ["--models", ",".join(args.models), "--repeats", str(args.repeats)]
            cmd += ["--quick"] if args.quick else []
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                out[option] = {
                    "flags": flags,
                    "what": what,
                    "error": p.stderr.strip().splitlines()[-1:],
                }
                print(f"{option:16} FAILED {out[option]['error']}", flush=True)
                continue
            rec = json.loads(p.stdout.strip().splitlines()[-1])
            for name, r in rec.items():
                base = out.get("default", {}).get("models", {}).get(name)
                a = np.load(f"{grads}/{option}_{name}.npz")
                b = np.load(f"{grads}/default_{name}.npz")
                # max |g - g_default| / max |g_default|, both over all parameters
                r["grad_max_rel_diff"] = float(
                    max(np.abs(a[k] - b[k]).max() for k in b) / max(np.abs(b[k]).max() for k in b)
                )
                r["same_hlo_as_default"] = base is None or base["hlo"] == r["hlo"]
                if "jax_ms" not in r:
                    print(f"{option:16} {name:4} the default's program (not timed)", flush=True)
                    continue
                print(
                    f"{option:16} {name:4} jax {r['jax_ms']:8.1f} ms  torch "
                    f"{r['torch_ms']:8.1f} ms  jax/torch {r['jax_over_torch']:.2f}x  "
                    f"grad rel diff {r['grad_max_rel_diff']:.1e}",
                    flush=True,
                )
            out[option] = {"flags": flags, "what": what, "models": rec}
    return out


def run_steps(args) -> dict:
    """Each model's non-private step as it is and with each model change of
    ``STEP_CHANGES``, and torch's, timed in turns in this one process."""
    import flax.linen as fnn
    import peers

    rows = {}
    for name in args.models:
        fns = {}
        for change in ("default", *STEP_CHANGES[name]):
            base = fnn.MultiHeadDotProductAttention
            loss_fn, params, batch = model(name, args.quick, change)
            step, state = compiled_step(loss_fn, params)
            compiled = step.lower(state, batch).compile()  # traced now, with the change in place
            fnn.MultiHeadDotProductAttention = base
            fns[f"jax_{change}" if change != "default" else "jax"] = peers._stateful(
                lambda st, c=compiled, b=batch: c(st, b), state
            )
        _, _, tbatch, sizes = peers.jax_model(name, _batch(name, args.quick), args.quick)
        tfns, _ = peers.torch_steps(
            ["torch_nonprivate"], name, sizes, peers.torch_batch(name, tbatch)
        )
        fns["torch"] = tfns["torch_nonprivate"]
        fns, info, errors = peers.prepare(fns)
        times = peers.time_interleaved(fns, {v: info[v]["calls"] for v in fns}, args.repeats)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        rows[f"{name} non-private step"] = {"ms": med, "errors": errors}
        print(f"{name:4} " + "  ".join(f"{k} {v:8.1f} ms" for k, v in med.items()), flush=True)
    return rows


# --------------------------------------------------------------------------- tables


def markdown(results: dict) -> str:
    """The tables of docs/performance.md's "Where XLA:CPU loses to PyTorch" section."""
    out = []
    for part in (p for p in ("steps", "components") if p in results):
        what = "model (whole step)" if part == "steps" else "component (forward + backward)"
        out += [f"| {what} | JAX ms | torch ms | JAX / torch | other JAX |"]
        out += ["| --- | --- | --- | --- | --- |"]
        for name, row in results[part].items():
            ms = row["ms"]
            extra = ", ".join(
                f"{k.removeprefix('jax_')} {v:.2f} ms"
                for k, v in ms.items()
                if k.startswith("jax_")
            )
            ratio = ms["jax"] / ms["torch"]
            out += [
                f"| {name} | {ms['jax']:.2f} | {ms['torch']:.2f} | {ratio:.2f}x | {extra or '-'} |"
            ]
        out += [""]
    if "profile" in results:
        prof = results["profile"]
        cats = sorted({c for p in prof.values() for c in p["categories"]})
        out += ["| share of XLA:CPU's thunk time | " + " | ".join(prof) + " |"]
        out += ["| --- |" + " --- |" * len(prof)]
        for c in cats:
            cells = [
                f"{p['categories'][c]['share']:.0%}" if c in p["categories"] else "-"
                for p in prof.values()
            ]
            out += [f"| {c} | " + " | ".join(cells) + " |"]
        out += [""]
    for key in (k for k in results if k.startswith("options")):
        models = list(next(iter(results[key].values()))["models"])
        out += [
            "| option | "
            + " | ".join(f"{m}: JAX / torch" for m in models)
            + " | max gradient change |"
        ]
        out += ["| --- |" + " --- |" * (len(models) + 1)]
        for name, opt in results[key].items():
            if "models" not in opt:
                out += [f"| {name} | failed |" + " |" * len(models)]
                continue
            cells = []
            for m in models:
                r = opt["models"][m]
                cells.append(f"{r['jax_over_torch']:.2f}x" if "jax_ms" in r else "same program")
            diff = max(r["grad_max_rel_diff"] for r in opt["models"].values())
            out += [f"| {name} | " + " | ".join(cells) + f" | {diff:.1e} |"]
        out += [""]
    return "\n".join(out)


# ---------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: cnn, vit, lm")
    ap.add_argument(
        "--options", default=",".join(OPTIONS), help="comma-separated: " + ", ".join(OPTIONS)
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds")
    ap.add_argument("--quick", action="store_true", help="small batches, 1 round: a smoke run")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--one-option", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grads", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--tables", default=None, help="print the markdown tables of this JSON, and exit"
    )
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    args.models = [m for m in args.models.split(",") if m]
    args.options = [o for o in args.options.split(",") if o]
    for field, values, allowed in (
        ("--parts", args.parts, PARTS),
        ("--models", args.models, MODELS),
        ("--options", args.options, OPTIONS),
    ):
        for v in values:
            if v not in allowed:
                ap.error(f"{field}: unknown {v!r}; allowed: {', '.join(allowed)}")
    if args.tables:
        with open(args.tables) as f:
            print(markdown(json.load(f)))
        return 0
    if args.quick:
        args.repeats = 1
        import peers

        peers.MIN_SAMPLE_S = 0.05
    import peers

    threads = peers.set_threads(2)
    if args.one_option:
        print(json.dumps(one_option(args.one_option, args)))
        return 0
    import jax

    results = {
        "device": f"{jax.devices()[0].platform} {jax.devices()[0].device_kind}",
        "versions": peers.versions(),
        "threads": threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    }
    if "components" in args.parts:
        results["components"] = run_components(args)
    if "steps" in args.parts:
        results["steps"] = run_steps(args)
    if "profile" in args.parts:
        results["profile"] = {m: profile_step(m, args) for m in args.models}
    if "options" in args.parts:  # a run over some of the models is kept apart
        key = "_".join(["options", *args.models]) if args.models != list(MODELS) else "options"
        results[key] = run_options(args)
    if args.json:
        if os.path.exists(args.json):  # the parts not run this time are kept
            with open(args.json) as f:
                results = {**json.load(f), **results}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
