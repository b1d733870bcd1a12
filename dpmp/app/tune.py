"""``dpmp tune``: a hyperparameter search whose whole release is inside epsilon.

``tune(config, ranges, out_dir=...)`` runs Papernot & Steinke's random-stopping
search (``dpmp.accounting._tuning``): it draws the number of candidates ``K``
(Poisson or truncated negative binomial) and, for each, hyperparameters from
the ``ranges``; each candidate is a full private run (``dpmp.train``) of the
config with those values, at a noise multiplier calibrated so that the WHOLE
search is ``(privacy.target_epsilon, privacy.delta)``-DP. It releases the best
candidate's run folder (``best/``) and score, and one (epsilon, delta) for the
search (``tune.json``). ``K``, the other candidates' hyperparameters and
scores stay in ``private/`` (``search.json``): releasing them is not covered.

What a search may vary, and what picks the winner:

* A range may cover any key the privacy plan does not read: the optimizer,
  its learning rate, the clip norm (the noise is sigma times it), the loss
  scale's schedule, chunk sizes. Keys that change the plan or the data
  (``privacy.*`` but ``l2_clip_norm`` and ``clip_method``, ``training.steps``,
  ``training.expected_batch_size``, ``training.seed``, ``data.*``,
  ``model.*``, ``pretrain.*``, ``loss_scale.kind``,
  ``loss_scale.count_noise_stddev``, ``policy``) are refused: the accounting
  holds one candidate plan for every draw.
* The score is a number each run already releases on its held-out test split
  (``test_accuracy`` by default; ``test_loss``, ``test_perplexity``), which a
  dpmp run does not protect (``docs/privacy.md``, "The held-out split"): data
  the user declares public. It costs no epsilon and is no part of a
  candidate's budget. Ties are broken by a secret uniform draw.

Secrets: ``K``, the hyperparameter draws and the tie-breaks come from the OS
entropy; each candidate's noise and sampling from its own run's. ``seed=`` makes
the search reproducible and NOT private (``tune.json`` says so). The progress
lines on stderr count the candidates, which reveals ``K`` by the end: they are
private diagnostics like ``private/`` (``progress=False`` prints none).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpmp.app.config import Config, ConfigError

if TYPE_CHECKING:
    from dpmp.accounting._tuning import CandidateCount, CandidatePlan, SearchGuarantee

__all__ = [
    "SCORES",
    "Range",
    "Score",
    "parse_range",
    "plot_search",
    "ranges_from_toml",
    "tune",
]

TUNE_FILE = "tune.json"
PLOT_FILE = "tune.png"
BEST_DIR = "best"
SEARCH_FILE = "search.json"
_CANDIDATES_DIR = "candidates"

# Keys (or sections, ending in ".") a range may not cover: the plan reads them.
_PLAN_KEYS = (
    "policy",
    "data.",
    "model.",
    "pretrain.",
    "privacy.target_epsilon",
    "privacy.delta",
    "privacy.noise_multiplier",
    "privacy.accountant",
    "privacy.sampling",
    "privacy.noise_sampler",
    "privacy.reproducible_noise",
    "privacy.allow_large_delta",
    "training.steps",
    "training.expected_batch_size",
    "training.seed",
    "loss_scale.kind",
    "loss_scale.count_noise_stddev",
)

_PRIVATE_README = """non-private diagnostics: do not publish

