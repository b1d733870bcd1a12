"""Names and checks for the floating dtypes dpmp supports."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["below_float32", "canonical_dtype", "dtype_name"]


_DTYPE_ALIASES: dict[str, Any] = {
    "float16": jnp.float16,
    "f16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float32": jnp.float32,
    "f32": jnp.float32,
    "fp32": jnp.float32,
    "single": jnp.float32,
    "float64": jnp.float64,
    "f64": jnp.float64,
    "fp64": jnp.float64,
    "double": jnp.float64,
}
_SHORT_NAME = {
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.float64): "f64",
}


def canonical_dtype(value: Any, *, field: str = "dtype") -> np.dtype:
    """Returns the numpy dtype for a dtype-like or one of the accepted names.

    Raises:
      ValueError: naming ``field`` and the accepted names, for anything that is
        not float16, bfloat16, float32 or float64.
    """
    if isinstance(value, str):
        key = value.strip().lower()
        if key not in _DTYPE_ALIASES:
            raise ValueError(
                f"{field}: unknown dtype {value!r}; allowed: " + ", ".join(sorted(_DTYPE_ALIASES))
            )
        return np.dtype(_DTYPE_ALIASES[key])
    try:
        dtype = np.dtype(value)
    except TypeError as e:
        raise ValueError(f"{field}: {value!r} is not a dtype") from e
    if dtype not in _SHORT_NAME:
        raise ValueError(
            f"{field}: dtype {dtype.name} is not a floating dtype dpmp supports; "
            "allowed: float16, bfloat16, float32, float64"
        )
    return dtype


def dtype_name(dtype: Any) -> str:
    """Short name (``bf16``, ``f16``, ``f32``, ``f64``) of a supported dtype."""
    return _SHORT_NAME[canonical_dtype(dtype)]


def below_float32(dtype: np.dtype) -> bool:
    return jnp.finfo(dtype).bits < 32
