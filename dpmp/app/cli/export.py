"""``dpmp export``: a finished run's parameters alone, or as a Hugging Face or PEFT
folder with its guarantee attached; and its secrets deleted."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpmp.app.cli.command import Command, UsageError

__all__ = ["COMMAND"]

_HF_ONLY = ("merge", "out", "checkpoint", "base_model", "force", "allow_not_private")


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument(
        "--format",
        choices=("npz", "hf"),
        default="npz",
        help="npz: the parameters alone in RUN_DIR/params.npz (default); hf: a Hugging "
        "Face folder (--merge) or a PEFT LoRA adapter, with privacy.json and a model card",
    )
    p.add_argument(
        "--to", metavar="PATH", help="where to write the parameters (default: RUN_DIR/params.npz)"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="hf: the fine-tuned weights, LoRA merged in, in the checkpoint's own layout "
        "(transformers.AutoModelForCausalLM loads it); without: a PEFT adapter",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="hf: the folder to write (default: RUN_DIR/hf or RUN_DIR/hf-merged)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="hf: the run's checkpoint folder, if not where model.checkpoint says",
    )
    p.add_argument(
        "--base-model",
        metavar="NAME",
        help="hf: the base model's name in adapter_config.json and the model card (e.g. its "
        "Hub id; default: the checkpoint folder's name)",
    )
    p.add_argument("--force", action="store_true", help="hf: replace an earlier export in DIR")
    p.add_argument(
        "--allow-not-private",
        action="store_true",
        help="hf: export a run whose report says it is NOT private (privacy.json says so)",
    )
    p.add_argument(
        "--delete-secrets",
        action="store_true",
        help="then delete RUN_DIR/checkpoints/ (noise keys, sampler seed, data fingerprint); "
        "the run can no longer be resumed",
    )


def _verdict(private: bool | None) -> str:
    if private is True:
        return "differentially private: safe to publish"
    if private is False:
        return "this run is NOT differentially private (report.json: privacy_warnings)"
    return "the run has not finished: no report.json says whether it is private"


def _hf(args: argparse.Namespace, run: Path) -> None:
    from dpmp.app.export import CHECKPOINTS_DIR, PARAMS_FILE, export_params
    from dpmp.app.export_hf import PRIVACY_FILE, export_hf

    if args.to is not None:
        raise UsageError("--to: the params.npz export's; with --format hf use --out DIR")
    out = export_hf(
        run,
        merge=args.merge,
        out=args.out,
        checkpoint=args.checkpoint,
        base_model=args.base_model,
        force=args.force,
        allow_not_private=args.allow_not_private,
    )
    what = "merged weights (transformers)" if args.merge else "LoRA adapter (peft)"
    print(f"{what}: {out} (the guarantee: {out / PRIVACY_FILE})")
    if args.delete_secrets and (run / CHECKPOINTS_DIR).is_dir():
        if not (run / PARAMS_FILE).is_file():  # the run keeps its parameters
            print(f"parameters: {export_params(run)}")


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.export import delete_secrets, export_params
    from dpmp.app.release import report_private

    run = Path(args.run_dir)
    if not run.is_dir():
        raise UsageError(f"no such run directory {args.run_dir!r}")
    if args.format == "hf":
        _hf(args, run)
    else:
        given = [n for n in _HF_ONLY if getattr(args, n) not in (None, False)]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')}: only with --format hf")
        dest = export_params(run, args.to)
        verdict = _verdict(report_private(run))
        print(f"parameters: {dest} ({verdict}); load with dpmp.load_params({str(dest)!r}, like)")
    if args.delete_secrets:
        deleted = delete_secrets(run)
        print(f"deleted: {', '.join(map(str, deleted)) or 'nothing (no checkpoints/)'}")
    return 0


COMMAND = Command(
    name="export",
    help="write a run's parameters alone, or as a Hugging Face / PEFT folder; "
    "optionally delete its secrets",
    description="Write the newest parameters of a run alone (no noise keys, no sampler "
    "seed, no data fingerprint) to RUN_DIR/params.npz; with --format hf, a run of a "
    "checkpoint's model (gpt2, llama, qwen2, gemma) as a folder transformers (--merge) or "
    "peft loads, with privacy.json (its epsilon, delta and how they were accounted) and a "
    "model card; with --delete-secrets, then delete the finished run's checkpoints/.",
    add_arguments=_arguments,
    run=_run,
    imports=("dpmp.app.export", "dpmp.app.export_hf", "dpmp.app.release"),
)
