"""Private fine-tuning steps of Llama, Qwen2 and Gemma at published sizes, against
non-private ones: compiled memory, compile time and (where asked) step time.

Each model is a random checkpoint of a published model's sizes, written in the
Hugging Face layout (``save_decoder``, bfloat16 as those checkpoints are
stored, a word-level ``tokenizer.json`` of 1,000 words) with a synthetic text
file, in a temporary folder; the steps are those ``configs/gpt2_lora.toml``
trains with (bf16 policy, Adam), built by ``build_private_step`` with
``model.kind`` the family, ``data.seq_len = --tokens`` and a batch of exactly
``--batch`` records (``privacy.sampling = "shuffle"``: a Poisson run's step is
the same program at its padded batch size). Rows: ``lora`` (rank-8 adapters on
the attention and MLP projections over the frozen base, an argument of the
step) and ``full`` (``model.lora_rank = 0``: every parameter trained; it holds
float32 parameters and Adam's two moments, 12 bytes a parameter, so it needs
memory: ``--rows full`` is opt-in). Each as the private step (clipping with
``clip_method = "auto"``, snapped noise, Adam) and the non-private one
(``jax.grad`` of the batch's mean loss, Adam), compiled for the arguments'
shapes (the non-private optimizer state never allocated), never run unless
``--time N``: StableHLO text size, lower and compile times (the least of
``--rounds`` cold compiles taken in turns; wall and process CPU seconds),
XLA's compiled memory (arguments + outputs + temporaries - aliases,
``memory_analysis``) and the private / non-private ratios.

The sizes (each model's published ``config.json``):

- ``llama``: Llama-3.2-1B (meta-llama/Llama-3.2-1B): 16 layers, width 2,048, MLP
  8,192, 32 query / 8 key-value heads of 64, vocabulary 128,256, tied
  embeddings, Llama 3 rotary scaling (factor 32).
- ``qwen2``: Qwen2.5-0.5B (Qwen/Qwen2.5-0.5B): 24 layers, width 896, MLP 4,864,
  14 query / 2 key-value heads of 64, vocabulary 151,936, tied, q/k/v biases.
- ``gemma``: Gemma-3-1B's sizes (google/gemma-3-1b-pt: 26 layers, width 1,152,
  MLP 6,912, 4 query / 1 key-value heads of 256, vocabulary 262,144, tied,
  GeGLU) in the Gemma architecture dpmp reads (``model_type = "gemma"``:
  global attention in every layer, no query/key norms, no sliding window),
  so the same matrices and the same arithmetic a token, not Gemma 3 itself.

Run: ``python benchmarks/llm_families.py [--families llama qwen2 gemma]
[--rows lora] [--batch 4] [--tokens 128] [--rounds 1] [--time N] [--set
KEY=VALUE] [--note TEXT] [--json FILE]``; prints one JSON line per step and
the ratios of each row; ``--json`` writes them with the command, the device
and the versions. Nothing is downloaded.
"""

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from _compiled import (
    compile_stats,
    least_compile_times,
    median_times,
    pair_ratios,
    step_facts,
    step_pair,
)
from tokenizers import Tokenizer, models, pre_tokenizers

from dpmp.app.config import load_config
from dpmp.app.trainer import build_private_step
from dpmp.models._hf_checkpoint import save_decoder
from dpmp.models._params_file import nest
from dpmp.models.families._decoder import DecoderConfig

CONFIG = "configs/gpt2_lora.toml"
ROWS = {"lora": [], "full": ["model.lora_rank=0"]}
WORDS = ["[UNK]", "<pad>"] + [f"w{i}" for i in range(998)]
RECORDS = 64  # records in the text file (a test split is taken from them)

