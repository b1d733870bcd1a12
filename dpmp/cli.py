"""The ``dpmp`` command: train, audit, compare, budget, report.

Errors in arguments, configs or data print one line naming the field and what
is allowed, and exit with status 2 (no traceback). ``dpmp audit`` exits 1 when
the audit finds a violation. ``dpmp train`` exits 3 when the run ended but did
not do what was asked (stopped early by the budget, a failed audit, parameters
that are not finite, most examples overflowed), saying why; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from dpmp.accounting._registry import accountant_names

__all__ = ["console", "main"]

_EXAMPLE_CONFIGS = "configs/default.toml, configs/fp16.toml, configs/fp32.toml, ..."


class _UsageError(Exception):
    """A user error: printed as one line, exit status 2."""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="PATH",
        help=f"TOML config (default: the built-in default run; see {_EXAMPLE_CONFIGS})",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config key, e.g. --set privacy.target_epsilon=4 (repeatable)",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="train on your own arrays: a .npz with x, y (and optionally x_test, y_test), or "
        "a folder of x_train.npy, y_train.npy, x_test.npy, y_test.npy (memory-mapped)",
    )


def _load(args):
    from dpmp.app.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "data", None):
        path = Path(args.data)
        if path.is_dir():
            if not (path / "x_train.npy").is_file():
                raise _UsageError(
                    f"--data: {args.data!r} is a folder without x_train.npy (a .npz file, or a "
                    "folder of x_train.npy, y_train.npy, x_test.npy, y_test.npy)"
                )
            kind = "npy"
        elif path.suffix != ".npz":
            raise _UsageError(
                f"--data: expected a .npz file or a folder of .npy files, got {args.data!r}"
            )
        elif not path.exists():
            raise _UsageError(f"--data: no such file {args.data!r}")
        elif not path.is_file():
            raise _UsageError(f"--data: {args.data!r} is not a regular file")
        else:
            kind = "npz"
        overrides += [f"data.dataset={kind}", f"data.path={json.dumps(str(path))}"]
    return load_config(args.config, overrides)


# ---- train -------------------------------------------------------------------------
def _cmd_train(args) -> int:
    from dpmp.app.checkpoint import CheckpointError
    from dpmp.app.release import run_failures
    from dpmp.app.trainer import train

    config = _load(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _UsageError(f"--out: {args.out!r} exists and is not a directory")
    import jax

    primary = jax.process_index() == 0
    try:
        report = train(
            config, out_dir=out, resume=not args.fresh, progress=not args.quiet and primary
        )
    except CheckpointError as e:
        # The trainer speaks of its Python arguments; say what to type instead.
        raise _UsageError(
            str(e).replace(
                "use resume=False (or another out_dir)", "use --fresh (or another --out)"
            )
        ) from e
    if not primary:  # process 0 writes and prints the run
        print(f"dpmp train: process {jax.process_index()} of {jax.process_count()}: done")
        return 0
    try:
        from dpmp.app.plots import plot_run

        plots = plot_run(out)
    except Exception as e:  # plots are a convenience; the run itself is saved
        plots = []
        print(f"dpmp train: warning: plots not written: {e}", file=sys.stderr)
    print(_summary(report))
    for p in plots:
        print(f"plot: {p}")
    print(f"run directory: {out}")
    for line in _inventory(out):
        print(line)
    failures = run_failures(report)
    for failure in failures:
        print(f"dpmp train: run failed: {failure}", file=sys.stderr)
    return 3 if failures else 0


def _inventory(run_dir) -> list[str]:
    from dpmp.app.release import inventory_lines

    return inventory_lines(run_dir)


def _fmt(value, spec=".4g"):
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _summary(report: dict) -> str:
    """The report's public numbers as a table, and whether the run is private."""
    overflow = report.get("overflow", {}) or {}
    audit = report.get("audit", {}) or {}
    standardize = report.get("standardize") or {}
    rows = [
        ("policy", report.get("policy")),
        (
            "model",
            (report.get("model") or {}).get("kind")
            if isinstance(report.get("model"), dict)
            else report.get("model"),
        ),
        ("steps", report.get("steps")),
        ("test accuracy", _fmt(report.get("test_accuracy"))),
        ("test perplexity", _fmt(report.get("test_perplexity"))),
        ("epsilon", f"{_fmt(report.get('epsilon'))} (delta {_fmt(report.get('delta'))})"),
        ("noise multiplier", _fmt(report.get("noise_multiplier"))),
        ("noised overflow total", _fmt(overflow.get("noised_count_total"))),
        ("loss-scale cost (epsilon)", _fmt(overflow.get("epsilon_cost"))),
        ("standardize", standardize.get("mode", "-")),
        ("audit", "ok" if audit.get("ok") else ("FAILED" if audit else "-")),
    ]
    if standardize.get("epsilon_cost") is not None:
        rows.append(("standardize cost (epsilon)", _fmt(standardize["epsilon_cost"])))
    start = report.get("starting_point")
    if isinstance(start, dict):
        text = start.get("source", "-")
        if start.get("public_test_perplexity") is not None:
            text += (
                f": {start.get('steps')} steps, held-out public perplexity "
                f"{_fmt(start['public_test_perplexity'], '.2f')}"
            )
        rows.append(("started from", text))
        rows.append(("trained parameters", f"{report.get('num_params'):,}"))
    if report.get("private") is True:
        rows.append(("private", "yes (differentially private; zero-out neighbours)"))
    elif report.get("private") is False:
        rows.append(("private", "NO: this run is NOT differentially private"))
        for warning in report.get("privacy_warnings") or []:
            rows.append(("privacy warning", warning))
    if report.get("stopped_early"):
        rows.append(("stopped early", report["stopped_early"]))
    if overflow.get("privacy"):
        rows.append(("loss-scale privacy", overflow["privacy"]))
    note = (report.get("sampling") or {}) if isinstance(report.get("sampling"), dict) else {}
    if note.get("privacy_note"):
        rows.append(("privacy note", note["privacy_note"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- audit -------------------------------------------------------------------------
def _integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer (``1,000,000`` and ``1_000_000`` too) in
    ``[low, high]`` (no upper bound when ``high`` is None)."""

    def parse(text: str) -> int:
        try:
            n = int(text.replace(",", "").replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if high is None and n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        if high is not None and not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {n}")
        return n

    return parse


def _cmd_audit(args) -> int:
    from dpmp.app.trainer import audit_step, privacy_audit_step

    _check_audit_options(args)
    if args.run:
        return _audit_run(args)
    if args.privacy:
        releases = 1_000_000 if args.releases is None else args.releases
        report = privacy_audit_step(_load(args), num_releases=releases)
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report)
        return 0 if report.ok else 1
    report = audit_step(_load(args))
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


def _check_audit_options(args) -> None:
    """Usage errors of ``dpmp audit``: options of one audit given to another."""
    if args.run and args.privacy:
        raise _UsageError(
            "--run and --privacy: choose one (a whole run with canaries, or one step's noise)"
        )
    if args.releases is not None and not args.privacy:
        raise _UsageError("--releases: applies to --privacy only")
    if not args.run:
        for option, name in _RUN_OPTIONS:
            if getattr(args, name) not in (None, False):
                raise _UsageError(f"{option}: applies to --run only")
        return
    if args.guesses is not None:
        canaries = args.canaries or _default_canaries()
        if args.guesses > canaries:
            raise _UsageError(
                f"--guesses: {args.guesses} exceeds the {canaries} canaries (--canaries)"
            )
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise _UsageError(f"--out: {args.out!r} exists and is not a directory")


def _default_canaries() -> int:
    from dpmp.app.audit_run import DEFAULT_CANARIES

    return DEFAULT_CANARIES


def _audit_run(args) -> int:
    """``dpmp audit --run``: one training with canaries, its epsilon lower bound."""
    from dpmp.app.audit_run import audit_run

    report = audit_run(
        _load(args),
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


# ---- compare -----------------------------------------------------------------------
def _cmd_compare(args) -> int:
    from dpmp.app.trainer.compare import compare, format_table

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise _UsageError("--policies: give at least one policy, e.g. fp32,bf16")
    rows = compare(
        _load(args),
        policies=policies,
        repeats=args.repeats,
        progress=lambda line: print(f"dpmp compare: {line}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows))
    return 0


# ---- budget ------------------------------------------------------------------------
def _cmd_budget(args) -> int:
    from dpmp import accounting

    q = args.sampling_prob
    if q is not None and (args.batch_size is not None or args.num_examples is not None):
        raise _UsageError(
            "give --sampling-prob, or --batch-size and --num-examples, not both "
            "(the sampling probability is batch size / number of examples)"
        )
    if q is None:
        if args.batch_size is None or args.num_examples is None:
            raise _UsageError("give --sampling-prob, or --batch-size and --num-examples")
        if args.num_examples <= 0:
            raise _UsageError(f"--num-examples: must be > 0, got {args.num_examples}")
        q = args.batch_size / args.num_examples
    if (args.params is None) == (not args.exact_gaussian):
        raise _UsageError(
            "give --params N (the trainable parameters noised each step: the snapped "
            "noise's residual is accounted) or --exact-gaussian (an idealised exact "
            "sampler), exactly one"
        )
    if args.params is not None and args.params < 1:
        raise _UsageError(f"--params: must be >= 1, got {args.params}")
    common = dict(
        sampling_prob=q,
        delta=args.delta,
        accountant=args.accountant,
        count_noise_stddev=args.count_noise_stddev,
        noised_coordinates=args.params,
    )
    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        raise _UsageError("give exactly one of --noise-multiplier or --target-epsilon")
    if args.noise_multiplier is not None:
        if args.steps is None:
            raise _UsageError("--steps is required with --noise-multiplier")
        br = accounting.epsilon_breakdown(
            noise_multiplier=args.noise_multiplier, steps=args.steps, **common
        )
        result = {
            "epsilon": br.total,
            "epsilon_dpsgd": br.dpsgd,
            "epsilon_counts": br.counts,
            "epsilon_noise_residual": br.noise_residual,
            "noise_multiplier": args.noise_multiplier,
            "steps": args.steps,
        }
    else:
        if args.steps is None:
            raise _UsageError("--steps is required with --target-epsilon")
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=args.target_epsilon, steps=args.steps, **common
        )
        eps = accounting.epsilon(noise_multiplier=sigma, steps=args.steps, **common)
        result = {
            "noise_multiplier": sigma,
            "epsilon": eps,
            "target_epsilon": args.target_epsilon,
            "steps": args.steps,
        }
    result.update(
        sampling_prob=q,
        delta=args.delta,
        accountant=args.accountant,
        noised_coordinates=args.params,
        noise="exact Gaussian (idealised)" if args.exact_gaussian else "snapped (dpmp's)",
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:<{width}}  {_fmt(v, '.6g')}")
    return 0


# ---- report ------------------------------------------------------------------------
def _cmd_report(args) -> int:
    from dpmp.app.plots import plot_run

    run = Path(args.run_dir)
    path = run / "report.json"
    if not run.is_dir():
        raise _UsageError(f"no such run directory {args.run_dir!r}")
    if not path.is_file():
        raise _UsageError(
            f"{path} not found (the run has not finished; metrics.jsonl holds "
            "what it logged so far)"
        )
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _UsageError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(report, dict):
        raise _UsageError(f"{path}: expected a JSON object (a dpmp run report), got {report!r:.60}")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(_summary(report))
    for p in plot_run(run):
        print(f"plot: {p}")
    for line in _inventory(run):
        print(line)
    return 0


# ---- parser ------------------------------------------------------------------------
def _version() -> str:
    """The installed version, from the package metadata."""
    from importlib import metadata

    try:
        return metadata.version("dpmp")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree, not installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpmp",
        description="Differentially private training in JAX with precision controls.",
    )
    parser.add_argument("--version", action="version", version=f"dpmp {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "train",
        help="train a private model from a config",
        description="Train a private model. With no arguments: a private MLP on the "
        "handwritten digits data in bf16 at epsilon 2, delta 1e-5.",
    )
    _add_config_args(p)
    p.add_argument("--out", default="runs/default", metavar="RUN_DIR", help="run directory")
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
    d.add_argument("--num-processes", type=_integer(1, 65536), metavar="N", help="processes in all")
    d.add_argument(
        "--process-id", type=_integer(0, 65535), metavar="I", help="this process's index"
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "audit",
        help="audit a config: its step's precision, its noise, or a whole run's privacy",
        description="Trace the private step a config would train with and report, for "
        "every batch reduction, norm, all-reduce, noise sample, noise addition and "
        "update, the dtype it runs in. Exit status 1 on a violation. With --privacy, "
        "the empirical audit of one step's noise; with --run, of a whole training run.",
    )
    _add_config_args(p)
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
        type=_integer(100),
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
        type=_integer(10),
        metavar="M",
        help="canaries, each in the training set with probability 1/2 (default 1,000)",
    )
    r.add_argument(
        "--guesses",
        type=_integer(1),
        metavar="K",
        help="guesses: K/2 'in' on the highest scores, the rest 'out' on the lowest (default M/5)",
    )
    r.add_argument(
        "--out",
        metavar="DIR",
        help="also write DIR/audit.json and DIR/canaries.npz (inputs, labels, membership, scores)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser(
        "compare",
        help="fp32, bf16 and fp16 side by side: memory and time, private and not",
        description="For a config, build its step under each policy three ways "
        "(non-private, clipped without noise, private) and print parameter bytes, "
        "optimizer state bytes, compiled temporary memory and step time, and the share "
        "of the private step spent in clipping and in noise. Prints no value computed "
        "from the data.",
    )
    _add_config_args(p)
    p.add_argument(
        "--policies",
        default="fp32,bf16,fp16",
        help="comma-separated policies (default: fp32,bf16,fp16)",
    )
    p.add_argument(
        "--repeats", type=_integer(1, 100), default=5, help="timed samples per step (default 5)"
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "budget",
        help="epsilon for a plan, or the noise multiplier for a target epsilon",
        description="With --noise-multiplier: the epsilon the plan spends. With "
        "--target-epsilon: the noise multiplier that spends exactly that. --params N "
        "accounts dpmp's snapped noise on N parameters (its residual included).",
    )
    p.add_argument("--noise-multiplier", type=float, metavar="SIGMA")
    p.add_argument("--target-epsilon", type=float, metavar="EPS")
    p.add_argument("--steps", type=int, metavar="N")
    p.add_argument("--sampling-prob", type=float, metavar="Q")
    p.add_argument("--batch-size", type=int, metavar="B", help="expected batch size")
    p.add_argument("--num-examples", type=int, metavar="N")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--accountant", choices=sorted(accountant_names()), default="pld")
    p.add_argument(
        "--count-noise-stddev",
        type=float,
        metavar="S",
        help="include a noised overflow count released every step (private dynamic loss scale)",
    )
    p.add_argument(
        "--params",
        type=int,
        metavar="N",
        help="trainable parameters (coordinates noised each step): the snapped noise's "
        "floating-point residual is accounted for them",
    )
    p.add_argument(
        "--exact-gaussian",
        action="store_true",
        help="account an exact Gaussian sampler instead (an idealisation: no residual)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_budget)

    p = sub.add_parser(
        "report",
        help="summary table and plots of a finished run",
        description="Print a run's summary, (re)write its plots and say which of its "
        "files are safe to publish.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print report.json")
    p.set_defaults(func=_cmd_report)
    return parser


# What each command imports, loaded up front with Ctrl-C held (see _import_all).
_IMPORTS = {
    "train": ("jax", "dpmp.app.trainer", "dpmp.app.release", "dpmp.app.plots", "matplotlib"),
    "audit": ("jax", "dpmp.app.trainer", "dpmp.audit._precision", "dpmp.app.audit_run"),
    "budget": ("dpmp.accounting._functions",),
    "compare": ("jax", "dpmp.app.trainer.compare"),
    "report": ("dpmp.app.release", "dpmp.app.plots", "matplotlib"),
}


def _distributed(args) -> dict | None:
    """The ``jax.distributed.initialize`` arguments ``dpmp train`` was given, or None."""
    given = {
        "coordinator": getattr(args, "coordinator", None),
        "num_processes": getattr(args, "num_processes", None),
        "process_id": getattr(args, "process_id", None),
    }
    if not getattr(args, "distributed", False) and all(v is None for v in given.values()):
        return None
    if given["process_id"] is not None and given["num_processes"] is not None:
        if given["process_id"] >= given["num_processes"]:
            raise _UsageError(
                f"--process-id: {given['process_id']} is not below --num-processes "
                f"{given['num_processes']}"
            )
    return given


def _import_all(modules, distributed: dict | None = None) -> None:
    """Imports ``modules`` with Ctrl-C held until they are loaded, then raises it.

    A KeyboardInterrupt raised inside a native extension's initialisation
    (jaxlib's) leaves it half-loaded: the interpreter reported an ImportError
    traceback, or lost the interrupt altogether and trained on. Importing is a
    second or two, so holding Ctrl-C that long is the safe way to stop there.
    """
    if threading.current_thread() is not threading.main_thread():
        for name in modules:
            importlib.import_module(name)
        _join(distributed)
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        for name in modules:
            importlib.import_module(name)
        _join(distributed)  # before the backend starts
        if "jax" in modules:
            sys.modules["jax"].devices()  # the backend's own start-up, also native
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def _join(distributed: dict | None) -> None:
    if distributed is not None:
        from dpmp.app.trainer.mesh import initialize

        try:
            initialize(**distributed, named="--coordinator, --num-processes and --process-id")
        except ValueError as e:
            raise _UsageError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _import_all(_IMPORTS.get(args.command, ()), _distributed(args))
        return args.func(args)
    except KeyboardInterrupt as e:
        # A run stopped between steps says where its checkpoint is (RunInterrupted).
        print(f"dpmp {args.command}: {e or 'interrupted'}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) closed the pipe: stop quietly, as Unix tools do
        # (status 128 + SIGPIPE); point stdout at /dev/null so the exit flush is silent.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (_UsageError, ValueError, OSError) as e:
        # ConfigError, DataError, PrecisionError, CheckpointError and accounting errors
        # are ValueErrors whose messages name the field and the allowed values; an
        # OSError names the path it could not read or write. DPMP_DEBUG=1 re-raises.
        if os.environ.get("DPMP_DEBUG"):
            raise
        print(f"dpmp {args.command}: error: {e}", file=sys.stderr)
        return 2


def console() -> int:
    """The ``dpmp`` console script: :func:`main`, leaving at once after Ctrl-C.

    After an interrupt the run has already unwound (checkpoint saved, files
    closed, lock released), but XLA's compiler threads may still be at work, and
    tearing the interpreter down under them crashed it (SIGSEGV instead of 130).
    """
    status = main()
    if status == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return status


if __name__ == "__main__":
    raise SystemExit(console())
