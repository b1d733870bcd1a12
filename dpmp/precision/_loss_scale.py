"""Loss scales as immutable pytrees, and the tree predicates they need.

A loss scale multiplies the loss before the backward pass so that small
half-precision gradients do not flush to zero, and divides the gradients
afterwards. Three kinds, with jmp's interface (``scale``, ``unscale``,
``adjust``, attribute ``loss_scale``) but without its bugs:

* the current scale is always a float32 scalar array, even when the user
  passes a float16 value (jmp #47 crashes in ``adjust`` there);
* ``period``, ``factor``, ``min_scale`` and ``max_scale`` are static pytree
  metadata, so they survive ``jax.jit`` and ``jax.vmap`` (jmp PR #44 lost
  ``min_loss_scale`` through jit);
* ``scale`` returns at least float32, so a float16 loss times 2**15 does not
  overflow before the backward pass starts; ``unscale`` casts to at least
  float32 before dividing, so an unscaled gradient is never rounded to half.

The dynamic algorithm (as in jmp, Micikevicius et al. 2018)::

    if grads_finite:
        counter += 1
        if counter == period:
            loss_scale = min(loss_scale * factor, max_scale); counter = 0
    else:
        loss_scale = max(loss_scale / factor, min_scale); counter = 0

In private training the choice between those branches depends on which
examples overflowed, i.e. on private data: see ``dpmp.PrivateDynamicLossScale``
for the variant whose only input is a noised overflow count.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.precision._casting import is_float_array

__all__ = [
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
]


def _at_least_f32(dtype) -> np.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def _scale_tree(tree, loss_scale):
    def scale(x):
        if not is_float_array(x):
            return x
        return x.astype(_at_least_f32(x.dtype)) * loss_scale.astype(_at_least_f32(x.dtype))

    return jax.tree.map(scale, tree)


def _unscale_tree(tree, loss_scale):
    def unscale(x):
        if not is_float_array(x):
            return x
        dtype = _at_least_f32(x.dtype)
        return x.astype(dtype) / loss_scale.astype(dtype)

    return jax.tree.map(unscale, tree)


def _as_f32_scale(value: Any, name: str = "loss_scale") -> jax.Array:
    """The scale as a float32 scalar; concrete values must be finite and > 0."""
    if isinstance(value, jax.core.Tracer):
        return jnp.asarray(value).astype(jnp.float32)
    arr = np.asarray(value, dtype=np.float64) if not hasattr(value, "dtype") else value
    as_np = np.asarray(arr).astype(np.float64)
    if as_np.shape != ():
        raise ValueError(f"{name}: must be a scalar, got shape {as_np.shape}")
    if not np.isfinite(as_np) or as_np <= 0:
        raise ValueError(f"{name}: must be finite and > 0, got {float(as_np)}")
    return jnp.asarray(value).astype(jnp.float32)


def _new(cls, **fields):
    """Builds an instance without running __init__ (for tree_unflatten)."""
    obj = object.__new__(cls)
    for k, v in fields.items():
        object.__setattr__(obj, k, v)
    return obj


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling: ``scale`` and ``unscale`` only lift to at least float32.

    The default for bf16, whose exponent range is that of float32.
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree):
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree):
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite) -> NoOpLossScale:
        del grads_finite
        return self

    def tree_flatten(self):
        return (), ()

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux, children
        return cls()


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale (a power of two keeps scaling exact)."""

    loss_scale: Any

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _as_f32_scale(self.loss_scale))

    def scale(self, tree):
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree):
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite) -> StaticLossScale:
        del grads_finite
        return self

    def tree_flatten(self):
        return (self.loss_scale,), ()

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return _new(cls, loss_scale=children[0])


def _check_static(name: str, value: Any, *, positive: bool = True, integer: bool = False):
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name}: must be a Python number, not a traced value")
    v = np.asarray(value).item()
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if integer and int(v) != v:
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if positive and not (v > 0 and np.isfinite(v)):
        raise ValueError(f"{name}: must be finite and > 0, got {value!r}")
    return int(v) if integer else float(v)


