"""The user-level private step against the record-level one, side by side: the same
model, the same records a step, compiled memory and step time.

Both steps are those ``configs/lm.toml`` trains with (the byte LM, bf16 policy,
Adam) on its data (the Python documentation's text, which ships with Python),
built by ``build_private_step``; the training records are given users, ``R =
--records-per-user`` consecutive records each. The record-level step
(``privacy.unit = "record"``) takes a batch of ``B = --batch`` records; the
user-level one (``privacy.unit = "user"``, ``privacy.user_records = k``) a
batch of ``U = B / k`` users of ``k = --user-records`` records each (every
record real), so both clip, sum and noise the gradients of ``B`` records: one
clip per record against one per user, whose ghost norms take the Gram form
over the user's ``k T`` rows (``dpmp.clipping._users``). Each step is compiled
for exactly those shapes (a Poisson run's step is the same program at its
padded batch size) with ``privacy.clip_method`` each of ``--methods``.

Rows: ``small`` (the config's model: width 64, depth 2; compiled, and with
``--time N`` the median of N calls after a warm-up, the steps of a method
called in turns so that a slow spell of a shared machine falls on both) and
``100m`` (width 768, depth 14, 12 heads: about 99 million parameters; compiled
memory only, never run). For each step: ``step_facts`` (the clip method
``auto`` chose, its reason, each layer's rule), StableHLO text size, lower and
compile times, XLA's compiled memory (arguments + outputs + temporaries -
aliases, ``memory_analysis``); per row and method the user / record ratios of
compiled memory and (timed) step time. The goal (issue 51): at most 1.3x each,
with ghost clipping.

Run: ``python benchmarks/user_level.py [--rows small 100m] [--methods ghost
vmap] [--batch 64] [--user-records 8] [--tokens 64] [--time 5] [--note TEXT]
[--json FILE]``; prints one JSON line per step and the ratios of each row and
method; ``--json`` writes them with the command, the device and the versions.
Nothing is downloaded.
"""

import argparse
import gc
import json
import os
import platform
import shlex
import sys

import jax
import numpy as np
from _compiled import compile_stats, median_times, step_facts  # benchmarks/_compiled.py

from dpmp.app.config import load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer import build_private_step
from dpmp.clipping._users import RECORD_MASK

CONFIG = "configs/lm.toml"
ROWS = {
    "small": [],
    "100m": ["model.dim=768", "model.depth=14", "model.heads=12"],
}
UNITS = ("record", "user")


def _config(row: str, unit: str, method: str, args):
    sets = [
        f"data.seq_len={args.tokens}",
        f'privacy.clip_method="{method}"',
        f'privacy.unit="{unit}"',
        # the noise's scale is not what is measured: one step at a given sigma
        "privacy.noise_multiplier=1.0",
        "training.steps=1",
        *ROWS[row],
    ]
    if unit == "user":
        users = args.batch // args.user_records
        sets += [f"privacy.user_records={args.user_records}"]
        sets += [f"training.expected_batch_size={users}", "privacy.delta=1e-6"]
    else:  # exactly B records a step
        sets += [f"training.expected_batch_size={args.batch}", 'privacy.sampling="shuffle"']
    return load_config(CONFIG, sets)


def _exact_batch(step, unit: str, args) -> tuple:
    """The step's arguments with a batch of exactly ``B`` records (``U`` users of ``k``
    real records each), none of them padding."""
    params, batch, pad, opt_state, scale = step.example_args
    n = args.batch if unit == "record" else args.batch // args.user_records
    batch = {name: np.asarray(v)[:n] for name, v in batch.items()}
    if unit == "user":
        assert batch["x"].shape[:2] == (n, args.user_records), batch["x"].shape
        batch[RECORD_MASK] = np.ones((n, args.user_records), bool)
    else:
        assert len(batch["x"]) == n, batch["x"].shape
    return params, batch, np.zeros(n, bool), opt_state, scale, *step.model.frozen_args()


def _step(row: str, unit: str, method: str, data, args):
    """``(jitted step, its arguments, facts)`` of one unit's step."""
    config = _config(row, unit, method, args)
    step = build_private_step(config, data)
    jax.clear_caches()  # the programs that made the starting parameters
    facts = {"row": row, "unit": unit, "method": method, **step_facts(step, config, args.tokens)}
    facts["clip_unit"] = step.clipping.get("unit", "example")
    fn = getattr(step.step_fn, "jitted", step.step_fn)
    return fn, _exact_batch(step, unit, args), facts


def measure(row: str, method: str, data, args) -> tuple[list[dict], dict]:
    """The record- and user-level steps of one row and method, and their ratios."""
    by_unit, calls = {}, {}
    for unit in UNITS:
        fn, call_args, facts = _step(row, unit, method, data, args)
        facts["batch"] = int(len(call_args[2]))  # records, or users
        given = call_args if row in args.time_rows else jax.eval_shape(lambda a=call_args: a)
        compiled, stats = compile_stats(fn, given)
        by_unit[unit] = {**facts, **stats}
        if args.time and row in args.time_rows:
            calls[unit] = (compiled, call_args)
    if calls:
        for unit, seconds in median_times(calls, args.time).items():
            by_unit[unit]["step_s"] = seconds
    del calls
    gc.collect()
    user, record = by_unit["user"], by_unit["record"]
    ratio = {
        "row": row,
        "method": method,
        "records_per_step": args.batch,
        "users_per_step": args.batch // args.user_records,
        "user_records": args.user_records,
        "clip_method": {u: by_unit[u]["clip_method"] for u in UNITS},
        "memory_ratio": round(user["compiled_mb"] / record["compiled_mb"], 3),
    }
    if "step_s" in user and "step_s" in record:
        ratio["time_ratio"] = round(user["step_s"] / record["step_s"], 3)
    return list(by_unit.values()), ratio


def _data(args):
    """The config's training records, ``--records-per-user`` consecutive ones a user."""
    config = load_config(CONFIG, [f"data.seq_len={args.tokens}"])
    data = load_data(config.data, config.training.seed)
    return data.with_users(np.arange(data.num_train) // args.records_per_user)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--methods", nargs="+", choices=["ghost", "vmap", "auto"],
                        default=["ghost", "vmap"])  # fmt: skip
    parser.add_argument("--batch", type=int, default=64, help="records a step (B)")
    parser.add_argument("--user-records", type=int, default=8, help="records a user (k)")
    parser.add_argument("--records-per-user", type=int, default=16, help="each user's records")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--time", type=int, default=0, help="timed calls per step (0: none)")
    parser.add_argument("--time-rows", nargs="+", choices=sorted(ROWS), default=["small"])
    parser.add_argument("--note", default="")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.user_records < 1 or args.batch % args.user_records:
        parser.error("--user-records must be at least 1 and divide --batch")
    if args.records_per_user < args.user_records:
        parser.error("--records-per-user must be at least --user-records")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    data = _data(args)
    rows, summary = [], []
    for row in args.rows:
        for method in args.methods:
            measured, ratio = measure(row, method, data, args)
            for r in measured:
                print(json.dumps(r), flush=True)
            print(json.dumps(ratio), flush=True)
            rows += measured
            summary.append(ratio)
    result = {
        "benchmark": "user_level",
        "command": shlex.join(["python", "benchmarks/user_level.py", *sys.argv[1:]]),
        "note": args.note,
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "rows": rows,
        "ratios": summary,
    }
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
