"""``dpmp compare``: what precision and privacy cost one config, side by side.

For each policy (fp32, bf16, fp16 by default) this builds the config's step
three ways and measures each in one process:

* ``non-private``: ``jax.grad`` of the batch's mean loss under the policy
  (parameters cast to its gradient dtype, the batch to its compute dtype), then
  the config's optimizer;
* ``clipped``: the private step without its noise: ``dpmp.private_grad`` (the
  config's clip method) and the same optimizer;
* ``private``: the step a run trains with (clipping, noise, optimizer).

Per step: the parameter bytes, the compiled temporary memory
(``memory_analysis().temp_size_in_bytes``) and the median wall time of
interleaved samples. ``clipped - non-private`` is what clipping costs and
``private - clipped`` what the noise costs, as shares of the private step.
It answers, with numbers, why a bf16 model need not use less memory than
fp32: the bf16 preset keeps float32 parameters (and optimizer state), only
activations and per-example values shrink, and on CPUs bf16 is emulated
through float32.

What it prints: shapes, dtypes, compiled sizes and times. Nothing is
computed from the data's values beyond running the step on one padded batch
of fixed shape (a step's time does not depend on which examples it holds).
The one-shot step is measured (``training.physical_batch_size`` is ignored).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import optax

from dpmp.app.config import Config
from dpmp.app.inputs import load_data
from dpmp.app.trainer.step import _make_optimizer, build_private_step
from dpmp.data._dataset import Dataset
from dpmp.models._model import count_bytes
from dpmp.step._step import WithFrozen

__all__ = ["KINDS", "POLICIES", "compare", "format_table"]

POLICIES = ("fp32", "bf16", "fp16")
KINDS = ("non-private", "clipped", "private")
_SAMPLE_S = 0.2  # a fast step is timed as the mean of enough calls to last this long


def _nonprivate_step(step, optimizer) -> Callable:
    policy, loss_fn = step.fn.grad_fn.policy, step.model.loss_fn

    def nonprivate_step(params, batch, is_padding_example, opt_state, loss_scale, *frozen):
        def loss(p):
            return loss_fn(policy.cast_to_grad(p), policy.cast_to_compute(batch), *frozen)

        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), jax.grad(loss)(params), params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return nonprivate_step


def _clipped_step(step, optimizer) -> Callable:
    grad_fn = step.fn.grad_fn

    def clipped_step(params, batch, is_padding_example, opt_state, loss_scale, *frozen):
        out = grad_fn(
            params, batch, *frozen, loss_scale=loss_scale, is_padding_example=is_padding_example
        )
        updates, opt_state = optimizer.update(out.grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out.stats

    return clipped_step


def _steps(step, config: Config) -> dict[str, tuple[Callable, tuple]]:
    """Each kind's jitted function and its arguments, for ``config``'s ``step`` (the
    model's frozen arrays, a LoRA base, last: an argument of each program, not
    constants in it)."""
    params, batch, pad, opt_state, scale = step.example_args
    base = _make_optimizer(config)
    base_state = base.init(params)
    frozen = step.model.frozen_args()
    private = step.step_fn
    if isinstance(private, WithFrozen):
        private = private.jitted
    return {
        "non-private": (
            jax.jit(_nonprivate_step(step, base)),
            (params, batch, pad, base_state, scale, *frozen),
        ),
        "clipped": (
            jax.jit(_clipped_step(step, base)),
            (params, batch, pad, base_state, scale, *frozen),
        ),
        "private": (private, (*step.example_args, *frozen)),
    }


def _time(fns: dict[str, tuple[Callable, tuple]], repeats: int) -> dict[str, float]:
    """Median seconds per call, from ``repeats`` interleaved samples per kind."""
    calls = {}
    for kind, (f, args) in fns.items():
        jax.block_until_ready(f(*args))  # warm-up
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        calls[kind] = max(1, min(200, round(_SAMPLE_S / (time.perf_counter() - t))))
    samples: dict[str, list[float]] = {kind: [] for kind in fns}
    for _ in range(repeats):
        for kind, (f, args) in fns.items():
            t = time.perf_counter()
            for _ in range(calls[kind]):
                out = f(*args)
            jax.block_until_ready(out)
            samples[kind].append((time.perf_counter() - t) / calls[kind])
    return {kind: statistics.median(s) for kind, s in samples.items()}


def _with_policy(config: Config, policy: str) -> Config:
    """``config`` under ``policy``, one-shot on one device (validated: a bad policy is a
    ConfigError): the costs compared are those of one device's step."""
    t = dataclasses.replace(
        config.training, physical_batch_size=None, devices=1, shard_params=False
    )
    return dataclasses.replace(config, policy=policy, training=t)


