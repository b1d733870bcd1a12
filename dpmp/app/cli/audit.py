"""``dpmp audit``: a config's step precision, its noise, or a whole run's privacy.

Exit status 1 when the audit finds a violation (or, with ``--run``, when the
epsilon lower bound exceeds the claim).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpmp.app.cli.command import Command, UsageError, add_config_args, config_from_args, integer

__all__ = ["COMMAND"]


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--privacy",
        action="store_true",
        help="instead, the empirical privacy audit of the config's noise stage: one step, "
        "a canary C e_0, threshold and exact-value lookup attacks on --releases "
        "releases per dataset; their epsilon lower bounds beside the theoretical epsilon",
    )
    p.add_argument(
        "--releases",
        type=integer(100),
        default=None,
        help="noisy releases per dataset for --privacy (default 1,000,000)",
    )
    r = p.add_argument_group(
        "a whole run (--run)",
        "Train the config once with canaries (Steinke, Nasr & Jagielski 2023, one-run "
        "audit) and print a 95% lower bound on epsilon beside the claimed epsilon and "
        "beside what the same audit gives on the exact Gaussian mechanism. Exit status "
        "1 when the lower bound exceeds the claim. The audit's numbers come from a model "
        "trained on the config's data: they are as private as a run of it.",
    )
    r.add_argument(
        "--run",
        action="store_true",
        help="audit one training run of the config with canaries",
    )
    r.add_argument(
        "--canaries",
        type=integer(10),
        metavar="M",
        help="canaries, each in the training set with probability 1/2 (default 1,000)",
    )
    r.add_argument(
        "--guesses",
        type=integer(1),
        metavar="K",
        help="guesses: K/2 'in' on the highest scores, the rest 'out' on the lowest (default M/5)",
    )
    r.add_argument(
        "--out",
        metavar="DIR",
        help="also write DIR/audit.json and DIR/canaries.npz (inputs, labels, membership, scores)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.trainer import audit_step, privacy_audit_step

    _check_options(args)
    if args.run:
        return _audit_run(args)
    if args.privacy:
        releases = 1_000_000 if args.releases is None else args.releases
        report = privacy_audit_step(config_from_args(args), num_releases=releases)
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report)
        return 0 if report.ok else 1
    report = audit_step(config_from_args(args))
    if args.json:
        print(report.to_json())
    else:
        print(report)
    return 0 if report.ok else 1


# The options of one kind of audit, refused with another (option, attribute).
_RUN_OPTIONS = (
    ("--canaries", "canaries"),
    ("--guesses", "guesses"),
    ("--out", "out"),
    ("--quiet", "quiet"),
)


def _check_options(args: argparse.Namespace) -> None:
    """Usage errors of ``dpmp audit``: options of one audit given to another."""
    if args.run and args.privacy:
        raise UsageError(
            "--run and --privacy: choose one (a whole run with canaries, or one step's noise)"
        )
    if args.releases is not None and not args.privacy:
        raise UsageError("--releases: applies to --privacy only")
    if not args.run:
        for option, name in _RUN_OPTIONS:
            if getattr(args, name) not in (None, False):
                raise UsageError(f"{option}: applies to --run only")
        return
    if args.guesses is not None:
        canaries = args.canaries or _default_canaries()
        if args.guesses > canaries:
            raise UsageError(
                f"--guesses: {args.guesses} exceeds the {canaries} canaries (--canaries)"
            )
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out: {args.out!r} exists and is not a directory")


def _default_canaries() -> int:
    from dpmp.app.audit_run import DEFAULT_CANARIES

    return DEFAULT_CANARIES


def _audit_run(args: argparse.Namespace) -> int:
    """``dpmp audit --run``: one training with canaries, its epsilon lower bound."""
    from dpmp.app.audit_run import audit_run

    report = audit_run(
        config_from_args(args),
        num_canaries=args.canaries or _default_canaries(),
        num_guesses=args.guesses,
        progress=not args.quiet,
        out_dir=args.out,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
        if args.out is not None:
            print(
                f"audit files: {Path(args.out) / 'audit.json'}, {Path(args.out) / 'canaries.npz'}"
            )
    return 0 if report.ok else 1


COMMAND = Command(
    name="audit",
    help="audit a config: its step's precision, its noise, or a whole run's privacy",
    description="Trace the private step a config would train with and report, for "
    "every batch reduction, norm, all-reduce, noise sample, noise addition and "
    "update, the dtype it runs in. Exit status 1 on a violation. With --privacy, "
    "the empirical audit of one step's noise; with --run, of a whole training run.",
    add_arguments=_arguments,
    run=_run,
    imports=("jax", "dpmp.app.trainer", "dpmp.audit._precision", "dpmp.app.audit_run"),
)
