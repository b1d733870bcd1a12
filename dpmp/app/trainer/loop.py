"""The training loop: step, account, evaluate, log, checkpoint, report.

``train(config, out_dir=...)`` runs DP-SGD as the config says (on the config's
model and data, or on the ``model`` and ``data`` given) and writes a run
directory: public files (``metrics.jsonl``, ``train.log``, ``report.json``;
what may be published is decided in ``dpmp.app.release``), the ``private/``
folder (exact training statistics: do not publish) and checkpoints (secret).
A ``BudgetTracker`` is advanced every step and a step that would exceed the
target is refused: the run stops after the last step within budget and says
so (``stopped_early`` in the report, a line in ``train.log``).

Between two steps the loop runs small periodic actions
(``dpmp.app.trainer.actions``): evaluation, the public and private logs
(``dpmp.app.trainer.writers``, ``training.writers``), the progress bar,
checkpoints, the ``callback`` and the caller's ``actions``. The budget stop is
the loop's own: no action can let a step past the target run.

Resuming (``resume=True``) restores the newest checkpoint in ``out_dir``
(params, optimizer state with the secret noise key, loss scale and its key,
the sampler with its secret seed, standardisation statistics, budget tracker,
metric totals) if its config, data and model match (``dpmp.app.trainer.resume``).
The batch of step ``t`` is a function of ``(sampler seed, t)`` and every key
lives in the state, so a killed and resumed run computes the same
parameters, bit for bit on CPU, and the same epsilon as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import signal
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

import dpmp.accounting as accounting
from dpmp.app import release
from dpmp.app.checkpoint import (
    CheckpointError,
    latest_meta,
    list_checkpoints,
    restore_latest,
    save_checkpoint,
)
from dpmp.app.config import Config, ConfigError
from dpmp.app.config_checkpoint import CHECKPOINT_KINDS
from dpmp.app.inputs import load_data
from dpmp.app.published import start_from_checkpoint
from dpmp.app.run_dir import ProgressBar, RunDir, SilentRunDir, locked
from dpmp.app.trainer.actions import (
    Actions,
    PeriodicAction,
    PrivateStepEnd,
    extra_actions,
    run_actions,
)
from dpmp.app.trainer.batches import input_dtype
from dpmp.app.trainer.evaluate import evaluator
from dpmp.app.trainer.interrupts import Interrupts, RunInterrupted
from dpmp.app.trainer.mesh import (
    is_primary,
    local,
    on_this_process,
    primary_first,
    same_everywhere,
)
from dpmp.app.trainer.plan import noise_plan, population
from dpmp.app.trainer.pretrain import params_digest, pretrain
from dpmp.app.trainer.resume import check_config, check_data, check_model, check_start
from dpmp.app.trainer.step import (
    PrivateStep,
    audit_summary,
    build_private_step,
    check_step_memory,
)
from dpmp.app.trainer.writers import TENSORBOARD_DIR
from dpmp.clipping._private_loss_scale import PrivateDynamicLossScale
from dpmp.data._dataset import Dataset, as_dataset, fingerprint
from dpmp.data._preprocess import FeatureStats
from dpmp.models._adapters import as_model, model_signature
from dpmp.models._model import count_params
from dpmp.models._params_file import load_params_file

__all__ = ["RunInterrupted", "train"]


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


def _new_totals() -> dict[str, Any]:
    """The run's running totals (checkpointed). ``noised_overflow``,
    ``noised_counts`` (each step's released count) and ``loss_scale_changes``
    are public; the others are exact (private/)."""
    return {
        "overflow": 0,
        "noised_overflow": 0.0,
        "noised_counts": [],
        "steps_with_overflow": 0,
        "clipped": 0,
        "examples": 0,
        "loss_scale_changes": 0,
        "elapsed_s": 0.0,
    }


def _log_plan(run: RunDir, config: Config, step: PrivateStep) -> None:
    p, t, plan = config.privacy, config.training, step.plan
    for note in step.notes:
        run.log(note)
    if step.data.cut_to is not None:  # the rule only: how many were cut is private
        run.log(
            f"data: a record longer than {step.data.cut_to} is cut to its first "
            f"{step.data.cut_to} (how many were: private/diagnostics.json)"
        )
    run.log(
        f"noise multiplier {plan.noise_multiplier:.6g} "
        f"({'calibrated to' if plan.calibrated else 'given; target'} epsilon "
        f"{p.target_epsilon:g} at delta {p.delta:g} over {t.steps} "
        f"steps, q = {plan.sampling_prob:.6g}, accountant {p.accountant})"
    )
    if step.fn.sensitivity:
        bound = step.fn.sensitivity
        run.log(
            f"noise stddev = noise multiplier x L2 sensitivity {bound['sensitivity']:.9g}: the "
            f"clip norm {bound['clip_norm']:g} plus the rounding of the clipped sum of "
            f"{bound['batch_size']} padded {'users' if p.unit == 'user' else 'examples'} in "
            f"{bound['parts']} part(s), accumulated in {bound['accumulate_dtype']}"
        )
    if step.fn.mesh is not None:
        where = release.mesh_summary(step.fn.mesh, sharded=t.shard_params)
        run.log(
            f"data-parallel mesh: {where['devices']} {where['platform']} devices in "
            f"{where['processes']} process(es); each clips its share of the batch, the "
            "clipped sums are all-reduced in the accumulate dtype, the noise is added once"
            + ("; parameters and optimizer state sharded" if t.shard_params else "")
        )
    clip = step.clipping
    run.log(
        f"per-{clip.get('unit', 'example')} clipping: {clip['method']} (requested "
        f"{clip['requested']}"
        + (f"; {clip['reason']}" if clip["reason"] and clip["requested"] != "vmap" else "")
        + (f"; {_ghost_layers(clip['layers'])}" if clip["method"] == "ghost" else "")
        + ")"
    )
    warnings_ = release.privacy_warnings(config, step.sampler.num_examples)
    for warning in warnings_:
        run.log("WARNING: " + warning, echo=True)
    if not warnings_:
        run.log(
            "privacy: noise keys and sampler seed drawn from OS entropy (kept only in "
            f"checkpoints); neighbours: zero-out {release.unit_text(config, step.data)}"
        )
    published = [*release.RUN_FILES] + [f"{TENSORBOARD_DIR}/"] * ("tensorboard" in t.writers)
    run.log(
        f"published files: {', '.join(published)}; "
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
    init_params: Any = None,
    actions: Sequence[PeriodicAction] = (),
) -> dict[str, Any]:
    """Trains privately as ``config`` says and returns the report (also ``report.json``).

    Args:
      config: a ``Config`` (default: ``Config()``, the digits MLP at epsilon 2).
      out_dir: the run directory (created if needed).
      resume: continue from the newest checkpoint in ``out_dir`` (its config
        must match, apart from the eval/log/checkpoint periods, and so must the
        data); with False an existing run there is replaced.
      progress: draw a progress bar and echo log lines on stderr (process 0 only).
      model: the model to train instead of ``config.model``: a flax linen
        module, a flax nnx module, an Equinox module, an ``(init, apply)`` pair
        of functions of a params pytree, or a ``dpmp`` ``Model``
        (``dpmp.models._adapters.as_model`` says how each is used). With
        ``model.kind = "gpt2"`` the model, its parameters and the text's
        tokenizer come from ``model.checkpoint`` (``dpmp.app.published``).
      loss: ``loss(outputs, labels) -> per-example losses [B]`` of a ``model``
        given here (default: softmax cross-entropy on integer labels; with
        per-token labels ``[B, T]`` of ``Dataset.from_tokens`` or a
        ``data.tokenizer``, the mean cross-entropy over each record's labelled
        tokens, ``dpmp.models._model.token_cross_entropy``).
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
        ``private/metrics.jsonl`` on logging steps, never passed here. In a
        run of several processes every process calls it with the same numbers
        (log from ``jax.process_index() == 0`` to log once).
      init_params: parameters to start from, in the structure of the model's
        own (pre-trained ones: they must not come from the private data, or
        the run is not private); with ``model.lora_rank`` the frozen base of
        the adapters. A path is read as a ``.safetensors`` file or an orbax
        checkpoint directory of them, each named by its path in the params
        pytree joined by ``.`` (``dpmp.models.save_params_file`` writes both). A
        ``[pretrain]`` section makes them instead.
      actions: ``dpmp.PeriodicAction``s run after each step when due, beside the
        run's own (``dpmp.app.trainer.actions``; every process of a run of
        several runs them). One sees the ``dpmp.StepEnd`` (the step, the last or
        not, the time, its released numbers, the parameters) and the outputs it
        ``reads``: ``"evaluation"`` (``test_accuracy``, ``test_loss``) and
        ``"metrics"`` (the ``metrics.jsonl`` record); exact training statistics
        only with ``reads_private = True`` (a ``Log`` with ``private`` writers).

    Returns:
      The report dict (see ``report.json``).

    Raises:
      TypeError, ValueError: ``actions`` that are not actions, or whose outputs
        clash with the run's own or one another's (``actions.extra_actions``).
      RunDirError: another run is writing to ``out_dir``, or it holds a
        ``report.json`` that dpmp did not write (nothing is changed).
      CheckpointError: ``resume=True`` and the checkpoint in ``out_dir`` was
        made by a different config (the message lists the differences), on
        different data or from other starting parameters.
    """
    config = Config() if config is None else config
    actions = extra_actions(actions, callback)  # checked before anything is written
    init_from = None
    if isinstance(init_params, str | os.PathLike):  # read before anything is written
        init_from = f"init_params read from {Path(init_params).name}"  # published: no folders
        init_params = load_params_file(init_params)
    if config.model.kind in CHECKPOINT_KINDS:  # read before anything is written
        model, init_params, data, init_from = start_from_checkpoint(
            config, model=model, init_params=init_params, data=data
        )
    # one writer per run directory, before anything changes (process 0 of several)
    with locked(out_dir) if is_primary() else contextlib.nullcontext():
        with Interrupts() as interrupts:
            return _train(
                config,
                out_dir,
                interrupts,
                resume=resume,
                progress=progress,
                model=model,
                loss=loss,
                data=data,
                actions=actions,
                init_params=init_params,
                init_from=init_from,
            )


def _train(
    config: Config,
    out_dir: str | Path,
    interrupts: Interrupts,
    *,
    resume: bool,
    progress: bool,
    model: Any,
    loss: Callable | None,
    data: Any,
    actions: list[PeriodicAction],
    init_params: Any,
    init_from: str | None,
) -> dict[str, Any]:
    """``train`` once the run directory is locked (arguments as there;
    ``init_from``: where ``init_params`` came from, as the report says it)."""
    started = time.perf_counter()
    progress = progress and is_primary()  # one progress bar for a run of several processes
    run_dir, found = _open_run_dir(config, out_dir, resume=resume, progress=progress)
    data = as_dataset(load_data(config.data, config.training.seed) if data is None else data)
    data_fingerprint = fingerprint(data)
    # several processes must train one config on one data set (each reads its own rows)
    same_everywhere(json.dumps(release.config_dict(config), sort_keys=True), "the config")
    same_everywhere(data_fingerprint, "the training data (every process must read the same)")
    saved_stats = None
    if found is not None:
        check_data(found[0], data_fingerprint, found[1])
        if found[0].get("feature_stats"):
            saved_stats = FeatureStats.from_dict(found[0]["feature_stats"])
    told: list[str] = []  # the pre-training's log lines, written once the run's log is open
    fixed = config.privacy.noise_multiplier is not None
    if fixed and config.pretrain.enabled:  # refuse a too-small sigma before pre-training
        exact = noise_plan(config, num_train=population(config, data), params_shape=None)
        _check_fixed_noise(config, exact.budget)
    init_params, start = _starting_point(
        config, run_dir, model, init_params, progress, told, init_from
    )
    step = _build_step(
        config, data, model=model, loss=loss, feature_stats=saved_stats, init_params=init_params
    )
    if fixed:
        _check_fixed_noise(config, step.plan.budget)
    step_bytes = check_step_memory(step)  # compiled now; the first step reuses it
    run = _Run(config, step, run_dir, data_fingerprint, start)
    if found is not None:
        check_model(found[0], run.signature, found[1])
        check_start(found[0], start, found[1])
    del step  # the run's own (a resumed run's holds the restored state, not the built one)
    if not (resume and run.restore()):
        run.start()
    for line in told:
        run_dir.log(line)
    _log_plan(run_dir, config, run.step)
    run_dir.log(f"the compiled step needs {step_bytes / 2**20:,.1f} MiB per device")
    audit = audit_summary(config, run.step)
    verdict = {True: "ok", False: "VIOLATIONS", None: "error"}[audit["ok"]]
    run_dir.log(f"precision audit of the step: {verdict}")
    run.loop(actions, progress=progress, interrupts=interrupts)
    return run.finish(audit, started)


def _open_run_dir(
    config: Config, out_dir: str | Path, *, resume: bool, progress: bool
) -> tuple[RunDir, tuple[dict[str, Any], Path] | None]:
    """The run directory, and the newest checkpoint's metadata if the run resumes
    (checked against the config before any work)."""
    primary = is_primary()
    run_dir = (RunDir if primary else SilentRunDir)(
        out_dir,
        echo=progress,
        private_note=release.PRIVATE_NOTE,
        private_readme=release.PRIVATE_README,
    )
    ckpt_dir = run_dir.path / "checkpoints"
    if not resume:
        run_dir.reset()
        for _, p in list_checkpoints(ckpt_dir) if primary else ():
            p.unlink()
        return run_dir, None
    found = latest_meta(ckpt_dir)
    if found is not None:
        check_config(found[0], config, found[1])
    return run_dir, found


def _starting_point(
    config: Config,
    run_dir: RunDir,
    model: Any,
    init_params: Any,
    progress: bool,
    told: list[str],
    init_from: str | None = None,
) -> tuple[Any, dict[str, Any] | None]:
    """The parameters the run starts from (or adapts, with LoRA) and what the
    report says of them: pre-trained on public text, given, or (None) the model's
    initialisation."""
    if config.pretrain.enabled:
        if init_params is not None or model is not None:
            raise ValueError(
                "pretrain.dataset: the [pretrain] section pre-trains config.model; with "
                "model= or init_params= of your own, pre-train it yourself and pass init_params="
            )
        if progress:  # the log is not open yet: say it now on stderr too
            print("public pre-training (not private, no epsilon)...", file=sys.stderr)
        # in a run of several processes, the others reuse what process 0 saved
        made = primary_first(
            lambda: pretrain(config, run_dir.path, log=told.append, progress=progress)
        )
        return made.params, {"source": "pretrained on public text (no epsilon)", **made.info}
    if init_params is None:
        if config.model.lora_rank:  # adapters over a frozen random base learn little
            raise ConfigError(
                f"model.lora_rank = {config.model.lora_rank}: LoRA trains adapters over a "
                "frozen pre-trained model, and this run has none (its base would be the "
                "model's random initialisation); add a [pretrain] section (or pass "
                "init_params= to dpmp.train), or set model.lora_rank = 0 to train every parameter"
            )
        return None, None
    source = init_from or "init_params given to dpmp.train"
    return init_params, {"source": source, "params_sha256": params_digest(init_params)}


def _check_fixed_noise(config: Config, budget: accounting.PrivacyBudget) -> None:
    """A given (not calibrated) noise multiplier must carry all planned steps within the budget
    (a calibrated one does by construction): refused before any step, rather than
    stopping part-way. The budget tracker's stop remains the guarantee.

    Before a public pre-training it is checked on exact Gaussian noise (no
    noised coordinates yet): the snapped noise's residual only adds epsilon, so
    a sigma refused there is refused after it too, and nothing is pre-trained
    for a run that cannot start."""
    p, steps = config.privacy, config.training.steps
    try:
        fits = accounting.BudgetTracker(budget).remaining_steps(steps)
    except ValueError as e:  # the snapped noise's tail does not fit in delta
        hint = re.search(r"\(about [0-9.e+-]+ or more\)", str(e))
        raise ConfigError(
            f"privacy.noise_multiplier: {budget.noise_multiplier:g} is too small for the "
            f"snapped noise at privacy.delta = {p.delta:g} over {steps} steps: some noised "
            "coordinate would likely land beyond the sampler's reach; raise it"
            + (f" {hint.group(0)}" if hint else "")
            + ", raise privacy.delta, or leave it unset to calibrate it"
        ) from None
    if fits < steps:
        raise ConfigError(
            f"privacy.noise_multiplier: {budget.noise_multiplier:g} spends target epsilon "
            f"{p.target_epsilon:g} (delta {p.delta:g}) in {fits} of training.steps = {steps} "
            "steps; raise it, lower training.steps, or leave it unset to calibrate it"
        )


def _build_step(
    config: Config, data: Dataset, *, model, loss, feature_stats, init_params
) -> PrivateStep:
    with warnings.catch_warnings():
        if config.loss_scale.kind == "nonprivate_dynamic":  # said loudly in log and report
            warnings.simplefilter("ignore", UserWarning)
        built = None
        if model is not None:
            built = as_model(
                model,
                data.input_shape,
                data.num_classes,
                config.precision,
                loss=loss,
                input_dtype=input_dtype(data),
            )
        # the loop keeps only the state each step returns: the step writes it in place
        return build_private_step(
            config,
            data,
            model=built,
            feature_stats=feature_stats,
            init_params=init_params,
            donate=True,
        )


class _Resumable(OSError):
    """A file could not be written; the message says what was kept and how to go on."""


class _Run:
    """A run in progress: the state, and what a checkpoint keeps beside it (the
    sampler, the budget tracker, running totals, the loss-scale history, the last
    evaluation, the number of completed steps)."""

    def __init__(
        self,
        config: Config,
        step: PrivateStep,
        run_dir: RunDir,
        data_fingerprint: str,
        start: dict[str, Any] | None = None,
    ):
        self.step, self.config, self.run_dir = step, config, run_dir
        self.start_info = start
        self.ckpt_dir = run_dir.path / "checkpoints"
        self.data_fingerprint = data_fingerprint
        self.signature = model_signature(step.init_state["params"])
        # evaluation calls hold no more rows than a step's (physical_batch_size)
        chunk = config.training.physical_batch_size or 512
        self.evaluate_split = evaluator(step.model, chunk, input_dtype=input_dtype(step.data))
        self.state = dict(step.init_state)
        self.sampler = step.sampler
        self.tracker = accounting.BudgetTracker(step.plan.budget)
        self.totals = _new_totals()
        first_scale = float(local(self.state["loss_scale"].loss_scale))
        self.scale_history: list[list[float]] = [[1, first_scale]]
        self.last_eval: dict[str, Any] = {}
        self.completed = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint
        self.stopped: dict[str, Any] | None = None
        self.elapsed_before = 0.0  # seconds trained before this session (a resumed run)

    # ---- start ----------------------------------------------------------------

    def start(self) -> None:
        self.run_dir.reset()
        step, data = self.step, self.step.data
        self.run_dir.log(
            f"new run: {step.model.name} on {data.num_train} examples, policy "
            f"{self.config.policy}, loss scale {self.config.loss_scale.kind}, standardize "
            f"{self.config.data.standardize}"
        )

    def restore(self) -> bool:
        """Continues from the newest readable checkpoint, if there is one."""
        restored = restore_latest(
            self.ckpt_dir,
            self.state,
            on_skip=lambda p, e: self.run_dir.log(f"skipping unreadable checkpoint {p.name}: {e}"),
        )
        if restored is None:
            return False
        self.state, meta, path = restored
        if self.step.fn.mesh is not None:
            self.state = self.step.fn.mesh.put(self.state, self.step.state_shardings)
        self.step = self.step.starting_from(self.state)  # the built state is let go
        check_config(meta, self.config, path)
        check_data(meta, self.data_fingerprint, path)
        check_model(meta, self.signature, path)
        check_start(meta, self.start_info, path)
        self.tracker = accounting.BudgetTracker.from_state_dict(meta["tracker"])
        if self.tracker.budget != self.step.plan.budget:
            raise CheckpointError(
                f"{path}: privacy plan differs from this config's: checkpoint "
                f"{self.tracker.budget}, config {self.step.plan.budget}"
            )
        self.sampler = self.sampler.from_state_dict(  # a user sampler keeps its users
            meta["sampler"], num_steps=self.config.training.steps
        )
        self.totals.update(meta["totals"])
        self.scale_history = [list(x) for x in meta["loss_scale_history"]]
        self.last_eval = dict(meta.get("last_eval", {}))
        self.completed = self.saved_step = int(meta["step"])
        self.run_dir.truncate_metrics(self.completed)
        if meta.get("finished"):  # nothing to train: its report is written again
            self.run_dir.log(
                f"this run is finished ({self.completed} steps, {path.name}); its report is "
                "written again, nothing is trained. To train afresh: dpmp train --fresh "
                "(dpmp.train(..., resume=False)) or another run directory",
                echo=True,  # with --quiet too
            )
            return True
        self.run_dir.log(
            f"resumed from {path.name} (step {self.completed}, "
            f"epsilon {release.epsilon_text(self.tracker.spent())})"
        )
        return True

    # ---- the loop -------------------------------------------------------------

    def loop(self, extra: list[PeriodicAction], *, progress: bool, interrupts: Interrupts) -> None:
        """Steps until the planned steps are done or the budget stops the run, with
        the run's own actions and the ``extra`` ones after each step."""
        bar = ProgressBar(self.config.training.steps, enabled=progress)
        own = run_actions(self.config, self.run_dir, bar, self.evaluate, self.save, self.completed)
        actions = Actions([*own, *extra])
        try:
            with interrupts.held():
                self._loop(actions, interrupts)
        finally:
            actions.close()
            bar.close()

    def _loop(self, actions: Actions, interrupts: Interrupts) -> None:
        steps = self.config.training.steps
        session_start = time.perf_counter()
        self.elapsed_before = float(self.totals["elapsed_s"])
        same_everywhere(self.completed, "the completed steps (is out_dir shared by every process?)")
        self.stopped = self.stop_reason()
        while self.completed < steps and self.stopped is None:
            if interrupts.requested:  # between steps: the state is whole, save it
                self.save(finished=False)
                how = "interrupted" if interrupts.signum == signal.SIGINT else "stopped by SIGTERM"
                message = (
                    f"{how} after step {self.completed} of {steps}; a checkpoint of "
                    f"that step is in {self.ckpt_dir}: run again in the same directory to resume"
                )
                self.run_dir.log(message, echo=False)  # the command prints it once
                raise RunInterrupted(message, interrupts.signum)
            tic = time.perf_counter()
            stats, eps, new_scale = self._advance()
            self.totals["elapsed_s"] = self.elapsed_before + (time.perf_counter() - session_start)
            self.stopped = self.stop_reason()  # the budget stop: the loop's, not an action's
            end = PrivateStepEnd(
                step=self.completed,
                last=self.completed >= steps or self.stopped is not None,
                time=time.monotonic(),
                released=self._released(stats, eps, new_scale),
                params=self.state["params"],
                stats=stats,
                totals=self.totals,
                started=tic,
            )
            with self.resumable():
                actions(end)

    def _advance(self):
        """One private step, accounted; returns its (exact) stats, the epsilon spent and
        the loss scale of the next step."""
        batch, pad = self.step.batch(next(self.sampler))
        s = self.state
        params, opt_state, loss_scale, stats = self.step.step_fn(
            s["params"], batch, pad, s["opt_state"], s["loss_scale"]
        )
        stats = local(stats)
        eps = self.tracker.step()  # accounts this step's release(s); never exceeds the target
        self.state = {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}
        self.completed += 1
        totals = self.totals
        overflow = int(stats.num_nonfinite)
        totals["overflow"] += overflow
        totals["steps_with_overflow"] += overflow > 0
        totals["clipped"] += int(stats.num_clipped)
        totals["examples"] += int(stats.num_examples)
        if self._private_dynamic:
            totals["noised_overflow"] += float(stats.noised_overflow_count)
            totals.setdefault("noised_counts", []).append(float(stats.noised_overflow_count))
        new_scale = float(local(loss_scale.loss_scale))
        if new_scale != self.scale_history[-1][1]:
            self.scale_history.append([self.completed + 1, new_scale])
            totals["loss_scale_changes"] += 1
        return stats, eps, new_scale

    @property
    def _private_dynamic(self) -> bool:
        return isinstance(self.state["loss_scale"], PrivateDynamicLossScale)

    def _released(self, stats, epsilon: float, next_scale: float) -> dict[str, Any]:
        """The released numbers of the step just done (``release.public_record``
        without an evaluation; an action adds the evaluation's held-out metrics)."""
        noised = float(stats.noised_overflow_count) if self._private_dynamic else None
        return release.public_record(
            step=self.completed,
            epsilon=epsilon,
            delta=self.config.privacy.delta,
            loss_scale=float(stats.loss_scale),
            next_loss_scale=next_scale,
            loss_scale_changes=self.totals["loss_scale_changes"],
            noised_overflow=noised,
            noised_overflow_total=self.totals["noised_overflow"] if noised is not None else None,
            evaluation=None,
        )

    def evaluate(self) -> dict[str, Any]:
        """Loss and accuracy now, on both splits; kept as the run's last evaluation."""
        # no host round trip in a one-process run (evaluation comes every eval_every steps)
        data, params = self.step.data, on_this_process(self.state["params"])
        train_acc, train_loss = self.evaluate_split(params, data.x_train, data.y_train)  # private
        test_acc, test_loss = self.evaluate_split(params, data.x_test, data.y_test)  # public
        evaluation = {
            "step": self.completed,
            "train_accuracy": train_acc,
            "train_loss": train_loss,
            "test_accuracy": test_acc,
            "test_loss": test_loss,
        }
        self.last_eval = evaluation
        return evaluation

    def stop_reason(self) -> dict[str, Any] | None:
        steps, p = self.config.training.steps, self.config.privacy
        if self.completed >= steps or self.tracker.can_step():
            return None
        peek = self.tracker.peek()
        return {
            "step": self.completed,
            "planned_steps": steps,
            "epsilon": self.tracker.spent(),
            "next_epsilon": peek,
            "target_epsilon": p.target_epsilon,
            "reason": (
                f"step {self.completed + 1} would spend epsilon {peek:.6g} > target "
                f"{p.target_epsilon:g} (delta {p.delta:g}); stopped after {self.completed} of "
                f"{steps} steps"
            ),
        }

    def save(self, *, finished: bool) -> None:
        state = local(self.state)  # every process: sharded state is gathered collectively
        self.saved_step = self.completed
        if not is_primary():  # process 0 writes the checkpoints of a multi-process run
            return
        stats = self.step.feature_stats
        meta = {  # secret: the sampler's seed, the data fingerprint, exact totals
            "config": release.config_dict(self.config),
            "tracker": self.tracker.state_dict(),
            "sampler": self.sampler.state_dict(),
            "data_fingerprint": self.data_fingerprint,
            "model_signature": self.signature,
            "starting_point": self.start_info,
            "params_leaves": _params_span(self.state),
            "feature_stats": None if stats is None else stats.to_dict(),
            "totals": self.totals,
            "loss_scale_history": self.scale_history,
            "last_eval": self.last_eval,
            "noise_multiplier": self.step.plan.noise_multiplier,
            "finished": finished,
            "stopped_early": self.stopped,
        }
        with self.resumable():
            save_checkpoint(self.ckpt_dir, step=self.completed, state=state, meta=meta)

    @contextlib.contextmanager
    def resumable(self):
        """A file that cannot be written (a full disk) stops the run with one line
        that names it, says which checkpoint is kept and how to go on."""
        try:
            yield
        except _Resumable:
            raise  # said already
        except OSError as e:
            saved = list_checkpoints(self.ckpt_dir)
            kept = (
                f"the newest checkpoint is of step {saved[-1][0]} ({saved[-1][1]})"
                if saved
                else "no checkpoint was saved"
            )
            raise _Resumable(
                f"{e}; {kept}: free space and run again in the same directory to "
                + ("resume" if saved else "start")
            ) from e

    # ---- the end --------------------------------------------------------------

    def finish(self, audit: dict[str, Any], started: float) -> dict[str, Any]:
        """Final evaluation and checkpoint, ``report.json`` and the private diagnostics."""
        if self.stopped is not None:
            self.run_dir.log("STOPPED EARLY: " + self.stopped["reason"], echo=True)
        if self.last_eval.get("step") != self.completed:  # zero steps, or a finished run
            self.evaluate()
        if self.saved_step != self.completed:  # not from the files: process 0 may still write
            self.save(finished=True)
        params = local(self.state["params"])
        report = release.build_report(
            config=self.config,
            step=self.step,
            tracker=self.tracker,
            completed=self.completed,
            totals=self.totals,
            scale_history=self.scale_history,
            evaluation=self.last_eval,
            audit=audit,
            stopped=self.stopped,
            sampler=self.sampler,
            params=params,
            final_scale=float(local(self.state["loss_scale"].loss_scale)),
            versions=_versions(),
            finite_params=all(
                bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(params)
            ),
            num_params=count_params(params),
            starting_point=self.start_info,
        )
        with self.resumable():  # a finished run started again writes its report again
            self.run_dir.write_report(report)
            self.run_dir.write_private_diagnostics(
                release.private_diagnostics(
                    totals=self.totals,
                    sampler=self.sampler,
                    evaluation=self.last_eval,
                    data=self.step.data,
                    wall_time_s=time.perf_counter() - started + self.elapsed_before,
                )
            )
            self.run_dir.log(
                f"done: {self.completed} steps, {release.held_out_text(self.last_eval)}, "
                f"epsilon {release.epsilon_text(report['epsilon'])} at delta "
                f"{self.config.privacy.delta:g}"
                + (
                    ""
                    if report["private"]
                    else "; NOT differentially private (see privacy_warnings)"
                )
            )
        return report


def _ghost_layers(layers: list[dict[str, str]]) -> str:
    """Why ghost clipping applies: every parameter leaf is in a layer with a rule
    (``"every parameter in a layer with a ghost rule: 28 dense"``)."""
    kinds = Counter(row["layer"] for row in layers)
    return "every parameter in a layer with a ghost rule: " + ", ".join(
        f"{n} {kind}" for kind, n in sorted(kinds.items())
    )
