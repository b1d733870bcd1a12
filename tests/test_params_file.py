"""Parameters in files (``.safetensors`` and orbax directories): round trips by
name, bad files named, and ``init_params`` given as a path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dpmp.app.config import load_config
from dpmp.app.inputs import load_data, model_from_config
from dpmp.app.trainer import build_private_step, train
from dpmp.data._dataset import DataError
from dpmp.models._params_file import (
    load_params_file,
    param_names,
    read_params_file,
    save_params_file,
)


def _params():
    rng = np.random.default_rng(0)
    return {
        "Dense_0": {
            "kernel": rng.standard_normal((3, 4)).astype(np.float32),
            "bias": rng.standard_normal(4).astype(np.float32),
        },
        "blocks": [
            {"scale": rng.standard_normal(2).astype(ml_dtypes.bfloat16)},
            {"scale": rng.standard_normal(2).astype(np.float16)},
        ],
    }


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["params.safetensors", "params_orbax"])
def test_a_round_trip_keeps_names_values_and_dtypes(tmp_path, name):
    params = _params()
    path = save_params_file(tmp_path / name, params)
    assert set(read_params_file(path)) == {
        "Dense_0.kernel",
        "Dense_0.bias",
        "blocks.0.scale",
        "blocks.1.scale",
    }
    _assert_same(load_params_file(path, like=params), params)
    nested = load_params_file(path)  # without `like`: nested dicts by name
    np.testing.assert_array_equal(nested["blocks"]["1"]["scale"], params["blocks"][1]["scale"])


def test_bad_files_and_names_are_one_named_error(tmp_path):
    params = _params()
    with pytest.raises(DataError, match="init_params: .*nothing.safetensors not found"):
        read_params_file(tmp_path / "nothing.safetensors")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="neither a .safetensors file nor an orbax checkpoint"):
        read_params_file(tmp_path / "folder")
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(DataError, match="junk.safetensors is not a safetensors file"):
        read_params_file(tmp_path / "junk.safetensors")
    flat = {k: np.asarray(v) for k, v in param_names(params).items()}
    cases = [
        ({k: v for k, v in flat.items() if k != "Dense_0.bias"}, "no parameter 'Dense_0.bias'"),
        (
            flat | {"Dense_1.kernel": np.zeros(2, np.float32)},
            "unexpected parameter 'Dense_1.kernel'",
        ),
        (
            flat | {"Dense_0.kernel": np.zeros((4, 3), np.float32)},
            r"parameter 'Dense_0.kernel' has shape \(4, 3\), the model's \(3, 4\)",
        ),
    ]
    for i, (stored, message) in enumerate(cases):
        save_file(stored, str(tmp_path / f"{i}.safetensors"))
        with pytest.raises(DataError, match=f"init_params {i}.safetensors: {message}"):
            load_params_file(tmp_path / f"{i}.safetensors", like=params)


def _digits_config():
    return load_config(None, ["training.steps=1", "model.hidden=[8]"])


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_init_params_may_be_a_file_and_what_is_cast_is_said(tmp_path):
    """A float16 file for a float32 model was cast without a word."""
    config = _digits_config()
    data = load_data(config.data, 0)
    model = model_from_config(config.model, data, config.precision)
    start = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(7)))
    flat = {name: np.asarray(a, np.float16) for name, a in param_names(start).items()}
    first = sorted(flat)[0]
    flat[first] = flat[first].astype(np.float32)  # one array stored as the model's
    save_file(flat, str(tmp_path / "start.safetensors"))
    step = build_private_step(config, data, init_params=tmp_path / "start.safetensors")
    stored = jax.tree.map(np.asarray, load_params_file(tmp_path / "start.safetensors", start))
    _assert_same(step.init_state["params"], jax.tree.map(lambda a: a.astype(np.float32), stored))
    assert step.notes == (
        "starting parameters: 3 of 4 arrays cast to the model's parameter dtypes "
        "(3 from float16 to float32)",
    )


def test_nothing_cast_is_nothing_said():
    from dpmp.app.trainer.step import _cast_note

    like = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "b": jnp.zeros(3, jnp.bfloat16)}
    assert (
        _cast_note({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, ml_dtypes.bfloat16)}, like)
        == ()
    )
    note = _cast_note({"w": np.zeros((2, 3), np.float64), "b": np.zeros(3, np.float32)}, like)
    assert note == (
        "starting parameters: 2 of 2 arrays cast to the model's parameter dtypes "
        "(1 from float32 to bfloat16, 1 from float64 to float32)",
    )


def test_a_bad_init_params_file_stops_train_before_anything_is_written(tmp_path):
    config = _digits_config()
    start = {"Dense_0": {"kernel": np.zeros((64, 8), np.float32)}}  # no bias, no Dense_1
    path = save_params_file(tmp_path / "start.safetensors", start)
    with pytest.raises(
        DataError, match="init_params start.safetensors: no parameter 'Dense_0.bias'"
    ):
        build_private_step(config, init_params=path)
    with pytest.raises(DataError, match="init_params: .*missing.safetensors not found"):
        train(config, out_dir=tmp_path / "run", init_params=tmp_path / "missing.safetensors")
    assert not (tmp_path / "run").exists()
