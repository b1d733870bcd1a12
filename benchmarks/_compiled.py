"""What jitted functions cost: the size of a lowered program, its lower and
compile times (the least of several cold compiles, taken in turns), XLA's
compiled memory and, if asked, the median time of a call (several functions
timed in turns, so that a slow spell of a shared machine falls on each of
them); and a built private step's function beside its non-private
counterpart."""

import statistics
import time
from collections import Counter

import jax

from dpmp.app.trainer.compare import _nonprivate_step
from dpmp.app.trainer.step import _make_optimizer
from dpmp.models._model import count_params
from dpmp.step._step import WithFrozen


def step_pair(step, config) -> dict[str, tuple]:
    """``{"private": (fn, make_args), "non-private": (fn, make_args)}`` of
    ``build_private_step(config)``'s result: its jitted step, and ``jax.grad`` of the
    batch's mean loss with the same optimizer (``dpmp compare``'s non-private
    step), each with the model's frozen arrays (a LoRA base) as last arguments.
    ``make_args()`` gives the arguments: the non-private optimizer state is
    allocated only when asked for (a model's size, twice with Adam)."""
    params, data, pad, opt_state, scale = step.example_args
    frozen = step.model.frozen_args()
    optimizer = _make_optimizer(config)
    private = step.step_fn.jitted if isinstance(step.step_fn, WithFrozen) else step.step_fn
    return {
        "private": (private, lambda: (*step.example_args, *frozen)),
        "non-private": (
            jax.jit(_nonprivate_step(step, optimizer)),
            lambda: (params, data, pad, optimizer.init(params), scale, *frozen),
        ),
    }


def step_facts(step, config, tokens: int) -> dict:
    """What a built private step of a language model trains and how it clips: its
    trainable and frozen parameter counts, batch, tokens a record, policy and the
    clip method ``auto`` chose, with its reason and each layer's rule."""
    frozen = step.model.frozen
    return {
        "trainable_params": count_params(step.example_args[0]),
        "base_params": count_params(frozen) if frozen is not None else None,
        "batch": int(len(step.example_args[2])),
        "tokens": tokens,
        "policy": str(config.precision),
        "clip_method": step.clipping["method"],
        "clip_reason": step.clipping["reason"],
        "clip_layers": dict(Counter(f"{t['layer']} {t['rule']}" for t in step.clipping["layers"])),
    }


def pair_ratios(by_step: dict[str, dict]) -> dict:
    """private / non-private of compiled memory, compile time and (if both were
    timed) step time."""
    private, base = by_step["private"], by_step["non-private"]
    out = {
        "memory_ratio": round(private["compiled_mb"] / base["compiled_mb"], 3),
        "compile_ratio": round(private["compile_s"] / base["compile_s"], 2),
    }
    if "step_s" in private and "step_s" in base:
        out["time_ratio"] = round(private["step_s"] / base["step_s"], 3)
    return out


def timed_compile(fn, args) -> tuple:
    """``(lowered, compiled, seconds)``: ``fn`` lowered and compiled for ``args``, and
    ``{"lower_s", "compile_s", "compile_cpu_s"}``: wall seconds of each, and process
    CPU seconds of both (all threads; less moved by other work on a shared machine
    than wall time)."""
    cpu = time.process_time()
    tic = time.perf_counter()
    lowered = fn.lower(*args)
    lower_s = time.perf_counter() - tic
    tic = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - tic
    seconds = {
        "lower_s": lower_s,
        "compile_s": compile_s,
        "compile_cpu_s": time.process_time() - cpu,
    }
    return lowered, compiled, seconds


def compile_stats(fn, args) -> tuple:
    """``(compiled, row)``: ``fn`` lowered and compiled for ``args``, and its text
    size, ``timed_compile``'s seconds and compiled megabytes. ``compiled_mb`` is
    arguments + outputs + temporaries - aliases of ``memory_analysis()``."""
    lowered, compiled, seconds = timed_compile(fn, args)
    text = lowered.as_text()
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    row = {
        "hlo_text_mb": round(len(text) / 1e6, 3),
        **{field: round(s, 2) for field, s in seconds.items()},
        "argument_mb": round(m.argument_size_in_bytes / 1e6, 2),
        "temp_mb": round(m.temp_size_in_bytes / 1e6, 2),
        "compiled_mb": round(total / 1e6, 2),
    }
    return compiled, row


def least_compile_times(fns: dict[str, tuple], rows: dict[str, dict], rounds: int) -> None:
    """Lower and compile each ``{name: (fn, args)}`` ``rounds`` more times, in turn,
    from cold caches (``jax.clear_caches``): each ``rows[name]`` keeps its least
    ``lower_s``, ``compile_s`` and ``compile_cpu_s`` (on a shared machine one
    compile can take 2-3x another of the same program)."""
    for _ in range(rounds):
        for name, (fn, args) in fns.items():
            jax.clear_caches()
            _, _, seconds = timed_compile(fn, args)
            row = rows[name]
            for field, s in seconds.items():
                row[field] = round(min(row[field], s), 2)


def median_times(calls: dict[str, tuple], repeats: int) -> dict[str, float]:
    """Median seconds of ``repeats`` calls of each ``{name: (fn, args)}``, after one
    warm-up call each; the functions take turns (one call of each per round)."""
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            tic = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - tic)
    return {name: round(statistics.median(t), 4) for name, t in times.items()}


def measure(fn, args, repeats: int) -> dict:
    """``compile_stats``' row of ``fn`` (and with ``repeats`` the median call, ``step_s``)."""
    compiled, row = compile_stats(fn, args)
    if repeats:
        row["step_s"] = median_times({"step": (compiled, args)}, repeats)["step"]
    return row
