"""Private LoRA fine-tuning of a Llama, Qwen2, Gemma or GPT-2 checkpoint on your own text.

``--model DIR`` is a Hugging Face checkpoint folder as published
(``config.json``, ``model.safetensors`` or its shards with
``model.safetensors.index.json``, ``tokenizer.json``; downloaded by you): its
``config.json``'s ``model_type`` (``llama``, ``qwen2``, ``gemma``, ``gpt2``)
picks the family. Its parameters are public and pre-trained: the run starts
from them at no cost in epsilon and keeps them frozen (in their stored dtype),
training rank-8 low-rank adapters on the attention and MLP projections with
DP-SGD and ghost clipping (bf16 compute; the adapters, norms, clipping, sum and
noise in float32). The records are ``--text`` (``.txt``, one record per line,
or ``.jsonl``, ``{"text": ...}`` per line) or, with ``--chat``, a ``.jsonl``
of conversations (``{"messages": [{"role": ..., "content": ...}, ...]}``
per line, rendered with the folder's ``chat_template``, the loss on the
assistant's tokens alone). A record, or a conversation, is the privacy unit.

It writes the usual run directory (``--out``: ``report.json`` with the
held-out perplexity, ``metrics.jsonl``, the log, the plots) and prints a
continuation of a prompt before and after fine-tuning. The prompt is public
text (``--prompt``), never a private record: what the model generates after
fine-tuning is as private as its adapters.

Expected output (its shape; the figures depend on the checkpoint and the
text, and the noise and the batches are fresh and secret each run):

    checkpoint: llama, 16 layers, width 2048 (1,235,814,400 parameters)
    before: The meaning of the word ...
    private LoRA: 5,636,096 trainable parameters over 16 layers, epsilon 8.000 (delta 1e-05)
    held-out perplexity P on N test records
    after: The meaning of the word ...

(The counts are those of Llama-3.2-1B's sizes at rank 8 on its seven
projections; no published checkpoint can be downloaded where dpmp is tested,
so the perplexity was not measured there: the smoke tests run tiny random
checkpoints of each family.)

Run: ``python examples/llm_lora.py --model DIR (--text FILE | --chat FILE) [--steps N]
[--epsilon E] [--prompt TEXT] [--out DIR]``
"""

import argparse
import json
from pathlib import Path

import jax

import dpmp
from dpmp.app.generate import load_trained
from dpmp.app.published import load_checkpoint
from dpmp.models import generate_text

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "gpt2_lora.toml"  # LoRA rank 8, Adam, bf16, epsilon 8
PROMPT = "The meaning of the word"  # public text, not a record


def sizes(config) -> tuple[int, int, int]:
    """Layers, width and longest sequence of a GPT-2 or a decoder config."""
    if hasattr(config, "n_layer"):
        return config.n_layer, config.n_embd, config.n_positions
    return config.num_hidden_layers, config.hidden_size, config.max_position_embeddings


def continuation(loaded, prompt: str, most: int = 20) -> str:
    """``prompt`` and up to ``most`` greedy tokens after it."""
    room = sizes(loaded.config)[2] - len(loaded.tokenizer.encode(prompt).ids)
    return generate_text(loaded, prompt, max_new_tokens=max(0, min(most, room)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint folder")
    records = parser.add_mutually_exclusive_group(required=True)
    records.add_argument("--text", metavar="FILE", help="private .txt or .jsonl records")
    records.add_argument("--chat", metavar="FILE", help="private .jsonl of conversations")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--batch-size", type=int, default=64, help="expected batch size")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per record")
    parser.add_argument("--prompt", default=PROMPT, help="public text to continue")
    parser.add_argument("--out", default="runs/llm_lora")
    args = parser.parse_args()
    kind = json.loads((Path(args.model) / "config.json").read_text())["model_type"]
    config = dpmp.load_config(
        CONFIG,
        [
            f"model.kind={json.dumps(kind)}",
            f"model.checkpoint={json.dumps(args.model)}",
            f"data.dataset={json.dumps('chat' if args.chat else 'text')}",
            f"data.path={json.dumps(args.chat or args.text)}",
            f"data.seq_len={args.seq_len}",
            f"training.steps={args.steps}",
            f"training.expected_batch_size={args.batch_size}",
            f"privacy.target_epsilon={args.epsilon}",
        ],
    )
    base = load_checkpoint(kind, Path(args.model), config.precision)
    count = sum(x.size for x in jax.tree.leaves(base.params))
    layers, width, _ = sizes(base.config)
    print(f"checkpoint: {kind}, {layers} layers, width {width} ({count:,} parameters)")
    print(f"before: {continuation(base, args.prompt)}")
    report = dpmp.train(config, out_dir=args.out, resume=False, progress=False)
    print(
        f"private LoRA: {report['num_params']:,} trainable parameters over {layers} layers, "
        f"epsilon {report['epsilon']:.3f} (delta {report['delta']:g})"
    )
    print(
        f"held-out perplexity {report['test_perplexity']:.2f} on "
        f"{report['data']['num_test']} test records"
    )
    print(f"after: {continuation(load_trained(args.out, args.model), args.prompt)}")


if __name__ == "__main__":
    main()
