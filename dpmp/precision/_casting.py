"""Casting pytrees and functions between precisions.

Only floating leaves are cast. Integer and boolean arrays, PRNG keys (typed
``key<...>`` arrays and raw ``uint32`` keys alike) and non-array leaves pass
through untouched, so a batch of labels or a PRNG key can sit in the same tree
as the parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cast_tree", "cast_function", "force_full_precision", "is_float_array"]


def is_float_array(x: Any) -> bool:
    """True for a jax or numpy array (or scalar) of a floating dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        return False
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # extended dtypes (PRNG keys) are not numpy-comparable
        return False


def _resolve(dtype: Any) -> np.dtype:
    from dpmp.precision._dtypes import canonical_dtype

    return canonical_dtype(dtype)


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts every floating leaf of ``tree`` to ``dtype``; leaves others alone.

    ``dtype`` may be a dtype or a name such as ``"bf16"``. A leaf already in
    ``dtype`` is returned as is (no copy, no op in the jaxpr).
    """
    dtype = _resolve(dtype)

    def cast(x):
        if is_float_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def cast_function(fn: Callable, dtype: Any, return_dtype: Any = None) -> Callable:
    """Wraps ``fn`` so that its floating inputs are cast to ``dtype``.

    If ``return_dtype`` is given, the floating leaves of the result are cast to
    it; otherwise the result is returned as ``fn`` produced it.
    """
    dtype = _resolve(dtype)
    return_dtype = None if return_dtype is None else _resolve(return_dtype)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = cast_tree((args, kwargs), dtype)
        out = fn(*args, **kwargs)
        return out if return_dtype is None else cast_tree(out, return_dtype)

    return wrapped


def force_full_precision(fn: Callable, return_dtype: Any = None) -> Callable:
    """Runs ``fn`` in float32 whatever the dtype of its inputs.

    For the parts of a half-precision model that need range and resolution:
    sums and means, softmax and log-softmax, normalisation statistics, losses.
    ``return_dtype`` casts the result back (e.g. to the compute dtype).

    Example::

      >>> import jax.numpy as jnp, dpmp
      >>> x = jnp.full((4096,), 1.0, jnp.float16) * 30
      >>> jnp.sum(x).dtype, float(jnp.sum(x))           # fp16 result overflows
      (dtype('float16'), inf)
      >>> float(dpmp.force_full_precision(jnp.sum)(x))
      122880.0
    """
    return cast_function(fn, jnp.float32, return_dtype)
