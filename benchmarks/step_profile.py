"""Where a private step's time goes: a profile of its compiled program, stage by stage.

For each model (those of ``benchmarks/peers.py``), this compiles the non-private step
(``jax.grad`` of the batch's mean loss, Adam) and dpmp's default private step
(``dpmp.private_step`` around ``dpmp.private_grad(method=--method)``, snapped noise at
noise multiplier 1, Adam), times three rounds of ``--steps`` steps of each untraced
(the median round per step), then runs them again under ``jax.profiler`` and adds up
the time of the compiled program's kernels
(XLA:GPU) or thunks (XLA:CPU) by the stage their HLO ``op_name`` names
(``dpmp.precision._stages``): forward and backward passes that clipping reads, clipping
norms, clipped sum, noise, optimizer, and the rest (the model's own passes in the
non-private step, the step's glue in the private one); "unnamed" is the time of kernels
whose metadata XLA dropped (on XLA:CPU some batched products of attention).

On a GPU the kernels of one stream run one at a time, so the report also gives the
device's busy time per step (the union of its kernels' intervals) against the step's
wall time: what is left is time the GPU waited for the host (kernel launches, a
conditional's predicate read back, synchronisation). On a CPU the thunks of several
threads overlap, so their times are summed over threads and no busy time is given.

    python benchmarks/step_profile.py --models lm,guide_vit --json profile.json
    python benchmarks/step_profile.py --models mlp --policy bf16 --steps 3
    python benchmarks/step_profile.py --quick        # tiny sizes: a smoke run

Times under the profiler are a little longer than untraced ones; the shares are
what this is for.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROUNDS = 3  # untraced rounds of --steps steps; their median is the step's time
CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}  # hold other thunks


def build_steps(
    model: str, batch_size: int, quick: bool, policy: str, method: str, donate: bool = False
) -> dict:
    """``{"non-private": (fn, args, advance), "private": ...}``: each step's jitted
    function, its first arguments, and ``advance(out, args)``, the next call's arguments.
    The private one is ``dpmp.private_step``'s own jitted ``step_fn``, statistics and
    all; ``donate``: both steps take over their state's buffers."""
    import jax
    import jax.numpy as jnp
    import optax
    import peers

    loss_fn, params, batch, _ = peers.jax_model(model, batch_size, quick, policy)
    grad = jax.grad(loss_fn)
    adam = optax.adam(peers.LEARNING_RATE)
    nonprivate, state = peers.optax_step(grad, adam, params, batch, donate=donate)
    step, pad = peers.dpmp_step(loss_fn, params, batch, policy, method=method, donate=donate)
    s = step.init(jax.tree.map(jnp.copy, params))  # its own: a donating step deletes its state
    return {
        "non-private": (nonprivate, (state,), lambda out, args: (out,)),
        "private": (
            step.step_fn,
            (s.params, batch, pad, s.opt_state, s.loss_scale),
            lambda out, args: (out[0], args[1], args[2], out[1], out[2]),
        ),
    }


def instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """``{instruction name: (opcode, op_name)}`` of a compiled module's HLO text. A fusion
    without metadata of its own (XLA:CPU's library fusions) takes the op_name of the
    computation it calls (its root's, else its first instruction's that has one)."""
    out, calls, first = {}, {}, {}
    computation = None
    pattern = r"\s*(ROOT )?%?([\w.\-]+) = \S+(?: \S+)*? ([a-z][\w\-]*)\("
    for line in hlo_text.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$", line)
        if header:
            computation = header.group(1)
            continue
        m = re.match(pattern, line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        op_name = op.group(1) if op else ""
        out[m.group(2)] = (m.group(3), op_name)
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            calls[m.group(2)] = called.group(1)
        if op_name and computation and (m.group(1) or computation not in first):
            first[computation] = op_name  # a root's op_name wins over the first one
    for name, (opcode, op_name) in out.items():
        if not op_name and name in calls:
            out[name] = (opcode, first.get(calls[name], ""))
    return out


def _stat(event, key: str):
    for k, v in event.stats:
        if k == key:
            return v
    return None


def profile(
    fn, args, advance, steps: int, trace_dir: str | None = None, options: dict | None = None
) -> dict:
    """Untraced and traced times of ``steps`` calls of ``fn`` (each on the arguments
    ``advance`` makes of the call before), the traced kernel time by stage, and the
    compiled program's control flow (a conditional's predicate or a loop's condition
    may be read back on the host). The trace is kept in ``trace_dir`` if given;
    ``options``: XLA's options for this compilation (``compiler_options``)."""
    import jax

    compiled = fn.lower(*args).compile(compiler_options=options or None)
    ops = instructions(compiled.as_text())
    module = re.match(r"HloModule (\S+?),", compiled.as_text()).group(1)
    control = collections.Counter(op for op, _ in ops.values() if op in ("while", "conditional"))

    def run(args, n):
        t = time.perf_counter()
        for _ in range(n):
            args = advance(compiled(*args), args)
        jax.block_until_ready(args)
        return args, (time.perf_counter() - t) / n

    args, _ = run(args, 3)  # warm-up
    rounds = []
    for _ in range(ROUNDS):
        args, seconds = run(args, steps)
        rounds.append(seconds)
    kept = contextlib.nullcontext(trace_dir) if trace_dir else tempfile.TemporaryDirectory()
    with kept as d:
        jax.profiler.start_trace(d)
        args, traced = run(args, steps)
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(
            sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)[-1]
        )
    return {
        "ms_per_step": statistics.median(rounds) * 1e3,
        "traced_ms_per_step": traced * 1e3,
        "control_flow": dict(control),
        **_by_stage(data, ops, module, steps),
    }


def _by_stage(data, ops: dict, module: str, steps: int) -> dict:
    """A trace's kernel (thunk) milliseconds a step of ``module``, by stage; the device's
    busy time; the kernels per step and the top ones of each stage."""
    from dpmp.precision._stages import stage_of

    per_stage, kernels, stages = collections.Counter(), collections.Counter(), {}
    intervals, unmatched = [], 0.0
    for plane, line in _kernel_lines(data):
        on_device = plane.name.startswith("/device:")
        for ev in line.events:
            if on_device:  # copies and kernels of other modules keep the device busy too
                intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
            name = _instruction(ev, ops, on_device)
            if name is None or not str(_stat(ev, "hlo_module") or module).startswith(module):
                continue
            opcode, op_name = ops.get(name, ("", ""))
            if opcode in CONTAINERS:
                continue
            ms = ev.duration_ns / 1e6 / steps
            if not op_name and name not in ops:
                unmatched += ms
                continue
            stage = (stage_of(op_name) or "rest") if op_name else "unnamed"
            per_stage[stage] += ms
            kernels[name] += ms
            stages[name] = stage
    busy = _union(intervals) / 1e6 / steps if intervals else None
    return {
        "device_busy_ms_per_step": busy,
        "longest_idle_us": _gaps(intervals)[:8],
        "kernel_ms_by_stage": dict(per_stage.most_common()),
        "kernels_per_step": len(kernels),
        "top_kernels_ms": {
            stage: [(k, ops[k][1], v) for k, v in kernels.most_common() if stages[k] == stage][:5]
            for stage in per_stage
        },
        "unmatched_ms": unmatched,
    }


def _instruction(event, ops: dict, on_device: bool) -> str | None:
    """The HLO instruction an event ran: its ``hlo_op`` statistic, else (a device's
    kernel) its name, or the name with XLA:GPU's ``_N`` for the instruction's ``.N``.
    A kernel of a CUDA graph has the graph's ``command_buffer_N`` for ``hlo_op``: its
    own name tells the instruction (a library's kernel, cuBLAS's or cuDNN's, has a
    name of its own: it stays unmatched)."""
    name = _stat(event, "hlo_op")
    if not on_device or (name is not None and not str(name).startswith("command_buffer")):
        return name
    dotted = re.sub(r"_(\d+)$", r".\1", event.name)
    return dotted if dotted in ops and event.name not in ops else event.name


def _gaps(intervals) -> list:
    """``(microseconds, kernel before)`` of the device's idle gaps, longest first."""
    out, end, last = [], None, None
    for a, b, name in sorted(intervals):
        if end is not None and a > end:
            out.append((round((a - end) / 1e3, 1), last))
        if end is None or b > end:
            end, last = b, name
    return sorted(out, reverse=True)


