"""The training loop: step, account, evaluate, log, checkpoint, report.

``train(config, out_dir=...)`` runs DP-SGD as the config says (on the config's
model and data, or on the ``model`` and ``data`` given) and writes a run
directory: public files (``metrics.jsonl``, ``train.log``, ``report.json``;
what may be published is decided in ``dpmp._src.release``), the ``private/``
folder (exact training statistics: do not publish) and checkpoints (secret).
A ``BudgetTracker`` is advanced every step and a step that would exceed the
target is refused: the run stops after the last step within budget and says
so (``stopped_early`` in the report, a line in ``train.log``).

Resuming (``resume=True``) restores the newest checkpoint in ``out_dir``
(params, optimizer state with the secret noise key, loss scale and its key,
the sampler with its secret seed, standardisation statistics, budget tracker,
metric totals) if its config, data and model match (``dpmp._src.trainer.resume``).
The batch of step ``t`` is a function of ``(sampler seed, t)`` and every key
lives in the state, so a killed and resumed run computes the same
parameters, bit for bit on CPU, and the same epsilon as an uninterrupted one.
"""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dpmp._src import accounting, release
from dpmp._src.adapters import as_model, model_signature
from dpmp._src.checkpoint import (
    CheckpointError,
    latest_meta,
    list_checkpoints,
    restore_latest,
    save_checkpoint,
)
from dpmp._src.config import Config
from dpmp._src.data import as_dataset, fingerprint, load_data
from dpmp._src.models import count_params
from dpmp._src.preprocess import FeatureStats
from dpmp._src.private_loss_scale import PrivateDynamicLossScale
from dpmp._src.run_dir import ProgressBar, RunDir
from dpmp._src.trainer.batches import gather
from dpmp._src.trainer.evaluate import evaluator
from dpmp._src.trainer.resume import check_config, check_data, check_model
from dpmp._src.trainer.step import PrivateStep, audit_summary, build_private_step

__all__ = ["train"]


