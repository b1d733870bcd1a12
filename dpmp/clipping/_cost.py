"""The modelled cost of ghost clipping against per-example gradients, on a device.

``method="auto"`` takes ghost clipping where every parameter sits in a
supported layer, unless per-example gradients (vmap) are cheaper on the device
the step is traced for. Both compute the same backward pass; they differ, per
example and per ghost layer of T tokens, fan-in K and fan-out N, in:

* vmap: the per-example weight gradient ``X^T G`` (``2 T K N`` flops in the grad
  dtype, as batched small products) and its ``K N`` entries written, then read
  by the norm and by the clip-weighted sum;
* ghost: the two Gram matrices (``2 T^2 (K + N)`` flops on half or float32
  operands, ``dpmp.clipping.ghost._operands``), the clip-weighted contraction
  (``2 T K N`` flops accumulated in the accumulate dtype, float64 by default) and
  the stored ``T (K + N)`` activations and output gradients, read in their dtype
  and again as float32 and as the accumulate dtype.

Costs are flops over a device's matrix-product rate plus bytes over its memory
bandwidth (``DEVICES``: round figures, H100-like for GPUs, v5e-like for TPUs,
2 CPU cores). Checked against benchmarks/results: on an H100
(``gpu_h100_transformers*.json``, private gradient over the non-private one, in
ms) per-example gradients took 12.7 and ghost clipping 3.0 more for the float32
guide ViT (bf16: 11.5 and 2.1), 2.7 and 1.6 for the byte LM, 24.4 and 15.3 at
GPT-2 small's shape (bf16: 20.1 and 12.3); on an H200 the MLP 0.60 and 0.23 ms;
on 2 CPU cores ghost clipping was the faster everywhere (guide ViT 3.2 s against
7.4 s). The model picks the faster method in each case; its ghost costs come
within 1.9x of those measured, its vmap costs within 2.5x (the GPU's
``per_example`` is fitted to these five). Layers whose per-example gradient
ghost clipping forms too cost the same either way and are left out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dpmp.clipping.ghost._operands import half_operands
from dpmp.clipping.ghost._rule import is_float
from dpmp.precision._dtypes import dtype_name

__all__ = ["DEVICES", "DeviceModel", "modelled_choice"]


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """Round figures of one kind of device.

    Attributes:
      matmul: FLOP/s of a large matrix product by operand size in bytes (2: bf16
        or fp16 operands accumulated in float32; 4: float32 at
        ``Precision.HIGHEST``, as ghost clipping reads float32; 8: float64).
      default32: FLOP/s of a float32 product at the default precision (TF32 on
        GPUs, one bf16 pass on TPUs), as the per-example gradients of a float32
        model are computed.
      per_example: the fraction of the rate that vmap's batched per-example
        products reach.
      bandwidth: memory bytes/s.
      launch: seconds per step that each ghost layer's extra operations cost
        whatever their size (kernel launches: the Gram matrices, their bound, the
        casts), against one per-example product for vmap.
      note: what about the device decides most often, for the reason string.
    """

    matmul: dict[int, float]
    default32: float
    per_example: float
    bandwidth: float
    launch: float
    note: str


DEVICES = {
    "cpu": DeviceModel(
        {2: 50e9, 4: 100e9, 8: 50e9},
        100e9,
        0.15,  # guide ViT, 2 cores: 87 GFLOP of per-example products took ~5 s more
        10e9,
        0.0,
        "on cpu bf16 is emulated through float32, and vmap's per-example products are "
        "small batched ones",
    ),
    "gpu": DeviceModel(
        {2: 400e12, 4: 40e12, 8: 40e12},
        200e12,
        # H100: the batched per-example products of the guide ViT, the byte LM and GPT-2
        # small's shape ran at 2-18% of this rate (geometric mean 5%): each example's
        # product contracts only T tokens, and writes K N numbers.
        0.05,
        3e12,
        20e-6,
        "on gpu half-precision operands run on tensor cores, 10x float32 at HIGHEST and float64",
    ),
    "tpu": DeviceModel(
        {2: 150e12, 4: 25e12, 8: 1e12},
        150e12,
        1.0,
        1e12,
        20e-6,
        "on tpu the matrix unit takes bf16 operands; float32 at HIGHEST takes 6 passes "
        "and float64 is emulated",
    ),
}


def modelled_choice(
    plan, batch_size, *, grad_dtype, clip_dtype, acc_dtype, platform=None, memory=None
):
    """``(method, reason)``: ``"ghost"`` or ``"vmap"``, whichever the model finds
    cheaper for ``plan``'s ghost layers and a batch of ``batch_size`` on ``platform``
    (default: JAX's default backend; an unknown one is modelled as a GPU), and why,
    naming the largest cost of the method not chosen. Equal costs (no ghost layer)
    choose ghost, and so do per-example gradients that would fill more than a
    quarter of the device's ``memory`` (bytes; default: what the first device
    reports, if anything)."""
    platform = platform or jax.default_backend()
    device = DEVICES.get(platform, DEVICES["gpu"])
    memory = _device_memory() if memory is None else memory
    per_example = batch_size * jnp.dtype(grad_dtype).itemsize
    # one gradient per parameter leaf, also for a table tied between two layers
    per_example *= sum({t.leaf: plan.eqn(t).invars[t.pos].aval.size for t in plan.taps}.values())
    if memory and per_example > memory / 4:
        return "ghost", (
            f"per-example gradients would take {per_example / 2**30:.3g} GiB, more than a "
            f"quarter of the device's {memory / 2**30:.3g} GiB"
        )
    ghost, vmap = {}, {}
    for tap in plan.taps:
        if tap.mode == "ghost":
            terms = _ghost_terms(plan, tap, device, clip_dtype, acc_dtype)
            _add(ghost, {k: v * batch_size for k, v in terms.items()})
            _add(ghost, {"ghost's extra operations per layer": device.launch})
            terms = _vmap_terms(plan, tap, device, grad_dtype)
            _add(vmap, {k: v * batch_size for k, v in terms.items()})
    cost_g, cost_v = sum(ghost.values()), sum(vmap.values())
    method = "vmap" if cost_v < cost_g else "ghost"
    loser = ghost if method == "vmap" else vmap
    deciding = max(loser, key=loser.get) if loser else "no layer takes a ghost norm"
    ratio = cost_g / cost_v if cost_v > 0 else 1.0
    reason = (
        f"modelled cost on {platform}: ghost clipping {ratio:.2g}x per-example gradients "
        f"(vmap); deciding: {deciding}; {device.note}"
    )
    return method, reason


def _device_memory() -> int | None:
    """The first device's memory limit in bytes, where it reports one (GPUs, TPUs)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return stats.get("bytes_limit")


