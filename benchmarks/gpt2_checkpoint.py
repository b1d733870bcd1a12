"""Loading a GPT-2-small-shaped checkpoint folder and its forward pass.

A random GPT-2 of the published small model's sizes (vocabulary 50,257,
context 1,024, width 768, 12 layers, 12 heads: 124,439,808 parameters) is
written with ``save_gpt2`` in float32 and in bfloat16 to a temporary folder,
then read with ``load_gpt2`` under the bf16 policy: the seconds to load, to
compile and run the first forward pass, and per forward pass after it (batch
1, 128 tokens, mean of 3). Nothing is downloaded.

Run: ``python benchmarks/gpt2_checkpoint.py [--out FILE]``; prints JSON.
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.models import GPT2Config, load_gpt2, save_gpt2
from dpmp.models.families._gpt2 import gpt2_init

SMALL = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)


def measure(folder: Path, stored) -> dict:
    params = jax.jit(gpt2_init, static_argnums=0)(SMALL, jax.random.key(0))
    save_gpt2(folder, jax.tree.map(lambda a: a.astype(stored), params), SMALL)
    del params
    start = time.perf_counter()
    gpt2 = load_gpt2(folder, "bf16")
    load_s = time.perf_counter() - start
    tokens = np.random.default_rng(0).integers(0, SMALL.vocab_size, (1, 128)).astype(np.int32)
    forward = jax.jit(gpt2.model.predict)
    start = time.perf_counter()
    forward(gpt2.params, tokens).block_until_ready()
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(3):
        forward(gpt2.params, tokens).block_until_ready()
    return {
        "stored_dtype": jnp.dtype(stored).name,
        "file_bytes": (folder / "model.safetensors").stat().st_size,
        "params": sum(a.size for a in jax.tree.leaves(gpt2.params)),
        "params_dtypes": sorted({str(a.dtype) for a in jax.tree.leaves(gpt2.params)}),
        "load_s": round(load_s, 3),
        "compile_and_first_forward_s": round(first_s, 3),
        "forward_s": round((time.perf_counter() - start) / 3, 3),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            measure(Path(tmp) / name, d)
            for name, d in (("f32", jnp.float32), ("bf16", jnp.bfloat16))
        ]
    result = {
        "benchmark": "gpt2_checkpoint",
        "policy": "bf16",
        "batch": 1,
        "tokens": 128,
        "machine": f"{platform.machine()}, {jax.devices()[0].platform}",
        "jax": jax.__version__,
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
