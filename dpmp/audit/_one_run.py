"""The statistics of a one-run privacy audit (Steinke, Nasr & Jagielski 2023).

"Privacy auditing with one (1) training run" (NeurIPS 2023) audits a whole
training run at once. The game, with ``m`` canaries:

1. each canary is included in the training set independently with
   probability 1/2 (the secret ``S``; excluded canaries are left out);
2. after the run the auditor scores every canary (higher: more likely in),
   guesses "in" for the ``k+`` highest scores and "out" for the ``k-`` lowest,
   and abstains on the rest;
3. ``W`` of its ``r = k+ + k-`` guesses are correct.

If the run is ``(epsilon, delta)``-DP with respect to each canary's
inclusion, ``W`` is stochastically dominated by ``Binomial(r, p)`` with
``p = e^epsilon / (1 + e^epsilon)``, up to a term in ``delta`` (their main
theorem, with ``delta > 0`` as jax-privacy evaluates it)::

    P[W >= v] <= beta + 2 m delta alpha,
    beta  = P[Binomial(r, p) >= v],
    alpha = max over i in 1..v of (P[Binomial(r, p) >= v - i] - beta) / i.

An epsilon whose right-hand side is at most the significance level is
rejected: ``epsilon_lower_bound`` returns the largest epsilon rejected
at level ``significance`` from ``(m, r, W)``, so the run's true epsilon (at
that delta) is below it with probability at most ``significance``. The
computation is jax-privacy's (``jax_privacy.auditing._epsilon_one_run``,
the p-value above and a root search); this module only feeds it the counts.
The guesses may come from any function of the run's output and of public
values (the canaries, the initialisation), never from ``S``.

``exact_gaussian_game`` plays the same game on the mechanism the
accountant analyses (see its docstring): what the audit can expect to show
when the implementation is exactly what is claimed and the attack is optimal.
Canaries in one run interfere with each other: each moves the model in
directions that the others' scores also read, which limits what one run can
show (Keinan, Shenfeld & Ligett 2025, "How well can differential privacy be
audited in one run?"); the simulated game has no such interference.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import scipy.stats
from jax_privacy import auditing as jp_auditing

__all__ = [
    "GaussianGame",
    "auc",
    "epsilon_lower_bound",
    "exact_gaussian_game",
    "guess",
]

# Simulated games of the exact mechanism draw about this many Gaussians in all
# (m canaries x steps x games), within [_MIN_GAMES, _MAX_GAMES] games.
_DRAWS = 4e7
_MIN_GAMES, _MAX_GAMES = 20, 200


def epsilon_lower_bound(
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    *,
    delta: float,
    significance: float = 0.05,
) -> float:
    """The largest epsilon that ``num_correct`` correct guesses out of
    ``num_guesses`` on ``num_canaries`` canaries reject at level ``significance``
    (0 when none is rejected); see the module docstring."""
    m, r, w = int(num_canaries), int(num_guesses), int(num_correct)
    if not 1 <= r <= m:
        raise ValueError(f"num_guesses: must be in [1, num_canaries = {m}], got {num_guesses}")
    if not 0 <= w <= r:
        raise ValueError(f"num_correct: must be in [0, num_guesses = {r}], got {num_correct}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta: must be in [0, 1), got {delta!r}")
    if not 0 < significance < 0.5:
        raise ValueError(f"significance: must be in (0, 0.5), got {significance!r}")
    if w == 0:
        return 0.0
    return float(jp_auditing._epsilon_one_run(0.0, m, r, w, significance, delta))


def guess(scores: np.ndarray, member: np.ndarray, num_guesses: int) -> int:
    """Correct guesses among ``num_guesses``: "in" for the ``num_guesses // 2``
    highest ``scores``, "out" for the rest of them, taken from the lowest (ties
    go by index, a public order). ``member`` is the secret, used only to count."""
    scores, member = np.asarray(scores, np.float64), np.asarray(member, bool)
    if scores.shape != member.shape or scores.ndim != 1:
        raise ValueError(f"scores and member: one per canary, got {scores.shape}, {member.shape}")
    if not 1 <= num_guesses <= len(scores):
        raise ValueError(
            f"num_guesses: must be in [1, {len(scores)}] (the canaries), got {num_guesses}"
        )
    if not np.isfinite(scores).all():
        raise ValueError("scores: must be finite")
    order = np.argsort(scores, kind="stable")
    k_in = num_guesses // 2
    high = order[len(order) - k_in :] if k_in else order[:0]
    low = order[: num_guesses - k_in]
    return int(member[high].sum() + (~member[low]).sum())


def auc(scores_in: np.ndarray, scores_out: np.ndarray) -> float:
    """The area under the ROC curve of "in when the score is higher": the chance
    that an included canary outscores an excluded one, ties counting half
    (Mann-Whitney U / (n_in n_out); 0.5 for a score that carries no signal).
    jax-privacy's ``attack_auroc`` is the area under the ROC's convex hull
    instead, which is above 0.5 even for pure noise (0.52 for 500 + 500)."""
    scores_in, scores_out = np.asarray(scores_in), np.asarray(scores_out)
    u = scipy.stats.mannwhitneyu(scores_in, scores_out).statistic
    return float(u / (len(scores_in) * len(scores_out)))


@dataclasses.dataclass(frozen=True)
class GaussianGame:
    """The one-run game played on the accountant's exact mechanism.

    Attributes:
      epsilon_median: median over the simulated games of the lower bound.
      epsilon_low, epsilon_high: its 5th and 95th percentiles.
      auc: mean area under the ROC curve of the likelihood-ratio scores (``auc``).
      games: number of simulated games.
    """

    epsilon_median: float
    epsilon_low: float
    epsilon_high: float
    auc: float
    games: int


def _log_ratio_sums(
    rng: np.random.Generator, member: np.ndarray, sigma: float, q: float, steps: int
) -> np.ndarray:
    """Per canary, the log-likelihood ratio of its ``steps`` releases: each release
    is ``b + sigma z`` (``b`` ~ Bernoulli(q) for an included canary, 0 else); the
    ratio of one release ``y`` is ``(1 - q) + q exp((2y - 1) / (2 sigma^2))``."""
    out = np.zeros(len(member))
    rows = max(1, int(2e6 // max(len(member), 1)))  # steps per block: bounded memory
    with np.errstate(divide="ignore"):
        log_keep = np.log1p(-q)
    for start in range(0, steps, rows):
        n = min(rows, steps - start)
        y = sigma * rng.standard_normal((n, len(member)))
        y += member & (rng.random((n, len(member))) < q)
        a = (2.0 * y - 1.0) / (2.0 * sigma**2)
        out += np.logaddexp(log_keep, math.log(q) + a).sum(0)
    return out


def exact_gaussian_game(
    *,
    noise_multiplier: float,
    sampling_prob: float,
    steps: int,
    num_canaries: int,
    num_guesses: int,
    delta: float,
    significance: float = 0.05,
    games: int | None = None,
    seed: int = 0,
) -> GaussianGame:
    """The lower bound the one-run audit reaches on the exact mechanism.

    Simulates ``games`` times the game of the module docstring with ``m =
    num_canaries`` canaries and ``num_guesses`` guesses on the mechanism that
    the accountant analyses: each canary, when included, is a record whose
    clipped gradient has the full clip norm ``C`` in a direction of its own,
    sampled at each of ``steps`` steps with probability ``sampling_prob``, and
    the auditor sees every step's noisy release along that direction (noise
    ``noise_multiplier * C``), i.e. every intermediate model of DP-SGD. Each
    canary is scored by the exact likelihood ratio of its releases, the most
    powerful test (Neyman-Pearson), and the guesses and the bound are made as
    for the real run. The canaries do not interfere with each other.

    So the result is what the audit can expect to show of a run that is
    exactly the accounted Poisson-subsampled Gaussian mechanism, attacked as
    well as possible with white-box canaries: a run's lower bound far below it
    says the attack (a black-box score on the final model) is weak, not that
    the run leaks less; one well above it says the implementation leaks more
    than the mechanism the accountant analysed. It is not a bound on the
    real run's outcome. The simulation's seed is public (this is theory).
    """
    sigma, q = float(noise_multiplier), float(sampling_prob)
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"noise_multiplier: must be a finite number > 0, got {noise_multiplier!r}")
    if not 0 < q <= 1:
        raise ValueError(f"sampling_prob: must be in (0, 1], got {sampling_prob!r}")
    m = int(num_canaries)
    if games is None:
        games = int(np.clip(_DRAWS // max(m * steps, 1), _MIN_GAMES, _MAX_GAMES))
    rng = np.random.default_rng(seed)
    bounds, aucs = [], []
    for _ in range(games):
        member = rng.random(m) < 0.5
        if member.all() or not member.any():  # a game needs both sides for the AUC
            member[0] = not member[0]
        scores = _log_ratio_sums(rng, member, sigma, q, int(steps))
        correct = guess(scores, member, num_guesses)
        bounds.append(
            epsilon_lower_bound(m, num_guesses, correct, delta=delta, significance=significance)
        )
        aucs.append(auc(scores[member], scores[~member]))
    low, median, high = np.percentile(bounds, [5, 50, 95])
    return GaussianGame(
        epsilon_median=float(median),
        epsilon_low=float(low),
        epsilon_high=float(high),
        auc=float(np.mean(aucs)),
        games=games,
    )
