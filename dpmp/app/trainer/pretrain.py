"""Public pre-training: non-private training on public text before a private run.

A config with a ``[pretrain]`` section first trains its language model
without privacy on PUBLIC text (the standard library's docstrings, or a
user's file), then the private run starts from those parameters: it
fine-tunes all of them, or, with ``model.lora_rank``, trains low-rank
adapters on them frozen (``dpmp.models._lora``). The public text is not
protected and costs no epsilon; nothing private is read here, so every
number this stage gives (its held-out loss on the public text) is public.

The parameters are saved in the run directory as ``pretrained/checkpoints/``
(``dpmp.load_params(out_dir / "pretrained", like)`` reads them) with what
made them: the ``[pretrain]`` section, the model, the policy, the record
length and a digest of the public text. A later run in the same directory
(a resumed one, or one that only changes the private part) reuses them when
all of that is the same, and pre-trains again otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmp.app.checkpoint import CheckpointError, latest_meta, load_checkpoint, save_checkpoint
from dpmp.app.config import Config
from dpmp.app.inputs import model_from_config
from dpmp.app.run_dir import ProgressBar
from dpmp.app.trainer.evaluate import evaluator
from dpmp.data._dataset import Dataset, fingerprint
from dpmp.data._tokens import records_dataset
from dpmp.data.sources import PUBLIC_TEXT

__all__ = ["Pretrained", "params_digest", "pretrain", "public_text"]

FOLDER = "pretrained"
# Share of the public text held out to report the pre-trained model's loss.
_TEST_FRACTION = 0.05


@dataclasses.dataclass(frozen=True, eq=False)
class Pretrained:
    """Pre-trained parameters and what the report says of them (all public)."""

    params: Any
    info: dict[str, Any]


def public_text(config: Config) -> Dataset:
    """The public text of ``config.pretrain`` as a next-token ``Dataset`` (encoded by
    ``data.tokenizer`` when it is set, as the private text is)."""
    p, d = config.pretrain, config.data
    records, source = PUBLIC_TEXT.get(p.dataset).records(p.path, "pretrain.path")
    return records_dataset(
        records,
        source,
        tokenizer=d.tokenizer,
        seq_len=d.seq_len,
        test_fraction=_TEST_FRACTION,
        seed=p.seed,
    )


def params_digest(params: Any) -> str:
    """sha256 of the parameters' shapes, dtypes and bytes (a frozen base is checked by it)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        arr = np.asarray(leaf)
        h.update(f"{arr.shape}{arr.dtype}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _spec(config: Config, data: Dataset) -> dict[str, Any]:
    """Everything the pre-trained parameters depend on."""
    model = dataclasses.asdict(config.model)
    model.pop("lora_rank"), model.pop("lora_alpha")  # the private run's, not the base's
    model["hidden"] = list(model["hidden"])
    spec = {
        "pretrain": dataclasses.asdict(config.pretrain),
        "model": model,
        "policy": config.policy,
        "seq_len": config.data.seq_len,
        "text_sha256": fingerprint(data),  # public text: its digest may be kept anywhere
    }
    return json.loads(json.dumps(spec))  # as a checkpoint's metadata gives it back


def pretrain(
    config: Config, out_dir: str | Path, *, log: Callable[[str], None], progress: bool = True
) -> Pretrained:
    """The pre-trained parameters of ``config``: reused from ``out_dir/pretrained``
    when they were made by the same spec, else trained now (and saved there);
    ``log(line)`` is told which."""
    data = public_text(config)
    model = model_from_config(config.model, data, config.precision)
    spec = _spec(config, data)
    folder = Path(out_dir) / FOLDER / "checkpoints"
    like = jax.eval_shape(model.init, jax.random.key(0))
    reused = _reuse(folder, spec, like)
    if reused is not None:
        log(f"public pre-training: reused {FOLDER}/ ({reused.info['description']})")
        return reused
    log(
        f"public pre-training (NOT private; public text only, no epsilon spent): "
        f"{config.pretrain.steps} steps of {config.pretrain.batch_size} records of "
        f"{data.description}"
    )
    started = time.perf_counter()
    params = _train(config, model, data, progress=progress)
    # held-out calls of a training step's rows (pretrain.batch_size), not more
    evaluate = evaluator(model, config.pretrain.batch_size, input_dtype=np.int32)
    accuracy, loss = evaluate(params, data.x_test, data.y_test)
    info = {
        "dataset": config.pretrain.dataset,
        "description": data.description,
        "steps": config.pretrain.steps,
        "batch_size": config.pretrain.batch_size,
        "records": data.num_train,
        "public_test_loss": loss,
        "public_test_perplexity": math.exp(loss),
        "public_test_accuracy": accuracy,
        "seconds": round(time.perf_counter() - started, 1),
        "params_sha256": params_digest(params),
    }
    meta = {"spec": spec, "info": info, "params_leaves": [0, len(jax.tree.leaves(params))]}
    save_checkpoint(folder, step=config.pretrain.steps, state={"params": params}, meta=meta)
    log(
        f"public pre-training done in {info['seconds']:.0f} s: held-out public loss "
        f"{loss:.4f} (perplexity {info['public_test_perplexity']:.2f}, accuracy {accuracy:.4f})"
    )
    return Pretrained(params, info)


def _reuse(folder: Path, spec: dict[str, Any], like: Any) -> Pretrained | None:
    found = latest_meta(folder)
    if found is None or found[0].get("spec") != spec:
        return None
    meta, path = found
    try:
        state, _ = load_checkpoint(path, {"params": like})
    except CheckpointError:
        return None  # unreadable or another shape: pre-train again
    if params_digest(state["params"]) != meta["info"].get("params_sha256"):
        return None
    return Pretrained(state["params"], dict(meta["info"]))


def _chunk(batch: int, physical: int | None) -> int:
    """Records per pass of a public batch: the largest divisor of ``batch`` up to
    ``training.physical_batch_size`` (the whole batch when it is unset)."""
    if physical is None or physical >= batch:
        return batch
    return max(d for d in range(1, physical + 1) if batch % d == 0)


def _chunked_value_and_grad(loss_fn: Callable, chunk: int) -> Callable:
    """``(params, x, y) -> (loss, grads)`` of the batch's mean loss, ``chunk`` records
    a pass: the mean over equal chunks of their mean losses and gradients (a scan),
    so the compiled memory is one chunk's (the 12.9M-parameter byte LM of
    ``configs/lm_lora.toml`` at ``dim = 512, depth = 4``: 974 MB of temporaries
    for a batch of 64 in one pass)."""

    def whole(params, x, y):
        return jax.value_and_grad(loss_fn)(params, {"x": x, "y": y})

    def chunked(params, x, y):
        parts = x.shape[0] // chunk
        if parts == 1:
            return whole(params, x, y)
        xs, ys = (a.reshape(parts, chunk, *a.shape[1:]) for a in (x, y))

        def add(acc, xy):
            part = whole(params, *xy)
            return jax.tree.map(lambda s, v: s + v.astype(s.dtype) / parts, acc, part), None

        shapes = jax.eval_shape(whole, params, xs[0], ys[0])
        zero = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, "f4")), shapes)
        total = jax.lax.scan(add, zero, (xs, ys))[0]  # added up in float32 at least
        return jax.tree.map(lambda t, a: t.astype(a.dtype), total, shapes)

    return chunked


def _train(config: Config, model, data: Dataset, *, progress: bool) -> Any:
    """Adam on the mean loss of uniformly drawn batches of the public text (in
    chunks of at most ``training.physical_batch_size`` records when it is set)."""
    p = config.pretrain
    optimizer = optax.adam(p.learning_rate)
    params = jax.jit(model.init)(jax.random.key(p.seed))
    opt_state = optimizer.init(params)

    value_and_grad = _chunked_value_and_grad(
        model.loss_fn, _chunk(p.batch_size, config.training.physical_batch_size)
    )

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = value_and_grad(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(p.seed)
    bar = ProgressBar(p.steps, enabled=progress)
    for i in range(1, p.steps + 1):
        rows = np.sort(rng.integers(0, data.num_train, p.batch_size))
        x = jnp.asarray(np.asarray(data.x_train[rows], np.int32))
        y = jnp.asarray(np.asarray(data.y_train[rows], np.int32))
        params, opt_state, loss = step(params, opt_state, x, y)
        due = i % 50 == 0 or i == p.steps
        if due or bar.tty:
            bar.update(i, {"public pre-training loss": f"{float(loss):.3f}"}, force=due)
    bar.close()
    return params