search.json holds what the search keeps secret: the number of candidates K, every
candidate's hyperparameters and score, and their times. The search's guarantee
(../tune.json) covers releasing the chosen candidate alone; publishing K or another
candidate's score is not covered. candidates/ (with --keep-candidates) holds the
other candidates' run folders, their checkpoints as secret as the data.
"""


# ---- ranges ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Range:
    """Where a search draws one config key from.

    Attributes:
      key: ``section.key`` of the run config.
      kind: ``"log"`` (log-uniform on ``[low, high]``, both > 0), ``"uniform"``
        (on ``[low, high]``), ``"int"`` (an integer of ``[low, high]``) or
        ``"choice"`` (one of ``choices``, each equally likely).
      low, high: the interval's ends (not for ``choice``).
      choices: the values of a ``choice``.
    """

    key: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()

    def draw(self, rng) -> Any:
        """One value, from ``rng`` (a numpy ``Generator``)."""
        if self.kind == "choice":
            return self.choices[int(rng.integers(len(self.choices)))]
        if self.kind == "int":
            return int(rng.integers(int(self.low), int(self.high) + 1))
        if self.kind == "log":
            return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return float(rng.uniform(self.low, self.high))

    def ends(self) -> tuple[Any, ...]:
        """The values whose configs are checked before the search starts."""
        return self.choices if self.kind == "choice" else (self.low, self.high)

    def spec(self) -> str:
        """The range as ``--range`` writes it."""
        if self.kind == "choice":
            return "choice:" + ",".join(str(c) for c in self.choices)
        return f"{self.kind}:{self.low!r}:{self.high!r}"


_KINDS = ("log", "uniform", "int", "choice")
_SYNTAX = (
    "KEY=log:LOW:HIGH, KEY=uniform:LOW:HIGH, KEY=int:LOW:HIGH or KEY=choice:A,B,... "
    "(e.g. training.learning_rate=log:1e-3:1e-1)"
)


def parse_range(text: str) -> Range:
    """A ``Range`` from ``KEY=KIND:...`` (``_SYNTAX``); ``ConfigError`` (one line,
    naming the range) if it is malformed, empty or not numbers."""
    key, sep, spec = text.partition("=")
    key = key.strip()
    if not sep or ("." not in key and key != "policy"):
        raise ConfigError(f"range {text!r}: expected {_SYNTAX}")
    return _range(key, spec.strip())


def _range(key: str, spec: str) -> Range:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    where = f"range {key}={spec}"
    if kind not in _KINDS:
        raise ConfigError(
            f"{where}: the kind must be one of {', '.join(_KINDS)}; expected {_SYNTAX}"
        )
    _check_key(key)
    if kind == "choice":
        choices = tuple(_value(c.strip()) for c in rest.split(",") if c.strip())
        if not choices:
            raise ConfigError(f"{where}: the range is empty (no choices)")
        return Range(key, kind, choices=choices)
    parts = rest.split(":")
    if len(parts) != 2:
        raise ConfigError(f"{where}: expected {kind}:LOW:HIGH")
    low, high = (_number(where, p, integer=kind == "int") for p in parts)
    if (kind == "int" and low > high) or (kind != "int" and not low < high):
        raise ConfigError(f"{where}: the range is empty (LOW {low:g} is not below HIGH {high:g})")
    if kind == "log" and not low > 0:
        raise ConfigError(f"{where}: a log range needs LOW > 0, got {low:g}")
    return Range(key, kind, low, high)


def _number(where: str, text: str, *, integer: bool) -> float:
    try:
        value = int(text.strip()) if integer else float(text.strip())
    except ValueError:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: {text.strip()!r} is not {what}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {text.strip()!r} is not a finite number")
    return value


def _value(text: str) -> Any:
    """A choice as TOML reads it (``0.1``, ``true``, ``"adam"``), else the bare word."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _check_key(key: str) -> None:
    """A key of the config (names only: nothing heavy is imported) that the plan
    does not read."""
    from dpmp.app.config import check_keys

    for plan_key in _PLAN_KEYS:
        if key == plan_key or (plan_key.endswith(".") and key.startswith(plan_key)):
            raise ConfigError(
                f"range {key}: the search's accounting holds one privacy plan and one dataset "
                "for every candidate, and this key changes them; tune keys the plan does not "
                "read (training.learning_rate, training.optimizer, privacy.l2_clip_norm, ...)"
            )
    section, _, name = key.partition(".")
    try:
        check_keys({section: {name: None}})
    except ConfigError as e:
        raise ConfigError(f"range {key}: {e}") from None


