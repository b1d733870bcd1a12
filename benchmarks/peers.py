"""The whole private step, side by side with Opacus and jax-privacy, on the same models.

Four models, built in JAX (flax linen: the modules of ``benchmarks/clipping.py``
and ``benchmarks/transformers.py``) and in PyTorch, with equal parameter counts
(the script asserts it):

* ``mlp``  784-1024-1024-1024-10, ReLU; 2,913,290 parameters, batch 256;
* ``cnn``  two 3x3 convolutions (16, 32 channels) with 2x2 average pooling on
  32x32x3, a linear head; 25,578 parameters, batch 256;
* ``vit``  4x4 patches of 32x32x3 (64 tokens), dim 64, 2 pre-LN blocks, 4 heads,
  MLP 128; 74,954 parameters, batch 256;
* ``lm``   the byte-level causal transformer language model (vocabulary 256,
  context 128, width 256, 4 blocks, 4 heads, MLP 1024); 3,323,648 parameters,
  batch 32; each record's loss is the mean over its own (unpadded) tokens.

and two for GPUs (``--models guide_vit,gpt2``; not in the default list):

* ``guide_vit`` the ViT of ``benchmarks/transformers.py`` (width 384, 6 blocks, 8 heads,
  MLP 1536); 10,694,794 parameters, batch 64;
* ``gpt2`` the language model above at GPT-2 small's shape (vocabulary 50,257, width
  768, 12 blocks, 12 heads, MLP 3072, untied head, 128 tokens); 162,399,313
  parameters, batch 16.

In PyTorch, attention is four ``nn.Linear`` layers around
``F.scaled_dot_product_attention`` and the learned positions an ``nn.Embedding``
of the token positions, so that every Opacus mode can take the models.

Every variant is a FULL training step -- forward, backward, per-example clip at
norm 1, sum, Gaussian noise at noise multiplier 1, Adam (learning rate 1e-3) --
or the same step without clipping and noise:

* ``jax_nonprivate``    ``jax.grad`` of the batch's mean loss, ``optax.adam``, one jit;
* ``dpmp``              ``dpmp.private_step`` around ``dpmp.private_grad`` (policy
  fp32, ``method="auto"``), with dpmp's default noise (``noise_sampler="snapped"``);
* ``dpmp_plain``        the same with ``noise_sampler="plain"`` (``jax.random.normal``);
* ``dpmp_f32sum``       the default step with the clipped sum accumulated in float32
  (``accumulation="policy"``: Higham's rounding bound accounted in the sensitivity);
* ``dpmp_nonoise``      the default step at noise multiplier 0 (clipping alone; not
  private): with ``dpmp`` and ``dpmp_f32sum``, what the noise and the float64 sum cost;
* ``jaxprivacy``        ``jax_privacy.clipping.clipped_grad`` (per-example gradients),
  ``jax_privacy.noise_addition.gaussian_privatizer``, then ``1 / B`` and Adam, one jit;
* ``torch_nonprivate``  ``loss.backward()`` and ``torch.optim.Adam``;
* ``opacus_hooks``, ``opacus_ghost``, ``opacus_functorch``: Opacus's
  ``PrivacyEngine.make_private`` with that ``grad_sample_mode`` (flat clipping, no
  Poisson sampling, expected batch size B) around ``torch.optim.Adam``; the ghost
  step calls ``DPTensorFastGradientClipping(...).backward()`` on the per-example
  losses (its two backward passes).

Timing follows ``benchmarks/clipping.py``: a warm-up step (for JAX, after
compiling), then ``--repeats`` interleaved rounds in which every variant of a
model is timed in turn, a sample being the mean of enough back-to-back steps
to last ~0.5 s; variants that take a second or more per step are timed in
rounds of their own after the others. The state (parameters, optimizer state,
noise key) carries from step to step, as in training. It reports per model
each variant's median time per step, its ratio to its own framework's
non-private step, and its ratio to the fastest Opacus mode in absolute time.

Threads: ``OMP_WAIT_POLICY=PASSIVE`` is set before anything is imported (unless
already set), torch gets ``torch.set_num_threads(--threads)``, and XLA:CPU,
which sizes its thread pool from the CPUs the process may run on, gets the
same number by pinning the process to ``--threads`` CPUs when it may use more
(both frameworks then share those CPUs; they never run at once). All are
recorded in the JSON (``--json``) with the versions of every package involved.

``--policy bf16`` builds the JAX models in bf16 compute (float32 parameters) with
dpmp's ``bf16`` policy, and runs torch's forward pass and loss under ``torch.autocast``
in bf16 (float32 parameters and Adam on both sides); the default is float32.

On a GPU (``--device cuda``, the default where torch sees one) torch runs on it too,
its float32 products in TF32 as XLA:GPU's default precision runs them, a torch step is
timed up to ``torch.cuda.synchronize()``, and no thread count is set.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: torch 2.13.0, CPU
build, and Opacus); torch is imported only once the arguments are read.

    python benchmarks/peers.py --json peers.json          # all four models
    python benchmarks/peers.py --models mlp,lm --repeats 3
    python benchmarks/peers.py --quick                    # tiny batches: a smoke run
    python benchmarks/peers.py --models lm --policy bf16  # bf16 compute, torch autocast
"""