def _one_policy(cfg: Config, data: Dataset, policy: str, repeats: int) -> list[dict]:
    step = build_private_step(cfg, data)
    fns = _steps(step, cfg)
    temp = {
        kind: int(jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes)
        for kind, (f, args) in fns.items()
    }
    seconds = _time(fns, repeats)
    params = step.example_args[0]
    param_dtypes = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(params)})
    return [
        {
            "policy": str(cfg.precision),
            "preset": policy,
            "step": kind,
            "param_dtype": ",".join(param_dtypes),
            "param_bytes": count_bytes(params),
            "opt_state_bytes": count_bytes(fns[kind][1][3]),  # each kind's own state
            "temp_bytes": temp[kind],
            "step_s": seconds[kind],
            "clip_method": step.clipping["method"],
            "batch": int(jax.tree.leaves(step.example_args[1])[0].shape[0]),
        }
        for kind in KINDS
    ]


def compare(
    config: Config,
    *,
    data: Dataset | None = None,
    policies: Sequence[str] = POLICIES,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """One row per policy and step kind (``KINDS``): parameter and optimizer
    state bytes, compiled temporary bytes, median seconds per step, and for the
    private rows ``clip_share`` and ``noise_share`` of its time and
    ``clip_temp_bytes`` / ``noise_temp_bytes`` of its memory."""
    configs = [_with_policy(config, policy) for policy in policies]  # all checked first
    data = load_data(config.data, config.training.seed) if data is None else data
    rows = []
    for policy, cfg in zip(policies, configs):
        if progress is not None:
            progress(f"measuring {policy}")
        rows += _one_policy(cfg, data, policy, repeats)
    for i in range(0, len(rows), len(KINDS)):
        nonprivate, clipped, private = rows[i : i + len(KINDS)]
        private["clip_share"] = (clipped["step_s"] - nonprivate["step_s"]) / private["step_s"]
        private["noise_share"] = (private["step_s"] - clipped["step_s"]) / private["step_s"]
        private["clip_temp_bytes"] = clipped["temp_bytes"] - nonprivate["temp_bytes"]
        private["noise_temp_bytes"] = private["temp_bytes"] - clipped["temp_bytes"]
    return rows


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, then one line per policy on where the
    private step's time and memory go."""
    head = ("policy", "step", "params", "param dtype", "opt state", "temp mem", "time", "x time")
    lines = []
    base = {}
    for r in rows:
        if r["step"] == "non-private":
            base[r["preset"]] = r
        b = base[r["preset"]]
        lines.append(
            (
                r["preset"],
                r["step"],
                _mb(r["param_bytes"]),
                r["param_dtype"],
                _mb(r["opt_state_bytes"]),
                _mb(r["temp_bytes"]),
                f"{r['step_s'] * 1e3:.2f} ms",
                f"{r['step_s'] / b['step_s']:.2f}x",
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [head]]
    out += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in lines]
    out.append("")
    for r in rows:
        if r["step"] == "private":
            out.append(
                f"{r['preset']}: {r['policy']}, clipping by {r['clip_method']}: clipping "
                f"{r['clip_share']:.0%} of the private step's time "
                f"({r['clip_temp_bytes'] / 1e6:+.2f} MB temp), noise "
                f"{r['noise_share']:.0%} ({r['noise_temp_bytes'] / 1e6:+.2f} MB)"
            )
    return "\n".join(out)