def ranges_from_toml(path: str | Path) -> list[Range]:
    """The ranges of a TOML file's ``[tune]`` table: ``"section.key" = "KIND:..."``,
    or nested, ``[tune.training]`` with ``learning_rate = "log:1e-3:1e-1"``."""
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8")).get("tune")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"ranges: cannot read {str(path)!r} as TOML: {e}") from None
    if not isinstance(table, dict) or not table:
        raise ConfigError(f'ranges: {str(path)!r} has no [tune] table of KEY = "KIND:..."')
    out = []
    for key, spec in _flat(table):
        if not isinstance(spec, str):
            raise ConfigError(f'range {key}: expected a string such as "log:1e-3:1e-1"')
        out.append(_range(key, spec))
    return out


def _flat(table: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def check_ranges(config: Config, ranges: Sequence[Range]) -> list[Range]:
    """``ranges`` checked against ``config``: one range per key, and every end (each
    choice) a value the config accepts (``ConfigError`` naming the range)."""
    ranges = list(ranges)
    if not ranges:
        raise ConfigError("ranges: a search needs at least one range (--range KEY=KIND:...)")
    keys = [r.key for r in ranges]
    if len(set(keys)) != len(keys):
        raise ConfigError(
            f"ranges: a key has two ranges: {sorted(k for k in keys if keys.count(k) > 1)[0]}"
        )
    for r in ranges:
        for value in r.ends():
            try:
                _with_values(config, {r.key: value})
            except (ConfigError, TypeError) as e:
                raise ConfigError(f"range {r.key}={r.spec()}: {e}") from None
    return ranges


def _with_values(config: Config, values: Mapping[str, Any]) -> Config:
    """``config`` with ``values`` (``section.key``) set, checked by ``Config``."""
    raw = config.to_dict()
    for key, value in values.items():
        section, name = key.split(".", 1)
        if section not in raw or not isinstance(raw[section], dict) or name not in raw[section]:
            raise ConfigError(f"unknown key {key}")
        raw[section][name] = value
    return Config.from_dict(raw)


# ---- the score -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Score:
    """A number every candidate's ``report.json`` releases, and which way is better."""

    name: str
    higher_is_better: bool

    def key(self, report: Mapping[str, Any]) -> float:
        """Larger is better; a missing or non-finite score is the worst."""
        value = report.get(self.name)
        if not isinstance(value, int | float) or not math.isfinite(value):
            return -math.inf
        return float(value) if self.higher_is_better else -float(value)


SCORES = {
    s.name: s
    for s in (
        Score("test_accuracy", True),
        Score("test_loss", False),
        Score("test_perplexity", False),
    )
}
SCORE_SOURCE = (
    "the candidate's own report.json, on its held-out test split, which a dpmp run does "
    "not protect (docs/privacy.md, 'The held-out split'): public data, no epsilon spent"
)


def _score(name: str) -> Score:
    if name not in SCORES:
        raise ConfigError(f"score: {name!r} is not one of {', '.join(SCORES)}")
    return SCORES[name]


# ---- the plan: one candidate's releases, the same for every draw ----------------


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What a candidate's plan needs of the data and the model."""

    num_train: int
    params_shape: Any


def _facts(config: Config) -> _Facts:
    """The training records and the shapes of the model's parameters (the whole
    model's: with LoRA only the adapters are noised, fewer coordinates, and the
    residual only grows with them, so this is an upper bound)."""
    import jax

    from dpmp.app.config_checkpoint import CHECKPOINT_KINDS
    from dpmp.app.inputs import load_data, model_from_config

    if config.model.kind in CHECKPOINT_KINDS:
        from dpmp.app.published import start_from_checkpoint

        start = start_from_checkpoint(config, model=None, init_params=None, data=None)
        model, data = start.model, start.data
    else:
        data = load_data(config.data, config.training.seed)
        model = model_from_config(config.model, data, config.precision)
    from dpmp.app.trainer.plan import population  # the users, with privacy.unit = "user"

    shape = jax.eval_shape(model.init, jax.random.key(config.training.seed))
    return _Facts(population(config, data), shape)


def _noise_plan(config: Config, facts: _Facts):
    """The trainer's own plan of ``config`` (``dpmp.app.trainer.plan.noise_plan``)."""
    from dpmp.app.trainer.plan import max_truncation_prob, noise_plan

    return noise_plan(
        config,
        num_train=facts.num_train,
        params_shape=facts.params_shape,
        truncation_probability=max_truncation_prob(config),
    )


def _candidate_plan(config: Config, facts: _Facts) -> CandidatePlan:
    """The ``CandidatePlan`` every candidate of ``config`` runs (noise to calibrate):
    the trainer's releases, its noise's contract and coordinates, and the
    truncation bound its padded batch size is chosen for (a candidate's own
    epsilon target is at least the search's, so its bound is at most this)."""
    from dpmp.accounting._tuning import CandidatePlan
    from dpmp.app.trainer.plan import max_truncation_prob

    plan = _noise_plan(_with_values(config, {"privacy.noise_multiplier": 1.0}), facts)
    steps = config.training.steps
    return CandidatePlan(
        noise_multiplier=None,
        sampling_prob=plan.sampling_prob,
        steps=steps,
        count_noise_stddev=plan.count_noise_stddev,
        preprocessing_noise_multiplier=plan.budget.preprocessing_noise_multiplier,
        noised_coordinates=plan.noised_coordinates,
        noise_sampler=plan.budget.noise_sampler if plan.noised_coordinates else None,
        truncation_tv=min(1.0, steps * max_truncation_prob(config)),
    )


def _candidate_config(config: Config, sigma: float, facts: _Facts) -> Config:
    """``config`` at noise multiplier ``sigma``, with an epsilon target its trainer
    admits every step under: the search's own target, raised only when one
    candidate's epsilon by the trainer's accountant exceeds it (the target is
    the trainer's stop, not the search's guarantee, which ``tune.json`` states)."""
    import dpmp.accounting as accounting

    target = config.privacy.target_epsilon
    steps = config.training.steps
    for _ in range(400):
        candidate = _with_values(
            config, {"privacy.noise_multiplier": sigma, "privacy.target_epsilon": target}
        )
        budget = _noise_plan(candidate, facts).budget
        if accounting.BudgetTracker(budget).remaining_steps(steps) >= steps:
            return candidate
        target *= 1.01
    raise ConfigError(  # pragma: no cover - the search's epsilon bounds one candidate's
        f"privacy.target_epsilon: no candidate target admits noise multiplier {sigma:.4g}"
    )


# ---- progress --------------------------------------------------------------------


class _Progress:
    """Stderr lines for the operator: the current candidate's steps and time left,
    and how many candidates are done. Counting candidates reveals ``K`` by the
    end, which the guarantee does not cover: private diagnostics, said in the
    first line. No score is shown: only the chosen one is released, at the end."""

    def __init__(self, enabled: bool, steps: int, stream=None):
        self.enabled, self.steps = enabled, steps
        self.stream = sys.stderr if stream is None else stream
        self.done, self.bar, self.seconds, self.began = 0, None, [], 0.0

    def say(self, line: str) -> None:
        if self.enabled:
            print(f"dpmp tune: {line}", file=self.stream, flush=True)

    def start(self) -> None:
        from dpmp.app.run_dir import ProgressBar

        self.bar = ProgressBar(self.steps, enabled=self.enabled, stream=self.stream)
        self.began = time.perf_counter()

    def step(self, step: int, info: Mapping[str, Any]) -> None:
        del info  # released numbers of a candidate that may not be chosen: not shown
        fields = {"candidate": str(self.done + 1)}
        if self.seconds:  # the mean time of the candidates done
            fields["each"] = "~" + _clock(sum(self.seconds) / len(self.seconds))
        self.bar.update(step, fields, force=step == self.steps)

    def end(self) -> None:
        self.bar.close()
        self.done += 1
        self.seconds.append(time.perf_counter() - self.began)
        self.say(f"candidates done: {self.done} (private: the count reveals K)")


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}:{secs:02d}"