from __future__ import annotations

import os

# Read by OpenMP (torch's, XLA's oneDNN) when it loads: before any import that may load it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

JAX_VARIANTS = ("jax_nonprivate", "dpmp", "dpmp_plain", "dpmp_f32sum", "dpmp_nonoise", "jaxprivacy")
TORCH_VARIANTS = ("torch_nonprivate", "opacus_hooks", "opacus_ghost", "opacus_functorch")
VARIANTS = JAX_VARIANTS + TORCH_VARIANTS
# --policy: dpmp's policy for the JAX steps; torch runs the bf16 one under autocast.
POLICIES = {"f32": "fp32", "bf16": "bf16"}
MODELS = ("mlp", "cnn", "vit", "lm", "guide_vit", "gpt2")
DEFAULT_MODELS = ("mlp", "cnn", "vit", "lm")  # the CPU table; the last two are for GPUs
# GPT-2 small's shape in benchmarks/transformers.py's language model (untied head, 128 tokens).
GPT2_SHAPE = dict(vocab=50257, context=128, width=768, mlp=3072, heads=12, depth=12)
CLIP, SIGMA, LEARNING_RATE = 1.0, 1.0, 1e-3
NOISE_KEY_SEED = 0  # the benchmarks' noise key: public, as a benchmark may; never a run's
# dpmp's variants: (noise sampler, accumulation of the clipped sum, noise multiplier). The
# last two are not private steps of the default kind; they say what the default's parts cost.
DPMP_VARIANTS = {
    "dpmp": ("snapped", "float64", SIGMA),
    "dpmp_plain": ("plain", "float64", SIGMA),
    "dpmp_f32sum": ("snapped", "policy", SIGMA),
    "dpmp_nonoise": ("snapped", "float64", 0.0),
}
IMAGE_SHAPES = {"mlp": (28, 28, 1), "cnn": (32, 32, 3), "vit": (32, 32, 3)}
BATCH = {"mlp": 256, "cnn": 256, "vit": 256, "lm": 32, "guide_vit": 64, "gpt2": 16}
QUICK_BATCH = {"mlp": 8, "cnn": 8, "vit": 8, "lm": 4, "guide_vit": 8, "gpt2": 4}
MIN_SAMPLE_S = 0.5  # a fast step is timed as the mean of enough steps to last this long
PACKAGES = ("dpmp", "jax", "jaxlib", "flax", "optax", "jax-privacy", "numpy", "torch", "opacus")


# ----------------------------------------------------------------------------- JAX


