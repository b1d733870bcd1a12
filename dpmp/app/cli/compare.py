"""``dpmp compare``: fp32, bf16 and fp16 side by side, private and not.

Prints shapes, dtypes, compiled sizes and step times; no value computed from
the data (see ``dpmp.app.trainer.compare``).
"""

from __future__ import annotations

import argparse
import json
import sys

from dpmp.app.cli.command import Command, UsageError, add_config_args, config_from_args, integer

__all__ = ["COMMAND"]


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument(
        "--policies",
        default="fp32,bf16,fp16",
        help="comma-separated policies (default: fp32,bf16,fp16)",
    )
    p.add_argument(
        "--repeats", type=integer(1, 100), default=5, help="timed samples per step (default 5)"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.trainer.compare import compare, format_table

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise UsageError("--policies: give at least one policy, e.g. fp32,bf16")
    rows = compare(
        config_from_args(args),
        policies=policies,
        repeats=args.repeats,
        progress=lambda line: print(f"dpmp compare: {line}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    return 0


COMMAND = Command(
    name="compare",
    help="fp32, bf16 and fp16 side by side: memory and time, private and not",
    description="For a config, build its step under each policy three ways "
    "(non-private, clipped without noise, private) and print parameter bytes, "
    "optimizer state bytes, compiled temporary memory and step time, and the share "
    "of the private step spent in clipping and in noise. Prints no value computed "
    "from the data.",
    add_arguments=_arguments,
    run=_run,
    imports=("jax", "dpmp.app.trainer.compare"),
)
