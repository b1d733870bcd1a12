"""Private GPT-2-small fine-tuning steps against non-private ones.

A random GPT-2 of the published small model's sizes and layout (124,439,808
parameters, float32, written with ``save_gpt2`` with a word-level
``tokenizer.json``) and a synthetic text file go to a temporary folder; the
steps are those ``configs/gpt2_lora.toml`` trains with (bf16 policy), built by
``build_private_step`` from that config with the folder and the file set,
``data.seq_len = --tokens`` and a batch of exactly ``--batch`` records
(``privacy.sampling = "shuffle"``: a Poisson run's step is the same program at
its padded batch size). Rows: ``lora`` (the config's rank-8 adapters over the
frozen base, an argument of the step) and ``full`` (``model.lora_rank = 0``:
every parameter trained), each as the private step (clipping with the
config's ``clip_method = "auto"``, noise, Adam) and the non-private one
(``jax.grad`` of the batch's mean loss, Adam).

For each step: its StableHLO text size, lower and compile times (the least of
``--rounds`` compiles from cold caches, the row's steps in turn), XLA's
compiled memory (arguments + outputs + temporaries - aliases,
``memory_analysis``), its temporaries and, with ``--time N``, the median of N
calls after a warm-up (the row's two steps called in turns, so that a slow
spell of a shared machine falls on both); then per row the private /
non-private ratios of time, compiled memory and compile time, and the clip
method ``auto`` chose with its reason. Nothing but ``--time`` runs a step
(``--time-rows`` names the rows it runs; the others are compiled only).
``--set`` overrides the config for every row (``--set
privacy.clip_method="vmap"``). Batch 2 by default: with per-example gradients
(``vmap``) full fine-tuning's private step holds a gradient of every parameter
for each example (7.6 GB compiled at batch 4).

Run: ``python benchmarks/gpt2.py [--rows lora full] [--batch 2] [--tokens 128]
[--time 5] [--rounds 3] [--time-rows lora] [--set KEY=VALUE] [--note TEXT]
[--json FILE]``; prints one JSON line per step, then the ratios of each row;
``--json`` writes them with the command, the device and the versions. Nothing
is downloaded.
"""

import argparse
import dataclasses
import gc
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from _compiled import (  # benchmarks/_compiled.py
    compile_stats,
    least_compile_times,
    median_times,
    pair_ratios,
    step_facts,
    step_pair,
)
from gpt2_checkpoint import SMALL  # benchmarks/gpt2_checkpoint.py
from tokenizers import Tokenizer, models, pre_tokenizers

from dpmp.app.config import load_config
from dpmp.app.trainer import build_private_step
from dpmp.models import save_gpt2
from dpmp.models._model import count_params
from dpmp.models.families._gpt2 import gpt2_init

CONFIG = "configs/gpt2_lora.toml"
ROWS = {"lora": [], "full": ["model.lora_rank=0"]}
WORDS = ["[UNK]", "<pad>"] + [f"w{i}" for i in range(998)]
RECORDS = 64  # records in the text file (a test split is taken from them)


def write_inputs(folder: Path, tokens: int) -> tuple[Path, Path]:
    """A random GPT-2-small checkpoint folder and a text file of records longer
    than ``tokens`` words."""
    params = jax.jit(gpt2_init, static_argnums=0)(SMALL, jax.random.key(0))
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    checkpoint = save_gpt2(folder / "gpt2-small", params, SMALL, tokenizer)
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS[2:], tokens + 8)) for _ in range(RECORDS)]
    text = folder / "text.txt"
    text.write_text("\n".join(lines) + "\n")
    return checkpoint, text


def steps(row: str, checkpoint: Path, text: Path, batch: int, tokens: int, sets=()):
    """``(step_pair(step), facts)`` of one row: each step with a maker of its arguments."""
    config = load_config(
        CONFIG,
        [
            f'model.checkpoint="{checkpoint}"',
            f'data.path="{text}"',
            f"data.seq_len={tokens}",
            f"training.expected_batch_size={batch}",
            'privacy.sampling="shuffle"',
            *ROWS[row],
            *sets,
        ],
    )
    step = build_private_step(config)
    jax.clear_caches()  # the program that made the starting parameters (their copy inside)
    facts = {"row": row, **step_facts(step, config, tokens)}
    return step_pair(step, config), facts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--time", type=int, default=0, help="timed calls per step (0: none)")
    parser.add_argument(
        "--time-rows",
        nargs="+",
        choices=sorted(ROWS),
        default=None,
        help="rows whose steps --time runs (default: every row)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="cold compiles of each step, in turn (least kept)"
    )
    parser.add_argument("--set", action="append", default=[], help="config override, every row")
    parser.add_argument("--note", default="", help="a note for the JSON")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    timed = set(args.rows if args.time_rows is None else args.time_rows)
    rows, summary = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, text = write_inputs(Path(tmp), args.tokens)
        for name in args.rows:
            fns, facts = steps(name, checkpoint, text, args.batch, args.tokens, args.set)
            by_step, calls, given = {}, {}, {}
            for kind, (fn, make_args) in fns.items():
                given[kind] = (fn, make_args())
                compiled, stats = compile_stats(*given[kind])
                calls[kind] = (compiled, given[kind][1])
                by_step[kind] = {**facts, "step": kind, **stats}
            least_compile_times(given, by_step, args.rounds - 1)
            if args.time and name in timed:
                for kind, seconds in median_times(calls, args.time).items():
                    by_step[kind]["step_s"] = seconds
            for row in by_step.values():
                print(json.dumps(row), flush=True)
                rows.append(row)
            del fns, calls, given  # the row's model, optimizer states and programs
            gc.collect()
            summary.append(
                {"row": name, "clip_method": facts["clip_method"], **pair_ratios(by_step)}
            )
            print(json.dumps(summary[-1]), flush=True)
    shapes = jax.eval_shape(lambda k: gpt2_init(SMALL, k), jax.random.key(0))
    result = {
        "benchmark": "gpt2",
        "command": shlex.join(["python", "benchmarks/gpt2.py", *sys.argv[1:]]),
        "note": args.note,
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "checkpoint": {"params": count_params(shapes), **dataclasses.asdict(SMALL)},
        "rows": rows,
        "ratios": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
