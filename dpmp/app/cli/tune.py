"""``dpmp tune``: a hyperparameter search inside epsilon (``dpmp.app.tune``).

Exit status 3 when the search released no usable model: it drew no candidate
(Poisson only), or the chosen run failed as ``dpmp train`` judges a run (from
its released numbers alone).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from dpmp.app.cli.command import (
    Command,
    UsageError,
    add_config_args,
    check_config_args,
    config_from_args,
    integer,
)

__all__ = ["COMMAND"]

_CANDIDATES = (
    "poisson:MEAN (default poisson:10), geometric:MEAN, logarithmic:MEAN or "
    "negative-binomial:ETA:MEAN"
)


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--range",
        dest="ranges",
        metavar="KEY=KIND:...",
        action="append",
        default=[],
        help="a key to search: KEY=log:LOW:HIGH, KEY=uniform:LOW:HIGH, KEY=int:LOW:HIGH or "
        "KEY=choice:A,B,... (e.g. training.learning_rate=log:1e-3:1e-1; repeatable)",
    )
    p.add_argument(
        "--ranges",
        dest="ranges_file",
        metavar="PATH",
        help='a TOML file whose [tune] table holds ranges ("training.learning_rate" = '
        '"log:1e-3:1e-1")',
    )
    p.add_argument(
        "--target-epsilon",
        type=float,
        metavar="EPS",
        help="the WHOLE search's epsilon (default: the config's privacy.target_epsilon)",
    )
    p.add_argument("--delta", type=float, help="the whole search's delta (default: privacy.delta)")
    p.add_argument(
        "--candidates",
        default="poisson:10",
        metavar="DIST",
        help=f"the distribution of the secret number of candidates: {_CANDIDATES}",
    )
    p.add_argument(
        "--score",
        default="test_accuracy",
        choices=("test_accuracy", "test_loss", "test_perplexity"),
        help="what picks the winner, on each candidate's held-out test split "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--out", default="runs/tune", metavar="DIR", help="output folder (default: %(default)s)"
    )
    p.add_argument(
        "--keep-candidates",
        action="store_true",
        help="keep the other candidates' run folders in DIR/private/candidates",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--seed",
        type=integer(0),
        help="draw the candidates from this public number: reproducible, NOT private",
    )
    p.set_defaults(precheck=_precheck)


def _overrides(args: argparse.Namespace) -> None:
    """``--target-epsilon`` and ``--delta`` as the ``--set`` overrides they stand for."""
    if args.target_epsilon is not None:
        args.overrides.append(f"privacy.target_epsilon={args.target_epsilon!r}")
    if args.delta is not None:
        args.overrides.append(f"privacy.delta={args.delta!r}")
    args.target_epsilon = args.delta = None  # applied once


def _ranges(args: argparse.Namespace) -> list:
    """The ranges of ``--range`` and ``--ranges``, their syntax checked."""
    from dpmp.app.tune import parse_range, ranges_from_toml

    ranges = [parse_range(text) for text in args.ranges]
    if args.ranges_file:
        ranges += ranges_from_toml(args.ranges_file)
    if not ranges:
        raise UsageError(
            "give the keys to search: --range KEY=KIND:... (e.g. "
            "--range training.learning_rate=log:1e-3:1e-1) or --ranges FILE"
        )
    return ranges


# --candidates KIND: (number of parameters, maker of the CandidateCount)
_KINDS = {
    "poisson": (1, lambda mean: _tuning().PoissonCount(mean)),
    "geometric": (1, lambda mean: _tuning().TruncatedNegativeBinomialCount.with_mean(mean, 1.0)),
    "logarithmic": (1, lambda mean: _tuning().TruncatedNegativeBinomialCount.with_mean(mean, 0.0)),
    "negative-binomial": (
        2,
        lambda eta, mean: _tuning().TruncatedNegativeBinomialCount.with_mean(mean, eta),
    ),
}


def _tuning():
    import dpmp.accounting._tuning as tuning

    return tuning


def _candidates(text: str, *, build: bool = True):
    """The ``CandidateCount`` of ``--candidates`` (``build=False``: its syntax only)."""
    kind, _, rest = text.partition(":")
    parts = rest.split(":") if rest else []
    if kind not in _KINDS or len(parts) != _KINDS[kind][0]:
        raise UsageError(f"--candidates: expected {_CANDIDATES}, got {text!r}")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"--candidates {text!r}: {rest!r} is not numbers") from None
    if not build:
        return None
    try:
        return _KINDS[kind][1](*numbers)
    except ValueError as e:
        raise UsageError(f"--candidates {text!r}: {e}") from None


def _precheck(args: argparse.Namespace) -> None:
    """Names a bad config, range or distribution before JAX starts."""
    _overrides(args)
    check_config_args(args)
    _ranges(args)
    _candidates(args.candidates, build=False)


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.release import run_failures
    from dpmp.app.tune import BEST_DIR, plot_search, tune

    _overrides(args)
    config = config_from_args(args)
    out = Path(args.out)
    try:
        release = tune(
            config,
            _ranges(args),
            out_dir=out,
            candidates=_candidates(args.candidates),
            score=args.score,
            seed=args.seed,
            progress=not args.quiet,
            keep_candidates=args.keep_candidates,
        )
    except KeyboardInterrupt as e:  # a candidate's "resume it" would mislead
        stop = KeyboardInterrupt(
            "the search stopped before its end and released nothing; a search does not "
            f"resume (its candidates are secret): start another in a new --out than {out}"
        )
        stop.signum = getattr(e, "signum", signal.SIGINT)
        raise stop from None
    _print(release, out, plot_search)
    chosen = release["chosen"]
    if chosen is None:
        print(f"dpmp tune: {release['nothing_chosen']}", file=sys.stderr)
        return 3
    failures = run_failures(_report(out / BEST_DIR))
    for failure in failures:
        print(f"dpmp tune: the chosen run failed: {failure}", file=sys.stderr)
    return 3 if failures else 0


def _report(run_dir: Path) -> dict:
    import json

    return json.loads((run_dir / "report.json").read_text(encoding="utf-8"))


def _print(release: dict, out: Path, plot_search) -> None:
    """The search's released numbers, its plots and its files."""
    from dpmp.app.cli.summary import inventory

    try:
        plots = [plot_search(out)]
        if release["chosen"]:
            from dpmp.app.plots import plot_run

            plots += plot_run(out / release["chosen"]["run_dir"])
    except Exception as e:  # plots are a convenience; the search itself is saved
        plots = []
        print(f"dpmp tune: warning: plots not written: {e}", file=sys.stderr)
    state = "private" if release["private"] else "NOT private (see privacy_warnings)"
    print(f"search: epsilon {release['epsilon']:.5g}, delta {release['delta']:g} ({state})")
    chosen = release["chosen"]
    if chosen:
        values = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in chosen["hyperparameters"].items())  # fmt: skip
        score = chosen["score"]
        shown = f"{score:.4g}" if isinstance(score, float) else score
        print(f"chosen: {values}; {release['score']['name']} {shown}")
    for p in plots:
        if p is not None:
            print(f"plot: {p}")
    public = f"{out / 'tune.json'}, tune.png and the public files of best/"
    if release["private"]:
        print(f"safe to publish: {public}:")
    else:
        print(f"public files (the search is NOT differentially private): {public}:")
    if chosen:
        for line in inventory(out / chosen["run_dir"]):
            print(f"  best/: {line}")
    print(f"private (the number of candidates and the others; do not publish): {out / 'private'}/")


COMMAND = Command(
    name="tune",
    help="a hyperparameter search with one (epsilon, delta) for the whole search",
    description="Run a random number of candidates (Papernot & Steinke 2022), each a private "
    "run of the config with hyperparameters drawn from --range, at a noise multiplier "
    "calibrated so that the WHOLE search spends privacy.target_epsilon; release only the "
    "best candidate's run folder and score, and one (epsilon, delta) in DIR/tune.json.",
    add_arguments=_arguments,
    run=_run,
    imports=("jax", "dpmp.app.trainer", "dpmp.app.tune", "dpmp.app.plots", "matplotlib"),
)
