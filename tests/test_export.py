"""Exporting a run's parameters alone, and deleting its secret state."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmp
from dpmp.app.checkpoint import CheckpointError, list_checkpoints, save_checkpoint
from tests.test_checkpoint import _assert_same, _state


def _run_dir(tmp_path):
    """A run directory with a checkpoint of ``_state()`` that says where its params are."""
    state = _state()
    leaves = jax.tree_util.tree_leaves(state)
    first = jax.tree_util.tree_leaves(state["params"])[0]
    start = next(i for i, x in enumerate(leaves) if x is first)
    span = [start, len(jax.tree_util.tree_leaves(state["params"]))]
    save_checkpoint(tmp_path / "checkpoints", step=5, state=state, meta={"params_leaves": span})
    return state


def test_export_params_alone_and_load_them(tmp_path):
    state = _run_dir(tmp_path)
    path = dpmp.export_params(tmp_path)
    assert path == tmp_path / "params.npz"
    with np.load(path) as npz:
        names = sorted(npz.files)
        meta = json.loads(str(npz["__meta__"]))
    assert len(names) == 1 + len(jax.tree_util.tree_leaves(state["params"]))
    assert meta["step"] == 5 and all(info["kind"] == "array" for info in meta["leaves"])
    like = jax.tree.map(jnp.zeros_like, state["params"])
    _assert_same(dpmp.load_params(path, like), state["params"])
    _assert_same(dpmp.load_params(path, like), dpmp.load_params(tmp_path, like))
    other = dpmp.export_params(tmp_path, tmp_path / "elsewhere.npz")
    _assert_same(dpmp.load_params(other, like), state["params"])


def test_delete_secrets_only_of_a_finished_run(tmp_path):
    _run_dir(tmp_path)
    with pytest.raises(CheckpointError, match="has not finished"):
        dpmp.delete_secrets(tmp_path)
    assert list_checkpoints(tmp_path / "checkpoints")
    (tmp_path / "report.json").write_text(json.dumps({"versions": {"dpmp": "x"}}))
    assert dpmp.delete_secrets(tmp_path) == [tmp_path / "checkpoints"]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / ".lock").exists()
    assert dpmp.delete_secrets(tmp_path) == []
    with pytest.raises(CheckpointError, match="no checkpoint"):
        dpmp.export_params(tmp_path)


def test_export_after_the_secrets_were_deleted_points_at_the_exported_parameters(tmp_path, capsys):
    """It said "no checkpoint (has the run started?)" with params.npz beside it."""
    from dpmp.app import cli

    _run_dir(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({"versions": {"dpmp": "x"}}))
    assert cli.main(["export", str(tmp_path), "--delete-secrets"]) == 0
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"dpmp export: error: {tmp_path}: its checkpoints were deleted (--delete-secrets); "
        f"the parameters are already exported: {tmp_path / 'params.npz'}\n"
    )
