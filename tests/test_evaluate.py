"""Evaluation over a whole split: per-prediction means, chunked and padded exactly."""

import jax.numpy as jnp
import numpy as np
import pytest

from dpmp.app.trainer.evaluate import evaluator
from dpmp.models._model import Model


def _model_reading_its_metrics_from_the_input():
    """metrics = (x[:, 0], x[:, 1], x[:, 2]): any chunking or padding error shows."""

    def metrics(params, batch):
        x = batch["x"]
        return x[:, 0].astype(jnp.float32), x[:, 1].astype(jnp.int32), x[:, 2].astype(jnp.int32)

    unused = lambda *a: None  # noqa: E731
    return Model("fake", "jax", "fake", unused, unused, unused, metrics, "")


@pytest.mark.parametrize("n", [1, 511, 512, 1100])
def test_means_are_per_prediction_over_every_row_once(n):
    rng = np.random.default_rng(n)
    counts = rng.integers(0, 9, size=n)
    correct = rng.integers(0, counts + 1)
    losses = rng.uniform(0, 5, size=n)
    x = np.stack([losses, correct, counts], axis=1)
    accuracy, loss = evaluator(_model_reading_its_metrics_from_the_input())(None, x, np.zeros(n))
    total = max(counts.sum(), 1)
    assert accuracy == pytest.approx(correct.sum() / total)
    assert loss == pytest.approx(losses.sum() / total, rel=1e-5)


@pytest.mark.parametrize("n", [0, 3, 513])
def test_a_split_without_a_prediction_has_no_loss_rather_than_a_perfect_one(n):
    """No row, or rows that predict nothing (next-token labels all -1): 0/0 is no
    number, where a 0 loss would be published as perplexity exp(0) = 1."""
    x = np.zeros((n, 3))
    x[:, 0] = 2.5  # a loss on rows that count no prediction must not leak in either
    assert evaluator(_model_reading_its_metrics_from_the_input())(None, x, np.zeros(n)) == (
        None,
        None,
    )


def test_one_labelled_prediction_is_enough_for_a_number():
    x = np.zeros((4, 3))
    x[2] = (0.75, 1, 1)
    accuracy, loss = evaluator(_model_reading_its_metrics_from_the_input())(None, x, np.zeros(4))
    assert (accuracy, loss) == (1.0, 0.75)
