"""Convolution kernels: a parameter as the kernel of a ``conv_general_dilated``.

A kernel's per-example gradient is ``patches_i^T g_i``, so its norm is the
dense Gram form on image patches (``ConvRule.sq_norms``). Most kernels are
cheaper per example than their patches, and form their gradient instead, one
contraction per kernel offset (``ConvRule.operand_grad``). Grouped
convolutions form theirs through the vjp of the layer.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from dpmp.clipping.ghost._gram import gram, gram_magnitude_ratio, gram_mode
from dpmp.clipping.ghost._operands import contract as contract_dims
from dpmp.clipping.ghost._operands import half_operands
from dpmp.clipping.ghost._rule import Unsupported, is_float

__all__ = ["ConvRule"]

_CONV_CHUNK = 64  # examples per step when convolution norms are taken from image patches
# A convolution with few input features (I) gives each kernel offset's contraction an
# [I, O] output that XLA:CPU computes far below matmul speed (RGB input: 9 offsets of
# [3, 16] took 24 ms of the 87 ms ghost step of benchmarks/clipping.py's CNN). Up to
# this many rows, the offsets along the last kernel dim are contracted together
# ([k, I, O]): that CNN's ghost step 1.17x -> 1.02x the non-private one (f32) at the
# same temp memory; at I k = 48 (its second convolution) it was slower and larger.
# With ONE input feature the row is slower again: cnn3's 28x28x1 convolution took
# 20 ms per batch of 256 per-example kernel gradients by rows, 11 ms an offset at a
# time (the row's gather costs more than its [1, 16] contractions save): rows from
# 2 features.
_ROW_FEATURES = 16


class ConvRule:
    """Ghost norms of convolution kernels: the Gram form on image patches."""

    primitives = ("conv_general_dilated",)
    described = "convolution"
    norm = "patch-gram"
    half_operands = True  # sq_norms and operand_grad read bf16/fp16 operands as they are

    def classify(self, eqn, pos, bijective, path):
        if pos != 1:
            raise Unsupported(f"parameter {path}: used as the input of a convolution")
        p = eqn.params
        if bijective and p["feature_group_count"] == 1 and p["batch_group_count"] == 1:
            return "conv", True
        return "conv (grouped)", False

    def mode(self, eqn, pos):
        if not is_float(eqn.invars[1 - pos].aval.dtype):
            return "ghost"
        return gram_mode(*_tkn(eqn))

    def rows(self, eqn, pos):
        return _tkn(eqn)[0]

    def magnitude_ratio(self, eqn, pos, dtype, wide_dtype):
        act, out = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        ops = half_operands(act, out, dtype, anywhere=True)  # the smaller ratio: either holds
        return gram_magnitude_ratio(*_tkn(eqn), dtype, ops)

    def sq_norms(self, eqn, pos, a, g, dtype, wide_dtype):
        """Per example, the Gram form on image patches. Patches are kernel-size times
        the activation: taken a few examples at a time so they never all exist at once."""
        return lax.map(
            lambda ag: _sq_norm_conv(eqn, ag[0], ag[1], dtype, wide_dtype),
            (a, g),
            batch_size=_CONV_CHUNK,
        )

    def operand_grad(self, eqn, pos, a, g, dtype):
        return _conv_kernel_grad(eqn, a, g, dtype)

    clipped_sum = None  # the vjp of the layer, weighted


def _tkn(eqn) -> tuple[int, int, int]:
    """A convolution's (patches T, fan-in K, fan-out N) for one example."""
    w = eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    spec = eqn.params["dimension_numbers"].out_spec
    n = out[spec[1]]
    t = out[spec[0]] * math.prod(out[d] for d in spec[2:])
    return t, math.prod(w) // n, n


