"""Shared test settings: dtype promotion is strict, so silent promotion fails a test."""

import atexit
import shutil
import tempfile

import jax
import pytest

# Many tests compile the same step (the default config's, the digits MLP's) in
# fresh closures; XLA's persistent compilation cache lets the second and later
# compilations of an identical program reuse the first. The cache lives in a
# fresh folder for this test session only, so no result comes from elsewhere.
_CACHE = tempfile.mkdtemp(prefix="dpmp-tests-xla-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def strict_promotion():
    """Run a test with ``jax_numpy_dtype_promotion='strict'``."""
    with jax.numpy_dtype_promotion("strict"):
        yield


HALF_DTYPES = ("bfloat16", "float16")
ALL_DTYPES = ("bfloat16", "float16", "float32")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.fast_cases("id", ...)`` on a parametrized test keeps those
    cases in the default suite and marks the others ``slow``: the property stays
    checked on every run, its costlier cases in the slow suite (CI runs both).
    Runs before ``-m`` deselects, so ``-m "not slow"`` sees the added marks."""
    for item in items:
        keep = item.get_closest_marker("fast_cases")
        if keep is None:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            raise pytest.UsageError(f"{item.nodeid}: fast_cases marks a parametrized test")
        if callspec.id not in keep.args:
            item.add_marker(pytest.mark.slow)
