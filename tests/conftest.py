"""Shared test settings: dtype promotion is strict, so silent promotion fails a test."""

import jax
import pytest


@pytest.fixture
def strict_promotion():
    """Run a test with ``jax_numpy_dtype_promotion='strict'``."""
    with jax.numpy_dtype_promotion("strict"):
        yield


HALF_DTYPES = ("bfloat16", "float16")
ALL_DTYPES = ("bfloat16", "float16", "float32")