# ---- the search ------------------------------------------------------------------


@dataclasses.dataclass
class _Candidate:
    index: int
    values: dict[str, Any]
    tiebreak: float
    folder: Path
    report: dict[str, Any] | None = None
    seconds: float = 0.0

    def key(self, score: Score) -> tuple[float, float]:
        return (score.key(self.report or {}), self.tiebreak)

    def record(self, score: Score) -> dict[str, Any]:
        return {
            "index": self.index,
            "hyperparameters": self.values,
            "score": (self.report or {}).get(score.name),
            "tiebreak": self.tiebreak,
            "seconds": self.seconds,
        }


@dataclasses.dataclass(frozen=True)
class _Search:
    """A search as planned: what ``tune.json`` reports beside the chosen candidate."""

    config: Config  # the user's: the search's target
    base: Config  # every candidate's, before its draws (its noise multiplier set)
    num_train: int
    plan: CandidatePlan  # at the calibrated noise multiplier
    count: CandidateCount
    guarantee: SearchGuarantee
    ranges: tuple[Range, ...]
    score: Score
    seed: int | None


def _run_candidates(
    k: int,
    search: _Search,
    rng,
    folder: Path,
    *,
    train: Callable[..., dict],
    progress: _Progress,
    keep: bool,
) -> tuple[_Candidate | None, list[_Candidate]]:
    """Runs ``k`` candidates into ``folder/NNN``; returns the best and all of them.
    A candidate that loses is deleted at once unless ``keep``."""
    best, done, score = None, [], search.score
    for i in range(k):
        values = {r.key: r.draw(rng) for r in search.ranges}
        cand = _Candidate(i + 1, values, float(rng.random()), folder / f"{i + 1:03d}")
        progress.start()
        began = time.perf_counter()
        cand.report = train(
            _with_values(search.base, values),
            out_dir=cand.folder,
            resume=False,
            progress=False,
            callback=progress.step,
        )
        cand.seconds = time.perf_counter() - began
        progress.end()
        done.append(cand)
        if best is None or cand.key(score) > best.key(score):
            best, loser = cand, best
        else:
            loser = cand
        if loser is not None and not keep:
            shutil.rmtree(loser.folder, ignore_errors=True)
    return best, done


