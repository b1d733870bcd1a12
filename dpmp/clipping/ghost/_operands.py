"""Half-precision operands for the ghost contractions, and the rounding they bring.

Under a half-precision policy the layers' activations ``x_t`` and output
gradients ``g_t`` are stored in bf16 or fp16. The Gram matrices ``X X^T``,
``G G^T`` and a formed per-example gradient ``X^T G`` can read those values as
they are, with float32 accumulation (``preferred_element_type=float32``), where
GPUs and TPUs run them on their matrix units; cast to float32 first, a
``Precision.HIGHEST`` contraction runs at the float32 rate (on an H100 about a
fifteenth of the bf16 one).

Such a contraction rounds only where it adds. A product of two bf16 values (8
significant bits each) or two fp16 values (11) has at most 22 significant bits
and is exact in float32 (a bf16 product can still overflow float32 or fall
below its normal range, as a product of float32 values can; these bounds, as
the float32 ones before them, leave underflow out). The sums
are the backend's, in an order and grouping it does not state: GPU tensor
cores add a block of ``k`` products and the running sum at once, each term
aligned to the largest and truncated, then normalise with truncation (Fasi,
Higham, Mikaitis and Pranesh 2021, "Numerical behavior of NVIDIA tensor
cores", PeerJ Comput. Sci. 7:e330). Each of those ``k + 2`` truncations loses
less than ``2^-23`` of the block's largest term, so a block adds at most ``(k +
2) 2^-23`` of the sum of its terms' magnitudes: per product at most ``2^-22``
for any ``k >= 2`` (``2^-24`` for an ordinary round-to-nearest sum). The bounds
of ``dpmp.clipping.ghost._gram`` therefore take ``u = 2^-22``
(``HALF_ACCUMULATION_U``) for every accumulation of half-precision
operands, four times float32's unit roundoff; a float32 operand keeps ``u =
2^-24`` and the contraction it enters is unchanged.

Where they run. On GPUs and TPUs half operands are the default: their matrix
units take them directly. On CPUs, where XLA emulates bf16 through float32,
the contractions read float32 operands as before: measured side by side on 2
CPU cores (benchmarks/ghost_operands.py, bf16 ghost step), half operands took
1.02x (MLP), 1.13x (CNN, its per-example kernel gradients), 1.03x (ViT), 1.01x
(guide ViT) and 0.94x (lm) the time, with compiled temporary memory within
+7.5% and -3%. ``operands`` overrides the choice for what is traced inside
it.

The larger ``u`` makes the certified norms of ordinary examples larger by about
``(K + N + 2 T) (2^-22 - 2^-24)`` relative (mean norm 1.0008x on the guide ViT,
1.001x on the lm of benchmarks/transformers.py): they are clipped that much harder.

A Gram bound grows like ``(T^2 + K + N) u`` on a cancelling example, so a
layer whose half-operand bound would pass the 5% the plan allows reads
float32 operands instead (``dpmp.clipping.ghost._gram.gram_operands``).

The output gradients stored in half precision still carry the loss scale
``S``; the clipped sum reads ``fl(g_t / S)`` (float32, the scale divided out
first). A norm taken from the scaled ``g_t`` is unscaled afterwards with a bound
on that elementwise rounding (``unscaled_norms``).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax

from dpmp.clipping._rounding import HIGHEST, unit_roundoff

__all__ = [
    "HALF_ACCUMULATION_U",
    "accumulation_roundoff",
    "contract",
    "dot_precision",
    "half_operands",
    "is_half",
    "operands",
    "unscaled_norms",
]

HALF_ACCUMULATION_U = 2.0**-22  # float32 accumulation of exact half products, any order
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_KINDS = ("auto", "half", "float32")
_chosen = ["auto"]


@contextlib.contextmanager
def operands(kind: str):
    """Within it, traced ghost contractions read ``"half"`` operands wherever they are
    stored in half precision, ``"float32"`` ones always (as before half operands were
    read), or (``"auto"``) whichever the device runs faster: half except on CPU.
    For measuring one against the other in one process, and for checking the
    half-operand bound on a CPU."""
    if kind not in _KINDS:
        raise ValueError(f"operands: unknown {kind!r}; allowed: {', '.join(_KINDS)}")
    _chosen.append(kind)
    try:
        yield
    finally:
        _chosen.pop()


def device_reads_half() -> bool:
    """Whether traced contractions read stored half operands: ``operands(...)`` if
    given, else half except on CPU (bf16 emulated there)."""
    if _chosen[-1] != "auto":
        return _chosen[-1] == "half"
    return jax.default_backend() != "cpu"


def half_operands(act_dtype, out_dtype, dtype, *, anywhere: bool = False):
    """The half dtype a layer's ghost contractions read, or ``None`` (they read ``dtype``).

    Half where ``dtype`` (the clip dtype) is float32 and the layer's floating
    operands (its activation, unless integer ids, and its output gradient) are
    both in one half dtype (bf16 or fp16), on a device that reads them
    (``device_reads_half``), or on any with ``anywhere`` (for a bound that
    must hold whichever was traced).
    """
    if not (anywhere or device_reads_half()) or jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        return None
    floats = {jnp.dtype(d) for d in (act_dtype, out_dtype) if jnp.issubdtype(d, jnp.floating)}
    if len(floats) != 1 or not floats <= set(_HALF):
        return None
    return floats.pop()


def accumulation_roundoff(operands, dtype) -> float:
    """The ``u`` that bounds a contraction of ``operands`` accumulated in ``dtype``:
    ``dtype``'s own for operands in ``dtype`` (or ``None``), else ``HALF_ACCUMULATION_U``."""
    if operands is None or jnp.dtype(operands) == jnp.dtype(dtype):
        return unit_roundoff(dtype)
    return HALF_ACCUMULATION_U


def dot_precision(operands, dtype):
    """``Precision.HIGHEST`` for operands in ``dtype`` (no TF32); the default for half
    operands, which it reads as they are (only float32 operands can be cut to fewer bits)."""
    if jnp.dtype(operands) == jnp.dtype(dtype):
        return HIGHEST
    return None


def unscaled_norms(sq, m, inv, dtype, ratio: float):
    """``(sq, m)`` of a norm taken from scaled output gradients ``G_s``, made those of the
    float32 gradients ``fl(G_s inv)`` the clipped sum reads.

    ``||A^T fl(G_s inv)||`` is at most ``inv ||A^T G_s|| + u inv sum_t |a_t| |g_t|``
    (each entry of ``fl(G_s inv)`` is within ``u`` of ``inv`` times it), and the
    magnitude ``m`` is at least ``ratio`` (``GhostRule.magnitude_ratio``) times that
    sum, so ``2 u m / ratio`` covers it and its own rounding. The other five
    roundings of the result are covered by the factors ``(1 + 8 u)`` and ``(1 + 4
    u)``. NaN stays NaN.
    """
    u = unit_roundoff(dtype)
    inv = inv.astype(dtype)
    m = m * inv
    term = jnp.asarray(2 * u / ratio if ratio > 0 else jnp.inf, dtype)
    norm = (jnp.sqrt(sq) * inv + term * m) * jnp.asarray(1 + 8 * u, dtype)
    return jnp.square(norm) * jnp.asarray(1 + 4 * u, dtype), m


def is_half(x) -> bool:
    return jnp.dtype(x) in _HALF


def contract(x, y, dims, dtype):
    """``lax.dot_general(x, y, dims)`` accumulated in ``dtype`` at ``dot_precision``."""
    return lax.dot_general(
        x, y, dims, precision=dot_precision(x.dtype, dtype), preferred_element_type=dtype
    )
