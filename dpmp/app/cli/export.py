"""``dpmp export``: a finished run's parameters alone, and its secrets deleted."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpmp.app.cli.command import Command, UsageError

__all__ = ["COMMAND"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument(
        "--to", metavar="PATH", help="where to write the parameters (default: RUN_DIR/params.npz)"
    )
    p.add_argument(
        "--delete-secrets",
        action="store_true",
        help="then delete RUN_DIR/checkpoints/ (noise keys, sampler seed, data fingerprint); "
        "the run can no longer be resumed",
    )


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.export import delete_secrets, export_params
    from dpmp.app.release import report_private

    run = Path(args.run_dir)
    if not run.is_dir():
        raise UsageError(f"no such run directory {args.run_dir!r}")
    dest = export_params(run, args.to)
    private = report_private(run)
    if private is True:
        verdict = "differentially private: safe to publish"
    elif private is False:
        verdict = "this run is NOT differentially private (report.json: privacy_warnings)"
    else:
        verdict = "the run has not finished: no report.json says whether it is private"
    print(f"parameters: {dest} ({verdict}); load with dpmp.load_params({str(dest)!r}, like)")
    if args.delete_secrets:
        deleted = delete_secrets(run)
        print(f"deleted: {', '.join(map(str, deleted)) or 'nothing (no checkpoints/)'}")
    return 0


COMMAND = Command(
    name="export",
    help="write a run's parameters alone; optionally delete its secrets",
    description="Write the newest parameters of a run alone (no noise keys, no sampler "
    "seed, no data fingerprint) to RUN_DIR/params.npz; with --delete-secrets, then delete "
    "the finished run's checkpoints/.",
    add_arguments=_arguments,
    run=_run,
    imports=("dpmp.app.export", "dpmp.app.release"),
)