def tune(
    config: Config | None = None,
    ranges: Sequence[Range | str] = (),
    *,
    out_dir: str | Path,
    candidates: CandidateCount | None = None,
    score: str = "test_accuracy",
    seed: int | None = None,
    progress: bool = True,
    keep_candidates: bool = False,
    train: Callable[..., dict] | None = None,
) -> dict[str, Any]:
    """Searches ``ranges`` of ``config`` within ``config.privacy``'s (epsilon, delta)
    for the whole search, and returns what it releases (also ``tune.json``).

    Args:
      config: the run every candidate trains (default: ``Config()``); its
        ``privacy.target_epsilon`` and ``privacy.delta`` are the WHOLE search's.
        ``privacy.noise_multiplier`` must be unset: the search calibrates it.
      ranges: ``Range``s or ``"KEY=KIND:..."`` strings (``parse_range``).
      out_dir: where ``tune.json``, ``tune.png``, ``best/`` (the chosen
        candidate's run folder) and ``private/`` go; it must hold no search.
      candidates: the distribution of the number of candidates, a
        ``dpmp.accounting._tuning.CandidateCount`` (default ``PoissonCount(10)``).
      score: what picks the winner: ``test_accuracy`` (default), ``test_loss``
        or ``test_perplexity`` of each candidate's held-out split.
      seed: draws the number of candidates, the hyperparameters and the
        tie-breaks from this public number: reproducible and NOT private.
      progress: stderr lines (they count the candidates: private).
      keep_candidates: keep the other candidates' run folders in ``private/``.
      train: trains one candidate, ``train(config, out_dir=, resume=, progress=,
        callback=) -> report`` (default ``dpmp.train``).

    Returns:
      ``tune.json``: the search's epsilon and delta, how they were accounted,
      the chosen candidate's hyperparameters and score (None if none ran).

    Raises:
      ConfigError: a bad range, score or config, a noise multiplier given, an
        out_dir that holds a search, or a target the search cannot meet.
    """
    import numpy as np

    from dpmp.app.run_dir import atomic_write_text, secret_dir
    from dpmp.noise._entropy import fresh_seed

    config = Config() if config is None else config
    out = _fresh_out(Path(out_dir), create=False)
    search = _plan_search(config, ranges, candidates, _score(score), seed)
    _fresh_out(out)
    rng = np.random.default_rng(fresh_seed() if seed is None else seed)
    k = search.count.draw(rng)
    private = secret_dir(out / "private")
    atomic_write_text(private / "README.txt", _PRIVATE_README, secret=True)
    show = _Progress(progress, config.training.steps)
    show.say(
        f"each candidate at noise multiplier {search.plan.noise_multiplier:.4g}; the whole "
        f"search is (epsilon {search.guarantee.epsilon:.4g}, delta {config.privacy.delta:g}); "
        "these lines count the candidates, which the search keeps secret: keep them private"
    )
    if train is None:
        from dpmp.app.trainer import train
    best, done = _run_candidates(
        k, search, rng, secret_dir(private / _CANDIDATES_DIR),
        train=train, progress=show, keep=keep_candidates,
    )  # fmt: skip
    if best is not None:
        best.folder.replace(out / BEST_DIR)
    if not keep_candidates:
        shutil.rmtree(private / _CANDIDATES_DIR, ignore_errors=True)
    secret = {"candidates_drawn": k, "seed": seed, "chosen": best and best.index,
              "candidates": [c.record(search.score) for c in done]}  # fmt: skip
    atomic_write_text(private / SEARCH_FILE, _json(secret), secret=True)
    release = _release(search, best)
    atomic_write_text(out / TUNE_FILE, _json(release))
    return release


