"""A parameter tied between an embedding and an output projection (GPT-2's ``wte``).

Most published language models use one table ``W [V, D]`` twice: as the input
embedding (``ids -> W[ids]``, ``dpmp.clipping.ghost._embedding``) and as the
output projection (``logits = h W^T``, a dense layer,
``dpmp.clipping.ghost._dense``). One example's gradient of ``W`` is then the
sum of the two layers' gradients, ``g = g_emb + g_head``, and its squared norm::

    ||g||^2 = ||g_emb||^2 + ||g_head||^2 + 2 <g_emb, g_head>

The first two terms are what the embedding's and the dense layer's rules
compute (each certified: its value plus a bound on its rounding). The cross
term needs neither gradient: with the example's ids ``id_t'``, the embedding's
output gradients ``dY [T', D]``, the head's inputs ``h [T, D]`` and output
gradients ``G [T, V]``, ``g_emb[v] = sum_{t': id_t' = v} dY_t'`` and ``g_head = G^T
h``, so::

    <g_emb, g_head> = sum_{t, t'} G[t, id_t'] (h_t . dY_t') = sum(A * B)

with ``A = h dY^T [T, T']`` and ``B[t, t'] = G[t, id_t']`` (a gather of ``G``'s
columns at the ids, exact). ``cross_term`` computes it with a bound on its
rounding, derived as ``dpmp.clipping.ghost._gram.gram`` derives the Gram
form's: ``|A^_tt' - A_tt'| <= gamma_D |h_t| |dY_t'|``, and the sum is T row dot
products of length T' then a sum of T (``gamma_{T + T'}``), so::

    |X - X^| <= gamma_D sum_tt' |h_t| |dY_t'| |B_tt'| + gamma_{T+T'} sum_tt' |A^_tt' B_tt'|

doubled to cover the rounding of the bound itself and of the row norms. Where
the dense rule forms the head's per-example gradient ``g_head`` instead (few
tokens against ``D V``, or too many for a Gram bound,
``dpmp.clipping.ghost._gram.gram_mode``), ``formed_cross_term`` reads
its rows at the ids: ``X = sum_t' dY_t' . g_head[id_t']``, within ``gamma_{D +
T'} sum_t' |dY_t'| |g_head[id_t']|`` (doubled), and that layer's magnitude is
its norm. The
cross term can be negative and cancel the own terms (``g_head ~ -g_emb``), so
``tied_sq_norm`` adds the bound, never subtracts it: the result is never
below the exact ``||g||^2``. Its clip factor floors the norm at ``(m_emb +
m_head) / 64`` (``dpmp.clipping.ghost._gram.cancellation_floor``): both layers'
clip-weighted contractions add into one leaf, and the rounding of each is
proportional to its own magnitude, whatever the sum cancels.

The tie is recognised in the plan (``pair``) where one parameter leaf
reaches exactly two layers, one a ghost embedding lookup of ``W`` itself and
the other a dense layer whose ghost norm holds, contracting ``W``'s second axis
(``h @ W.T``, an einsum), each through casts, copies and transposes only; the
dense layer keeps its rule's choice of mode. The leaf's clip-weighted sum is
rounded to the output dtype once: with the head in the Gram form, both layers'
contractions a block of table rows at a time (``tied_clipped_sum``); with
its gradient formed, both layers' sums in the accumulation dtype, added there.
Every other double use keeps the plan's refusal.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from dpmp.clipping._rounding import HIGHEST, higham_gamma
from dpmp.clipping._weighted import after, kept_rows, weighted_examples
from dpmp.clipping.ghost._dense import (
    DenseRule,
    contract_examples,
    dot_operands,
    in_blocks,
    weighted_columns,
)
from dpmp.clipping.ghost._embedding import EmbeddingRule
from dpmp.clipping.ghost._gram import cancellation_floor, gamma, row_dot_sum
from dpmp.clipping.ghost._operands import contract

__all__ = [
    "Tie",
    "cross_term",
    "formed_cross_term",
    "pair",
    "tied_clipped_sum",
    "tied_sq_norm",
]

# Layout operations a tied table may pass through on the way to either layer.
_SAME = frozenset(("convert_element_type", "copy", "copy_p"))


@dataclasses.dataclass(frozen=True)
class Tie:
    """One parameter leaf used as an embedding and as an output projection.

    Attributes:
      leaf: the parameter leaf's index.
      embedding: the index (in ``GhostPlan.taps``) of its embedding tap.
      head: the index of its dense tap.
    """

    leaf: int
    embedding: int
    head: int


def pair(eqns, uses, shape) -> tuple[int, int] | None:
    """``(embedding, head)``: which of two uses of a parameter of ``shape`` is the
    embedding and which the output projection, or ``None`` where they are not that pair.

    ``uses``: per use, ``(chain, eqn index, pos, rule, ghost, window)`` as the plan
    found it (``ghost``: the rule's ghost norm holds).
    """
    if len(uses) != 2 or len(shape) != 2 or any(u[5] for u in uses):
        return None
    emb, head = (0, 1) if isinstance(uses[0][3], EmbeddingRule) else (1, 0)
    if not (isinstance(uses[emb][3], EmbeddingRule) and isinstance(uses[head][3], DenseRule)):
        return None
    if not (uses[emb][4] and uses[head][4]):
        return None
    emb_axes = _axes(eqns, uses[emb][0])
    head_axes = _axes(eqns, uses[head][0])
    if emb_axes != (0, 1) or head_axes is None:
        return None
    eqn, pos = eqns[uses[head][1]], uses[head][2]
    (lc, rc), _ = eqn.params["dimension_numbers"]
    contracting = tuple(lc if pos == 0 else rc)
    if contracting != (head_axes.index(1),):  # h @ W.T contracts W's second axis
        return None
    return emb, head


def _axes(eqns, chain) -> tuple[int, ...] | None:
    """Which axis of the 2-D table each axis of the layer's operand is, following
    ``chain``; ``None`` where an operation other than a cast, copy or transpose is in it."""
    axes = (0, 1)
    for i in chain:
        eqn = eqns[i]
        name = eqn.primitive.name
        if name == "transpose":
            axes = tuple(axes[d] for d in eqn.params["permutation"])
        elif name not in _SAME:
            return None
    return axes


def cross_term(emb_eqn, head_eqn, head_pos, ids, dy, act, g, dtype):
    """Per example, ``(X^, E)``, each ``[B]``: the computed ``<g_emb, g_head>`` and a
    bound on its rounding error (``|X^ - X| <= E``).

    ``ids``, ``dy``: the embedding's indices and unscaled output gradients; ``act``,
    ``g``: the head's inputs and unscaled output gradients; floats in ``dtype``.
    """
    one = functools.partial(_cross, emb_eqn, head_eqn, head_pos, dtype=dtype)
    return jax.vmap(one)(ids, dy, act, g)


def formed_cross_term(emb_eqn, ids, dy, gh, dtype):
    """Per example, ``(X^, E)`` as ``cross_term``, where the head's per-example
    gradient ``gh [V, D]`` (laid out as the table, unscaled, in ``dtype``) is formed:
    ``X = sum_t' dY_t' . gh[id_t']``, T' dot products of length D and a sum of T', so
    ``|X^ - X| <= gamma_{D + T'} sum_t' |dY_t'| |gh[id_t']|``, doubled."""
    return jax.vmap(functools.partial(_formed_cross, emb_eqn, dtype=dtype))(ids, dy, gh)


def _formed_cross(emb_eqn, idx, dy, gh, *, dtype):
    vocab, dim = emb_eqn.invars[0].aval.shape
    ids = idx.reshape(-1)
    dym = dy.reshape(ids.shape[0], dim).astype(dtype)
    valid = _valid(emb_eqn, ids, vocab)
    rows = jnp.take(gh.reshape(vocab, dim).astype(dtype), jnp.clip(ids, 0, vocab - 1), axis=0)
    rows = jnp.where(valid[:, None], rows, jnp.zeros_like(rows))  # exact
    dots = lax.dot_general(
        dym, rows, (((1,), (1,)), ((0,), (0,))), precision=HIGHEST, preferred_element_type=dtype
    )
    norms = jnp.sqrt(jnp.sum(jnp.square(dym), axis=1) * jnp.sum(jnp.square(rows), axis=1))
    err = gamma(dim + ids.shape[0], dtype) * jnp.sum(norms)
    return jnp.sum(dots), 2 * err


def _valid(emb_eqn, ids, vocab):
    """Which ids the lookup reads: all (clipped into range) but where out-of-range ids
    fill with zeros and their gradient is dropped."""
    if emb_eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP:
        return (ids >= 0) & (ids < vocab)
    return jnp.ones_like(ids, dtype=bool)


def _cross(emb_eqn, head_eqn, head_pos, idx, dy, act, g, *, dtype):
    """One example's cross term and its error bound (see the module's docstring)."""
    vocab, dim = emb_eqn.invars[0].aval.shape
    am, gm = dot_operands(head_eqn, head_pos, act, g)  # h [T, D], G [T, V]
    ids = idx.reshape(-1)
    t, t2 = am.shape[0], ids.shape[0]
    dym = dy.reshape(t2, dim).astype(dtype)
    valid = _valid(emb_eqn, ids, vocab)
    cols = jnp.take(gm.astype(dtype), jnp.clip(ids, 0, vocab - 1), axis=1)
    b = jnp.where(valid[None, :], cols, jnp.zeros_like(cols))  # exact
    a = contract(am.astype(dtype), dym, (((1,), (1,)), ((), ())), dtype)
    nh = jnp.sqrt(jnp.sum(jnp.square(am.astype(dtype)), axis=1))
    nd = jnp.sqrt(jnp.sum(jnp.square(dym), axis=1))
    # Sums of non-negative numbers, taken elementwise: no reduced-precision matmul.
    err = gamma(dim, dtype) * jnp.sum(nh[:, None] * jnp.abs(b) * nd[None, :]) + gamma(
        t + t2, dtype
    ) * jnp.sum(jnp.abs(a * b))
    return row_dot_sum(a, b, dtype), 2 * err


def tied_sq_norm(own_emb, own_head, cross, norm_dtype):
    """The squared norm of a tied leaf's gradient as the clip factor uses it.

    ``own_emb``, ``own_head``: ``(sq, m)`` of each layer (certified, unfloored);
    ``cross``: ``(X^, E)`` of ``cross_term``. In ``norm_dtype`` (inside
    ``dpmp.clipping._rounding.wide``): ``S = sq_e + sq_h + 2 X^ + 2 E``, never below
    the exact ``||g_emb + g_head||^2``; its own rounding (four terms of either sign,
    then the bound added) is within ``gamma_4 (sq_e + sq_h + 2 |X^| + 2 E)``, added
    three times over. Floored at ``((m_e + m_h) / 64)^2``; negative or NaN stays NaN.
    """
    (se, me), (sh, mh) = own_emb, own_head
    se, sh, me, mh = (v.astype(norm_dtype) for v in (se, sh, me, mh))
    x, e = (v.astype(norm_dtype) for v in cross)
    total = se + sh + 2 * x + 2 * e
    slack = higham_gamma(4, norm_dtype) * (se + sh + 2 * jnp.abs(x) + 2 * e)
    m = (me + mh) * jnp.asarray(1 + 4 * higham_gamma(1, norm_dtype), norm_dtype)
    return cancellation_floor(total + 3 * slack, m)


def tied_clipped_sum(
    emb_eqn, head_eqn, head_pos, ids, dy, act, g, factor, keep, before, dtype, out_dtype
):
    """``sum_i factor_i (g_emb,i + g_head,i)`` laid out as the table ``[V, D]``, in
    ``out_dtype``, where the head takes the Gram form (its inputs ``act`` and output
    gradients ``g`` are stored). ``ids``, ``dy``: the embedding's indices and unscaled
    output gradients; rows of examples not in ``keep`` add exactly 0; read after
    ``before`` (``dpmp.clipping._weighted.after``).

    A block of at most ``max(B T, 128)`` table rows at a time: the head's
    contraction over examples and tokens for those rows (as the dense rule's
    clipped sum, accumulated in ``dtype``), plus the embedding's scatter-add of the
    ``factor_i dY_t'`` whose ids fall in the block (accumulated in ``dtype``), added
    in ``dtype`` and rounded to ``out_dtype`` once. Each part is within ``gamma_{B T}``
    of its magnitudes as when summed alone, and the leaf is rounded once, as a dense
    ghost layer's; only one block is held in ``dtype`` at a time, not two tables.
    """
    vocab, dim = emb_eqn.invars[0].aval.shape
    am, gm = jax.vmap(lambda a_, g_: dot_operands(head_eqn, head_pos, a_, g_))(act, g)
    bt = am.shape[0] * am.shape[1]
    rows = after(keep, before)
    x = kept_rows(am.astype(dtype), rows).reshape(bt, dim)
    flat_ids = ids.reshape(ids.shape[0], -1)
    valid = jax.vmap(lambda i_: _valid(emb_eqn, i_, vocab))(flat_ids)
    slot = jnp.where(valid, jnp.clip(flat_ids, 0, vocab - 1), vocab).reshape(-1)
    wdy = kept_rows(weighted_examples(dy.reshape(*flat_ids.shape, dim), factor, dtype), rows)
    wdy = wdy.reshape(-1, dim)

    def block(lo, size, done):
        wg = weighted_columns(gm, lo, size, factor, after(keep, done), dtype)
        head = contract_examples(wg, x, dtype)  # [size, D]: the table's rows
        local = jnp.where((slot >= lo) & (slot < lo + size), slot - lo, size)
        emb = jnp.zeros((size, dim), dtype).at[local].add(wdy, mode="drop")
        return (head + emb).astype(out_dtype)

    return in_blocks(jnp.zeros((vocab, dim), out_dtype), vocab, bt, block, 0, before, keep)
