"""Evaluation: loss and accuracy of the current parameters on a whole split.

The test split is held out, so its numbers are public (``metrics.jsonl``); the
same numbers on the training split are exact statistics of private data and
go to ``private/`` only (``dpmp._src.release``). A split is read in chunks of
``chunk`` rows, so a memory-mapped one is never loaded whole.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpmp._src.models import Model

__all__ = ["evaluator"]


def evaluator(model: Model, chunk: int = 512) -> Callable:
    """``evaluate(params, x, y) -> (accuracy, mean loss)`` over all rows of ``x, y``."""

    @jax.jit
    def sums(params, x, y, valid):
        losses, correct = model.metrics(params, {"x": x, "y": y})
        loss = jnp.where(valid, losses.astype(jnp.float32), 0.0).sum()
        return loss, (correct & valid).sum(dtype=jnp.int32)

    def evaluate(params, x, y) -> tuple[float, float]:
        n = len(x)
        loss, correct = 0.0, 0
        for start in range(0, n, chunk):  # one compiled shape for every chunk
            xb = np.asarray(x[start : start + chunk], np.float32)
            yb = np.asarray(y[start : start + chunk], np.int32)
            valid = np.ones(chunk, bool)
            if len(xb) < chunk:  # pad the last chunk
                valid[len(xb) :] = False
                fill = chunk - len(xb)
                xb = np.concatenate([xb, np.repeat(xb[:1], fill, 0)])
                yb = np.concatenate([yb, np.repeat(yb[:1], fill, 0)])
            s_loss, s_correct = sums(params, xb, yb, valid)
            loss += float(s_loss)
            correct += int(s_correct)
        return correct / n, loss / n

    return evaluate