def _plan_search(config: Config, ranges, candidates, scorer: Score, seed) -> _Search:
    """The search before any candidate runs: the ranges checked, the noise
    multiplier calibrated, every candidate's config."""
    from dpmp.accounting._tuning import PoissonCount, calibrate_search_noise, search_guarantee

    ranges = check_ranges(config, [parse_range(r) if isinstance(r, str) else r for r in ranges])
    count = PoissonCount(10.0) if candidates is None else candidates
    if config.privacy.noise_multiplier is not None:
        raise ConfigError(
            "privacy.noise_multiplier: the search calibrates it so that the whole search meets "
            "privacy.target_epsilon; leave it unset"
        )
    facts = _facts(config)
    plan = _candidate_plan(config, facts)
    p = config.privacy
    try:
        sigma = calibrate_search_noise(plan, count, target_epsilon=p.target_epsilon, delta=p.delta)
    except ValueError as e:
        raise ConfigError(f"privacy.target_epsilon: the search cannot meet it: {e}") from None
    plan = plan.replace(noise_multiplier=sigma)
    guarantee = search_guarantee(plan, count, delta=p.delta)
    base = _candidate_config(config, sigma, facts)
    return _Search(
        config, base, facts.num_train, plan, count, guarantee, tuple(ranges), scorer, seed
    )