def _versions() -> dict[str, str]:
    out = {}
    for name in ("dpmp", "jax", "jaxlib", "flax", "optax", "jax-privacy", "dp-accounting", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def _params_span(state: dict[str, Any]) -> list[int]:
    """[first, count] of the parameters among a checkpoint's flattened leaves."""
    first = sum(len(jax.tree.leaves(state[k])) for k in sorted(state) if k < "params")
    return [first, len(jax.tree.leaves(state["params"]))]


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _new_totals() -> dict[str, Any]:
    """The run's running totals (checkpointed). ``noised_overflow`` and
    ``loss_scale_changes`` are public; the others are exact (private/)."""
    return {
        "overflow": 0,
        "noised_overflow": 0.0,
        "steps_with_overflow": 0,
        "clipped": 0,
        "examples": 0,
        "loss_scale_changes": 0,
        "elapsed_s": 0.0,
    }


def _log_plan(run: RunDir, step: PrivateStep) -> None:
    config = step.config
    p, t = config.privacy, config.training
    run.log(
        f"noise multiplier {step.noise_multiplier:.6g} "
        f"({'calibrated to' if step.noise_calibrated else 'given; target'} epsilon "
        f"{p.target_epsilon:g} at delta {p.delta:g} over {t.steps} "
        f"steps, q = {step.sampling_prob:.6g}, accountant {p.accountant})"
    )
    clip = step.clipping
    run.log(
        f"per-example clipping: {clip['method']} (requested {clip['requested']}"
        + (f"; {clip['reason']}" if clip["reason"] and clip["requested"] != "vmap" else "")
        + ")"
    )
    warnings_ = release.privacy_warnings(config)
    for warning in warnings_:
        run.log("WARNING: " + warning, echo=True)
    if not warnings_:
        run.log(
            "privacy: noise keys and sampler seed drawn from OS entropy (kept only in "
            "checkpoints); neighbours: zero-out (the number of records is public)"
        )
    run.log(
        f"published files: {', '.join(release.PUBLIC_FILES)}; "
        f"private/: {release.PRIVATE_NOTE}; checkpoints/: secret"
    )


def train(
    config: Config | None = None,
    *,
    out_dir: str | Path,
    resume: bool = True,
    progress: bool = True,
    model: Any = None,
    loss: Callable | None = None,
    data: Any = None,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Trains privately as ``config`` says and returns the report (also ``report.json``).

    Args:
      config: a ``Config`` (default: ``Config()``, the digits MLP at epsilon 2).
      out_dir: the run directory (created if needed).
      resume: continue from the newest checkpoint in ``out_dir`` (its config
        must match, apart from the eval/log/checkpoint periods, and so must the
        data); with False an existing run there is replaced.
      progress: draw a progress bar and echo log lines on stderr.
      model: the model to train instead of ``config.model``: a flax linen
        module, a flax nnx module, an Equinox module, an ``(init, apply)`` pair
        of functions of a params pytree, or a ``dpmp`` ``Model``
        (``dpmp._src.adapters.as_model`` says how each is used).
      loss: ``loss(outputs, labels) -> per-example losses [B]`` of a ``model``
        given here (default: softmax cross-entropy on integer labels).
      data: the data to use instead of ``load_data(config.data)``: a
        ``dpmp.Dataset`` (arrays in memory or memory-mapped), or a
        ``(train, test)`` pair of random-access sources or ``(x, y)`` pairs
        (``dpmp.Dataset.from_sources``, ``dpmp.Dataset.from_arrays``).
      callback: ``callback(step, info)`` after every step (1-based ``step``).
        ``info`` holds public numbers only: ``epsilon``, ``delta``,
        ``loss_scale``, ``next_loss_scale``, ``loss_scale_changes``, with a
        private dynamic loss scale ``noised_overflow`` and
        ``noised_overflow_total``, and on evaluation steps ``test_accuracy``
        and ``test_loss``. Exact training statistics are written to
        ``private/metrics.jsonl`` on logging steps, never passed here.

    Returns:
      The report dict (see ``report.json``).

    Raises:
      CheckpointError: ``resume=True`` and the checkpoint in ``out_dir`` was
        made by a different config (the message lists the differences) or on
        different data.
    """
    started = time.perf_counter()
    config = Config() if config is None else config
    t = config.training
    run = RunDir(
        out_dir,
        echo=progress,
        private_note=release.PRIVATE_NOTE,
        private_readme=release.PRIVATE_README,
    )
    ckpt_dir = run.path / "checkpoints"
    found = None
    if not resume:
        run.reset()
        for _, p in list_checkpoints(ckpt_dir):
            p.unlink()
    else:
        found = latest_meta(ckpt_dir)
        if found is not None:  # fail before any work if the config changed
            check_config(found[0], config, found[1])
    if data is None:
        data = load_data(config.data, t.seed)
    data = as_dataset(data)
    data_fingerprint = fingerprint(data)
    saved_stats = None
    if found is not None:
        check_data(found[0], data_fingerprint, found[1])
        if found[0].get("feature_stats"):
            saved_stats = FeatureStats.from_dict(found[0]["feature_stats"])

    with warnings.catch_warnings():
        if config.loss_scale.kind == "nonprivate_dynamic":  # said loudly in log and report
            warnings.simplefilter("ignore", UserWarning)
        built = None
        if model is not None:
            built = as_model(model, data.input_shape, data.num_classes, config.precision, loss=loss)
        step = build_private_step(config, data, model=built, feature_stats=saved_stats)
    data, model = step.data, step.model
    signature = model_signature(step.init_state["params"])
    params_span = _params_span(step.init_state)
    if found is not None:
        check_model(found[0], signature, found[1])
    evaluate = evaluator(model)

    def evaluate_all(params, at_step: int) -> dict[str, Any]:
        train_acc, train_loss = evaluate(params, data.x_train, data.y_train)  # private/
        test_acc, test_loss = evaluate(params, data.x_test, data.y_test)  # public
        return {
            "step": at_step,
            "train_accuracy": train_acc,
            "train_loss": train_loss,
            "test_accuracy": test_acc,
            "test_loss": test_loss,
        }

    state = dict(step.init_state)
    sampler = step.sampler
    tracker = accounting.BudgetTracker(step.budget)
    totals = _new_totals()
    scale_history: list[list[float]] = [[1, float(state["loss_scale"].loss_scale)]]
    last_eval: dict[str, Any] = {}
    completed = 0

    restored = None
    if resume:
        restored = restore_latest(
            ckpt_dir,
            state,
            on_skip=lambda p, e: run.log(f"skipping unreadable checkpoint {p.name}: {e}"),
        )
    if restored is not None:
        state, meta, path = restored
        check_config(meta, config, path)
        check_data(meta, data_fingerprint, path)
        check_model(meta, signature, path)
        tracker = accounting.BudgetTracker.from_state_dict(meta["tracker"])
        if tracker.budget != step.budget:
            raise CheckpointError(
                f"{path}: privacy plan differs from this config's: checkpoint "
                f"{tracker.budget}, config {step.budget}"
            )
        sampler = type(sampler).from_state_dict(meta["sampler"], num_steps=t.steps)
        totals.update(meta["totals"])
        scale_history = [list(x) for x in meta["loss_scale_history"]]
        last_eval = dict(meta.get("last_eval", {}))
        completed = int(meta["step"])
        run.truncate_metrics(completed)
        run.log(f"resumed from {path.name} (step {completed}, epsilon {tracker.spent():.4f})")
    else:
        run.reset()
        run.log(
            f"new run: {model.name} on {data.num_train} examples, policy {config.policy}, "
            f"loss scale {config.loss_scale.kind}, standardize {config.data.standardize}"
        )
    _log_plan(run, step)

    audit = audit_summary(step)
    verdict = {True: "ok", False: "VIOLATIONS", None: "error"}[audit["ok"]]
    run.log(f"precision audit of the step: {verdict}")

    def save(finished: bool, stopped: dict | None):
        stats = step.feature_stats
        meta = {  # secret: the sampler's seed, the data fingerprint, exact totals
            "config": release.config_dict(config),
            "tracker": tracker.state_dict(),
            "sampler": sampler.state_dict(),
            "data_fingerprint": data_fingerprint,
            "model_signature": signature,
            "params_leaves": params_span,
            "feature_stats": None if stats is None else stats.to_dict(),
            "totals": totals,
            "loss_scale_history": scale_history,
            "last_eval": last_eval,
            "noise_multiplier": step.noise_multiplier,
            "finished": finished,
            "stopped_early": stopped,
        }
        save_checkpoint(ckpt_dir, step=completed, state=state, meta=meta)

    bar = ProgressBar(t.steps, enabled=progress)
    is_private_dynamic = isinstance(state["loss_scale"], PrivateDynamicLossScale)
    session_start = time.perf_counter()
    elapsed_before = float(totals["elapsed_s"])

    def stop_reason() -> dict[str, Any] | None:
        if completed >= t.steps or tracker.can_step():
            return None
        return {
            "step": completed,
            "planned_steps": t.steps,
            "epsilon": tracker.spent(),
            "next_epsilon": tracker.peek(),
            "target_epsilon": config.privacy.target_epsilon,
            "reason": (
                f"step {completed + 1} would spend epsilon {tracker.peek():.6g} > target "
                f"{config.privacy.target_epsilon:g} (delta {config.privacy.delta:g}); "
                f"stopped after {completed} of {t.steps} steps"
            ),
        }

    stopped = stop_reason()
    while completed < t.steps and stopped is None:
        tic = time.perf_counter()
        batch, pad = gather(data, next(sampler))
        params, opt_state, loss_scale, stats = step.step_fn(
            state["params"], batch, pad, state["opt_state"], state["loss_scale"]
        )
        stats = jax.device_get(stats)
        eps = tracker.step()  # accounts this step's release(s); never exceeds the target
        state = {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}
        completed += 1

        overflow = int(stats.num_nonfinite)
        totals["overflow"] += overflow
        totals["steps_with_overflow"] += overflow > 0
        totals["clipped"] += int(stats.num_clipped)
        totals["examples"] += int(stats.num_examples)
        noised = float(stats.noised_overflow_count) if is_private_dynamic else None
        if noised is not None:
            totals["noised_overflow"] += noised
        new_scale = float(loss_scale.loss_scale)
        if new_scale != scale_history[-1][1]:
            scale_history.append([completed + 1, new_scale])
            totals["loss_scale_changes"] += 1
        totals["elapsed_s"] = elapsed_before + (time.perf_counter() - session_start)

        stopped = stop_reason()
        last = completed >= t.steps or stopped is not None
        evaluation = None
        if _due(completed, t.eval_every) or last:
            evaluation = last_eval = evaluate_all(params, completed)
        record = release.public_record(
            step=completed,
            epsilon=eps,
            delta=config.privacy.delta,
            loss_scale=float(stats.loss_scale),
            next_loss_scale=new_scale,
            loss_scale_changes=totals["loss_scale_changes"],
            noised_overflow=noised,
            noised_overflow_total=totals["noised_overflow"] if noised is not None else None,
            evaluation=evaluation,
        )
        logged = _due(completed, t.log_every) or last
        if logged:
            run.append_metrics(record)
            run.append_private_metrics(
                release.private_record(
                    step=completed,
                    stats=stats,
                    totals=totals,
                    step_time_s=time.perf_counter() - tic,
                    evaluation=evaluation,
                )
            )
        bar.update(completed, release.progress_fields(record), force=logged)
        if _due(completed, t.checkpoint_every) or last:
            save(finished=last, stopped=stopped)
        if callback is not None:
            callback(completed, release.public_info(record))
    bar.close()

    if stopped is not None:
        run.log("STOPPED EARLY: " + stopped["reason"], echo=True)
    if last_eval.get("step") != completed:  # zero steps, or resumed a finished run
        last_eval = evaluate_all(state["params"], completed)
    saved = list_checkpoints(ckpt_dir)
    if not saved or saved[-1][0] != completed:
        save(finished=True, stopped=stopped)

    params = state["params"]
    report = release.build_report(
        step=step,
        tracker=tracker,
        completed=completed,
        totals=totals,
        scale_history=scale_history,
        evaluation=last_eval,
        audit=audit,
        stopped=stopped,
        sampler=sampler,
        params=params,
        final_scale=float(state["loss_scale"].loss_scale),
        versions=_versions(),
        finite_params=all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(params)),
        num_params=count_params(params),
    )
    run.write_report(report)
    run.write_private_diagnostics(
        release.private_diagnostics(
            totals=totals,
            sampler=sampler,
            evaluation=last_eval,
            wall_time_s=time.perf_counter() - started + elapsed_before,
        )
    )
    run.log(
        f"done: {completed} steps, test accuracy {last_eval['test_accuracy']:.4f}, "
        f"epsilon {report['epsilon']:.4f} at delta {config.privacy.delta:g}"
        + ("" if report["private"] else "; NOT differentially private (see privacy_warnings)")
    )
    return report
