"""``dpmp generate``: continue a prompt with a finished GPT-2 run's trained model."""

from __future__ import annotations

import argparse

from dpmp.app.cli.command import Command, integer

__all__ = ["COMMAND"]


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=integer(0, 1_000_000),
        default=20,
        metavar="N",
        help="tokens to add (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        metavar="T",
        help="0: the most likely token each time (default); above 0: sampled from "
        "softmax(logits / T)",
    )
    p.add_argument(
        "--seed", type=integer(0, 2**32 - 1), default=0, metavar="S", help="seeds the sampling"
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="the run's GPT-2 checkpoint folder, if not where its model.checkpoint says",
    )


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.generate import generate_from_run

    text = generate_from_run(
        args.run_dir,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        checkpoint=args.checkpoint,
    )
    print(text)
    return 0


COMMAND = Command(
    name="generate",
    help="continue a prompt with a finished GPT-2 run's trained model",
    description="Load the trained parameters of a finished run of model.kind = 'gpt2' "
    "(RUN_DIR/params.npz if it was exported, else its newest checkpoint) over its "
    "checkpoint folder, and print the prompt followed by the generated text. It reads "
    "released parameters only and spends no epsilon.",
    add_arguments=_arguments,
    run=_run,
    imports=("jax", "dpmp.app.generate"),
)
