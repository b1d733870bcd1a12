"""``dpmp generate``: continue a prompt, or answer it as a user's chat message
(``--chat``), with a finished checkpoint run's trained model."""

from __future__ import annotations

import argparse
import sys

from dpmp.app.cli.command import Command, UsageError, integer

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
    p.add_argument(
        "--prompt",
        required=True,
        metavar="TEXT",
        help="the text to continue; with --chat, the user's message to answer",
    )
    p.add_argument(
        "--max-new-tokens",
        type=integer(0, 1_000_000),
        default=20,
        metavar="N",
        help="the most tokens to add; fewer when an end-of-sequence token is written "
        "(default: %(default)s)",
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
        help="the run's checkpoint folder, if not where its model.checkpoint says",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="prompt as the run's chat records were rendered: TEXT a user message in the "
        "checkpoint's chat template, followed by the assistant's header; print the reply "
        "alone, stopped at the template's end of turn or an end-of-sequence token",
    )
    p.add_argument(
        "--system", metavar="TEXT", help="with --chat: a system message before the user's"
    )


def _run(args: argparse.Namespace) -> int:
    from dpmp.app.generate import generate_from_run, run_config

    if args.system is not None and not args.chat:
        raise UsageError("--system: a system message is a chat message; it needs --chat")
    text = generate_from_run(
        args.run_dir,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        checkpoint=args.checkpoint,
        chat=args.chat,
        system=args.system,
    )
    print(text)
    if not args.chat and _renders_chat(run_config(args.run_dir).data.dataset):
        print(
            "dpmp generate: note: the run was trained on chat records; --chat prompts it "
            "as they were rendered and prints the reply alone",
            file=sys.stderr,
        )
    return 0


def _renders_chat(dataset: str) -> bool:
    """Whether the run's data source renders conversations by a chat template."""
    from dpmp.data.sources import SOURCES

    return bool(getattr(SOURCES.get(dataset), "renders_chat", False))


COMMAND = Command(
    name="generate",
    help="continue a prompt (or answer it, --chat) with a finished run's trained model",
    description="Load the trained parameters of a finished run of a checkpoint's model "
    "(model.kind = 'gpt2', 'llama', 'qwen2', 'gemma') (RUN_DIR/params.npz if it was "
    "exported, else its newest checkpoint) over its checkpoint folder, and print the "
    "prompt followed by the generated text; with --chat, the prompt as a user message "
    "in the checkpoint's chat template, and the reply alone. It reads released "
    "parameters only and spends no epsilon.",
    add_arguments=_arguments,
    run=_run,
    imports=("jax", "dpmp.app.generate"),
)