SHAPES = {
    "llama": DecoderConfig(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "qwen2": DecoderConfig(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    "gemma": DecoderConfig(
        model_type="gemma",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        scale_embedding=True,
        norm_offset=True,
    ),
}


def random_params(config: DecoderConfig, seed: int = 0):
    """Parameters of ``config``'s shapes in bfloat16, N(0, 0.02^2) (norm scales
    around their identity), drawn leaf by leaf in NumPy (no float32 copy of the
    whole model)."""
    rng = np.random.default_rng(seed)

    def one(name: str, shape: tuple[int, ...]) -> np.ndarray:
        values = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        if name.endswith(".scale") and not config.norm_offset:
            values += 1.0
        return values.astype(ml_dtypes.bfloat16)

    return nest({name: one(name, shape) for name, shape in config.shapes().items()})


def write_inputs(folder: Path, family: str, tokens: int) -> tuple[Path, Path]:
    """A random checkpoint folder of ``family``'s published sizes and a text file of
    records longer than ``tokens`` words."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    config = SHAPES[family]
    checkpoint = save_decoder(folder / family, random_params(config), config, tokenizer)
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS[2:], tokens + 8)) for _ in range(RECORDS)]
    text = folder / "text.txt"
    text.write_text("\n".join(lines) + "\n")
    return checkpoint, text


def steps(family, row, checkpoint, text, batch, tokens, sets=()):
    """``(step_pair(step), facts)`` of one family's row."""
    config = load_config(
        CONFIG,
        [
            f'model.kind="{family}"',
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
    jax.clear_caches()  # the programs that made the starting parameters
    facts = {"family": family, "row": row, **step_facts(step, config, tokens)}
    return step_pair(step, config), facts


def measure(family: str, row: str, tmp: Path, args) -> tuple[list[dict], dict]:
    """The rows of one family's steps and their ratios."""
    checkpoint, text = write_inputs(tmp, family, args.tokens)
    fns, facts = steps(family, row, checkpoint, text, args.batch, args.tokens, args.set)
    by_step, calls, given = {}, {}, {}
    for kind, (fn, make_args) in fns.items():
        # compiled for the arguments' shapes alone unless timed: the non-private Adam
        # state of a full fine-tune is never allocated
        given[kind] = (fn, make_args() if args.time else jax.eval_shape(make_args))
        compiled, stats = compile_stats(*given[kind])
        calls[kind] = (compiled, given[kind][1])
        by_step[kind] = {**facts, "step": kind, **stats}
    least_compile_times(given, by_step, args.rounds - 1)
    if args.time:
        for kind, seconds in median_times(calls, args.time).items():
            by_step[kind]["step_s"] = seconds
    del fns, calls, given
    gc.collect()
    summary = {"family": family, "row": row, "clip_method": facts["clip_method"]}
    private, base = by_step["private"], by_step["non-private"]
    cpu = round(private["compile_cpu_s"] / base["compile_cpu_s"], 2)
    ratios = {**pair_ratios(by_step), "compile_cpu_ratio": cpu}
    return list(by_step.values()), {**summary, **ratios}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=["lora"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--time", type=int, default=0, help="timed calls per step (0: none)")
    parser.add_argument("--rounds", type=int, default=1, help="cold compiles of each step")
    parser.add_argument("--set", action="append", default=[], help="config override, every row")
    parser.add_argument("--note", default="")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batch < 1 or args.tokens < 2:
        parser.error("--rounds and --batch must be at least 1 and --tokens at least 2")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    rows, summary = [], []
    for family in args.families:
        for row in args.rows:
            with tempfile.TemporaryDirectory() as tmp:
                measured, ratio = measure(family, row, Path(tmp), args)
            for r in measured:
                print(json.dumps(r), flush=True)
            print(json.dumps(ratio), flush=True)
            rows += measured
            summary.append(ratio)
    result = {
        "benchmark": "llm_families",
        "command": shlex.join(["python", "benchmarks/llm_families.py", *sys.argv[1:]]),
        "note": args.note,
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "shapes": {
            f: {"params": sum(int(np.prod(s)) for s in SHAPES[f].shapes().values())}
            for f in args.families
        },
        "rows": rows,
        "ratios": summary,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