def _sq_norm_conv(eqn, a, g, dtype, wide_dtype):
    """A convolution's kernel gradient is patches^T g: the dense rule on image patches
    (in ``a``'s dtype: each patch entry is a copy of one entry of ``a``).

    The patches are the input slices the kernel offsets read, side by side along the
    feature dim: the Gram form ``<P P^T, G G^T>`` and the row norms ``|p_t|`` do not
    depend on the order of a patch's entries. (``lax.conv_general_dilated_patches``
    forms them with a grouped convolution, which XLA:CPU ran at 10 ms per 64 examples
    of the 7x7x32 input of benchmarks/clipping.py's ``cnn3``: most of that layer's
    norm.)
    """
    dn = eqn.params["dimension_numbers"]
    xp, size, strides = _padded(eqn, a)
    order = (dn.lhs_spec[0], *dn.lhs_spec[2:], dn.lhs_spec[1])  # batch, spatial..., feature
    slices = [
        jnp.transpose(lax.slice(xp, begin, [b + n for b, n in zip(begin, size)], strides), order)
        for begin in _offset_begins(eqn, a.ndim)
    ]
    pm = jnp.concatenate(slices, axis=-1)
    gm = jnp.transpose(g, (dn.out_spec[0], *dn.out_spec[2:], dn.out_spec[1]))
    return gram(pm.reshape(-1, pm.shape[-1]), gm.reshape(-1, gm.shape[-1]), dtype, wide_dtype)


def _padded(eqn, x):
    """``(x_pad, size, strides)``: ``x`` padded as the convolution pads it (``lhs_dilation``
    as interior padding), and the extent and strides of the slice one kernel offset reads."""
    p = eqn.params
    dn = p["dimension_numbers"]
    sp_in = dn.lhs_spec[2:]
    out_sp = tuple(eqn.outvars[0].aval.shape[d] for d in dn.out_spec[2:])
    config = [(0, 0, 0)] * x.ndim
    for s, d in enumerate(sp_in):
        lo, hi = p["padding"][s]
        config[d] = (lo, hi, p["lhs_dilation"][s] - 1)
    xp = lax.pad(x, jnp.zeros((), x.dtype), config)
    size, strides = list(xp.shape), [1] * x.ndim
    for s, d in enumerate(sp_in):
        size[d] = (out_sp[s] - 1) * p["window_strides"][s] + 1
        strides[d] = p["window_strides"][s]
    return xp, size, strides


def _offset_starts(eqn) -> np.ndarray:
    """Each kernel offset times the kernel dilation, per spatial dim: [offsets, spatial]."""
    p = eqn.params
    dn = p["dimension_numbers"]
    window = tuple(eqn.invars[1].aval.shape[d] for d in dn.rhs_spec[2:])
    starts = np.array(list(np.ndindex(*window)), np.int32) * np.array(p["rhs_dilation"], np.int32)
    return starts.reshape(-1, len(window))


def _offset_begins(eqn, ndim: int) -> list[list[int]]:
    """Per kernel offset, where its slice of the padded input begins (all dims)."""
    sp_in = eqn.params["dimension_numbers"].lhs_spec[2:]
    begins = []
    for start in _offset_starts(eqn):
        begin = [0] * ndim
        for s, d in enumerate(sp_in):
            begin[d] = int(start[s])
        begins.append(begin)
    return begins


