"""Checkpoints: round trips of real training states, atomicity, fallbacks."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmp
from dpmp.app.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_latest,
    save_checkpoint,
)


def _state(seed=0):
    """A linen-like params dict, a private optimizer state (with its noise key),
    and a private loss scale (with its key)."""
    k = jax.random.key(seed)
    params = {
        "Dense_0": {
            "kernel": jax.random.normal(k, (3, 4)),
            "bias": jnp.arange(4, dtype=jnp.float32),
        }
    }
    opt = dpmp.private_optimizer(
        optax.adam(1e-3),
        noise_multiplier=1.0,
        l2_clip_norm=1.0,
        expected_batch_size=8,
        prng_key=jax.random.key(seed + 1),
        policy="bf16",
    )
    scale = dpmp.PrivateDynamicLossScale(2.0**10, jax.random.key(seed + 2))
    return {"params": params, "opt_state": opt.init(params), "loss_scale": scale}


def _assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_with_typed_keys(tmp_path):
    state = _state()
    path = save_checkpoint(tmp_path, step=3, state=state, meta={"note": "x", "v": np.float32(1.5)})
    assert path.name == "checkpoint_00000003.npz"
    restored, meta = load_checkpoint(path, _state(seed=7))  # template: other values
    _assert_same(restored, state)
    assert meta["step"] == 3 and meta["note"] == "x" and meta["v"] == 1.5
    # the restored keys draw the same numbers
    k1 = jax.tree.leaves(state["loss_scale"])[-1]
    k2 = jax.tree.leaves(restored["loss_scale"])[-1]
    np.testing.assert_array_equal(jax.random.normal(k1, (3,)), jax.random.normal(k2, (3,)))


def test_round_trip_nnx_state_and_bf16_leaves(tmp_path):
    from flax import nnx

    _, state = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    tree = {"nnx": state, "half": jnp.ones((2,), jnp.bfloat16) / 3}
    save_checkpoint(tmp_path, step=1, state=tree, meta={})
    _, fresh = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(5)))
    restored, _ = load_checkpoint(
        latest_checkpoint(tmp_path), {"nnx": fresh, "half": jnp.zeros((2,), jnp.bfloat16)}
    )
    assert isinstance(restored["nnx"], nnx.State)
    _assert_same(restored, tree)


def test_keeps_the_newest_two(tmp_path):
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step=step, state=_state(), meta={})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 15]


def test_structure_mismatch_is_an_error(tmp_path):
    save_checkpoint(tmp_path, step=1, state={"a": jnp.zeros(3)}, meta={})
    with pytest.raises(CheckpointError, match="holds 1 arrays, but the state has 2"):
        load_checkpoint(latest_checkpoint(tmp_path), {"a": jnp.zeros(3), "b": jnp.zeros(1)})
    with pytest.raises(CheckpointError, match="shape"):
        load_checkpoint(latest_checkpoint(tmp_path), {"a": jnp.zeros(4)})
    with pytest.raises(CheckpointError, match="dtype"):
        load_checkpoint(latest_checkpoint(tmp_path), {"a": jnp.zeros(3, jnp.int32)})


def test_partial_temp_file_is_ignored(tmp_path):
    """A save killed before its rename leaves a temp file: the previous checkpoint loads."""
    state = _state()
    save_checkpoint(tmp_path, step=5, state=state, meta={"step_note": 5})
    (tmp_path / ".checkpoint_00000010.npz.tmp-12345").write_bytes(b"PK\x03\x04partial")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]
    restored, meta, path = restore_latest(tmp_path, _state(seed=3))
    assert meta["step"] == 5 and path.name == "checkpoint_00000005.npz"
    _assert_same(restored, state)
    save_checkpoint(tmp_path, step=10, state=state, meta={})  # and the next save cleans up
    assert not list(tmp_path.glob(".checkpoint_*"))


def test_torn_newest_checkpoint_falls_back(tmp_path):
    state = _state()
    save_checkpoint(tmp_path, step=5, state=state, meta={})
    save_checkpoint(tmp_path, step=10, state=state, meta={})
    newest = tmp_path / "checkpoint_00000010.npz"
    newest.write_bytes(newest.read_bytes()[:100])  # torn by something outside our protocol
    skipped = []
    _, meta, path = restore_latest(tmp_path, state, on_skip=lambda p, e: skipped.append(p))
    assert meta["step"] == 5 and skipped == [newest]


_KILL_DURING_SAVE = r"""
import os, signal, sys
import numpy as np
import jax.numpy as jnp
from dpmp.app import checkpoint
d = sys.argv[1]
checkpoint.save_checkpoint(d, step=1, state={"w": jnp.full((1000,), 1.0)}, meta={})
real_savez = np.savez
def savez_then_die(f, **arrays):
    real_savez(f, **arrays)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # dies mid-save, after writing, before the rename
np.savez = savez_then_die
checkpoint.save_checkpoint(d, step=2, state={"w": jnp.full((1000,), 2.0)}, meta={})
"""


def test_process_killed_during_save_keeps_the_previous_checkpoint(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_DURING_SAVE, str(tmp_path)], env=env, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr.decode()
    assert list(tmp_path.glob(".checkpoint_*"))  # the torn temp file is there ...
    state, meta, _ = restore_latest(tmp_path, {"w": jnp.zeros(1000)})  # ... and ignored
    assert meta["step"] == 1 and float(state["w"][0]) == 1.0


def test_load_params_reads_the_newest_readable_checkpoint_in_the_like_structure(tmp_path):
    """``dpmp.load_params`` gives the parameters alone, in ``like``'s structure and
    dtypes: bfloat16 parameters (stored as their bits) come back as their values."""
    half = {"w": jnp.asarray([[0.1, -2.5], [3.0, 1e-3]], jnp.bfloat16), "b": jnp.ones(2)}
    state = {"loss_scale": jnp.float32(4.0), "opt_state": (jnp.zeros(3),), "params": half}
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", step=2, state=state, meta={"params_leaves": [2, 2]})
    exact = dpmp.load_params(run, like=jax.tree.map(jnp.zeros_like, half))
    _assert_same(exact, half)
    as_f32 = dpmp.load_params(run, like={"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)})
    np.testing.assert_array_equal(as_f32["w"], np.asarray(half["w"], np.float32))
    assert as_f32["w"].dtype == jnp.float32
    # a torn newest checkpoint: the previous one, as a resumed run would take
    (run / "checkpoints" / "checkpoint_00000009.npz").write_bytes(b"torn")
    _assert_same(dpmp.load_params(run, like=half), half)
    with pytest.raises(CheckpointError, match=r"parameter 0 has shape \(2,\), `like` expects"):
        dpmp.load_params(run, like={"b": jnp.zeros(3), "w": jnp.zeros((2, 2))})
    with pytest.raises(CheckpointError, match="holds 2 parameter arrays, `like` has 1"):
        dpmp.load_params(run, like={"w": jnp.zeros((2, 2))})
    with pytest.raises(CheckpointError, match="no checkpoint"):
        dpmp.load_params(tmp_path / "empty", like=half)


def test_checkpoints_are_owner_only(tmp_path):
    previous = os.umask(0o022)
    try:
        (tmp_path / "ckpt").mkdir(mode=0o755)  # an older run's folder
        path = save_checkpoint(tmp_path / "ckpt", step=1, state=_state(), meta={})
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "ckpt").st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o600