def _add(total: dict, terms: dict) -> None:
    for name, seconds in terms.items():
        total[name] = total.get(name, 0.0) + seconds


def _shape(plan, tap) -> tuple[int, int, int, object]:
    """(T, K, N, activation dtype): K is 0 where the activation is integer ids."""
    eqn = plan.eqn(tap)
    t = tap.rule.rows(eqn, tap.pos)
    n = max(1, eqn.outvars[0].aval.size // max(t, 1))
    act = eqn.invars[1 - tap.pos].aval.dtype
    k = eqn.invars[tap.pos].aval.size // n if is_float(act) else 0
    return t, k, n, act


def _ghost_terms(plan, tap, device, clip_dtype, acc_dtype) -> dict[str, float]:
    t, k, n, act = _shape(plan, tap)
    out = plan.eqn(tap).outvars[0].aval.dtype
    half = tap.rule.half_operands and half_operands(act, out, clip_dtype)
    ops = jnp.dtype(half) if half else jnp.dtype(clip_dtype)
    acc = jnp.dtype(acc_dtype)
    stored = t * (k + n) * (jnp.dtype(out).itemsize + 4 + acc.itemsize)
    return {
        f"ghost's Gram matrices on {dtype_name(ops)} operands": 2
        * t
        * t
        * (k + n)
        / device.matmul[ops.itemsize],
        f"ghost's clip-weighted sums accumulated in {dtype_name(acc)}": 2
        * t
        * max(k, 1)
        * n
        / device.matmul[acc.itemsize],
        "ghost's stored activations and output gradients": stored / device.bandwidth,
    }


def _vmap_terms(plan, tap, device, grad_dtype) -> dict[str, float]:
    t, k, n, _ = _shape(plan, tap)
    size = plan.eqn(tap).invars[tap.pos].aval.size
    g = jnp.dtype(grad_dtype)
    rate = (device.default32 if g.itemsize == 4 else device.matmul[g.itemsize]) * device.per_example
    return {
        f"vmap's per-example products in {dtype_name(g)}": 2 * t * max(k, 1) * n / rate,
        "vmap's per-example gradients in memory": 3 * size * g.itemsize / device.bandwidth,
    }
