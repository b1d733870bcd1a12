"""``dpmp train``: train a private model from a config and write its run directory.

Exit status 3 when the run ended but did not do what was asked, judged from
released numbers alone (stopped early by the budget, a failed or unchecked
audit, parameters that are not finite, most examples overflowed by the noised
count), saying why on stderr. An exit status is a release too: the exact
overflow count, and what it says of the run, stay in
``private/diagnostics.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dpmp.app.cli.command import Command, UsageError, add_config_args, config_from_args, integer
from dpmp.app.cli.summary import inventory, summary

__all__ = ["COMMAND"]


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--out",
        default="runs/default",
        metavar="RUN_DIR",
        help="run directory (default: %(default)s)",
    )
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint in RUN_DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    d = p.add_argument_group(
        'several processes (jax.distributed; training.devices = "all")',
        "Every process runs the same command; process 0 writes RUN_DIR, which every "
        "process must see (a shared filesystem).",
    )
    d.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run described by the environment: a cluster JAX "
        "recognises (SLURM, Open MPI, mpi4py, Kubernetes, Cloud TPU), with "
        "JAX_COORDINATOR_ADDRESS or the flags below for what it does not give",
    )
    d.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address (implies --distributed)"
    )
    d.add_argument("--num-processes", type=integer(1, 65536), metavar="N", help="processes in all")
    d.add_argument("--process-id", type=integer(0, 65535), metavar="I", help="this process's index")


def _distributed(args: argparse.Namespace) -> dict | None:
    """The ``jax.distributed.initialize`` arguments ``dpmp train`` was given, or None."""
    given = {
        "coordinator": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if not args.distributed and all(v is None for v in given.values()):
        return None
    if given["process_id"] is not None and given["num_processes"] is not None:
        if given["process_id"] >= given["num_processes"]:
            raise UsageError(
                f"--process-id: {given['process_id']} is not below --num-processes "
                f"{given['num_processes']}"
            )
    return given


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.checkpoint import CheckpointError
    from dpmp.app.release import run_failures
    from dpmp.app.trainer import train

    config = config_from_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {args.out!r} exists and is not a directory")
    import jax

    primary = jax.process_index() == 0
    try:
        report = train(
            config, out_dir=out, resume=not args.fresh, progress=not args.quiet and primary
        )
    except CheckpointError as e:
        # The trainer speaks of its Python arguments; say what to type instead.
        raise UsageError(
            str(e).replace(
                "use resume=False (or another out_dir)", "use --fresh (or another --out)"
            )
        ) from e
    if not primary:  # process 0 writes and prints the run
        print(f"dpmp train: process {jax.process_index()} of {jax.process_count()}: done")
        return 0
    _print_run(report, out)
    failures = run_failures(report)
    for failure in failures:
        print(f"dpmp train: run failed: {failure}", file=sys.stderr)
    return 3 if failures else 0


def _print_run(report: dict, out: Path) -> None:
    """The summary, the plots and the run directory's files."""
    try:
        from dpmp.app.plots import plot_run

        plots = plot_run(out)
    except Exception as e:  # plots are a convenience; the run itself is saved
        plots = []
        print(f"dpmp train: warning: plots not written: {e}", file=sys.stderr)
    print(summary(report))
    for p in plots:
        print(f"plot: {p}")
    print(f"run directory: {out}")
    for line in inventory(out):
        print(line)


COMMAND = Command(
    name="train",
    help="train a private model from a config",
    description="Train a private model. With no arguments: a private MLP on the "
    "handwritten digits data in bf16 at epsilon 2, delta 1e-5.",
    add_arguments=_arguments,
    run=_run,
    imports=("jax", "dpmp.app.trainer", "dpmp.app.release", "dpmp.app.plots", "matplotlib"),
    distributed=_distributed,
)
