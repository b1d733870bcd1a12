"""A private trainer that reports epsilon next to overflow statistics.

``train(config, out_dir=...)`` runs DP-SGD as the config says and writes a run
directory: public files (``metrics.jsonl``, ``train.log``, ``report.json``;
what may be published is decided in ``dpmp._src.release``), the ``private/``
folder (exact training statistics: do not publish) and checkpoints (secret).
One step, jitted (``build_private_step``)::

    batch    = Poisson sample of the training set, padded to a fixed size
    out      = dpmp.private_grad(model.loss_fn, ...)(params, batch, loss_scale,
                                                     is_padding_example)
    updates  = dpmp.private_optimizer(optax opt, ...)   # snapped noise, / E[B]
    params   = params + updates                          # fp32 master params
    tracker.step()                                       # accountant, host side

Secret randomness (``run_keys``): the gradient-noise key, the overflow-count
key, the Poisson sampler's seed and the standardisation noise's seed come from
``os.urandom``; ``training.seed`` drives only the initialisation and the
train/test split. ``privacy.reproducible_noise = true`` derives them from the
seed instead, and the run then says it is NOT differentially private.

Privacy plan: the noise multiplier is calibrated (``dpmp.accounting``) so that
``training.steps`` steps at ``q = expected_batch_size / num_train`` spend
``privacy.target_epsilon`` at ``privacy.delta`` -- including the noised
overflow count released every step by a private dynamic loss scale and the
private standardisation release, if any -- or taken from
``privacy.noise_multiplier``. A ``BudgetTracker`` is advanced every step and a
step that would exceed the target is refused: the run stops after the last
step within budget and says so (``stopped_early`` in the report, a line in
``train.log``).

Resuming: with ``resume=True`` the newest checkpoint in ``out_dir`` is
restored (params, optimizer state with the secret noise key, loss scale and
its key, the sampler with its secret seed, standardisation statistics, budget
tracker, metric totals) if its config matches and the data's fingerprint
(``dpmp._src.data.fingerprint``) is the one it was made with. The batch of
step ``t`` is a function of ``(sampler seed, t)`` and every key lives in the
state, so a killed and resumed run computes the same parameters, bit for bit
on CPU, and the same epsilon as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import time
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmp._src import accounting, release
from dpmp._src.audit import audit_precision
from dpmp._src.audit_privacy import privacy_audit
from dpmp._src.checkpoint import (
    CheckpointError,
    latest_meta,
    list_checkpoints,
    restore_latest,
    save_checkpoint,
)
from dpmp._src.clipping import private_grad
from dpmp._src.config import Config, ConfigError
from dpmp._src.data import Dataset, fingerprint, load_data
from dpmp._src.entropy import fresh_key, fresh_seed
from dpmp._src.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from dpmp._src.models import Model, build_model, count_params
from dpmp._src.noise import draws_snapped, private_optimizer
from dpmp._src.preprocess import (
    FeatureStats,
    exact_feature_stats,
    private_feature_stats,
    release_noise_multiplier,
    standardize,
)
from dpmp._src.private_loss_scale import PrivateDynamicLossScale
from dpmp._src.run_dir import ProgressBar, RunDir
from dpmp._src.sampling import PoissonSampler, ShuffledSampler

__all__ = [
    "AUDIT_EXPECT",
    "PrivateStep",
    "RunKeys",
    "audit_step",
    "build_private_step",
    "run_keys",
    "train",
]

# Sites every private step must show; all_reduce only exists on several devices.
AUDIT_EXPECT = ("batch_reduction", "norm", "noise_sample", "noise_add", "update")

# Config fields that may change between a run and its resumption.
_RESUMABLE_CHANGES = {
    ("training", "eval_every"),
    ("training", "log_every"),
    ("training", "checkpoint_every"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class RunKeys:
    """The randomness of a run that protects privacy, and whether it is secret.

    Attributes:
      noise: PRNG key of the gradient noise.
      loss_scale: PRNG key of the noise on released overflow counts.
      sampler_seed: seed of the Poisson sampler (which examples each step uses).
      standardize_seed: seed of the noise on private feature statistics.
      reproducible: derived from ``training.seed`` (public: NOT private)
        rather than drawn from the OS entropy.
    """

    noise: Any
    loss_scale: Any
    sampler_seed: int
    standardize_seed: int
    reproducible: bool


def run_keys(config: Config) -> RunKeys:
    """Fresh OS entropy for a run (64-bit keys, 128-bit seeds), or, with
    ``privacy.reproducible_noise``, keys and seeds derived from ``training.seed``."""
    seed = config.training.seed
    if config.privacy.reproducible_noise:
        _, noise, scale = jax.random.split(jax.random.key(seed), 3)
        return RunKeys(noise, scale, sampler_seed=seed, standardize_seed=seed, reproducible=True)
    return RunKeys(fresh_key(), fresh_key(), fresh_seed(), fresh_seed(), reproducible=False)


@dataclasses.dataclass(frozen=True, eq=False)
class PrivateStep:
    """Everything one private step of a config is made of (see ``build_private_step``).

    Attributes:
      step_fn: jitted ``step_fn(params, batch, is_padding_example, opt_state,
        loss_scale) -> (params, opt_state, loss_scale, stats)``; ``batch`` is
        ``{"x": [B, ...] float32, "y": [B] int32}``.
      example_args: real arguments for ``step_fn`` (initial state, batch 0).
      config, policy, data, model, sampler, optimizer: the parts.
      data: the training data as the step sees it (standardised, if the
        config says so).
      noise_multiplier: sigma of the gradient noise.
      noise_calibrated: whether sigma was calibrated to the target epsilon.
      budget: the ``PrivacyBudget`` the run is tracked against.
      count_noise_stddev: noise on each released overflow count, or None.
      sampling_prob: q = expected_batch_size / num_train.
      grad_fn: the ``dpmp.private_grad`` function inside ``step_fn``.
      clipping: ``grad_fn.explain(...)`` for this config's batches: the clip
        method requested, the one used, why, and the rule for each parameter.
      feature_stats: the standardisation statistics, or None.
      keys: the run's ``RunKeys`` (secret unless reproducible).
    """

    step_fn: Callable
    example_args: tuple
    config: Config
    policy: Any
    data: Dataset
    model: Model
    sampler: Any
    optimizer: optax.GradientTransformation
    noise_multiplier: float
    noise_calibrated: bool
    budget: accounting.PrivacyBudget
    count_noise_stddev: float | None
    sampling_prob: float
    init_state: dict[str, Any]
    grad_fn: Any
    clipping: dict[str, Any]
    feature_stats: FeatureStats | None
    keys: RunKeys

    def __iter__(self):  # ``step_fn, example_args = build_private_step(...)``
        return iter((self.step_fn, self.example_args))


def _make_optimizer(config: Config) -> optax.GradientTransformation:
    t = config.training
    if t.optimizer == "adam":
        return optax.adam(t.learning_rate)
    if t.optimizer == "momentum":
        return optax.sgd(t.learning_rate, momentum=0.9)
    return optax.sgd(t.learning_rate)


def _make_loss_scale(config: Config, key) -> Any:
    ls = config.loss_scale
    if ls.kind == "none":
        return NoOpLossScale()
    if ls.kind == "static":
        return StaticLossScale(ls.initial)
    if ls.kind == "private_dynamic":
        return PrivateDynamicLossScale(
            ls.initial,
            key,
            count_noise_stddev=ls.count_noise_stddev,
            period=ls.period,
            factor=ls.factor,
            min_scale=ls.min_scale,
            max_scale=ls.max_scale,
        )
    return DynamicLossScale(
        ls.initial,
        period=ls.period,
        factor=ls.factor,
        min_scale=ls.min_scale,
        max_scale=ls.max_scale,
    )


def _preprocessing_sigma(config: Config) -> float | None:
    d = config.data
    if d.standardize != "private":
        return None
    return release_noise_multiplier(d.standardize_noise_multiplier)


def _noised_coordinates(config: Config, policy, params_shape) -> int | None:
    """Coordinates of each noisy release when the noise is snapped (its residual
    is then accounted), else None."""
    if not draws_snapped(config.privacy.noise_sampler, policy):
        return None
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params_shape))


def _noise_multiplier(
    config: Config, q: float, count_sigma: float | None, coordinates: int | None
) -> tuple[float, bool, accounting.PrivacyBudget]:
    p = config.privacy
    steps = config.training.steps
    pre_sigma = _preprocessing_sigma(config)

    def budget(sigma):
        return accounting.PrivacyBudget(
            noise_multiplier=sigma,
            sampling_prob=q,
            delta=p.delta,
            target_epsilon=p.target_epsilon,
            accountant=p.accountant,
            count_noise_stddev=count_sigma,
            count_every=1,
            preprocessing_noise_multiplier=pre_sigma,
            noised_coordinates=coordinates,
        )

    if p.noise_multiplier is not None:
        sigma = float(p.noise_multiplier)
        return sigma, False, budget(sigma)
    try:
        # Calibrate with the tracker's discretisation, so that the tracker --
        # which enforces the budget step by step -- admits all ``steps``.
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=p.target_epsilon,
            sampling_prob=q,
            steps=steps,
            delta=p.delta,
            accountant=p.accountant,
            count_noise_stddev=count_sigma,
            count_every=1,
            value_discretization_interval=accounting.TRACKING_DISCRETIZATION,
            preprocessing_noise_multiplier=pre_sigma,
            noised_coordinates=coordinates,
        )
    except ValueError as e:
        raise ConfigError(f"privacy.target_epsilon: cannot be reached: {e}") from e
    for _ in range(100):  # guard against rounding between accountant code paths
        if accounting.BudgetTracker(budget(sigma)).remaining_steps(steps) >= steps:
            break
        sigma *= 1 + 1e-4
    return sigma, True, budget(sigma)


def _make_sampler(config: Config, num_train: int, seed: int):
    t = config.training
    if t.expected_batch_size > num_train:
        raise ConfigError(
            f"training.expected_batch_size: {t.expected_batch_size} exceeds the "
            f"{num_train} training examples"
        )
    if config.privacy.sampling == "shuffle":
        return ShuffledSampler(num_train, t.expected_batch_size, seed=seed, num_steps=t.steps)
    sampler = PoissonSampler(num_train, t.expected_batch_size, seed=seed, num_steps=t.steps)
    micro = t.microbatch_size
    if micro and sampler.padded_batch_size % micro:
        padded = -(-sampler.padded_batch_size // micro) * micro
        sampler = PoissonSampler(
            num_train, t.expected_batch_size, padded_batch_size=padded, seed=seed, num_steps=t.steps
        )
    return sampler


def _feature_stats(config: Config, data: Dataset, seed: int) -> FeatureStats | None:
    d = config.data
    if d.standardize == "private":
        return private_feature_stats(
            data.x_train,
            clip=d.standardize_clip,
            noise_multiplier=d.standardize_noise_multiplier,
            seed=seed,
        )
    if d.standardize == "nonprivate":
        return exact_feature_stats(data.x_train)
    return None


def _gather(data: Dataset, batch) -> tuple[dict[str, np.ndarray], np.ndarray]:
    pad = np.asarray(batch.is_padding_example, bool)
    idx = np.where(pad, 0, np.asarray(batch.indices))  # padding rows: any example
    return {"x": data.x_train[idx], "y": data.y_train[idx]}, pad


def build_private_step(
    config: Config,
    data: Dataset | None = None,
    *,
    keys: RunKeys | None = None,
    feature_stats: FeatureStats | None = None,
) -> PrivateStep:
    """The jitted private step of ``config`` and real arguments for it.

    ``step_fn, example_args = build_private_step(config)`` unpacks it; the
    precision audit of a config is
    ``dpmp.audit_precision(step_fn, *example_args, policy=config.precision,
    params_argnums=0, batch_argnums=1)`` (``audit_step`` does exactly this).

    Args:
      config: a ``dpmp`` run ``Config``.
      data: a loaded ``Dataset`` (not standardised); default
        ``load_data(config.data, seed)``.
      keys: the run's noise keys and seeds; default ``run_keys(config)``
        (fresh OS entropy unless ``privacy.reproducible_noise``).
      feature_stats: standardisation statistics to reuse (a resumed run's);
        default: computed as ``data.standardize`` says.
    """
    policy = config.precision
    t = config.training
    if data is None:
        data = load_data(config.data, t.seed)
    keys = run_keys(config) if keys is None else keys
    if config.data.standardize != "none":
        if feature_stats is None:
            feature_stats = _feature_stats(config, data, keys.standardize_seed)
        data = standardize(data, feature_stats)
    model = build_model(config.model, data, policy)
    init_key = jax.random.split(jax.random.key(t.seed), 3)[0]
    noise_key, scale_key = keys.noise, keys.loss_scale
    count_sigma = (
        float(config.loss_scale.count_noise_stddev)
        if config.loss_scale.kind == "private_dynamic"
        else None
    )
    sampler = _make_sampler(config, data.num_train, keys.sampler_seed)
    q = t.expected_batch_size / data.num_train
    coordinates = _noised_coordinates(config, policy, jax.eval_shape(model.init, init_key))
    sigma, calibrated, budget = _noise_multiplier(config, q, count_sigma, coordinates)
    grad_fn = private_grad(
        model.loss_fn,
        l2_clip_norm=config.privacy.l2_clip_norm,
        policy=policy,
        microbatch_size=t.microbatch_size,
        allow_nonprivate_loss_scale=config.loss_scale.kind == "nonprivate_dynamic",
        method=config.privacy.clip_method,
    )
    optimizer = private_optimizer(
        _make_optimizer(config),
        noise_multiplier=sigma,
        l2_clip_norm=config.privacy.l2_clip_norm,
        expected_batch_size=t.expected_batch_size,
        prng_key=noise_key,
        policy=policy,
        sampler=config.privacy.noise_sampler,
    )

    def private_step(params, batch, is_padding_example, opt_state, loss_scale):
        out = grad_fn(params, batch, loss_scale=loss_scale, is_padding_example=is_padding_example)
        updates, opt_state = optimizer.update(out.grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, out.loss_scale, out.stats

    params = jax.jit(model.init)(init_key)
    init_state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "loss_scale": _make_loss_scale(config, scale_key),
    }
    batch, pad = _gather(data, sampler.batch(0))
    example_args = (
        init_state["params"],
        jax.tree.map(jnp.asarray, batch),
        jnp.asarray(pad),
        init_state["opt_state"],
        init_state["loss_scale"],
    )
    return PrivateStep(
        step_fn=jax.jit(private_step),
        example_args=example_args,
        config=config,
        policy=policy,
        data=data,
        model=model,
        sampler=sampler,
        optimizer=optimizer,
        noise_multiplier=sigma,
        noise_calibrated=calibrated,
        budget=budget,
        count_noise_stddev=count_sigma,
        sampling_prob=q,
        init_state=init_state,
        grad_fn=grad_fn,
        clipping=_explain_clipping(grad_fn, example_args[0], example_args[1]),
        feature_stats=feature_stats,
        keys=keys,
    )


def _explain_clipping(grad_fn, params, batch) -> dict[str, Any]:
    """Which clip method the step uses; ``method="ghost"`` on an unsupported model is a
    ``ConfigError`` naming the parameter (before any work)."""
    try:
        return grad_fn.explain(params, batch)
    except ValueError as e:
        raise ConfigError(f"privacy.clip_method: {e}") from None


def audit_step(config: Config, data: Dataset | None = None, *, step: PrivateStep | None = None):
    """Precision audit (``dpmp.audit_precision``) of the config's private step."""
    step = build_private_step(config, data) if step is None else step
    return audit_precision(
        step.step_fn,
        *step.example_args,
        policy=step.policy,
        params_argnums=0,
        batch_argnums=1,
        expect=AUDIT_EXPECT,
        name=f"private step ({step.model.name}, {config.policy})",
    )


def privacy_audit_step(
    config: Config,
    data: Dataset | None = None,
    *,
    num_releases: int = 1_000_000,
    step: PrivateStep | None = None,
):
    """Empirical privacy audit (``dpmp.privacy_audit``) of the config's noise stage:
    its policy, noise multiplier (calibrated as the run would), clip norm and delta."""
    step = build_private_step(config, data) if step is None else step
    return privacy_audit(
        step.noise_multiplier,
        policy=step.policy,
        clip_norm=config.privacy.l2_clip_norm,
        delta=config.privacy.delta,
        num_releases=num_releases,
        mechanism="dpmp" if config.privacy.noise_sampler == "snapped" else "plain",
    )


def _audit_summary(step: PrivateStep) -> dict[str, Any]:
    try:
        report = audit_step(step.config, step=step)
    except Exception as e:  # the audit must never take the run down
        return {"ok": None, "error": f"{type(e).__name__}: {e}"}
    return {
        "ok": report.ok,
        "violations": [f.to_dict() for f in report.violations],
        "missing": list(report.missing),
        "counts": report.counts(),
        "expect": list(AUDIT_EXPECT),
    }


def _evaluator(model: Model, chunk: int = 512):
    @jax.jit
    def sums(params, x, y, valid):
        logits = model.predict(params, x).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        correct = (jnp.argmax(logits, axis=-1) == y) & valid
        return jnp.where(valid, losses, 0.0).sum(), correct.sum()

    def evaluate(params, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        n = len(x)
        size = chunk  # one compiled shape for the train and the test split
        loss, correct = 0.0, 0
        for start in range(0, n, size):
            xb, yb = x[start : start + size], y[start : start + size]
            valid = np.ones(size, bool)
            if len(xb) < size:  # pad the last chunk: one compiled shape
                valid[len(xb) :] = False
                fill = size - len(xb)
                xb = np.concatenate([xb, np.repeat(xb[:1], fill, 0)])
                yb = np.concatenate([yb, np.repeat(yb[:1], fill, 0)])
            s_loss, s_correct = sums(params, xb, yb, valid)
            loss += float(s_loss)
            correct += int(s_correct)
        return correct / n, loss / n

    return evaluate


def _versions() -> dict[str, str]:
    out = {}
    for name in ("dpmp", "jax", "jaxlib", "flax", "optax", "jax-privacy", "dp-accounting", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def _config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    diffs = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section), current.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if (section, key) in _RESUMABLE_CHANGES:
                    continue
                if a.get(key) != b.get(key):
                    diffs.append(
                        f"{section}.{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}"
                    )
        elif a != b:
            diffs.append(f"{section}: checkpoint {a!r}, config {b!r}")
    return diffs


_START_OVER = "use resume=False (or another out_dir) to start a new run"


def _check_config(meta: dict[str, Any], config: Config, path: Path) -> None:
    diffs = _config_diff(meta["config"], release.config_dict(config))
    if diffs:
        raise CheckpointError(
            f"{path}: made by a different config; {_START_OVER}. Differences: " + "; ".join(diffs)
        )


def _check_data(meta: dict[str, Any], data_fingerprint: str, path: Path) -> None:
    """Resuming on other data would replay the saved noise on it: refused."""
    if meta.get("data_fingerprint") != data_fingerprint:
        raise CheckpointError(
            f"{path}: made on different training data (the sha256 fingerprint of the "
            f"train and test arrays differs); {_START_OVER}"
        )


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
    data: Dataset | None = None,
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
      data: a loaded ``Dataset`` (not standardised) to use instead of
        ``load_data(config.data)``.
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
            _check_config(found[0], config, found[1])
    if data is None:
        data = load_data(config.data, t.seed)
    data_fingerprint = fingerprint(data)
    saved_stats = None
    if found is not None:
        _check_data(found[0], data_fingerprint, found[1])
        if found[0].get("feature_stats"):
            saved_stats = FeatureStats.from_dict(found[0]["feature_stats"])

    with warnings.catch_warnings():
        if config.loss_scale.kind == "nonprivate_dynamic":  # said loudly in log and report
            warnings.simplefilter("ignore", UserWarning)
        step = build_private_step(config, data, feature_stats=saved_stats)
    data, model = step.data, step.model
    evaluate = _evaluator(model)

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
        _check_config(meta, config, path)
        _check_data(meta, data_fingerprint, path)
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

    audit = _audit_summary(step)
    verdict = {True: "ok", False: "VIOLATIONS", None: "error"}[audit["ok"]]
    run.log(f"precision audit of the step: {verdict}")

    def save(finished: bool, stopped: dict | None):
        stats = step.feature_stats
        meta = {  # secret: the sampler's seed, the data fingerprint, exact totals
            "config": release.config_dict(config),
            "tracker": tracker.state_dict(),
            "sampler": sampler.state_dict(),
            "data_fingerprint": data_fingerprint,
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
        batch, pad = _gather(data, next(sampler))
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