def _validate_dynamic_fields(obj) -> None:
    """Normalises and checks period, factor, min_scale and max_scale of a dynamic scale."""
    object.__setattr__(obj, "period", _check_static("period", obj.period, integer=True))
    object.__setattr__(obj, "factor", _check_static("factor", obj.factor))
    object.__setattr__(obj, "min_scale", _check_static("min_scale", obj.min_scale))
    object.__setattr__(obj, "max_scale", _check_static("max_scale", obj.max_scale))
    if obj.factor <= 1:
        raise ValueError(f"factor: must be > 1, got {obj.factor}")
    if obj.min_scale > obj.max_scale:
        raise ValueError(f"min_scale ({obj.min_scale}) must not exceed max_scale ({obj.max_scale})")


def dynamic_rule(obj, finite) -> tuple[jax.Array, jax.Array]:
    """The grow-after-``period`` / back-off rule: ``(next loss_scale, next counter)``."""
    finite = jnp.asarray(finite, dtype=jnp.bool_)
    f32 = jnp.float32
    grow = obj.counter == (obj.period - 1)
    up = jnp.minimum(obj.loss_scale * f32(obj.factor), f32(obj.max_scale))
    down = jnp.maximum(obj.loss_scale / f32(obj.factor), f32(obj.min_scale))
    loss_scale = jnp.where(finite, jnp.where(grow, up, obj.loss_scale), down)
    loss_scale = jnp.clip(loss_scale, f32(obj.min_scale), f32(obj.max_scale))
    counter = jnp.where(finite & ~grow, obj.counter + 1, 0).astype(jnp.int32)
    return loss_scale, counter


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that grows after ``period`` finite steps and backs off on overflow.

    Args:
      loss_scale: initial scale; any float dtype, stored as float32.
      counter: finite steps since the last change (int32), normally left at 0.
      period: finite steps before the scale grows by ``factor``.
      factor: growth and back-off factor.
      min_scale: lower clamp; ``adjust`` never leaves ``[min_scale, max_scale]``.
      max_scale: upper clamp.

    ``period``, ``factor``, ``min_scale`` and ``max_scale`` are static: they
    are kept in the pytree's metadata and survive ``jit``, ``vmap`` and
    ``tree_map``.
    """

    loss_scale: Any
    counter: Any = None
    period: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0
    max_scale: float = float(2**24)

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", _as_f32_scale(self.loss_scale))
        counter = jnp.zeros((), jnp.int32) if self.counter is None else self.counter
        object.__setattr__(self, "counter", jnp.asarray(counter).astype(jnp.int32))
        _validate_dynamic_fields(self)

    def scale(self, tree):
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree):
        return _unscale_tree(tree, self.loss_scale)

    def adjust(self, grads_finite) -> DynamicLossScale:
        """The scale for the next step, given whether this step's grads were finite."""
        loss_scale, counter = dynamic_rule(self, grads_finite)
        return dataclasses.replace(self, loss_scale=loss_scale, counter=counter)

    def tree_flatten(self):
        aux = (self.period, self.factor, self.min_scale, self.max_scale)
        return (self.loss_scale, self.counter), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        period, factor, min_scale, max_scale = aux
        loss_scale, counter = children
        return _new(
            cls,
            loss_scale=loss_scale,
            counter=counter,
            period=period,
            factor=factor,
            min_scale=min_scale,
            max_scale=max_scale,
        )


def all_finite(tree) -> jax.Array:
    """A boolean scalar: every floating leaf of ``tree`` is free of inf and NaN."""
    leaves = [x for x in jax.tree.leaves(tree) if is_float_array(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred, a, b):
    """``a`` where the scalar ``pred`` is true, else ``b``, leaf by leaf (exact, no arithmetic).

    ``a`` and ``b`` must have the same structure; ``pred`` must be a scalar.
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(
            f"select_tree: pred must be a boolean scalar, got {pred.dtype}{pred.shape}"
        )
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    if sa != sb:
        raise ValueError(f"select_tree: trees differ in structure: {sa} vs {sb}")

    return jax.tree.map(lambda x, y: jax.lax.select(pred, jnp.asarray(x), jnp.asarray(y)), a, b)