def _conv_kernel_grad(eqn, x, g, dtype):
    """One example's kernel gradient of a convolution (one group), laid out as the kernel.

    ``dW[o, i, k] = sum_{n, y} g[n, o, y] x_pad[n, i, y * stride + k * rhs_dilation]``
    (``x_pad``: ``x`` padded, ``lhs_dilation`` as interior padding): per kernel
    offset ``k``, one contraction of the input slice that offset reads with ``g``
    over the example's batch and spatial dims, accumulated in ``dtype`` (``x``, ``g``
    in ``dtype`` at ``Precision.HIGHEST``, or both in one half dtype, read as they
    are). It is the sum the convolution's own transpose
    computes; but under ``vmap`` that transpose becomes a grouped convolution
    (``feature_group_count = B``), which XLA:CPU runs 1.5-3x slower than the
    batch's kernel gradient, while each offset here is one batched matrix
    product. Where windows overlap the offsets are a loop (``lax.map``), so that
    one slice, the size of the output times the input features, exists at a
    time: image patches, or all slices unrolled, hold them all (+44 MB on the
    CNN of benchmarks/clipping.py at batch 256, 2/3 of its non-private step's).
    With few input features the loop takes a row of offsets at a time (the last
    kernel dim's, ``_ROW_FEATURES``), so that each contraction has k I rows.
    """
    p = eqn.params
    dn = p["dimension_numbers"]
    window = tuple(eqn.invars[1].aval.shape[d] for d in dn.rhs_spec[2:])
    xp, size, strides = _padded(eqn, x)

    # Laid out once as (batch, feature, spatial...): each offset's slice is then the
    # [I, T] operand of its contraction as it is, where features last had each slice
    # transposed (a copy per offset). Per-example kernel gradients of a batch of 256:
    # cnn3's 14x14x16 convolution 36 -> 28 ms (+0.9 MB temp), the CNN's 16x16x16 one
    # 44 -> 40 ms (+4.7 MB), the ViT's patches 2.9 -> 2.8 ms (benchmarks/clipping.py).
    def in_order(v):
        return [v[d] for d in dn.lhs_spec]

    xp, size, strides = jnp.transpose(xp, dn.lhs_spec), in_order(size), in_order(strides)
    sp_in = tuple(range(2, x.ndim))
    x_c = (0, *sp_in)  # batch and spatial dims, contracted
    g_c = (dn.out_spec[0], *dn.out_spec[2:])

    def contract(xs, lead=0):  # [lead dims..., I, O]
        dims = tuple(c + lead for c in x_c)
        return contract_dims(xs, g, ((dims, g_c), ((), ())), dtype)

    def static_offset(begin):
        return contract(lax.slice(xp, begin, [b + n for b, n in zip(begin, size)], strides))

    def run_of_offsets(start, k):  # the k offsets from ``start`` along the last kernel dim
        d_last, dil = sp_in[-1], p["rhs_dilation"][-1]
        begin = [jnp.asarray(0, jnp.int32)] * x.ndim
        for s, d in enumerate(sp_in):
            begin[d] = start[s]
        span = list(size)
        span[d_last] += (k - 1) * dil
        xr = lax.dynamic_slice(xp, begin, span)  # under vmap a gather
        slices = []
        for j in range(k):
            lo = [0] * x.ndim
            lo[d_last] = j * dil
            slices.append(lax.slice(xr, lo, [a + n for a, n in zip(lo, size)], strides))
        return contract(jnp.stack(slices), lead=1)  # [k, I, O]

    starts = _offset_starts(eqn)
    reach = [(k - 1) * r + 1 for k, r in zip(window, p["rhs_dilation"])]
    if all(k <= st for k, st in zip(reach, p["window_strides"])):
        # Windows that do not overlap (patch embeddings): the slices together are no
        # larger than the input, and unrolled they need no loop and no gather.
        begins = [in_order(b) for b in _offset_begins(eqn, x.ndim)]
        per_offset = jnp.stack([static_offset(begin) for begin in begins])
    else:
        # Few input features (2 or more): a row of offsets per contraction
        # (``_ROW_FEATURES``).
        features = xp.shape[1]
        k = window[-1] if 1 < features and features * window[-1] <= _ROW_FEATURES else 1
        runs = lax.map(lambda start: run_of_offsets(start, k), jnp.asarray(starts[::k]))
        per_offset = runs.reshape((-1,) + runs.shape[2:])
    kio = per_offset.reshape(window + per_offset.shape[1:])  # [k..., I, O]
    dims = (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])  # the kernel dim of each axis
    return jnp.transpose(kio, np.argsort(dims))
