"""The shipped configs: each loads, validates, trains, and says what it measured."""

import math
import tomllib
from pathlib import Path

import jax
import pytest

import dpmp
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer import audit_step, build_private_step, train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
NAMES = sorted(p.name for p in CONFIGS.glob("*.toml"))


def test_the_promised_configs_exist():
    assert {"default.toml", "fp16.toml", "fp32.toml", "vit.toml", "nnx.toml"} <= set(NAMES)


def test_default_toml_is_exactly_the_built_in_default():
    assert load_config(CONFIGS / "default.toml") == load_config(None) == Config()
    # every key is written out, so a reader learns them all from this file
    raw = tomllib.loads((CONFIGS / "default.toml").read_text())
    for section, values in Config().to_dict().items():
        if section == "policy":
            assert raw["policy"] == "bf16"
            continue
        unset = {k for k, v in values.items() if v is None}
        assert set(raw[section]) == set(values) - unset, section
        text = (CONFIGS / "default.toml").read_text()
        for key in unset:  # unset keys appear commented out
            assert f"# {key} = " in text, f"{section}.{key}"


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_validates_and_states_its_measurement(name):
    config = dpmp.load_config(CONFIGS / name)
    assert isinstance(config, dpmp.Config)
    assert Config.from_dict(config.to_dict()) == config
    header = (CONFIGS / name).read_text().split("\n\n")[0]
    if config.model.kind == "lm":  # text: a language model's own measure
        assert "measured:" in header and "perplexity at eps" in header, name
        return
    assert "measured:" in header and "test accuracy at eps" in header, name
    # every classifier config spends the default's budget, so their accuracies compare
    assert config.privacy.target_epsilon == 2.0 and config.privacy.delta == 1e-5


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


@pytest.mark.parametrize(
    "name",
    # the default in the default suite; the others trace the same code paths
    [n if n == "default.toml" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES],
)
def test_config_builds_and_traces_its_private_step(name, digits):
    """Model, sampler, noise calibration and the whole step, traced (not compiled)."""
    config = load_config(CONFIGS / name, ["training.steps=2"])
    step = build_private_step(config, None if config.model.kind == "lm" else digits)
    assert step.model.kind == config.model.kind
    assert 0 < step.noise_multiplier < math.inf
    params, *_ = jax.eval_shape(step.step_fn, *step.example_args)
    assert jax.tree.structure(params) == jax.tree.structure(step.example_args[0])
    report = audit_step(config, step=step)
    assert report.ok, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_config_trains_two_steps(name, digits, tmp_path):
    config = load_config(
        CONFIGS / name, ["training.steps=2", "training.log_every=1", "pretrain.steps=2"]
    )
    data = None if config.model.kind == "lm" else digits
    report = train(config, out_dir=tmp_path, progress=False, data=data)
    assert report["steps"] == 2 and report["finite_params"]
    assert report["audit"]["ok"] is True, report["audit"]
    assert report["epsilon"] <= config.privacy.target_epsilon
    assert math.isfinite(report["test_loss"])
    assert report["model"]["kind"] == config.model.kind
