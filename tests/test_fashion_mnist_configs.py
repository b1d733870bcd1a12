"""The configs of Tramer and Boneh's Fashion-MNIST table: the paper's settings with
what the guarantee needs (Poisson sampling, PLD accounting of the snapped noise,
epsilon 3), and a private step each builds, passes the precision audit and trains
on data of the shape its model takes (random here: the real data is the
benchmark's, benchmarks/reproductions/tramer_boneh.py)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import dpmp
from dpmp.app.config import Config, load_config
from dpmp.app.trainer import audit_step, build_private_step, train
from tests.test_configs import CONFIGS, FIGURE, REPRODUCTIONS

TRAIN_RECORDS = 60_000  # Fashion-MNIST's published training split
# The paper's rows (ftramer/Handcrafted-DP README): model, batch, learning rate.
PAPER = {
    "fashion_mnist_cnn.toml": ("cnn", 2048, 4.0),
    "fashion_mnist_scatter_linear.toml": ("scatter_linear", 8192, 16.0),
    "fashion_mnist_scatter_cnn.toml": ("scatter_cnn", 2048, 4.0),
}
# What each model takes: the pixels, or the scattering features of 28x28 images.
SHAPES = {"none": (28, 28, 1), "scattering": (7, 7, 81)}


def test_the_three_rows_have_a_config():
    assert REPRODUCTIONS == sorted(PAPER)


@pytest.mark.parametrize("name", sorted(PAPER))
def test_a_row_is_the_papers_settings_under_the_guarantee(name):
    config = load_config(CONFIGS / name)
    assert Config.from_dict(config.to_dict()) == config
    kind, batch, learning_rate = PAPER[name]
    assert config.model.kind == kind and config.data.dataset == "fashion_mnist"
    assert config.data.features == ("scattering" if kind.startswith("scatter") else "none")
    t, p = config.training, config.privacy
    assert (t.optimizer, t.expected_batch_size, t.learning_rate) == (
        "momentum",
        batch,
        learning_rate,
    )
    assert round(t.steps * t.expected_batch_size / TRAIN_RECORDS) == 40  # 40 epochs
    assert (p.target_epsilon, p.delta, p.l2_clip_norm) == (3.0, 1e-5, 0.1)
    assert (p.sampling, p.accountant, p.noise_sampler) == ("poisson", "pld", "snapped")
    assert p.noise_multiplier is None  # calibrated to epsilon 3 at the planned steps
    assert not p.reproducible_noise and str(config.precision).startswith("param=f32,compute=bf16")


@pytest.mark.parametrize("name", sorted(PAPER))
def test_a_rows_header_points_to_its_measurement_and_no_comment_holds_a_figure(name):
    text = (CONFIGS / name).read_text()
    header = text.split("\n\n")[0]
    assert "measured:" in header and "benchmarks/reproductions/tramer_boneh.py" in header
    assert "apt-get install dataset-fashion-mnist" in header
    comments = [line for line in text.splitlines() if "#" in line]
    assert not [c for c in comments if FIGURE.search(c)], name


def random_data(config: Config, n_train: int, n_test: int) -> dpmp.Dataset:
    """Random examples of the shape the config's model takes, labels 0..9."""
    rng = np.random.default_rng(0)
    shape = SHAPES[config.data.features]
    x = rng.random((n_train + n_test, *shape), dtype=np.float32)
    y = np.arange(n_train + n_test) % 10
    return dpmp.Dataset.from_arrays((x[:n_train], y[:n_train]), (x[n_train:], y[n_train:]))


SMALL = ["training.steps=2", "training.expected_batch_size=16", "training.log_every=1"]


@pytest.mark.slow  # builds, traces and audits each row's step (~10-45 s each on 2 cores)
@pytest.mark.parametrize("name", sorted(PAPER))
def test_a_rows_private_step_builds_and_passes_the_precision_audit(name):
    config = load_config(CONFIGS / name, SMALL)
    step = build_private_step(config, random_data(config, 160, 20))
    assert step.model.kind == PAPER[name][0]
    assert 0 < step.plan.noise_multiplier < math.inf
    params, *_ = jax.eval_shape(step.step_fn, *step.example_args)
    assert jax.tree.structure(params) == jax.tree.structure(step.example_args[0])
    report = audit_step(config, step=step)
    assert report.ok, str(report)


@pytest.mark.slow  # compiles and runs each row's step through dpmp.train (~30 s each)
@pytest.mark.parametrize("name", sorted(PAPER))
def test_a_row_trains_two_steps(name, tmp_path):
    config = load_config(CONFIGS / name, SMALL)
    report = train(config, out_dir=tmp_path, progress=False, data=random_data(config, 160, 20))
    assert report["steps"] == 2 and report["finite_params"]
    assert report["audit"]["ok"] is True, report["audit"]
    assert report["epsilon"] <= config.privacy.target_epsilon
    assert report["model"]["kind"] == PAPER[name][0]
