"""Data sources and model families are registries: a new one is one file and one
registration, the config, the reference table and ``dpmp train`` take it, and
what the app decides about one it asks of the object (its ``needs_path``,
``task``, ``sizes``, ``checkpoint``), never of its name."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import sys

import pytest

import dpmp
from dpmp.app.config import ConfigError, ModelConfig, load_config
from dpmp.app.config_checkpoint import CHECKPOINT_KINDS
from dpmp.app.config_reference import config_reference
from dpmp.app.inputs import load_data, model_from_config
from dpmp.data import DataError, load_dataset
from dpmp.data.sources import PUBLIC_TEXT, SOURCES
from dpmp.models.families import FAMILIES, Architecture

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
    sizes = ()
    checkpoint = None

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


def _readers(registry) -> tuple[str, ...]:
    return tuple(v.name for v in registry if v.needs_path)


def test_the_built_in_sources_and_families_are_registered_with_what_is_asked_of_them():
    assert {"digits", "npz", "npy", "python_docs", "text"} <= set(SOURCES.names())
    assert {"python_stdlib", "text"} <= set(PUBLIC_TEXT.names())
    assert {"mlp", "nnx_mlp", "linear", "vit", "lm", "gpt2"} <= set(FAMILIES.names())
    for source in SOURCES:
        assert isinstance(source.needs_path, bool) and source.task in ("classify", "next_token")
    keys = {f.name for f in dataclasses.fields(Architecture)}
    for family in FAMILIES:
        assert family.task in ("classify", "next_token") and set(family.sizes) <= keys
        assert family.checkpoint is None or isinstance(family.checkpoint, str)
    # the model kinds read from a checkpoint folder are the families that say so
    assert dict(CHECKPOINT_KINDS) == {f.name: f.checkpoint for f in FAMILIES if f.checkpoint}
    assert (
        "gpt2" in CHECKPOINT_KINDS and "mlp" not in CHECKPOINT_KINDS and 3 not in CHECKPOINT_KINDS
    )


@pytest.mark.slow  # a 2-step run through dpmp train (~15 s)
def test_a_source_registered_after_a_config_trains_through_dpmp_train(tmp_path, capsys):
    """A data source and a model family registered after the first config train
    through ``dpmp train`` and are reported and audited as themselves."""
    from dpmp.app import cli

    load_config(None)
    (tmp_path / "toy_source.py").write_text(TOY_SOURCE)
    (tmp_path / "toy_family.py").write_text(TOY_FAMILY)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("toy_source")
        importlib.import_module("toy_family")
        sets = ["data.dataset=toy_blobs", "model.kind=toy_logistic", "training.steps=2"]
        sets += ["training.expected_batch_size=32"]
        argv = ["train", "--quiet", "--out", str(tmp_path / "run")]
        for item in sets:
            argv += ["--set", item]
        assert cli.main(argv) == 0, capsys.readouterr().err
    finally:
        sys.path.remove(str(tmp_path))
        SOURCES.unregister("toy_blobs")
        FAMILIES.unregister("toy_logistic")
        for name in ("toy_source", "toy_family"):
            sys.modules.pop(name, None)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == 2 and report["data"]["description"] == "toy blobs"
    assert report["data"]["num_train"] == 240 and report["data"]["input_shape"] == [4]
    assert report["model"]["num_params"] == 4 * 3 + 3
    assert report["config"]["data"]["dataset"] == "toy_blobs"
    assert report["audit"]["ok"] is True and report["audit"]["missing"] == []
    assert 0 < report["epsilon"] <= report["config"]["privacy"]["target_epsilon"]


def test_registered_names_are_choices_while_registered(toy_modules):
    allowed = {r["key"]: r["allowed"] for r in config_reference()}
    assert '"toy_blobs"' in allowed["data.dataset"]
    assert allowed["model.kind"].startswith(", ".join(f'"{k}"' for k in FAMILIES.names()))
    assert FAMILIES.names()[-1] == "toy_logistic"  # registered last, listed last
    data = load_data(load_config(None, ["data.dataset=toy_blobs"]).data, seed=3)
    model = model_from_config(load_config(None, ["model.kind=toy_logistic"]).model, data, "fp32")
    assert model.kind == "linear" and data.num_classes == 3


def test_unregistered_names_are_refused_with_the_registered_ones():
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"data.dataset: 'toy_blobs' is not allowed; allowed: {', '.join(SOURCES.names())}"
        ),
    ):
        load_config(None, ["data.dataset=toy_blobs"])
    with pytest.raises(ConfigError, match="model.kind: 'toy_logistic' is not allowed"):
        load_config(None, ["model.kind=toy_logistic"])
    public = ", ".join(("none", *PUBLIC_TEXT.names()))
    with pytest.raises(
        ConfigError,
        match=re.escape(f"pretrain.dataset: 'python_docs' is not allowed; allowed: {public}"),
    ):
        load_config(None, ["pretrain.dataset=python_docs", "model.kind=lm"])
    with pytest.raises(ValueError) as e:
        load_dataset("nope")
    assert str(e.value) == f"data source must be one of {SOURCES.names()}, got 'nope'."


def test_a_source_that_reads_a_path_needs_one():
    assert _readers(SOURCES) and _readers(PUBLIC_TEXT)
    for name in _readers(SOURCES):
        with pytest.raises(ConfigError, match=f'data.path: required when data.dataset = "{name}"'):
            load_config(None, [f"data.dataset={name}"])
        with pytest.raises(DataError, match=f'data.path: required when data.dataset = "{name}"'):
            load_dataset(name)
    for name in _readers(PUBLIC_TEXT):
        with pytest.raises(
            ConfigError, match=f'pretrain.path: required when pretrain.dataset = "{name}"'
        ):
            load_config(None, [f"pretrain.dataset={name}", "model.kind=lm"])


def test_a_path_for_a_source_that_reads_none_is_refused(toy_modules):
    """The source says whether it reads a path (``needs_path``). A path given to
    the digits was ignored: the run trained on them and its report said
    ``"path": "mine.npz"``."""
    readers = ", ".join(_readers(SOURCES))
    for name in ("digits", "toy_blobs"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"data.dataset={name}", "data.path=mine.npz"])
        assert str(e.value) == (
            f"data.path: data.dataset = \"{name}\" reads no file, so 'mine.npz' would be "
            f"ignored; set data.dataset to a source that reads it ({readers})"
        )
        with pytest.raises(DataError, match=f"data.dataset '{name}' reads no file"):
            load_dataset(name, path="mine.npz")
    with pytest.raises(ConfigError, match='pretrain.dataset = "python_stdlib" reads no file'):
        load_config(None, ["model.kind=lm", "pretrain.dataset=python_stdlib", "pretrain.path=p"])


def test_registration_checks_the_protocol_and_refuses_a_taken_name():
    class Nameless:
        needs_path = False
        task = "classify"

    class Unsized:
        name = "unsized"
        task = "classify"

        def build(self, architecture, input_shape, num_classes, policy):
            raise AssertionError("never built")

    with pytest.raises(
        TypeError, match=r"data source: Nameless lacks name, load \(see DataSource\)"
    ):
        dpmp.data.register_source(Nameless())
    with pytest.raises(
        TypeError,
        match=r"model family: Unsized 'unsized' lacks sizes, checkpoint \(see ModelFamily\)",
    ):
        dpmp.models.register_family(Unsized())
    assert "unsized" not in FAMILIES
    with pytest.raises(ValueError, match="data source 'digits' is already registered"):
        dpmp.data.register_source(SOURCES.get("digits"))
    with pytest.raises(ValueError, match="model family 'mlp' is already registered"):
        dpmp.models.register_family(FAMILIES.get("mlp"))


@dataclasses.dataclass(frozen=True)
class ToyFamily:
    """A family the config asks about (never built here)."""

    name: str
    task: str = "next_token"
    sizes: tuple[str, ...] = ("dim",)
    checkpoint: str | None = None

    def build(self, architecture, input_shape, num_classes, policy):
        raise AssertionError("never built")


@dataclasses.dataclass(frozen=True)
class ToyCheckpointFamily(ToyFamily):
    """A family read from a checkpoint folder (never loaded here)."""

    model_types: tuple[str, ...] = ("toy",)

    def load(self, folder, policy):
        raise AssertionError("never loaded")


@pytest.fixture
def toy_families():
    made = [
        ToyFamily("toy_lm"),
        ToyCheckpointFamily("toy_ckpt", sizes=(), checkpoint="a toy folder"),
    ]
    for family in made:
        dpmp.models.register_family(family)
    yield made
    for family in made:
        FAMILIES.unregister(family.name)


def test_what_the_config_decides_about_a_family_it_asks_the_family(toy_families):
    """Pre-training takes every family of next-token models built from sizes; a
    family read from a checkpoint folder needs ``model.checkpoint`` and says what
    it holds; the parameters that do not fit are named by the family's sizes."""
    from dpmp.app.trainer.step import _sized_by

    pretrains = [f.name for f in FAMILIES if f.task == "next_token" and f.checkpoint is None]
    assert "toy_lm" in pretrains and "toy_ckpt" not in pretrains and "gpt2" not in pretrains
    config = load_config(None, ["model.kind=toy_lm", "pretrain.dataset=python_stdlib"])
    assert config.pretrain.enabled and config.model.kind == "toy_lm"
    for kind in ("mlp", "toy_ckpt"):
        sets = [f"model.kind={kind}", "pretrain.dataset=python_stdlib", "model.checkpoint=x"]
        with pytest.raises(ConfigError) as e:
            load_config(None, sets if kind == "toy_ckpt" else sets[:2])
        wanted = " or ".join(map(repr, pretrains))
        assert f"it needs model.kind = {wanted}, got {kind!r}" in str(e.value)
    assert CHECKPOINT_KINDS["toy_ckpt"] == "a toy folder" and "toy_lm" not in CHECKPOINT_KINDS
    with pytest.raises(ConfigError, match="required when model.kind = 'toy_ckpt' .a toy folder"):
        load_config(None, ["model.kind=toy_ckpt"])
    with pytest.raises(ConfigError, match="model.checkpoint: read only when model.kind is"):
        load_config(None, ["model.kind=toy_lm", "model.checkpoint=x"])
    assert _sized_by(ModelConfig(kind="toy_lm", dim=8)) == "model.dim = 8"
    assert _sized_by(ModelConfig(kind="mlp", hidden=(3, 4))) == "model.hidden = [3, 4]"
    assert _sized_by(ModelConfig(kind="vit", dim=8, depth=3)) == "model.dim = 8, model.depth = 3"
    assert _sized_by(ModelConfig(kind="linear")) == "model.kind = 'linear'"
