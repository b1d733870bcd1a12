"""End-to-end privacy audit of a whole run, in one run (``dpmp audit --run``).

``audit_run(config)`` trains the config ONCE with ``m`` canaries and reports a
lower bound on its epsilon at 95% confidence, beside what the accountant
claims and beside what the same audit reaches on the accountant's exact
mechanism (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1)
training run"; the statistics are in ``dpmp.audit._one_run``).

The audit run::

    base     = the config's training data (n records), test split unchanged
    canaries = m inputs of the data's shape, every feature +1 or -1 at random,
               each with a random label: far from any real input, so that
               training on one moves its loss
    S        = m secret fair coins from the OS entropy: canary i is in iff S_i
    data     = base + all m canaries: N = n + m records, a public number
    run      = the config's trainer step (clipping, noise, optimizer, loss
               scale, policy: build_private_step) for training.steps steps,
               Poisson sampling every record with q' = E / N, E =
               round(q N), q = the config's rate; a sampled canary that is
               out is a padding slot of the batch: it contributes nothing
               (a null record: the zero-out neighbours dpmp's accountant covers);
               ``train``'s loop wraps the same two calls (``step.batch``,
               ``step.step_fn``) in checkpoints, evaluation and logs, and has
               no way to zero a record out
    sigma    = the config's noise multiplier, calibrated as `dpmp train`
               calibrates it on the n records (or as given)
    score_i  = loss(theta_0; canary i) - loss(theta_T; canary i), from the
               initial (public: training.seed) and final parameters only
    guesses  = "in" for the m/10 highest scores, "out" for the m/10 lowest
    bound    = the largest epsilon the correct guesses reject at 5%

The claim is what the accountant says of this very run, per canary: epsilon
at the config's delta (a part of which the trainer's accountant reserves for
a truncated Poisson sample, as in any run) of ``steps`` Poisson-subsampled
Gaussian steps with noise multiplier sigma and rate q' (with the noised
overflow counts of a private dynamic loss scale and the snapped noise's
residual, as the trainer accounts them). q' differs from q by at most 1/(2N)
(E is an integer); the report gives both epsilons. A private standardisation
is computed from the n records without the canaries, so its cost is not part
of the claim. Everything the canaries' membership could change -- N, E, q',
the batch shape, the normalisation by E -- is the same whichever canaries
are in.

Exit status of the command: 1 when the lower bound exceeds the claim (the run
leaks more than the accountant says, at 95% confidence), 0 otherwise.

What it publishes: the report's numbers are computed from the audit's own
model, trained on your training records plus the canaries by the same
mechanism as a run of the config. With respect to your records the audit is a
second run: its numbers (and ``--out``'s files) are ``(epsilon, delta)``-DP
for them at the claimed epsilon (plus a private standardisation's cost, when
there is one), which composes with every other release of the same records;
on public data (the default digits) they disclose nothing private. The
canaries' membership ``S`` is the audit's own secret, revealed in ``--out``
only once the audit is over.

With ``privacy.unit = "user"`` the canaries are users of ``privacy.user_records``
identical records each, in or out whole (``dpmp.app.audit_users``); the rate
q' is over the users (or, with ``privacy.user_sampling = "records"``, over the
kept records, and the claim is the accountant's of k records per user).

What the audit cannot see: it scores the final model only (black box), so
its bound is a lower bound that a weak attack keeps low; canaries that share
a model interfere with each other's scores. The exact-Gaussian column says
how far the attack is from what the accounted mechanism could show.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import dpmp.accounting as accounting
from dpmp.accounting._groups import rdp_compatible, unit_event
from dpmp.app.audit_users import record_out, with_canary_users, zero_out_users
from dpmp.app.config import Config, ConfigError
from dpmp.app.config_users import records_per_unit
from dpmp.app.inputs import load_data
from dpmp.app.run_dir import ProgressBar
from dpmp.app.trainer.batches import feature_stats, input_dtype
from dpmp.app.trainer.evaluate import evaluator
from dpmp.app.trainer.mesh import local
from dpmp.app.trainer.plan import population
from dpmp.app.trainer.step import PrivateStep, build_private_step
from dpmp.audit._one_run import auc, epsilon_lower_bound, exact_gaussian_game, guess
from dpmp.data._dataset import Dataset
from dpmp.noise._entropy import fresh_seed

__all__ = ["DEFAULT_CANARIES", "RunAuditReport", "audit_run"]

DEFAULT_CANARIES = 1000
MIN_CANARIES = 10
# Total guesses as a share of the canaries (half "in", half "out"). Fixed before
# the run, so no correction for choosing it is needed; on simulated Gaussian
# scores it is within a few percent of the best fixed share from 0.02 to 0.4.
GUESS_SHARE = 0.2
SIGNIFICANCE = 0.05


@dataclasses.dataclass(frozen=True)
class RunAuditReport:
    """What one audit of a whole run measured (see the module docstring).

    Attributes:
      model, policy, data: what was trained, in words.
      num_canaries: m; num_in: how many were in (the secret's sum).
      num_guesses, num_correct: the guesses made and how many were right.
      epsilon_lower: the lower bound on epsilon (confidence 1 - significance).
      epsilon_claimed: the accountant's epsilon of the audit run, per canary.
      epsilon_config: the accountant's epsilon of the config's own run (what
        ``dpmp train`` reports: its rate q, and any private standardisation).
      epsilon_gaussian, epsilon_gaussian_low, epsilon_gaussian_high: the lower
        bound the same game reaches on the exact mechanism, median and 5th-95th
        percentiles over ``gaussian_games`` simulated games.
      auc, auc_gaussian: the attack's area under the ROC curve, and the exact
        mechanism's under the optimal test.
      delta, noise_multiplier, clip_norm, steps, accountant: the plan.
      sampling_prob: q' of the audit run; config_sampling_prob: the config's q.
      num_train: n (the config's records); expected_batch_size: E of the audit.
      test_accuracy: of the audit's model on the held-out split.
      seconds: wall time of the whole audit.
    """

    model: str
    policy: str
    data: str
    num_canaries: int
    num_in: int
    num_guesses: int
    num_correct: int
    epsilon_lower: float
    epsilon_claimed: float
    epsilon_config: float
    epsilon_gaussian: float
    epsilon_gaussian_low: float
    epsilon_gaussian_high: float
    gaussian_games: int
    auc: float
    auc_gaussian: float
    delta: float
    significance: float
    noise_multiplier: float
    clip_norm: float
    steps: int
    accountant: str
    sampling_prob: float
    config_sampling_prob: float
    num_train: int
    expected_batch_size: int
    test_accuracy: float
    score: str
    seconds: float

    @property
    def ok(self) -> bool:
        """The lower bound does not exceed the claim."""
        return self.epsilon_lower <= self.epsilon_claimed

    def verdict(self) -> str:
        if self.ok:
            return "OK: the lower bound does not exceed the claim"
        return (
            f"LEAKS: epsilon >= {self.epsilon_lower:.3f} with confidence "
            f"{1 - self.significance:.0%}, above the claimed {self.epsilon_claimed:.3f}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(ok=self.ok, verdict=self.verdict())
        return out

    def __str__(self) -> str:
        conf = f"{1 - self.significance:.0%}"
        rows = [
            ("model", f"{self.model}, policy {self.policy}"),
            ("data", self.data),
            (
                "plan",
                f"{self.steps} steps, sigma {self.noise_multiplier:.4g}, clip {self.clip_norm:g}, "
                f"q {self.sampling_prob:.5g} ({self.num_train} records + {self.num_canaries} "
                f"canaries, expected batch {self.expected_batch_size}; the config's q "
                f"{self.config_sampling_prob:.5g})",
            ),
            (
                "claimed epsilon",
                f"{self.epsilon_claimed:.3f} at delta {self.delta:g} ({self.accountant} "
                f"accountant, this run, per canary; the config's own run: "
                f"{self.epsilon_config:.3f})",
            ),
            (
                "epsilon lower bound",
                f"{self.epsilon_lower:.3f} ({conf} confidence, one-run audit)",
            ),
            (
                "exact Gaussian",
                f"{self.epsilon_gaussian:.3f} (5-95%: {self.epsilon_gaussian_low:.3f}-"
                f"{self.epsilon_gaussian_high:.3f}, {self.gaussian_games} simulated games of the "
                "accounted mechanism, optimal white-box attack)",
            ),
            (
                "canaries",
                f"{self.num_canaries} ({self.num_in} in), random +-1 inputs with random labels",
            ),
            (
                "guesses",
                f"{self.num_correct} of {self.num_guesses} correct "
                f"({self.num_correct / self.num_guesses:.1%}); score: {self.score}",
            ),
            (
                "attack AUC",
                f"{self.auc:.3f} (exact Gaussian, optimal test: {self.auc_gaussian:.3f})",
            ),
            ("test accuracy", f"{self.test_accuracy:.4f} (the audit's model)"),
            ("wall time", f"{self.seconds:.1f} s"),
            ("verdict", self.verdict()),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- the audit run's data and config ----------------------------------------------


def make_canaries(
    rng: np.random.Generator, num: int, input_shape: tuple[int, ...], num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """``num`` canaries ``(x [num, *input_shape] float32, y [num] int32)``: every
    feature +1 or -1 at random, a random label. Made from nothing but the data's
    shape and classes (no statistic of the data)."""
    x = rng.choice(np.float32([-1.0, 1.0]), size=(num, *input_shape))
    y = rng.integers(0, num_classes, num).astype(np.int32)
    return x, y


def _check_config(config: Config) -> None:
    if config.privacy.sampling != "poisson":
        raise ConfigError(
            f"privacy.sampling: the audit checks the Poisson-sampling accounting; "
            f"got {config.privacy.sampling!r}, use 'poisson'"
        )


def _check_data(config: Config, data: Dataset) -> None:
    if config.privacy.unit == "user" and data.users_train is None:
        raise ConfigError(
            'privacy.unit: "user" needs a user id per training record to audit: set data.user_field'
        )
    if data.task != "classify":
        raise ConfigError(
            "data.dataset: the run audit needs a classification dataset (its canaries are "
            f"random inputs with random labels); got {data.task!r} data"
        )


def _with_plan(config: Config, *, noise_multiplier: float, expected_batch_size: int) -> Config:
    """``config`` with the noise multiplier fixed and another expected batch size."""
    return dataclasses.replace(
        config,
        privacy=dataclasses.replace(config.privacy, noise_multiplier=noise_multiplier),
        training=dataclasses.replace(config.training, expected_batch_size=expected_batch_size),
    )


def _with_canaries(base: Dataset, x: np.ndarray, y: np.ndarray) -> Dataset:
    """``base`` with the canaries appended to its training split."""
    x_train = np.concatenate([np.asarray(base.x_train, np.float32), x])
    return Dataset.from_arrays(
        (x_train, np.concatenate([base.y_train, y])),
        (base.x_test, base.y_test),
        description=f"{base.description}; + {len(y)} canaries",
    )


# ---- training -----------------------------------------------------------------------


def _train(step: PrivateStep, steps: int, out: np.ndarray, progress: bool) -> Any:
    """Runs ``step`` for ``steps`` steps, excluded records zeroed out; the final
    parameters. Each step is the trainer's own (``PrivateStep.step_fn`` on
    ``PrivateStep.batch`` of the sampler's batch); ``step`` is left as it was
    (the sampler is copied)."""
    bar = ProgressBar(steps, enabled=progress)
    every = max(1, steps // 10)
    state = dict(step.init_state)
    sampler = copy.deepcopy(step.sampler)
    for t in range(1, steps + 1):
        batch, pad = step.batch(zero_out_users(next(sampler), out))
        params, opt_state, loss_scale, _ = step.step_fn(
            state["params"], batch, pad, state["opt_state"], state["loss_scale"]
        )
        state = {"params": params, "opt_state": opt_state, "loss_scale": loss_scale}
        bar.update(t, {}, force=t % every == 0 or t == steps)
    bar.close()
    return local(state["params"])


def _losses(step: PrivateStep, params: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-canary float32 loss under ``params`` (``model.metrics``), in chunks."""
    chunk = 1024
    frozen = step.model.frozen_args()
    fn = jax.jit(lambda p, xb, yb, *f: step.model.metrics(p, {"x": xb, "y": yb}, *f)[0])
    out = []
    for start in range(0, len(y), chunk):
        xb, yb = x[start : start + chunk], y[start : start + chunk]
        n = len(yb)
        if n < chunk and len(y) > chunk:  # one compiled shape for every chunk
            xb = np.concatenate([xb, np.repeat(xb[:1], chunk - n, 0)])
            yb = np.concatenate([yb, np.repeat(yb[:1], chunk - n, 0)])
        out.append(np.asarray(fn(params, xb, yb, *frozen), np.float64)[:n])
    return np.concatenate(out)


# ---- the claim ----------------------------------------------------------------------


def _epsilon(
    config: Config, step: PrivateStep, sampling_prob: float, *, preprocessing: bool
) -> float:
    b = step.plan.budget
    return accounting.epsilon(
        noise_multiplier=step.plan.noise_multiplier,
        sampling_prob=sampling_prob,
        steps=config.training.steps,
        delta=b.delta,  # privacy.delta less what a truncated Poisson sample may take
        accountant=config.privacy.accountant,
        count_noise_stddev=step.plan.count_noise_stddev,
        count_every=1,
        preprocessing_noise_multiplier=b.preprocessing_noise_multiplier if preprocessing else None,
        noised_coordinates=b.noised_coordinates,
        records_per_unit=records_per_unit(config.privacy),
    )


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"dpmp audit: {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, eq=False)
class _Setup:
    """The config and its own step (its plan), the audit run's config and step, and
    the canaries: the last ``len(member)`` training records of ``step.data``."""

    config: Config
    own: PrivateStep
    audit_config: Config
    step: PrivateStep
    x: np.ndarray
    y: np.ndarray
    member: np.ndarray

    @property
    def num_train(self) -> int:
        return self.own.data.num_train

    @property
    def copies(self) -> int:
        """Records per canary: ``privacy.user_records`` for canary users, else 1."""
        return self.config.privacy.user_records if self.config.privacy.unit == "user" else 1


def _setup(config: Config, base: Dataset, m: int, seed: int | None) -> _Setup:
    """Draws the canaries and their membership, and builds the audit run's step:
    the config's noise multiplier (calibrated on ``base`` as ``dpmp train`` would)
    and sampling rate, on ``base`` plus every canary."""
    own = build_private_step(config, base)
    rng = np.random.default_rng(fresh_seed() if seed is None else seed)
    x, y = make_canaries(rng, m, base.input_shape, base.num_classes)
    member = rng.random(m) < 0.5
    if config.privacy.unit == "user":
        data = with_canary_users(base, x, y, config.privacy.user_records)
    else:
        data = _with_canaries(base, x, y)
    units = population(config, data)  # records, users, or kept records: what is sampled
    batch = min(units, max(1, round(own.plan.sampling_prob * units)))
    audit_config = _with_plan(
        config, noise_multiplier=own.plan.noise_multiplier, expected_batch_size=batch
    )
    stats = None
    if config.data.standardize != "none":  # from the n records: the canaries play no part
        stats = feature_stats(config, base, fresh_seed())
    step = build_private_step(audit_config, data, feature_stats=stats)
    return _Setup(config, own, audit_config, step, x, y, member)


def _scores(setup: _Setup, params: Any) -> np.ndarray:
    """Each canary's loss at the initial minus the final parameters (higher: in)."""
    step, n = setup.step, setup.num_train
    # each canary's first record, standardised as it was trained on
    x = np.asarray(step.data.x_train[n :: setup.copies], np.float32)
    initial = local(step.init_state["params"])
    return _losses(step, initial, x, setup.y) - _losses(step, params, x, setup.y)


def _checked_counts(num_canaries: int, num_guesses: int | None, significance: float):
    m = num_canaries
    if not (isinstance(m, int) and m >= MIN_CANARIES):
        raise ValueError(f"num_canaries: must be an integer >= {MIN_CANARIES}, got {m!r}")
    k = max(2, round(GUESS_SHARE * m)) if num_guesses is None else num_guesses
    if not (isinstance(k, int) and 1 <= k <= m):
        raise ValueError(f"num_guesses: must be an integer in [1, {m}], got {num_guesses!r}")
    if not 0 < significance < 0.5:
        raise ValueError(f"significance: must be in (0, 0.5), got {significance!r}")
    return m, k


def audit_run(
    config: Config | None = None,
    data: Dataset | None = None,
    *,
    num_canaries: int = DEFAULT_CANARIES,
    num_guesses: int | None = None,
    significance: float = SIGNIFICANCE,
    progress: bool = True,
    out_dir: str | Path | None = None,
    seed: int | None = None,
) -> RunAuditReport:
    """Audits one whole run of ``config`` with ``num_canaries`` canaries.

    Args:
      config: a ``Config`` (default: ``Config()``, the digits MLP at epsilon 2).
      data: the training data instead of ``load_data(config.data)``; a
        classification ``Dataset``.
      num_canaries: m >= 10.
      num_guesses: guesses in all, half "in" on the highest scores, half "out"
        on the lowest (default: m / 5).
      significance: 1 - the confidence of the lower bound, in (0, 0.5).
      progress: a progress bar and a few lines on stderr.
      out_dir: if given, writes ``audit.json`` (the report) and
        ``canaries.npz`` (inputs, labels, membership, scores) there.
      seed: draws the canaries and their membership from this public seed
        (reproducible, for tests); None (default): OS entropy. The run's noise
        and sampling come from fresh OS entropy either way.

    Returns:
      A ``RunAuditReport``; ``report.ok`` is False when the lower bound
      exceeds the claim.

    Raises:
      ConfigError: shuffled sampling or text data (what the audit cannot check).
      ValueError: ``num_canaries``, ``num_guesses`` or ``significance`` out of range.
    """
    started = time.perf_counter()
    config = Config() if config is None else config
    m, k = _checked_counts(num_canaries, num_guesses, significance)
    _check_config(config)
    base = load_data(config.data, config.training.seed) if data is None else data
    _check_data(config, base)
    setup = _setup(config, base, m, seed)
    step = setup.step
    _say(
        progress,
        f"training with {m} canaries ({step.data.num_train} records, q "
        f"{step.plan.sampling_prob:.5g}, sigma {step.plan.noise_multiplier:.4g}, "
        f"{config.training.steps} steps)",
    )
    out = record_out(setup.num_train, setup.member, setup.copies)
    params = _train(step, config.training.steps, out, progress)
    scores = _scores(setup, params)
    _say(progress, "simulating the same audit of the exact Gaussian mechanism")
    report = _report(setup, params, scores, k, significance, started)
    if out_dir is not None:
        _write(Path(out_dir), report, setup, scores)
    return report


def _report(
    setup: _Setup, params: Any, scores: np.ndarray, k: int, significance: float, started: float
) -> RunAuditReport:
    step, own, member = setup.step, setup.own, setup.member
    config, m = setup.config, len(member)
    delta = config.privacy.delta
    correct = guess(scores, member, k)
    sigma = accounting.effective_noise_multiplier(
        step.plan.noise_multiplier, step.plan.count_noise_stddev
    )
    # k records per canary user, each sampled on its own: the game of the Poisson step
    # that dominates their mixture (rate 1 - (1 - q)^k, noise sigma / k), an upper
    # bound on what the mixture can show; k = 1: the step itself
    step_event = rdp_compatible(
        unit_event(sigma, step.plan.sampling_prob, records_per_unit(config.privacy))
    )
    game = exact_gaussian_game(
        noise_multiplier=step_event.event.noise_multiplier,
        sampling_prob=step_event.sampling_probability,
        steps=config.training.steps,
        num_canaries=m,
        num_guesses=k,
        delta=delta,
        significance=significance,
    )
    evaluate = evaluator(step.model, input_dtype=input_dtype(step.data))
    test_accuracy, _ = evaluate(params, step.data.x_test, step.data.y_test)
    return RunAuditReport(
        model=step.model.name,
        policy=config.policy,
        data=own.data.description,
        num_canaries=m,
        num_in=int(member.sum()),
        num_guesses=k,
        num_correct=correct,
        epsilon_lower=epsilon_lower_bound(m, k, correct, delta=delta, significance=significance),
        epsilon_claimed=_epsilon(
            setup.audit_config, step, step.plan.sampling_prob, preprocessing=False
        ),
        epsilon_config=_epsilon(config, own, own.plan.sampling_prob, preprocessing=True),
        epsilon_gaussian=game.epsilon_median,
        epsilon_gaussian_low=game.epsilon_low,
        epsilon_gaussian_high=game.epsilon_high,
        gaussian_games=game.games,
        auc=auc(scores[member], scores[~member]),
        auc_gaussian=game.auc,
        delta=float(delta),
        significance=float(significance),
        noise_multiplier=float(step.plan.noise_multiplier),
        clip_norm=float(config.privacy.l2_clip_norm),
        steps=config.training.steps,
        accountant=config.privacy.accountant,
        sampling_prob=float(step.plan.sampling_prob),
        config_sampling_prob=float(own.plan.sampling_prob),
        num_train=setup.num_train,
        expected_batch_size=setup.audit_config.training.expected_batch_size,
        test_accuracy=float(test_accuracy),
        score="loss at the initial minus the final parameters",
        seconds=time.perf_counter() - started,
    )


def _write(out: Path, report: RunAuditReport, setup: _Setup, scores: np.ndarray) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    np.savez_compressed(
        out / "canaries.npz", x=setup.x, y=setup.y, member=setup.member, scores=scores
    )