def _kernel_lines(data):
    """``(plane, line)`` of a trace whose events are the program's kernels or thunks: a
    device's stream lines (its other lines repeat the same spans by module and op), and
    every line of the host (XLA:CPU's thunks carry an ``hlo_op``)."""
    for plane in data.planes:
        lines = list(plane.lines)
        if plane.name.startswith("/device:"):
            streams = [ln for ln in lines if ln.name.startswith("Stream")]
            lines = streams or lines
        for line in lines:
            yield plane, line


def _union(intervals) -> float:
    total, end = 0.0, None
    for a, b, *_ in sorted(intervals):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


STAGE_ORDER = ("forward_backward", "norms", "clipped_sum", "noise", "optimizer", "rest", "unnamed")


def _count(control: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(control.items())) or "no control flow"


def report(model: str, rec: dict) -> None:
    for kind in ("non-private", "private"):
        r = rec[kind]
        busy = r["device_busy_ms_per_step"]
        idle = "" if busy is None else f", device busy {busy:.2f} ms"
        print(
            f"\n{model} {kind}: {r['ms_per_step']:.2f} ms/step "
            f"({r['traced_ms_per_step']:.2f} traced{idle}); {r['kernels_per_step']} kernels, "
            f"{_count(r.get('control_flow', {}))}"
        )
        gaps = r.get("longest_idle_us") or []
        if gaps:
            print(
                "  device idle longest: "
                + ", ".join(f"{us} us after {k[:40]}" for us, k in gaps[:3])
            )
        total = sum(r["kernel_ms_by_stage"].values()) or 1.0
        for stage in STAGE_ORDER:
            ms = r["kernel_ms_by_stage"].get(stage)
            if ms is not None:
                print(f"  {stage:18} {ms:9.2f} ms  {ms / total:6.1%}")
            for name, op_name, ms in r["top_kernels_ms"].get(stage, [])[:2]:
                print(f"      {ms:8.2f} ms  {name[:32]:32} {op_name[-64:]}")


def _option_value(text: str):
    """An XLA option's value from the command line: a bool, an int, or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def main(argv=None) -> int:
    import peers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lm", help=f"comma-separated: {', '.join(peers.MODELS)}")
    ap.add_argument("--policy", choices=tuple(peers.POLICIES), default="f32")
    ap.add_argument("--method", default="auto", help="private_grad's method (default auto)")
    ap.add_argument("--steps", type=int, default=10, help="steps timed and traced (default 10)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and batches, 2 steps")
    ap.add_argument(
        "--donate", action="store_true", help="both steps take over their state's buffers"
    )
    ap.add_argument(
        "--xla",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="an XLA option for both steps' compilation, e.g. "
        "xla_gpu_enable_command_buffer= (repeatable)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--trace-dir",
        default=None,
        help="keep each step's trace here (MODEL_KIND/, for TensorBoard or Perfetto)",
    )
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in peers.MODELS:
            ap.error(f"--models: unknown {m!r}; allowed: {', '.join(peers.MODELS)}")
    steps = 2 if args.quick else args.steps
    options = {}
    for option in args.xla:
        key, sep, value = option.partition("=")
        if not sep or not key:
            ap.error(f"--xla: {option!r} is not OPTION=VALUE")
        options[key] = _option_value(value)
    import jax

    device = jax.devices()[0]
    out = {
        "device": f"{device.platform} {device.device_kind}",
        "jax": jax.__version__,
        "policy": args.policy,
        "method": args.method,
        "steps": steps,
        "donate": args.donate,
        "xla_options": options,
        "models": {},
    }
    print(
        f"{out['device']}, jax {jax.__version__}, policy {args.policy}, {steps} steps, "
        f"donate {args.donate}, XLA options {options or 'none'}"
    )
    for model in models:
        batch = (peers.QUICK_BATCH if args.quick else peers.BATCH)[model]
        built = build_steps(model, batch, args.quick, args.policy, args.method, args.donate)
        rec = {"batch": batch}
        for kind, (fn, first, advance) in built.items():
            trace = args.trace_dir and os.path.join(args.trace_dir, f"{model}_{kind}")
            rec[kind] = profile(fn, first, advance, steps, trace, options)
        report(model, rec)
        out["models"][model] = rec
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
