"""Evaluation: loss and accuracy of the current parameters on a whole split.

The test split is held out, so its numbers are public (``metrics.jsonl``); the
same numbers on the training split are exact statistics of private data and
go to ``private/`` only (``dpmp.app.release``). A split is read in chunks of
``chunk`` rows, so a memory-mapped one is never loaded whole. A split without
a single prediction (no rows, or next-token records whose labels are all -1)
has no accuracy or loss: both are None, never the 0 (perplexity 1) of a 0/0.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.models._model import Model

__all__ = ["evaluator"]


def evaluator(model: Model, chunk: int = 512, input_dtype=np.float32) -> Callable:
    """``evaluate(params, x, y) -> (accuracy, mean loss)`` over all rows of ``x, y``.

    ``model.metrics`` gives per example a summed loss, a number of correct
    predictions and a number of predictions (1, 0/1, 1 for a classifier; sums
    over the real tokens of a record for next-token prediction), so the mean
    loss and the accuracy are per prediction; ``(None, None)`` when the rows
    hold no prediction (an empty split, or every label -1): there is nothing to
    average, and a 0 would read as a perfect loss. The model's frozen arrays (a
    LoRA base) are an argument of the compiled function, not constants in it.
    """

    @jax.jit
    def sums(params, x, y, valid, *frozen):
        losses, correct, counts = model.metrics(params, {"x": x, "y": y}, *frozen)
        loss = jnp.where(valid, losses.astype(jnp.float32), 0.0).sum()
        return (
            loss,
            jnp.where(valid, correct, 0).sum(dtype=jnp.int32),
            jnp.where(valid, counts, 0).sum(dtype=jnp.int32),
        )

    def evaluate(params, x, y) -> tuple[float, float] | tuple[None, None]:
        loss, correct, total = 0.0, 0, 0
        for start in range(0, len(x), chunk):  # one compiled shape for every chunk
            xb = np.asarray(x[start : start + chunk], input_dtype)
            yb = np.asarray(y[start : start + chunk], np.int32)
            valid = np.ones(chunk, bool)
            if len(xb) < chunk:  # pad the last chunk
                valid[len(xb) :] = False
                fill = chunk - len(xb)
                xb = np.concatenate([xb, np.repeat(xb[:1], fill, 0)])
                yb = np.concatenate([yb, np.repeat(yb[:1], fill, 0)])
            s_loss, s_correct, s_total = sums(params, xb, yb, valid, *model.frozen_args())
            loss += float(s_loss)
            correct += int(s_correct)
            total += int(s_total)
        if total == 0:  # no prediction to average over
            return None, None
        return correct / total, loss / total

    return evaluate
