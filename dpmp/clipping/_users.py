"""Per-user clipping: the clip bounds the norm of each user's summed gradient.

A user-level batch holds one row per user: every leaf of the batch is
``[users, k, ...]`` (a user's up to ``k`` records, ``dpmp.data._user_sampling``)
and ``batch[RECORD_MASK]`` is bool ``[users, k]``, True at the user's real
records. ``user_private_grad`` is ``private_grad`` of the per-user loss::

    loss_u = sum over u's real records j of loss_fn(params, record j)   # float32
    g_u    = grad(loss_u) = the sum of u's records' gradients
    grads  = sum over real users u of clip(g_u, C)

so each user is one example of the private-gradient machinery, and every
property ``private_grad`` states of an example holds of a user: a clipped
contribution of norm at most ``C (1 + 16 u_c)``, a padding user
(``is_padding_example``) contributing exactly zero, an overflowed user zeroed
and counted, and the sensitivity ``g.sensitivity_bound(batch_size=padded
users, ...)`` of the sum over users.

**User-level ghost norms.** ``method="ghost"`` (and ``"auto"`` where the
modelled cost prefers it) takes ghost clipping of the per-user loss, which
forms no per-user gradient. Inside one "example" (a user), ``user_loss`` vmaps
the record loss over the user's ``k`` records, so a dense layer's activation
``X`` and output gradient ``G`` of that example are ``[k, T, K]`` and ``[k, T,
N]``: ``k T`` rows. The user's weight gradient is ``sum_{j,t} x_jt g_jt^T =
X^T G`` over all ``k T`` rows, so the Gram form of ``dpmp.clipping.ghost``
over those rows::

    ||g_u||^2 = ||X^T G||_F^2 = <X X^T, G G^T>      # [kT, kT] Gram matrices

is exactly the squared norm of the user's SUMMED gradient (cross terms between
records included), not a sum of per-record norms; an embedding's id-gram and
the other rules read the same ``k T`` rows alike. The certified rounding bound
of each Gram norm (``ghost._gram.gram``) grows like ``((kT)^2 + K + N) u``: past
5% (``kT`` above about 900 rows in float32) ``gram_mode`` makes that layer
form its per-user gradient instead, and a layer whose per-user gradient is the
cheaper (``K N <= kT (K + N)``) forms it anyway. The sensitivity reads the rows
per example from the plan (``k T`` here), as it does per example.

Padding records have their loss masked out (``jnp.where``), so their output
gradients are exactly zero: their rows add nothing to a Gram matrix, to the
cancellation floor or to the clip-weighted sum (their values must be finite,
as the trainer's are, copies of real records: ``0 x inf`` is not 0, with
per-user gradients too). Padding users are padding
examples: zeroed, whatever their rows hold. A ghost layer's norm is taken as
at least ``sum_rows |x| |g| / 64`` (``ghost._gram.cancellation_floor``): a user
whose records' gradients cancel more than 64-fold is clipped harder than its
norm asks (never less hard). With ``"auto"`` the choice is
``private_grad``'s own (``dpmp.clipping._cost``, on the per-user loss's
shapes); ``g.explain(...)`` names the unit and says why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.clipping._grad_fn import PrivateGradFn
from dpmp.clipping._private_grad import private_grad

__all__ = ["RECORD_MASK", "UNIT_REASON", "user_loss", "user_private_grad"]

# The batch key of the real-record mask ``[users, k]``.
RECORD_MASK = "user_records"
UNIT_REASON = (
    "privacy unit user: each example is one user's records, and the clip bounds the norm "
    "of the user's summed gradient (ghost layers: the Gram form over the user's k x T rows)"
)


def user_loss(loss_fn: Callable) -> Callable:
    """The loss of one user: ``user_loss(loss_fn)(params, block, *rest)`` is the float32
    sum of ``loss_fn(params, record, *rest)`` over the block's real records.

    ``block`` is one user's batch: its leaves ``[1, k, ...]`` (the batch axis of
    one ``private_grad`` gives each example) and ``block[RECORD_MASK]`` ``[1, k]``;
    each record reaches ``loss_fn`` as a batch of one, as a record-level run
    hands it.
    """

    def loss(params, block, *rest):
        real = block[RECORD_MASK][0]
        records = {name: value[0] for name, value in block.items() if name != RECORD_MASK}

        def one(record):
            single = jax.tree.map(lambda v: v[None], record)
            return jnp.asarray(loss_fn(params, single, *rest)).astype(jnp.float32)

        losses = jax.vmap(one)(records)
        return jnp.sum(jnp.where(real, losses, jnp.zeros_like(losses)))

    return loss


def user_private_grad(
    loss_fn: Callable,
    *,
    l2_clip_norm: float,
    policy: Any,
    method: str = "auto",
    **kwargs: Any,
) -> PrivateGradFn:
    """``private_grad`` with a user as the unit: the sum over users of each user's
    summed gradient clipped to ``l2_clip_norm`` (module docstring).

    Args:
      loss_fn: ``loss_fn(params, batch, *rest)``, the mean loss of a batch of
        records (it is handed one record at a time).
      l2_clip_norm: C, the per-user clip norm.
      policy: the precision policy.
      method: ``"vmap"`` (per-user gradients), ``"ghost"`` (user-level ghost
        norms: per layer the Gram form over the user's ``k T`` rows or the
        layer's per-user gradient, ``gram_mode``), or ``"auto"``: whichever of
        the two ``private_grad``'s modelled cost picks for the per-user loss.
      **kwargs: the other arguments of ``private_grad`` (``microbatch_size``
        counts users); the batch is argument 1.

    Returns:
      A ``PrivateGradFn`` ``g(params, batch, *rest, loss_scale=...,
      is_padding_example=[users] bool)``; ``g.explain(...)`` adds ``"unit":
      "user"`` and a reason that names the unit before saying why the method
      was chosen.
    """
    g = private_grad(
        user_loss(loss_fn), l2_clip_norm=l2_clip_norm, policy=policy, method=method, **kwargs
    )
    g._explain = functools.partial(_explained, g._explain)
    return g


def _explained(explain: Callable, params, *args) -> dict[str, Any]:
    out = dict(explain(params, *args))
    why = out.get("reason", "")
    out["reason"] = f"{UNIT_REASON}; {why}" if why else UNIT_REASON
    out["unit"] = "user"
    return out
