"""``dpmp budget``: the epsilon a plan spends, or the noise multiplier for a target.

Both go through ``dpmp.accounting``, as a run's own accounting does: the
DP-SGD steps (or, with ``--bands``, amplified banded matrix factorization's
rounds), a noised overflow count when one is released, and the residual of
dpmp's snapped noise on ``--params`` coordinates.
"""

from __future__ import annotations

import argparse
import json

from dpmp.app.cli.command import Command, LibraryChoices, UsageError
from dpmp.app.cli.summary import fmt

__all__ = ["COMMAND"]


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--noise-multiplier",
        type=float,
        metavar="SIGMA",
        help="the gradient noise's stddev / the clip norm: print the epsilon it spends",
    )
    p.add_argument(
        "--target-epsilon",
        type=float,
        metavar="EPS",
        help="print the noise multiplier that spends exactly EPS (give this or --noise-multiplier)",
    )
    p.add_argument("--steps", type=int, metavar="N", help="training steps (one release each)")
    p.add_argument(
        "--sampling-prob",
        type=float,
        metavar="Q",
        help="Poisson sampling probability per example and step (or --batch-size and "
        "--num-examples)",
    )
    p.add_argument(
        "--batch-size", type=int, metavar="B", help="expected batch size (with --num-examples)"
    )
    p.add_argument(
        "--num-examples", type=int, metavar="N", help="training records (with --batch-size)"
    )
    p.add_argument(
        "--delta", type=float, default=1e-5, help="the guarantee's delta (default: 1e-5)"
    )
    accountant = p.add_argument(
        "--accountant", default="pld", help="privacy accountant (default: pld)"
    )
    accountant.choices = LibraryChoices("dpmp.accounting", "ACCOUNTANTS")
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
    p.add_argument(
        "--records-per-user",
        type=int,
        default=1,
        metavar="K",
        help="user-level privacy with records sampled on their own (privacy.user_sampling = "
        '"records"): each user has at most K records, each Poisson-sampled at Q '
        "(default: 1, a record or a user sampled whole)",
    )
    p.add_argument(
        "--bands",
        type=int,
        default=1,
        metavar="B",
        help='amplified banded matrix factorization (privacy.mechanism = "banded_mf") '
        "with B bands on b-cyclic Poisson samples: Q is within a group, --batch-size "
        "over --num-examples // B records (default: 1, DP-SGD)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")


def _sampling_prob(args: argparse.Namespace) -> float:
    """``--sampling-prob``, or ``--batch-size / --num-examples``."""
    q = args.sampling_prob
    if q is not None and (args.batch_size is not None or args.num_examples is not None):
        raise UsageError(
            "give --sampling-prob, or --batch-size and --num-examples, not both "
            "(the sampling probability is batch size / number of examples)"
        )
    if q is None:
        if args.batch_size is None or args.num_examples is None:
            raise UsageError("give --sampling-prob, or --batch-size and --num-examples")
        if args.num_examples <= 0:
            raise UsageError(f"--num-examples: must be > 0, got {args.num_examples}")
        q = args.batch_size / (args.num_examples // args.bands or 1)  # one group's records
    return q


def _check_noise(args: argparse.Namespace) -> None:
    """Exactly one noise model (``--params`` or ``--exact-gaussian``)."""
    if (args.params is None) == (not args.exact_gaussian):
        raise UsageError(
            "give --params N (the trainable parameters noised each step: the snapped "
            "noise's residual is accounted) or --exact-gaussian (an idealised exact "
            "sampler), exactly one"
        )
    if args.params is not None and args.params < 1:
        raise UsageError(f"--params: must be >= 1, got {args.params}")


def _plan(args: argparse.Namespace, common: dict) -> dict:
    """The epsilon of ``--noise-multiplier``, or the calibrated noise multiplier of
    ``--target-epsilon``, over ``--steps``."""
    import dpmp.accounting as accounting

    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        raise UsageError("give exactly one of --noise-multiplier or --target-epsilon")
    if args.noise_multiplier is not None:
        if args.steps is None:
            raise UsageError("--steps is required with --noise-multiplier")
        br = accounting.epsilon(
            noise_multiplier=args.noise_multiplier, steps=args.steps, breakdown=True, **common
        )
        return {
            "epsilon": br.total,
            "epsilon_dpsgd": br.dpsgd,
            "epsilon_counts": br.counts,
            "epsilon_noise_residual": br.noise_residual,
            "noise_multiplier": args.noise_multiplier,
            "steps": args.steps,
        }
    if args.steps is None:
        raise UsageError("--steps is required with --target-epsilon")
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=args.target_epsilon, steps=args.steps, **common
    )
    eps = accounting.epsilon(noise_multiplier=sigma, steps=args.steps, **common)
    return {
        "noise_multiplier": sigma,
        "epsilon": eps,
        "target_epsilon": args.target_epsilon,
        "steps": args.steps,
    }


def _run(args: argparse.Namespace) -> int:
    if args.bands < 1 or (args.steps is not None and args.bands > max(args.steps, 1)):
        raise UsageError(f"--bands: must be in [1, --steps], got {args.bands}")
    if args.bands > 1 and args.records_per_user > 1:
        raise UsageError(
            "--records-per-user: k records per user are accounted for DP-SGD steps, "
            "not with --bands > 1 (banded matrix factorization)"
        )
    q = _sampling_prob(args)
    _check_noise(args)
    if args.records_per_user < 1:
        raise UsageError(f"--records-per-user: must be >= 1, got {args.records_per_user}")
    common = dict(
        sampling_prob=q,
        delta=args.delta,
        accountant=args.accountant,
        count_noise_stddev=args.count_noise_stddev,
        noised_coordinates=args.params,
        records_per_unit=args.records_per_user,
        bands=args.bands,
    )
    result = _plan(args, common)
    result.update(
        sampling_prob=q,
        delta=args.delta,
        accountant=args.accountant,
        noised_coordinates=args.params,
        records_per_user=args.records_per_user,
        bands=args.bands,
        noise="exact Gaussian (idealised)" if args.exact_gaussian else "snapped (dpmp's)",
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(len(k) for k in result)
        for k, v in result.items():
            print(f"{k:<{width}}  {fmt(v, '.6g')}")
    return 0


COMMAND = Command(
    name="budget",
    help="epsilon for a plan, or the noise multiplier for a target epsilon",
    description="With --noise-multiplier: the epsilon the plan spends. With "
    "--target-epsilon: the noise multiplier that spends exactly that. --params N "
    "accounts dpmp's snapped noise on N parameters (its residual included).",
    add_arguments=_arguments,
    run=_run,
    imports=("dpmp.accounting",),
)