def _fresh_out(out: Path, *, create: bool = True) -> Path:
    """``out`` created if needed (``create``); refused if it holds a search already."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir: {str(out)!r} exists and is not a directory")
    taken = [n for n in (TUNE_FILE, BEST_DIR, "private") if (out / n).exists()]
    if taken:
        raise ConfigError(
            f"out_dir: {str(out)!r} holds a search already ({', '.join(taken)}); a search's "
            "files are its release: choose another folder"
        )
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out


def _json(value: Any) -> str:
    from dpmp.app.run_dir import to_jsonable

    return json.dumps(to_jsonable(value), indent=2) + "\n"


_GUARANTEE_NOTE = (
    "one (epsilon, delta) for the whole search: it covers releasing the chosen candidate's "
    "run folder (best/: its model, hyperparameters and score) and this file, with the number "
    "of candidates and the other candidates kept secret (private/). best/report.json's "
    "epsilon is that one run's alone; the chosen model's guarantee is this one."
)
_NOTHING_CHOSEN = (
    "the search drew no candidate (K = 0): nothing else is released, and its epsilon is "
    "spent all the same"
)


def _release(search: _Search, best: _Candidate | None) -> dict:
    """``tune.json``: what the search releases (every number public or accounted)."""
    from dpmp.accounting._tuning import SEARCH_ORDERS
    from dpmp.app.release import privacy_warnings, public_config

    seed, scorer, plan, guarantee = search.seed, search.score, search.plan, search.guarantee
    warnings = privacy_warnings(search.base, search.num_train)
    if seed is not None:
        warnings.append(
            f"seed = {seed}: the number of candidates, the hyperparameters and the tie-breaks "
            "were drawn from a public seed, so the search is NOT differentially private"
        )
    chosen = None
    if best is not None:
        report = best.report or {}
        warnings += [w for w in report.get("privacy_warnings", []) if w not in warnings]
        chosen = {
            "run_dir": BEST_DIR,
            "hyperparameters": best.values,
            "score": report.get(scorer.name),
            "test_accuracy": report.get("test_accuracy"),
            "test_loss": report.get("test_loss"),
        }
    return {
        "private": not warnings and (best is None or (best.report or {}).get("private") is True),
        "privacy_warnings": warnings,
        "epsilon": guarantee.epsilon,
        "delta": guarantee.delta,
        "target_epsilon": search.config.privacy.target_epsilon,
        "guarantee": _GUARANTEE_NOTE,
        "chosen": chosen,
        "nothing_chosen": None if best else _NOTHING_CHOSEN,
        "score": {
            "name": scorer.name,
            "higher_is_better": scorer.higher_is_better,
            "source": SCORE_SOURCE,
        },
        "ranges": {r.key: r.spec() for r in search.ranges},
        "candidates": {
            **search.count.record(),
            "drawn_from": "public seed" if seed is not None else "OS entropy (secret)",
        },
        "candidate_plan": {
            "noise_multiplier": plan.noise_multiplier,
            "sampling_prob": plan.sampling_prob,
            "steps": plan.steps,
            "count_noise_stddev": plan.count_noise_stddev,
            "preprocessing_noise_multiplier": plan.preprocessing_noise_multiplier,
            "noised_coordinates": plan.noised_coordinates,
            "noise_sampler": plan.noise_sampler,
            "epsilon_alone": guarantee.candidate_epsilon,
            "trainer_target_epsilon": search.base.privacy.target_epsilon,
        },
        "accounting": {
            "method": "Papernot & Steinke 2022 (ICLR), random stopping, Renyi DP "
            "(dpmp.accounting._tuning)",
            "delta_rdp": guarantee.delta_rdp,
            "delta_residual_and_truncation": guarantee.delta_tv,
            "order": guarantee.order,
            "orders": f"{len(SEARCH_ORDERS)} from {SEARCH_ORDERS[0]:g} to {SEARCH_ORDERS[-1]:g}",
            "residual_log_ratio": guarantee.residual_log_ratio,
            "truncation_tv": plan.truncation_tv,
            "neighbouring": "add_or_remove (zero-out), as a dpmp run's",
        },
        "config": public_config(search.base),
    }


# ---- the plot --------------------------------------------------------------------


def plot_search(out_dir: str | Path) -> Path | None:
    """``tune.png``: the chosen candidate's held-out score against its steps (from
    ``best/metrics.jsonl``: released with the chosen run) and its final score,
    under the search's (epsilon, delta). Nothing of the other candidates is
    drawn; None when no candidate was chosen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dpmp.app.run_dir import naming, read_metrics

    out = Path(out_dir)
    release = json.loads((out / TUNE_FILE).read_text(encoding="utf-8"))
    chosen = release.get("chosen")
    if not chosen:
        return None
    name = release["score"]["name"]
    records = read_metrics(out / chosen["run_dir"])
    points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), int | float)]
    fig, ax = plt.subplots(figsize=(7, 4))
    if points:
        ax.plot(*zip(*points, strict=True), "o-", color="tab:green", markersize=4)
    if chosen.get("score") is not None:
        ax.axhline(chosen["score"], color="tab:gray", linestyle="--", linewidth=1)
    ax.set_xlabel("step of the chosen candidate")
    ax.set_ylabel(f"{name} (held-out)")
    values = ", ".join(
        f"{k.split('.')[-1]} {_short(v)}" for k, v in chosen["hyperparameters"].items()
    )
    ax.set_title(
        f"dpmp tune: the chosen candidate ({values})\nthe whole search: epsilon "
        f"{release['epsilon']:.4g}, delta {release['delta']:g}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / PLOT_FILE
    try:
        with naming(path, "the plot"):
            fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
