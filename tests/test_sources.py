"""Data sources and model families are registries: a new one is one file and one
registration, and the config, the reference table and ``dpmp.train`` take it."""

from __future__ import annotations

import importlib
import sys

import pytest

import dpmp
from dpmp.app.config import ConfigError, load_config
from dpmp.app.config_reference import config_reference
from dpmp.app.inputs import load_data, model_from_config
from dpmp.data import DataError, load_dataset
from dpmp.data.sources import PUBLIC_TEXT, SOURCES
from dpmp.models.families import FAMILIES

TOY_SOURCE = '''
import numpy as np

from dpmp.data import Dataset, SourceOptions, register_source


class Blobs:
    """Three Gaussian blobs in 4 dimensions, split by the seed."""

    name = "toy_blobs"
    needs_path = False
    task = "classify"

    def load(self, options: SourceOptions) -> Dataset:
        rng = np.random.default_rng(options.seed)
        y = np.arange(300) % 3
        x = rng.normal(size=(300, 4)).astype(np.float32) + 3 * np.eye(4, dtype=np.float32)[y]
        n_test = int(options.test_fraction * 300)
        return Dataset.from_arrays(
            (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test]), description="toy blobs"
        )


register_source(Blobs())
'''

TOY_FAMILY = '''
from dpmp.models import register_family
from dpmp.models.families import FAMILIES


class Logistic:
    """Softmax regression under a name of its own."""

    name = "toy_logistic"
    task = "classify"

    def build(self, architecture, input_shape, num_classes, policy):
        linear = FAMILIES.get("linear")
        no_hidden = type(architecture)(hidden=())
        return linear.build(no_hidden, input_shape, num_classes, policy)


register_family(Logistic())
'''


@pytest.fixture
def toy_modules(tmp_path, monkeypatch):
    """Imports the toy source and family from files of their own; unregisters them after."""
    (tmp_path / "toy_source.py").write_text(TOY_SOURCE)
    (tmp_path / "toy_family.py").write_text(TOY_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("toy_source")
    importlib.import_module("toy_family")
    yield
    SOURCES.unregister("toy_blobs")
    FAMILIES.unregister("toy_logistic")
    for name in ("toy_source", "toy_family"):
        sys.modules.pop(name, None)


def test_builtin_choices_keep_their_order():
    assert SOURCES.names() == ("digits", "npz", "npy", "python_docs", "text")
    assert PUBLIC_TEXT.names() == ("python_stdlib", "text")
    assert FAMILIES.names() == ("mlp", "nnx_mlp", "linear", "vit", "lm")


def test_a_registered_source_trains_through_dpmp_train(toy_modules, tmp_path):
    config = load_config(
        None,
        [
            "data.dataset=toy_blobs",
            "model.kind=toy_logistic",
            "training.steps=4",
            "training.expected_batch_size=32",
            "training.eval_every=4",
            "training.checkpoint_every=0",
        ],
    )
    report = dpmp.train(config, out_dir=tmp_path / "run", progress=False)
    assert report["steps"] == 4 and report["data"]["description"] == "toy blobs"
    assert report["data"]["num_train"] == 240 and report["data"]["input_shape"] == [4]
    assert report["model"]["num_params"] == 4 * 3 + 3
    assert 0 < report["epsilon"] <= 2.0
    assert 0 <= report["test_accuracy"] <= 1


def test_registered_names_are_choices_while_registered(toy_modules):
    allowed = {r["key"]: r["allowed"] for r in config_reference()}
    assert '"toy_blobs"' in allowed["data.dataset"]
    assert allowed["model.kind"].startswith('"mlp", "nnx_mlp", "linear", "vit", "lm", ')
    assert '"toy_logistic"' in allowed["model.kind"]
    data = load_data(load_config(None, ["data.dataset=toy_blobs"]).data, seed=3)
    model = model_from_config(load_config(None, ["model.kind=toy_logistic"]).model, data, "fp32")
    assert model.kind == "linear" and data.num_classes == 3


def test_unregistered_names_are_refused_with_the_registered_ones():
    with pytest.raises(
        ConfigError,
        match="data.dataset: 'toy_blobs' is not allowed; allowed: "
        "digits, npz, npy, python_docs, text",
    ):
        load_config(None, ["data.dataset=toy_blobs"])
    with pytest.raises(ConfigError, match="model.kind: 'toy_logistic' is not allowed"):
        load_config(None, ["model.kind=toy_logistic"])
    with pytest.raises(
        ConfigError,
        match="pretrain.dataset: 'python_docs' is not allowed; allowed: none, python_stdlib, text",
    ):
        load_config(None, ["pretrain.dataset=python_docs", "model.kind=lm"])
    with pytest.raises(ValueError, match="unknown data source 'nope'; registered: digits, npz"):
        load_dataset("nope")


def test_a_source_that_reads_a_path_needs_one():
    for name in ("npz", "npy", "text"):
        with pytest.raises(ConfigError, match=f'data.path: required when data.dataset = "{name}"'):
            load_config(None, [f"data.dataset={name}"])
    with pytest.raises(ConfigError, match='pretrain.path: required when pretrain.dataset = "text"'):
        load_config(None, ["pretrain.dataset=text", "model.kind=lm"])


def test_a_path_for_a_source_that_reads_none_is_refused(toy_modules):
    """The source says whether it reads a path (``needs_path``). A path given to
    the digits was ignored: the run trained on them and its report said
    ``"path": "mine.npz"``."""
    for name in ("digits", "toy_blobs"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"data.dataset={name}", "data.path=mine.npz"])
        assert str(e.value) == (
            f"data.path: data.dataset = \"{name}\" reads no file, so 'mine.npz' would be "
            "ignored; set data.dataset to a source that reads it (npz, npy, text)"
        )
        with pytest.raises(DataError, match=f"data.dataset '{name}' reads no file"):
            load_dataset(name, path="mine.npz")
    with pytest.raises(ConfigError, match='pretrain.dataset = "python_stdlib" reads no file'):
        load_config(None, ["model.kind=lm", "pretrain.dataset=python_stdlib", "pretrain.path=p"])
    with pytest.raises(DataError, match='data.path: required when data.dataset = "npz"'):
        load_dataset("npz")


def test_registration_checks_the_protocol_and_refuses_a_taken_name():
    class Nameless:
        needs_path = False
        task = "classify"

    with pytest.raises(TypeError, match="name, needs_path, task and load"):
        dpmp.data.register_source(Nameless())
    with pytest.raises(ValueError, match="data source 'digits' is already registered"):
        dpmp.data.register_source(SOURCES.get("digits"))
    with pytest.raises(ValueError, match="model family 'mlp' is already registered"):
        dpmp.models.register_family(FAMILIES.get("mlp"))
