"""Private LoRA fine-tuning of a published GPT-2 checkpoint on your own text.

``--model DIR`` is a GPT-2 checkpoint folder in the layout its publishers use
(``config.json``, ``model.safetensors``, ``tokenizer.json``; the hub's
``gpt2`` folder, downloaded by you). Its parameters are public and
pre-trained: the run starts from them at no cost in epsilon and keeps them
frozen, training rank-8 low-rank adapters with DP-SGD (bf16 compute, the
parameters and the noise in float32) on the records of ``--text`` (``.txt``,
one record per line, or ``.jsonl``, ``{"text": ...}`` per line), encoded by
the checkpoint's tokenizer. A record is the privacy unit.

It writes the usual run directory (``--out``: ``report.json`` with the
held-out perplexity, ``metrics.jsonl``, the log, the plots) and prints a
continuation of a prompt before and after fine-tuning. The prompt is public
text (``--prompt``, default below), never a private record: what the model
generates after fine-tuning is as private as its parameters.

Expected output (its shape; the figures depend on the checkpoint and the text,
and the noise and the batches are fresh and secret each run):

    checkpoint: GPT-2 12 layers width 768 heads 12 (124,439,808 parameters)
    before: The meaning of the word ...
    private LoRA: 1,179,648 trainable parameters over 12 layers, epsilon 8.000 (delta 1e-05)
    held-out perplexity P on N test records
    after: The meaning of the word ...

(The parameter counts are those of the published 124M GPT-2 at LoRA rank 8;
no published checkpoint can be downloaded where dpmp is tested, so the
perplexity was not measured there: the smoke test runs a tiny random one.)

Run: ``python examples/gpt2_lora.py --model DIR --text FILE [--steps N] [--epsilon E]
[--prompt TEXT] [--out DIR]``
"""

import argparse
import json
from pathlib import Path

import jax

import dpmp
from dpmp.app.generate import load_trained
from dpmp.models import generate_text, load_gpt2

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "gpt2_lora.toml"
PROMPT = "The meaning of the word"  # public text, not a record


def continuation(loaded, prompt: str, most: int = 20) -> str:
    """``prompt`` and up to ``most`` greedy tokens after it."""
    room = loaded.config.n_positions - len(loaded.tokenizer.encode(prompt).ids)
    return generate_text(loaded, prompt, max_new_tokens=max(0, min(most, room)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, metavar="DIR", help="GPT-2 checkpoint folder")
    parser.add_argument("--text", required=True, metavar="FILE", help="private .txt or .jsonl")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--batch-size", type=int, default=64, help="expected batch size")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per record")
    parser.add_argument("--prompt", default=PROMPT, help="public text to continue")
    parser.add_argument("--out", default="runs/gpt2_lora")
    args = parser.parse_args()
    config = dpmp.load_config(
        CONFIG,
        [
            f"model.checkpoint={json.dumps(args.model)}",
            f"data.path={json.dumps(args.text)}",
            f"data.seq_len={args.seq_len}",
            f"training.steps={args.steps}",
            f"training.expected_batch_size={args.batch_size}",
            f"privacy.target_epsilon={args.epsilon}",
        ],
    )
    base = load_gpt2(args.model, config.policy)
    count = sum(x.size for x in jax.tree.leaves(base.params))
    print(f"checkpoint: {base.model.name} ({count:,} parameters)")
    print(f"before: {continuation(base, args.prompt)}")
    report = dpmp.train(config, out_dir=args.out, resume=False, progress=False)
    print(
        f"private LoRA: {report['num_params']:,} trainable parameters over "
        f"{base.config.n_layer} layers, epsilon {report['epsilon']:.3f} "
        f"(delta {report['delta']:g})"
    )
    print(
        f"held-out perplexity {report['test_perplexity']:.2f} on "
        f"{report['data']['num_test']} test records"
    )
    print(f"after: {continuation(load_trained(args.out, args.model), args.prompt)}")


if __name__ == "__main__":
    main()
