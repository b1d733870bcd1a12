"""What donating the state saves: the private step's compiled memory with and without
``dpmp.private_step(..., donate=True)``.

For each MLP (784 inputs, ReLU layers, 10 classes; a 2.9M-parameter one and a
104M-parameter one) and policy, this builds dpmp's default private step (Adam,
snapped noise) from the parameters' shapes alone, compiles it twice (the state
kept, the state donated) and prints XLA's ``memory_analysis`` in bytes per
parameter: arguments, outputs, temporaries, the bytes aliased (outputs written
into donated arguments) and the total the step holds at once (arguments +
outputs + temporaries - aliased). Nothing runs: no gigabytes are needed.

    python benchmarks/donation.py --json benchmarks/results/cpu_2core_donation.json
    python benchmarks/donation.py --quick        # small models: a smoke run
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import optax
from _mlp import mlp_loss, mlp_shapes  # benchmarks/_mlp.py

import dpmp

# (name, hidden widths, batch)
MODELS = (
    ("mlp 784-1024x3-10", (1024,) * 3, 256),
    ("mlp 784-4096x7-10", (4096,) * 7, 64),
)
QUICK = (("mlp 784-64x2-10", (64,) * 2, 16),)


def step_memory(hidden, batch: int, policy: str, donate: bool) -> dict:
    """``memory_analysis`` of the compiled private step, in bytes."""
    params, data = mlp_shapes(hidden, batch)
    grad_fn = dpmp.private_grad(mlp_loss, l2_clip_norm=1.0, policy=policy)
    step = dpmp.private_step(
        grad_fn,
        optax.adam(1e-3),
        params=params,
        batch=data,
        noise_multiplier=1.0,
        noise_key=jax.random.key(0),  # compiled only, never run
        expected_batch_size=batch,
        padded_batch_size=batch,
        donate=donate,
    )
    opt_state = jax.eval_shape(step.optimizer.init, params)
    pad = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    scale = dpmp.NoOpLossScale()
    m = step.step_fn.lower(params, data, pad, opt_state, scale).compile().memory_analysis()
    out = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
    }
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fp32,bf16", help="comma-separated (default fp32,bf16)")
    ap.add_argument("--quick", action="store_true", help="a small model only")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    out = {"device": f"{device.platform} {device.device_kind}", "jax": jax.__version__, "rows": []}
    print(f"{out['device']}, jax {jax.__version__}; bytes per parameter")
    print(
        f"{'model':20} {'policy':6} {'params':>12} {'state':>8} {'args':>6} {'out':>6} "
        f"{'temp':>6} {'alias':>6} {'total':>6}  donated / kept"
    )
    for name, hidden, batch in QUICK if args.quick else MODELS:
        n = sum(math.prod(s.shape) for s in jax.tree.leaves(mlp_shapes(hidden, batch)[0]))
        for policy in args.policies.split(","):
            row = {"model": name, "params": n, "batch": batch, "policy": policy}
            for donate in (False, True):
                mem = step_memory(hidden, batch, policy, donate)
                row["donated" if donate else "kept"] = mem
                print(
                    f"{name:20} {policy:6} {n:12,} {'donated' if donate else 'kept':>8} "
                    + " ".join(f"{mem[k] / n:6.2f}" for k in mem)
                    + (f"  {mem['total'] / row['kept']['total']:.2f}x" if donate else "")
                )
            row["ratio"] = row["donated"]["total"] / row["kept"]["total"]
            out["rows"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
