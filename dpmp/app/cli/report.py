"""``dpmp report``: a finished run's summary, its plots, and which of its files
are safe to publish."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dpmp.app.cli.command import Command, UsageError
from dpmp.app.cli.summary import inventory, summary

__all__ = ["COMMAND"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print report.json")


def _read_report(run_dir: str) -> dict:
    """``RUN_DIR/report.json``, or a usage error saying what is wrong with it."""
    run = Path(run_dir)
    path = run / "report.json"
    if not run.is_dir():
        raise UsageError(f"no such run directory {run_dir!r}")
    if not path.is_file():
        raise UsageError(
            f"{path} not found (the run has not finished; metrics.jsonl holds "
            "what it logged so far)"
        )
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(report, dict):
        raise UsageError(f"{path}: expected a JSON object (a dpmp run report), got {report!r:.60}")
    versions = report.get("versions")
    if not isinstance(versions, dict) or "dpmp" not in versions:
        raise UsageError(
            f"{path}: not a dpmp report (one names its dpmp version); "
            f"is {run_dir} a dpmp run directory?"
        )
    return report


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.plots import plot_run, plots_current

    report = _read_report(args.run_dir)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    run = Path(args.run_dir)
    plots, skipped, note = [], None, ""
    if _read_only(run):  # a reader leaves a folder marked read-only as it is
        skipped = f"{run} is read-only: its plots were not rewritten"
    else:
        # drawn only when one is missing or metrics.jsonl / report.json changed
        note = " (up to date)" if plots_current(run) else ""
        try:
            plots = plot_run(run)  # its other errors come before any output
        except OSError as e:  # a folder this process may not write
            skipped = f"plots not rewritten: {e}"
    print(summary(report))
    for p in plots:
        print(f"plot: {p}{note}")
    for line in inventory(run):
        print(line)
    if skipped:
        print(f"dpmp report: {skipped}", file=sys.stderr)
    return 0


def _read_only(run: Path) -> bool:
    """Whether ``run`` may not be written, or is marked so (no write bit: a user
    who may write anyway, root, still leaves it alone)."""
    return not os.access(run, os.W_OK) or not run.stat().st_mode & 0o222


COMMAND = Command(
    name="report",
    help="summary table and plots of a finished run",
    description="Print a run's summary, draw its plots when they are missing or their "
    "inputs changed (not in a read-only run directory) and say which of its files are "
    "safe to publish.",
    add_arguments=_arguments,
    run=_run,
    imports=("dpmp.app.release", "dpmp.app.plots", "matplotlib"),
)