def jax_model(model: str, batch_size: int, quick: bool, policy: str = "f32"):
    """``(loss_fn, params, batch, sizes)``: the model of dpmp's own benchmarks, computing in
    ``policy``'s compute dtype (parameters float32)."""
    if model in ("lm", "gpt2", "guide_vit"):
        import transformers as tfm  # benchmarks/transformers.py

        if model == "guide_vit":
            sizes = dict(tfm.VIT_QUICK if quick else tfm.VIT_FULL, batch=batch_size)
        else:
            full = tfm.LM_FULL if model == "lm" else dict(tfm.LM_FULL, **GPT2_SHAPE)
            sizes = dict(tfm.LM_QUICK if quick else full, batch=batch_size)
        family = "guide_vit" if model == "guide_vit" else "lm"
        loss_fn, params, batch, _ = tfm.build(family, policy, sizes)
        return loss_fn, params, batch, sizes
    import clipping  # benchmarks/clipping.py

    loss_fn, params, batch = clipping.build(model, POLICIES[policy], batch_size)
    return loss_fn, params, batch, {"batch": batch_size}


def jax_steps(
    variants, loss_fn, params, batch, policy: str = "f32", donate: bool = False
) -> dict[str, Callable]:
    """Each JAX variant as ``step()``: one full training step from the state it keeps;
    ``donate``: dpmp's steps and the non-private one take over their state's buffers
    (each from its own copy of ``params``)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax_privacy import clipping as jp_clipping
    from jax_privacy import noise_addition

    def own():  # a donating step deletes the state it is given
        return jax.tree.map(jnp.copy, params) if donate else params

    b = len(jax.tree.leaves(batch)[0])
    fns = {}
    if "jax_nonprivate" in variants:
        adam = optax.adam(LEARNING_RATE)
        fns["jax_nonprivate"] = _stateful(
            *optax_step(jax.grad(loss_fn), adam, own(), batch, donate=donate)
        )
    for name, (sampler, accumulation, sigma) in DPMP_VARIANTS.items():
        if name in variants:
            step, pad = dpmp_step(
                loss_fn, params, batch, policy, sampler, accumulation, sigma, donate=donate
            )
            fns[name] = _stateful(
                lambda s, step=step, pad=pad: step(s, batch, pad)[0], step.init(own())
            )
    if "jaxprivacy" in variants:
        clipped = jp_clipping.clipped_grad(loss_fn, l2_clip_norm=CLIP, batch_argnums=1)
        optimizer = optax.chain(
            noise_addition.gaussian_privatizer(
                stddev=SIGMA * CLIP, prng_key=jax.random.key(NOISE_KEY_SEED)
            ),
            optax.scale(1.0 / b),
            optax.adam(LEARNING_RATE),
        )
        fns["jaxprivacy"] = _stateful(*optax_step(clipped, optimizer, params, batch))
    return fns


def optax_step(grad_fn, optimizer, params, batch, donate: bool = False) -> tuple[Callable, Any]:
    """``(step, state)``: the jitted ``step(state) -> state`` that applies ``optimizer``
    to ``grad_fn(params, batch)``, and its first state; ``donate``: the step takes
    over the state's buffers."""
    import functools

    import jax
    import optax

    @functools.partial(jax.jit, donate_argnums=0 if donate else ())
    def step(state):
        p, s = state
        updates, s = optimizer.update(grad_fn(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    return step, (params, optimizer.init(params))


def dpmp_step(
    loss_fn,
    params,
    batch,
    policy: str = "f32",
    sampler: str = "snapped",
    accumulation: str = "float64",
    sigma: float = SIGMA,
    method: str = "auto",
    donate: bool = False,
):
    """``(step, pad)``: ``dpmp.private_step`` of ``dpmp.private_grad(loss_fn, method=...)``
    and Adam, for the whole batch as one Poisson sample without padding (``pad``: its
    padding mask, all False); ``donate`` as ``private_step``'s."""
    import jax
    import jax.numpy as jnp
    import optax

    import dpmp

    b = len(jax.tree.leaves(batch)[0])
    grad_fn = dpmp.private_grad(
        loss_fn,
        l2_clip_norm=CLIP,
        policy=POLICIES[policy],
        method=method,
        accumulation=accumulation,
    )
    step = dpmp.private_step(
        grad_fn,
        optax.adam(LEARNING_RATE),
        params=params,
        batch=batch,
        noise_multiplier=sigma,
        # a benchmark's noise: a known key is fine here, never in training
        noise_key=jax.random.key(NOISE_KEY_SEED),
        expected_batch_size=b,
        padded_batch_size=b,
        noise_sampler=sampler,
        donate=donate,
    )
    return step, jnp.zeros((b,), bool)


def _stateful(fn: Callable, state) -> Callable:
    """``step()`` that replaces the kept state by ``fn(state)`` and returns it."""
    box = [state]

    def step():
        box[0] = fn(box[0])
        return box[0]

    return step


def dpmp_method(loss_fn, params, batch, policy: str = "f32") -> str:
    """What ``dpmp.private_grad(method="auto")`` chooses for the model, and why."""
    import dpmp

    g = dpmp.private_grad(loss_fn, l2_clip_norm=CLIP, policy=POLICIES[policy], method="auto")
    try:
        ex = g.explain(params, batch)
    except Exception as e:  # noqa: BLE001 - informative only
        return f"unknown ({type(e).__name__}: {e})"
    return ex["method"] + (f" ({ex['reason']})" if ex.get("reason") else "")


# ------------------------------------------------------------------------- PyTorch


def torch_module(model: str, sizes: dict):
    """The PyTorch twin of the JAX model (same layers, same parameter count)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class SelfAttention(nn.Module):
        """flax's ``MultiHeadDotProductAttention``: q, k, v and output projections
        with biases around a (fused) scaled dot-product attention."""

        def __init__(self, dim: int, heads: int, causal: bool):
            super().__init__()
            self.heads, self.causal = heads, causal
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

        def forward(self, x):
            b, t, d = x.shape

            def split(y):
                return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

            y = F.scaled_dot_product_attention(
                split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=self.causal
            )
            return self.o(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        """Pre-LN: x + attn(LN(x)), then x + MLP(LN(x)) with tanh-GELU (flax's ``gelu``)."""

        def __init__(self, dim: int, heads: int, mlp: int, causal: bool):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
            self.attn = SelfAttention(dim, heads, causal)
            self.mlp = nn.Sequential(
                nn.Linear(dim, mlp), nn.GELU(approximate="tanh"), nn.Linear(mlp, dim)
            )

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Transformer(nn.Module):
        """Embedding (patches or tokens), learned positions, blocks, LayerNorm, head."""

        def __init__(self, embed, tokens, dim, heads, mlp, depth, out, causal, pool):
            super().__init__()
            self.embed, self.pool = embed, pool
            self.pos = nn.Embedding(tokens, dim)  # learned positions, as Opacus takes them
            self.blocks = nn.Sequential(*(Block(dim, heads, mlp, causal) for _ in range(depth)))
            self.ln, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, out)

        def forward(self, x):
            x = self.embed(x)
            if x.dim() == 4:  # patches: [B, C, H', W'] -> [B, tokens, C]
                x = x.flatten(2).transpose(1, 2)
            b, t, _ = x.shape
            # contiguous: Opacus's ghost norm of an embedding views its indices flat
            positions = torch.arange(t, device=x.device).expand(b, t).contiguous()
            x = x + self.pos(positions)
            x = self.ln(self.blocks(x))
            return self.head(x.mean(1) if self.pool else x)

    if model == "mlp":
        layers = [nn.Flatten()]
        for a, w in zip((784, 1024, 1024), (1024, 1024, 1024)):
            layers += [nn.Linear(a, w), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(1024, 10))
    if model == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
            nn.Flatten(), nn.Linear(8 * 8 * 32, 10),
        )  # fmt: skip
    if model == "vit":
        patches = nn.Conv2d(3, 64, 4, stride=4)
        return Transformer(patches, 64, 64, 4, 128, 2, 10, causal=False, pool=True)
    s = sizes
    if model == "guide_vit":
        patches = nn.Conv2d(3, s["width"], s["patch"], stride=s["patch"])
        tokens = (s["image"] // s["patch"]) ** 2
        return Transformer(
            patches, tokens, s["width"], s["heads"], s["mlp"], s["depth"], s["classes"],
            causal=False, pool=True,
        )  # fmt: skip
    tokens = nn.Embedding(s["vocab"], s["width"])
    return Transformer(
        tokens, s["context"], s["width"], s["heads"], s["mlp"], s["depth"], s["vocab"],
        causal=True, pool=False,
    )  # fmt: skip


def torch_batch(batch, device: str) -> dict:
    """The JAX batch as torch tensors on ``device`` (images NHWC -> NCHW)."""
    import numpy as np
    import torch

    if "tokens" in batch:
        out = {
            "tokens": np.asarray(batch["tokens"], np.int64),
            "targets": np.asarray(batch["targets"], np.int64),
            "mask": np.asarray(batch["mask"], np.float32),
        }
    else:
        x = np.ascontiguousarray(np.asarray(batch["x"], np.float32).transpose(0, 3, 1, 2))
        out = {"x": x, "y": np.asarray(batch["y"], np.int64)}
    return {k: torch.from_numpy(v).to(device) for k, v in out.items()}


def per_example_loss(module, batch):
    """``[B]`` losses: cross-entropy, or for the LM the mean over each record's own tokens."""
    from torch.nn import functional as F

    if "x" in batch:
        return F.cross_entropy(module(batch["x"]), batch["y"], reduction="none")
    logits = module(batch["tokens"])
    ce = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
    m = batch["mask"]
    return (ce.view_as(m) * m).sum(1) / m.sum(1).clamp(min=1.0)


def torch_steps(
    variants, model: str, sizes: dict, batch, device: str, policy: str = "f32"
) -> tuple[dict, int]:
    """Each PyTorch variant as ``step()`` on ``device``, and the model's parameter count;
    with ``policy="bf16"`` the forward pass and loss run under ``torch.autocast`` in bf16
    (float32 parameters and optimizer, as dpmp's bf16 policy keeps them)."""
    import torch

    fns, count = {}, None
    for name in variants:
        torch.manual_seed(0)
        module = torch_module(model, sizes).to(device)
        count = sum(p.numel() for p in module.parameters())
        optimizer = torch.optim.Adam(module.parameters(), lr=LEARNING_RATE)
        if name == "torch_nonprivate":
            fns[name] = _torch_step(module, optimizer, batch, False, device, policy)
            continue
        mode = name.removeprefix("opacus_")
        rows = len(batch["mask" if "mask" in batch else "y"])
        module, optimizer = _make_private(module, optimizer, mode, rows)
        fns[name] = _torch_step(module, optimizer, batch, mode == "ghost", device, policy)
    return fns, count


def _make_private(module, optimizer, mode: str, batch_size: int):
    """Opacus's ``make_private`` in ``grad_sample_mode=mode``: flat clipping at ``CLIP``,
    noise multiplier ``SIGMA``, expected batch size ``batch_size`` (a loader of one batch)."""
    import torch
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(batch_size, 1)), batch_size=batch_size
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]ecure RNG.*")
        out = PrivacyEngine().make_private(
            module=module,
            optimizer=optimizer,
            criterion=torch.nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
    return out[0], out[1]


def _torch_step(module, optimizer, batch, ghost: bool, device: str, policy: str) -> Callable:
    """``step()``: forward, backward (Opacus's two passes for ghost), ``optimizer.step()``."""
    import torch
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    module.train()
    bf16 = policy == "bf16"

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            losses = per_example_loss(module, batch)
        if ghost:
            DPTensorFastGradientClipping(module, optimizer, losses, "mean").backward()
        else:
            losses.mean().backward()
        optimizer.step()

    return step


# -------------------------------------------------------------------------- timing


def _block(out) -> None:
    """Wait for a step's work: JAX's arrays, and torch's queued CUDA kernels (a torch step
    returns nothing; on a GPU its kernels run after ``step()`` returns)."""
    import jax

    jax.block_until_ready(out)
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        sys.modules["torch"].cuda.synchronize()


def prepare(fns: dict[str, Callable]) -> tuple[dict, dict, dict]:
    """First step (compiles a JAX step), a warm-up and a calibration step per variant.

    Returns ``(fns, info, errors)``: ``info[v]`` has ``first_step_s`` and ``calls``
    (steps per sample); ``errors[v]`` the message of a variant that failed.
    """
    ok, info, errors = {}, {}, {}
    for name, step in fns.items():
        print(f"  {name}: first steps ...", end="\r", file=sys.stderr, flush=True)
        try:
            t = time.perf_counter()
            _block(step())
            first = time.perf_counter() - t
            _block(step())  # warm-up
            t = time.perf_counter()
            _block(step())
            once = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"  {name}: FAILED {errors[name]}\n{traceback.format_exc(limit=-3)}")
            continue
        ok[name] = step
        info[name] = {"first_step_s": first, "calls": max(1, min(100, round(MIN_SAMPLE_S / once)))}
    return ok, info, errors


