"""Tramer and Boneh's three models (``cnn``, ``scatter_linear``, ``scatter_cnn``): the
paper's parameter counts from its layer table, per-example forward passes, and two
private steps each on random data of the shape they take."""

from __future__ import annotations

import types

import jax
import numpy as np
import optax
import pytest

import dpmp
from dpmp.models._model import count_params
from dpmp.models.families import FAMILIES, build_model

POLICY = dpmp.Policy.parse("bf16")


def conv(k: int, c_in: int, c_out: int) -> int:
    return (k * k * c_in + 1) * c_out


def dense(n_in: int, n_out: int) -> int:
    return (n_in + 1) * n_out


# ftramer/Handcrafted-DP, models.py: MNIST_CNN (1 and 81 input channels), ScatterLinear.
# The end-to-end CNN: 28 -(conv 8/2, pad 2)-> 13 -(pool 2/1)-> 12 -(conv 4/2)-> 5 -(pool)-> 4.
# On the features: 7 -(conv 3/2, pad 1)-> 4 -(conv 3/1, pad 1)-> 4.
PAPER = {
    "cnn": ((28, 28, 1), conv(8, 1, 16) + conv(4, 16, 32) + dense(32 * 4 * 4, 32) + dense(32, 10)),
    "scatter_linear": ((7, 7, 81), dense(81 * 7 * 7, 10)),
    "scatter_cnn": (
        (7, 7, 81),
        conv(3, 81, 16) + conv(3, 16, 32) + dense(32 * 4 * 4, 32) + dense(32, 10),
    ),
}


def model(kind: str):
    shape, _ = PAPER[kind]
    info = types.SimpleNamespace(input_shape=shape, num_classes=10, task="classify")
    return build_model(kind, info, POLICY)


def some_params(m, seed: int = 0):
    """Parameters of ``m``'s shapes drawn by numpy (an eager ``init`` compiles every
    random op: seconds on a busy machine)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(m.init, jax.random.key(0))
    return jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


def random_batch(kind: str, n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.random((n, *PAPER[kind][0]), dtype=np.float32)
    return {"x": x, "y": rng.integers(0, 10, n).astype(np.int32)}


def paper_step(m, params, batch):
    """The paper's optimiser (SGD, momentum 0.9, learning rate 4, clip 0.1) in one
    DP-SGD step over the whole ``batch``; its clipped-sum function."""
    grad_fn = dpmp.private_grad(m.loss_fn, l2_clip_norm=0.1, policy=POLICY)
    n = len(batch["y"])
    step = dpmp.private_step(
        grad_fn,
        optax.sgd(4.0, momentum=0.9),
        params=params,
        batch=batch,
        noise_multiplier=1.0,
        expected_batch_size=n,
        padded_batch_size=n,
    )
    return step, grad_fn


def test_the_counts_are_the_papers():
    assert {k: v[1] for k, v in PAPER.items()} == {
        "cnn": 26_010,
        "scatter_linear": 39_700,
        "scatter_cnn": 33_066,
    }
    for kind in PAPER:
        assert FAMILIES.get(kind).task == "classify"
        params = jax.eval_shape(model(kind).init, jax.random.key(0))
        assert count_params(params) == PAPER[kind][1], kind
        for leaf in jax.tree.leaves(params):
            assert leaf.dtype == np.float32


@pytest.mark.parametrize("kind", sorted(PAPER))
def test_an_examples_output_reads_no_other_example(kind):
    """No batch statistics (GroupNorm normalises within one example): changing the
    other examples of a batch leaves one example's logits bit-identical."""
    m = model(kind)
    params = some_params(m)
    rng = np.random.default_rng(0)
    shape = PAPER[kind][0]
    a = rng.random((4, *shape), dtype=np.float32)
    b = rng.random((4, *shape), dtype=np.float32) * 3
    b[2] = a[2]
    out_a, out_b = np.asarray(m.predict(params, a)), np.asarray(m.predict(params, b))
    assert out_a.shape == (4, 10)
    np.testing.assert_array_equal(out_a[2], out_b[2])


def test_the_scatter_models_ask_for_scattering_features():
    for kind in ("scatter_linear", "scatter_cnn"):
        info = types.SimpleNamespace(input_shape=(28, 28, 1), num_classes=10, task="classify")
        with pytest.raises(ValueError, match='data.features = "scattering"'):
            build_model(kind, info, POLICY)
    info = types.SimpleNamespace(input_shape=(64,), num_classes=10, task="classify")
    with pytest.raises(ValueError, match=r"images \[h, w, c\]"):
        build_model("cnn", info, POLICY)


@pytest.mark.parametrize("kind", sorted(PAPER))
def test_the_private_step_clips_by_ghost_norms(kind):
    """Every layer has a ghost rule (conv, dense, bias; GroupNorm and max pooling
    hold no parameters), so ``auto`` clips by ghost norms: the step traced."""
    m = model(kind)
    params = some_params(m)
    batch = random_batch(kind, 4, seed=1)
    step, grad_fn = paper_step(m, params, batch)
    state = jax.eval_shape(step.init, params)
    pad = np.zeros(4, bool)
    out = jax.eval_shape(step.step_fn, params, batch, pad, state.opt_state, state.loss_scale)
    assert jax.tree.structure(out[0]) == jax.tree.structure(params)
    assert grad_fn.resolved_method == "ghost"


@pytest.mark.slow  # compiles the ghost-clipped step of each model (~10-25 s each)
@pytest.mark.parametrize("kind", sorted(PAPER))
def test_two_private_steps_run(kind):
    m = model(kind)
    params = m.init(jax.random.key(2))
    batch = random_batch(kind, 8, seed=3)
    step, grad_fn = paper_step(m, params, batch)
    state = step.init(params)
    pad = np.zeros(8, bool)
    for _ in range(2):
        state, _ = step(state, *step.put_batch(batch, pad))
    assert grad_fn.resolved_method == "ghost"
    moved = jax.tree.map(
        lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), state.params, params
    )
    assert all(np.isfinite(v) and v > 0 for v in jax.tree.leaves(moved))
