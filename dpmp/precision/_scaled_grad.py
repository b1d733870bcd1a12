"""Loss-scaled gradients for ordinary (non-private) mixed-precision training.

``value_and_grad`` fixes the two mistakes that make mixed-precision steps
silently wrong in peer libraries:

* the gradient is divided by the scale that was used in the forward pass, not
  by the already-adjusted one (MPX divides by the new scale and so halves the
  gradient on every step where the scale grows);
* the gradient is lifted to float32 before it is unscaled, so unscaling never
  rounds in half precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmp.precision._casting import cast_tree
from dpmp.precision._loss_scale import all_finite, select_tree
from dpmp.precision._policy import Policy

__all__ = ["ScaledGrad", "value_and_grad", "update_if_finite"]


class ScaledGrad(NamedTuple):
    """What ``value_and_grad``'s function returns.

    Attributes:
      value: the unscaled loss (float32), or ``(loss, aux)`` with ``has_aux``.
      grads: gradients, unscaled with the scale of the forward pass, in the
        policy's param dtype (float32 without a policy, or the params' dtype if wider).
      grads_finite: boolean scalar, every gradient entry finite.
      loss_scale: the loss scale for the NEXT step (already adjusted).
    """

    value: Any
    grads: Any
    grads_finite: jax.Array
    loss_scale: Any


def value_and_grad(
    fun: Callable, *, has_aux: bool = False, policy: Policy | str | None = None
) -> Callable[..., ScaledGrad]:
    """Loss-scaled ``jax.value_and_grad`` with respect to the first argument.

    Returns ``g(loss_scale, params, *args, **kwargs) -> ScaledGrad``.

    With a ``policy``, ``fun`` receives the params cast to ``policy.grad`` (so
    that the gradients really are computed in that dtype; casting to bf16
    *inside* the loss gives float32 gradients through the cast's transpose) and
    the returned grads are in ``policy.param``. Without one, ``fun`` receives
    the params as given and the grads come back in at least float32.

    The step, in full::

        S = loss_scale.loss_scale                      # float32
        loss, g = value_and_grad(lambda p: f32(fun(p)) * S)(params)
        grads = cast(f32(g) / S, param dtype)          # unscaled with THIS step's S
        grads_finite = all_finite(grads)
        return ScaledGrad(loss / S, grads, grads_finite, loss_scale.adjust(grads_finite))
    """
    policy = None if policy is None else Policy.parse(policy)

    def scaled_fun(diff_params, loss_scale, *args, **kwargs):
        out = fun(diff_params, *args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        loss = jnp.asarray(loss)
        if loss.shape != ():
            raise ValueError(
                f"value_and_grad: fun must return a scalar loss, got shape {loss.shape}"
            )
        loss32 = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
        return loss_scale.scale(loss32), (loss32, aux)

    grad_fn = jax.grad(scaled_fun, has_aux=True)

    def g(loss_scale, params, *args, **kwargs) -> ScaledGrad:
        diff_params = params if policy is None else cast_tree(params, policy.grad)
        scaled_grads, (loss, aux) = grad_fn(diff_params, loss_scale, *args, **kwargs)
        grads = loss_scale.unscale(scaled_grads)
        if policy is not None:
            grads = cast_tree(grads, policy.param)
        finite = all_finite(grads)
        value = (loss, aux) if has_aux else loss
        return ScaledGrad(value, grads, finite, loss_scale.adjust(finite))

    return g


def update_if_finite(
    optimizer: optax.GradientTransformation,
    grads: Any,
    opt_state: Any,
    params: Any,
    grads_finite: jax.Array | None = None,
) -> tuple[Any, Any]:
    """One optax step that is skipped, bit for bit, when the gradients are not finite.

    Returns ``(new_params, new_opt_state)``. When ``grads_finite`` is false
    (computed from ``grads`` if not given) both are returned unchanged: every
    leaf is selected from the inputs, not recomputed. Unlike
    ``optax.apply_if_finite`` no counter in the optimizer state moves either.
    """
    if grads_finite is None:
        grads_finite = all_finite(grads)
    updates, new_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_params = jax.tree.map(lambda new, old: new.astype(old.dtype), new_params, params)
    return (
        select_tree(grads_finite, new_params, params),
        select_tree(grads_finite, new_state, opt_state),
    )