def time_interleaved(fns: dict[str, Callable], calls: dict[str, int], repeats: int) -> dict:
    """``repeats`` rounds, each timing every variant in turn over ``calls[v]`` steps
    (seconds per step); variants of one step per sample in rounds of their own, after
    the others (what such a step frees slows the next one down: see clipping.py)."""
    fast = {v: f for v, f in fns.items() if calls[v] > 1}
    slow = {v: f for v, f in fns.items() if calls[v] == 1}
    times = {v: [] for v in fns}
    for group in (fast, slow):
        for _ in range(repeats):
            for v, step in group.items():
                t = time.perf_counter()
                for _ in range(calls[v]):
                    out = step()
                _block(out)
                times[v].append((time.perf_counter() - t) / calls[v])
    return times


# ---------------------------------------------------------------------------- main


def set_threads(threads: int, device: str) -> dict:
    """torch's intra-op threads, and XLA:CPU's (by CPU affinity); what each got.

    On a GPU (``device="cuda"``) the host threads are left as they are (XLA:GPU compiles on
    all of them), and torch's float32 matrix products use TF32 like XLA:GPU's default
    precision does, so that both frameworks run float32 at the same rate.
    """
    import opacus  # noqa: F401  (checked here, used later)
    import torch

    if device == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        return {
            "torch_device": torch.cuda.get_device_name(),
            "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
            "machine_cpus": os.cpu_count(),
        }
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > threads:
        os.sched_setaffinity(0, cpus[:threads])
    torch.set_num_threads(threads)
    return {
        "torch_intra_op": torch.get_num_threads(),
        "torch_inter_op": torch.get_num_interop_threads(),
        "xla_cpu_affinity": len(os.sched_getaffinity(0)),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "machine_cpus": os.cpu_count(),
    }


def versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def run_model(model: str, variants, args) -> dict:
    """Build, check the parameter counts, time, and print one model's table."""
    batch_size = (QUICK_BATCH if args.quick else BATCH)[model]
    loss_fn, params, batch, sizes = jax_model(model, batch_size, args.quick, args.policy)
    import jax

    jax_count = sum(x.size for x in jax.tree.leaves(params))
    jax_variants = [v for v in variants if v in JAX_VARIANTS]
    fns = jax_steps(jax_variants, loss_fn, params, batch, args.policy, args.donate)
    tfns, torch_count = torch_steps(
        [v for v in variants if v in TORCH_VARIANTS],
        model,
        sizes,
        torch_batch(batch, args.device),
        args.device,
        args.policy,
    )
    assert torch_count in (None, jax_count), f"{model}: {torch_count} torch, {jax_count} JAX params"
    method = dpmp_method(loss_fn, params, batch, args.policy)
    both = "in both" if torch_count else "(JAX only)"
    print(f"\n{model}: {jax_count:,} parameters {both}, batch {batch_size}; dpmp: {method}")
    fns, info, errors = prepare({**fns, **tfns})
    print(" " * 40, end="\r", file=sys.stderr, flush=True)  # clears the progress line
    times = time_interleaved(fns, {v: info[v]["calls"] for v in fns}, args.repeats)
    med = {v: statistics.median(t) for v, t in times.items()}
    opacus = [v for v in med if v.startswith("opacus_")]
    fastest = min(opacus, key=med.get) if opacus else None
    rec = dict(params=jax_count, batch=batch_size, sizes=sizes, dpmp_method=method)
    rec.update(fastest_opacus=fastest, variants={}, errors=errors)
    header = f"{'variant':17} {'ms/step':>10} {'x own non-private':>18} "
    header += f"{'x ' + (fastest or 'Opacus'):>20}"
    print(header + "\n" + "-" * len(header))
    for v in variants:
        if v in errors:
            print(f"{v:17} {'failed':>10}")
            continue
        base = "jax_nonprivate" if v in JAX_VARIANTS else "torch_nonprivate"
        r = dict(info[v], median_s=med[v], times_s=times[v])
        r["x_own_nonprivate"] = med[v] / med[base] if base in med else None
        r["x_fastest_opacus"] = med[v] / med[fastest] if fastest else None
        rec["variants"][v] = r
        print(
            f"{v:17} {med[v] * 1e3:10.2f} {_x(r['x_own_nonprivate']):>18} "
            f"{_x(r['x_fastest_opacus']):>20}",
            flush=True,
        )
    return rec


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated: {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; quick 1)")
    ap.add_argument(
        "--policy",
        choices=tuple(POLICIES),
        default="f32",
        help="compute dtype: dpmp's policy for JAX, torch.autocast for bf16 (default f32)",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch's and XLA:CPU's threads")
    ap.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="torch's device (auto: cuda where torch sees a GPU)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="batches of 8 (LM: 4, tiny sizes), 1 round, ~0.05 s samples, XLA backend "
        "optimisation level 0: a smoke run",
    )
    ap.add_argument(
        "--donate",
        action="store_true",
        help="dpmp's steps and JAX's non-private one take over their state's buffers "
        "(private_step's donate=True)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: unknown {m!r}; allowed: {', '.join(MODELS)}")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; allowed: {', '.join(VARIANTS)}")
    for base, family in (("jax_nonprivate", JAX_VARIANTS), ("torch_nonprivate", TORCH_VARIANTS)):
        if base not in variants and any(v in family for v in variants):
            variants.insert(0, base)
    variants = [v for v in VARIANTS if v in variants]
    # torch's note on a first layer whose input needs no gradient, and Opacus's functorch
    # mode's on float32 autocast on CPU: both expected here, neither changes a result.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    if args.quick:
        global MIN_SAMPLE_S
        MIN_SAMPLE_S = 0.05
        flags = os.environ.get("XLA_FLAGS", "")  # read when the first jax call makes the backend
        if "xla_backend_optimization_level" not in flags:
            os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
    try:
        import torch

        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        # before JAX makes its backend: XLA:CPU sizes its thread pool from the CPU affinity
        threads = set_threads(args.threads, args.device)
    except ImportError:
        sys.exit("benchmarks/peers.py needs torch and opacus: pip install -e '.[bench]'")
    import jax

    device = jax.devices()[0]
    results = {
        "device": f"{device.platform} {device.device_kind}",
        "cpu": platform.processor() or platform.machine(),
        "versions": versions(),
        "torch_device": args.device,
        "policy": args.policy,
        "donate": args.donate,
        "threads": threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "clip_norm": CLIP,
        "noise_multiplier": SIGMA,
        "learning_rate": LEARNING_RATE,
        "models": {},
    }
    v = results["versions"]
    print(
        f"{results['device']}; jax {v['jax']}, dpmp {v['dpmp']}, jax-privacy {v['jax-privacy']}, "
        f"torch {v['torch']}, opacus {v['opacus']}; policy {args.policy}; threads: {threads}; "
        f"{args.repeats} round(s)"
    )
    for model in models:
        results["models"][model] = run_model(model, variants, args)
        if args.json:  # rewritten after every model
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
