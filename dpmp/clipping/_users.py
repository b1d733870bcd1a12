"""Per-user clipping: the clip bounds the norm of each user's summed gradient.

A user-level batch holds one row per user: every leaf of the batch is
``[users, k, ...]`` (a user's up to ``k`` records, ``dpmp.data._user_sampling``)
and ``batch[RECORD_MASK]`` is bool ``[users, k]``, True at the user's real
records. ``user_private_grad`` is ``private_grad`` of the per-user loss::

    loss_u = sum over u's real records j of loss_fn(params, record j)   # float32
    g_u    = grad(loss_u) = the sum of u's records' gradients
    grads  = sum over real users u of clip(g_u, C)

so each user is one example of the per-example (vmap) machinery, and every
property ``private_grad`` states of an example holds of a user: a clipped
contribution of norm at most ``C (1 + 16 u_c)``, a padding user (``is_padding_example``)
contributing exactly zero, an overflowed user zeroed and counted, and the
sensitivity ``g.sensitivity_bound(batch_size=padded users, ...)`` of the sum
over users. Padding records contribute nothing to their user's loss.

User-level ghost norms (the norm of a user's summed gradient from activations
and output gradients) are not implemented yet: ``method="auto"`` takes vmap
and says so, ``method="ghost"`` is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.clipping._grad_fn import PrivateGradFn
from dpmp.clipping._private_grad import private_grad

__all__ = ["AUTO_REASON", "RECORD_MASK", "user_loss", "user_private_grad"]

# The batch key of the real-record mask ``[users, k]``.
RECORD_MASK = "user_records"
AUTO_REASON = (
    "privacy unit user: per-user gradients (vmap), each the sum of the user's records' "
    "gradients (user-level ghost norms: not yet)"
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
      method: ``"auto"`` or ``"vmap"`` (both per-user gradients); ``"ghost"`` is
        refused.
      **kwargs: the other arguments of ``private_grad`` (``microbatch_size``
        counts users); the batch is argument 1.

    Returns:
      A ``PrivateGradFn`` ``g(params, batch, *rest, loss_scale=...,
      is_padding_example=[users] bool)``; ``g.explain(...)`` says the method was
      requested as ``method`` and why vmap is used.
    """
    if method == "ghost":
        raise ValueError(
            'method: "ghost" with a user as the unit: user-level ghost norms are not '
            'implemented yet; use "vmap" or "auto"'
        )
    g = private_grad(
        user_loss(loss_fn), l2_clip_norm=l2_clip_norm, policy=policy, method="vmap", **kwargs
    )
    g.method = method
    g._explain = functools.partial(_explained, g._explain, method)
    return g


def _explained(explain: Callable, requested: str, params, *args) -> dict[str, Any]:
    out = dict(explain(params, *args))
    out["requested"] = requested
    out["reason"] = AUTO_REASON if requested == "auto" else out.get("reason", "")
    out["unit"] = "user"
    return out
