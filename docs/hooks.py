"""The docs' benchmark tables, generated from the committed results at build time.

A page writes, on a line of its own::

    {{ table("clipping", "cpu_2core.json", ms=",.0f") }}

and ``mkdocs build`` (this module is a hook in ``mkdocs.yml``) replaces it with
the Markdown table that ``TABLES["clipping"]`` makes from
``benchmarks/results/cpu_2core.json``. The arguments are Python literals: the
kind of table, one or more results files, then the kind's options. No figure
of a table is typed by hand, so none can drift from the file it came from;
``tests/test_readme_figures.py`` expands every placeholder of the docs.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLACEHOLDER = re.compile(r"^(?P<indent>[ \t]*)\{\{\s*table\((?P<args>.*?)\)\s*\}\}[ \t]*$", re.M)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# -- clipping: benchmarks/clipping.py and benchmarks/transformers.py ----------------------------

CLIP_METHODS = {
    "jaxprivacy": "jax-privacy vmap",
    "dpmp_vmap": "dpmp vmap",
    "dpmp_ghost": "dpmp ghost",
}
MODEL_NAMES = {"guide_vit": "guide ViT", "lm": "LM"}


def _by_model(files: tuple[str, ...], names: dict) -> dict[tuple[str, str], dict[str, dict]]:
    """``{(model, policy): {method: run}}`` over ``files``; ``names`` renames a file's
    models (``{"file.json": {"lm": "GPT-2 shape"}}``)."""
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for name in files:
        rename = {**MODEL_NAMES, **names.get(name, {})}
        for r in _load(name)["runs"]:
            model = rename.get(r["model"], r["model"])
            runs.setdefault((model, r["policy"]), {})[r["method"]] = r
    return runs


def clipping(*files: str, ms: str = ",.0f", mb: str = ",.0f", names: dict | None = None) -> str:
    """Per (model, policy): the non-private gradient's time and compiled temporary
    memory, then each private method's ratios to it."""
    runs = _by_model(files, names or {})
    methods = [m for m in CLIP_METHODS if any(m in by for by in runs.values())]
    header = ["model", "policy", "non-private", *(CLIP_METHODS[m] for m in methods)]
    rows = []
    for (model, policy), by in runs.items():
        base = by["nonprivate"]
        row = [
            model,
            policy,
            f"{base['median_s'] * 1e3:{ms}} ms, {base['temp_bytes'] / 1e6:{mb}} MB",
        ]
        for m in methods:
            r = by.get(m)
            row.append(f"{r['time_ratio']:.2f}x time, {r['mem_ratio']:.2f}x mem" if r else "-")
        rows.append(row)
    return _table(header, rows)


def bf16_speedup(*files: str, names: dict | None = None) -> str:
    """Float32 time over bf16 time, per method, for the models run in both."""
    runs = _by_model(files, names or {})
    models = [m for m, p in runs if p == "bf16" and (m, "f32") in runs]
    methods = {"nonprivate": "non-private gradient", **CLIP_METHODS}
    rows = []
    for method, label in methods.items():
        cells = []
        for model in models:
            f32, bf16 = runs[model, "f32"].get(method), runs[model, "bf16"].get(method)
            cells.append(f"{f32['median_s'] / bf16['median_s']:.2f}x" if f32 and bf16 else "-")
        if any(c != "-" for c in cells):
            rows.append([label, *cells])
    return _table(["method", *models], rows)


# -- whole steps against the peers: benchmarks/peers.py ----------------------------------------

PEER_COLUMNS = {
    "jax_nonprivate": "JAX non-private",
    "dpmp": "dpmp (default)",
    "dpmp_plain": "dpmp, plain noise",
    "dpmp_f32sum": "dpmp, float32 sums",
    "dpmp_nonoise": "dpmp, no noise",
    "jaxprivacy": "jax-privacy",
    "torch_nonprivate": "PyTorch non-private",
    "opacus_hooks": "Opacus hooks",
    "opacus_ghost": "Opacus ghost",
    "opacus_functorch": "Opacus functorch",
}


def peers(name: str, ms: str = ",.0f") -> str:
    """Each variant's time a step and its ratio to its own framework's non-private
    step, then dpmp's default step over the fastest Opacus mode's."""
    data = _load(name)
    columns = [c for c in PEER_COLUMNS if any(c in m["variants"] for m in data["models"].values())]
    rows = []
    for model, rec in data["models"].items():
        v = rec["variants"]
        row = [f"{model}, {rec['params']:,} params, batch {rec['batch']}"]
        for c in columns:
            if c not in v:
                row.append("-")
                continue
            time = f"{v[c]['median_s'] * 1e3:{ms}} ms"
            row.append(
                time if c.endswith("nonprivate") else f"{time}, {v[c]['x_own_nonprivate']:.2f}x"
            )
        row.append(f"{v['dpmp']['x_fastest_opacus']:.2f}x ({rec['fastest_opacus']})")
        rows.append(row)
    header = ["model", *(PEER_COLUMNS[c] for c in columns), "dpmp / fastest Opacus"]
    return _table(header, rows)


# -- where the time goes: benchmarks/step_profile.py -------------------------------------------

STAGES = {
    "forward_backward": "forward + backward",
    "norms": "clip norms",
    "clipped_sum": "clipped sum",
    "noise": "noise",
    "optimizer": "optimizer",
    "rest": "rest",
    "unnamed": "unnamed",
}


def step_profile(name: str) -> str:
    """The steps' times, then the private step's kernel milliseconds by stage."""
    rows = []
    for model, rec in _load(name)["models"].items():
        n, p = rec["non-private"], rec["private"]
        by_stage = p["kernel_ms_by_stage"]
        rows.append(
            [
                f"{model}, batch {rec['batch']}",
                f"{n['ms_per_step']:,.0f} ms",
                f"{p['ms_per_step']:,.0f} ms, {p['ms_per_step'] / n['ms_per_step']:.2f}x",
                *(f"{by_stage[s]:,.1f}" if s in by_stage else "-" for s in STAGES),
            ]
        )
    return _table(["model", "non-private step", "private step", *STAGES.values()], rows)


GPU_PROFILE_RUNS = {
    "pieces of chunk_size, a conditional each (d1f8d58)": "private, noise in pieces, "
    "a conditional each",
    "pieces of chunk_size, no conditional": "private, noise in pieces, no conditional",
    "one piece per leaf up to SNAP_CHUNK, no conditional": "private, noise one piece per "
    "leaf (now)",
}


def gpu_profile(name: str, model: str = "guide_vit", policy: str = "f32") -> str:
    """The private step's wall and GPU-busy time and its loops and conditionals, per
    way of drawing the noise; the non-private step's range over the same runs."""
    runs = _load(name)["runs"]
    rows, wall, busy = [], [], []
    for run, label in GPU_PROFILE_RUNS.items():
        rec = runs[run][policy][model]
        p, n = rec["private"], rec["non-private"]
        wall.append(n["ms_per_step"])
        busy.append(n["device_busy_ms_per_step"])
        flow = p["control_flow"]
        loops = f"{flow.get('while', 0)}, {flow.get('conditional', 0)}"
        rows.append(
            [label, f"{p['ms_per_step']:.1f} ms", f"{p['device_busy_ms_per_step']:.1f} ms", loops]
        )
    first = [
        "non-private",
        f"{min(wall):.1f}-{max(wall):.1f} ms",
        f"{min(busy):.1f}-{max(busy):.1f} ms",
        "0, 0",
    ]
    return _table(["step", "wall time", "GPU busy", "loops, conditionals"], [first, *rows])


# -- the noise stage: benchmarks/noise.py ------------------------------------------------------


def noise_stage(name: str) -> str:
    rows = []
    for r in _load(name)["noise_stage"]:
        ns, b = r["ns_per_coordinate"], r["temp_bytes_per_coordinate"]
        cells = [f"{ns[k]:.1f} ns, {b[k]:.1f} B temp per coordinate" for k in ("plain", "snapped")]
        rows.append([f"{r['size']:,}", *cells, f"{r['time_ratio']:.2f}x"])
    header = [
        "coordinates",
        "plain (float32 `jax.random.normal`)",
        "snapped (default)",
        "time ratio",
    ]
    return _table(header, rows)


def noise_memory(name: str) -> str:
    rows = []
    for r in _load(name)["step_memory"]:
        m = r["memory"]
        rows.append(
            [
                f"{r['params']:,} parameters",
                f"{m['nonprivate']['total'] / 2**20:,.1f} MiB",
                f"{m['private']['total'] / 2**20:,.1f} MiB",
                f"{r['ratio']:.2f}x",
            ]
        )
    header = [
        "MLP, bf16, batch 64 (compiled, not run)",
        "non-private step (`jax.grad`, Adam)",
        "private step (ghost clipping, snapped noise, Adam)",
        "ratio",
    ]
    return _table(header, rows)


def noise_residual(name: str) -> str:
    data = _load(name)["residual"]
    steps = sorted({r["steps"] for r in data})
    by_params: dict[int, dict[int, dict]] = {}
    for r in data:
        by_params.setdefault(r["params"], {})[r["steps"]] = r
    rows = [
        [f"{p:,} parameters"]
        + [f"{row[s]['residual']:.2g} ({row[s]['summed_cells_bound']:.3g})" for s in steps]
        for p, row in by_params.items()
    ]
    header = ["epsilon added (summing every cell's bound instead)"] + [
        f"{s:,} steps" for s in steps
    ]
    return _table(header, rows)


def noise_step(name: str) -> str:
    s = _load(name)["private_step"]
    return _table(
        ["the default run's private step", "plain noise", "snapped noise", "ratio"],
        [
            [
                "time",
                f"{1e3 * s['seconds']['plain']:.2f} ms",
                f"{1e3 * s['seconds']['snapped']:.2f} ms",
                f"{s['time_ratio']:.2f}x",
            ]
        ],
    )


def ndtri(name: str) -> str:
    rows = []
    for r in _load(name)["ndtri"]:
        ns, up, cup = r["ns_per_coordinate"], r["speedup"], r["cpu_speedup"]
        rows.append(
            [
                f"{r['size']:,}",
                f"{ns['draw_jax']:.1f} ns",
                f"{ns['draw_dpmp']:.1f} ns",
                f"{up['draw']:.2f}x, {cup['draw']:.2f}x",
                f"{ns['ndtri_jax']:.1f} ns",
                f"{ns['ndtri_dpmp']:.1f} ns",
                f"{up['ndtri']:.2f}x, {cup['ndtri']:.2f}x",
            ]
        )
    header = [
        "coordinates",
        "whole `snapped_gaussian`, JAX's `ndtri`",
        "dpmp's `ndtri`",
        "speedup (wall, CPU)",
        "`ndtri` alone, JAX's",
        "dpmp's",
        "speedup (wall, CPU)",
    ]
    return _table(header, rows)


# -- XLA:CPU against PyTorch: benchmarks/xla_gap.py --------------------------------------------


def _others(ms: dict) -> str:
    rest = [
        f"{k.removeprefix('jax_')} {v:,.2f} ms" for k, v in ms.items() if k not in ("jax", "torch")
    ]
    return ", ".join(rest) or "-"


def xla_components(name: str, part: str = "components") -> str:
    """JAX against torch per component (or whole step), in one process."""
    rows = []
    for what, rec in _load(name)[part].items():
        ms = rec["ms"]
        row = [what, f"{ms['jax']:,.2f}", f"{ms['torch']:,.2f}", f"{ms['jax'] / ms['torch']:.2f}x"]
        rows.append([*row, _others(ms)])
    return _table(["component", "JAX ms", "torch ms", "JAX / torch", "other JAX"], rows)


def xla_profile(name: str) -> str:
    """Shares of XLA:CPU's thunk time by category, per model."""
    profile = _load(name)["profile"]
    models = list(profile)
    categories = sorted({c for m in models for c in profile[m]["categories"]})
    rows = []
    for c in categories:
        cells = [profile[m]["categories"].get(c) for m in models]
        rows.append([c, *(f"{x['share']:.0%}" if x else "-" for x in cells)])
    return _table(["share of XLA:CPU's thunk time", *models], rows)


def xla_options(name: str, part: str = "options") -> str:
    """Each XLA:CPU option's JAX / torch step time per model, and how far it moved
    the gradient from the default's."""
    options = _load(name)[part]
    models = list(next(iter(options.values()))["models"])
    rows = []
    for option, rec in options.items():
        by = rec["models"]
        cells = [f"{by[m]['jax_over_torch']:.2f}x" if m in by else "-" for m in models]
        change = max(by[m].get("grad_max_rel_diff", 0.0) for m in by)
        rows.append([option, *cells, f"{change:.1e}"])
    header = ["option", *(f"{m}: JAX / torch" for m in models), "max gradient change"]
    return _table(header, rows)


# -- own-model.md and language-models.md --------------------------------------------------------


def donation(name: str, policy: str = "fp32") -> str:
    rows = []
    for r in _load(name)["rows"]:
        if r["policy"] == policy:
            n = r["params"]
            rows.append(
                [
                    f"{n:,} parameters, batch {r['batch']}",
                    f"{r['kept']['total'] / n:.1f}",
                    f"{r['donated']['total'] / n:.1f}",
                ]
            )
    return _table(["MLP, Adam, float32", "state kept", "state donated"], rows)


def lora(name: str) -> str:
    """Held-out perplexity per way of training (its config and overrides) and target
    epsilon; the public pre-training alone (epsilon 0) in every column."""
    runs = _load(name)
    epsilons = sorted({r["target_epsilon"] for r in runs if r["target_epsilon"] > 0})
    modes: dict[str, dict[float, dict]] = {}
    for r in runs:
        modes.setdefault(r["mode"], {})[r["target_epsilon"]] = r
    rows = []
    for mode, by in modes.items():
        first = next(iter(by.values()))
        setup = [f"`{first['config']}`", *(f"`{o}`" for o in first.get("overrides", []))]
        trained = f"{first['trainable_params']:,}" if "trainable_params" in first else "none"
        cells = [by.get(e, by.get(0.0)) for e in epsilons]
        perplexity = [f"{c['test_perplexity']:.2f}" if c else "-" for c in cells]
        rows.append([mode, ", ".join(setup), trained, *perplexity])
    header = ["run", "config", "parameters trained privately"]
    return _table(header + [f"eps {e:g}" for e in epsilons], rows)


def lora_compile(name: str) -> str:
    rows = _load(name)["rows"]
    by = {(r["dim"], r["depth"], r["step"]): r for r in rows}
    out = []
    for dim, depth in sorted({(r["dim"], r["depth"]) for r in rows}):
        p, n = by[dim, depth, "private"], by[dim, depth, "non-private"]
        base = p["base_params"] / 1e6
        out.append(
            [
                f"{dim} x {depth}",
                f"{base:.2g}M" if base < 10 else f"{base:.1f}M",
                f"{p['hlo_text_mb']:.2f} / {n['hlo_text_mb']:.2f} MB",
                f"{p['compile_s']:.1f} / {n['compile_s']:.1f} s "
                f"({p['compile_vs_non_private']:.2f}x)",
                f"{p['compiled_mb']:,.0f} / {n['compiled_mb']:,.0f} MB",
            ]
        )
    header = [
        "base (dim x depth)",
        "base parameters",
        "StableHLO text, private / non-private",
        "compile, private / non-private",
        "compiled memory, private / non-private",
    ]
    return _table(header, out)


GPT2_ROWS = {
    "lora": "LoRA rank 8 (`configs/gpt2_lora.toml`), {:,} adapter parameters",
    "full": "full fine-tuning (`model.lora_rank = 0`), all {:,} parameters",
}


def gpt2_step(name: str, unit: str = "s") -> str:
    """GPT-2 small's private and non-private steps, LoRA and full fine-tuning; step
    times in seconds or (``unit="ms"``) milliseconds."""
    scale, digits = (1e3, ",.1f") if unit == "ms" else (1.0, ",.2f")
    data = _load(name)
    by_step = {(r["row"], r["step"]): r for r in data["rows"]}
    first = data["rows"][0]
    rows = []
    for ratio in data["ratios"]:
        steps = [by_step[ratio["row"], kind] for kind in ("non-private", "private")]
        row = [GPT2_ROWS[ratio["row"]].format(steps[0]["trainable_params"]), ratio["clip_method"]]
        for r in steps:
            time = f"{r['step_s'] * scale:{digits}} {unit}" if "step_s" in r else "not timed"
            row.append(f"{time}, {r['compiled_mb']:,.0f} MB, compiled in {r['compile_s']:.1f} s")
        times = f"{ratio['time_ratio']:.2f}x time, " if "time_ratio" in ratio else ""
        row.append(
            f"{times}{ratio['memory_ratio']:.2f}x memory, {ratio['compile_ratio']:.1f}x compile"
        )
        rows.append(row)
    header = [
        f"GPT-2 small, bf16, batch {first['batch']} x {first['tokens']} tokens",
        "clip method (`auto`)",
        "non-private step",
        "private step",
        "private / non-private",
    ]
    return _table(header, rows)


LLM_FAMILIES = {
    "llama": "Llama-3.2-1B's sizes",
    "qwen2": "Qwen2.5-0.5B's sizes",
    "gemma": "Gemma-3-1B's sizes (Gemma architecture)",
}
LLM_ROWS = {"lora": "LoRA rank 8, {:,} adapter parameters", "full": "full, {:,} parameters"}


def llm_families(name: str) -> str:
    """Each family's private and non-private steps at a published model's sizes:
    compiled memory and compile CPU seconds, and their ratios."""
    data = _load(name)
    by_step = {(r["family"], r["row"], r["step"]): r for r in data["rows"]}
    first = data["rows"][0]
    rows = []
    for ratio in data["ratios"]:
        key = (ratio["family"], ratio["row"])
        steps = [by_step[(*key, kind)] for kind in ("non-private", "private")]
        base = steps[0]["base_params"] or steps[0]["trainable_params"]
        row = [
            f"{LLM_FAMILIES[key[0]]}, {base:,} parameters",
            LLM_ROWS[key[1]].format(steps[0]["trainable_params"]),
            ratio["clip_method"],
        ]
        for r in steps:
            row.append(f"{r['compiled_mb']:,.0f} MB, compiled in {r['compile_cpu_s']:.1f} s CPU")
        row.append(
            f"{ratio['memory_ratio']:.2f}x memory, {ratio['compile_cpu_ratio']:.2f}x compile"
        )
        rows.append(row)
    header = [
        f"model (bf16, batch {first['batch']} x {first['tokens']} tokens)",
        "trained",
        "clip method (`auto`)",
        "non-private step",
        "private step",
        "private / non-private",
    ]
    return _table(header, rows)


USER_LEVEL_ROWS = {"small": "byte LM (`configs/lm.toml`)", "100m": "byte LM, width 768, depth 14"}


def user_level(name: str) -> str:
    """The user-level private step beside the record-level one (the same records a
    step): compiled memory, step time where measured, and their ratios."""
    data = _load(name)
    by_step = {(r["row"], r["method"], r["unit"]): r for r in data["rows"]}

    def cell(r: dict) -> str:
        timed = f", {1000 * r['step_s']:,.0f} ms" if "step_s" in r else " (compiled only)"
        return f"{r['compiled_mb']:,.0f} MB{timed}"

    rows = []
    for ratio in data["ratios"]:
        record, user = (by_step[(ratio["row"], ratio["method"], u)] for u in ("record", "user"))
        ratios = f"{ratio['memory_ratio']:.2f}x memory"
        if "time_ratio" in ratio:
            ratios += f", {ratio['time_ratio']:.2f}x time"
        rows.append(
            [
                f"{USER_LEVEL_ROWS[ratio['row']]}, {record['trainable_params']:,} parameters",
                f"`{ratio['method']}`",
                cell(record),
                cell(user),
                ratios,
            ]
        )
    first = data["ratios"][0]
    header = [
        f"model (bf16, {data['rows'][0]['tokens']} tokens a record)",
        "clip method",
        f"record level: {first['records_per_step']} records",
        f"user level: {first['users_per_step']} users x {first['user_records']} records",
        "user / record",
    ]
    return _table(header, rows)


def privacy_units(name: str) -> str:
    """Held-out perplexity at equal epsilon with a record or a user as the unit (the
    Shakespeare speakers): each run's plan and its test perplexity."""
    data = _load(name)
    rows = [
        [
            r["unit"],
            f"{r['epsilon']:.2f}",
            f"{r['noise_multiplier']:.3g}",
            f"{r['sampling_prob']:.4f}",
            f"`{r['clip_method']}`",
            f"{r['test_perplexity']:.2f}",
        ]
        for r in data["rows"]
    ]
    header = ["privacy unit", "epsilon", "noise multiplier", "q", "clip", "test perplexity"]
    return _table(header, rows)


OPERAND_MODELS = {
    "mlp": "MLP 784-1024-1024-1024-10",
    "cnn": "CNN",
    "vit": "small ViT",
    "guide_vit": "guide ViT",
    "lm": "LM",
    "gpt2": "GPT-2-shaped LM (compiled only)",
}


def ghost_operands(name: str) -> str:
    """A bf16 ghost step's memory and time with bf16 operands against float32 ones."""
    rows = []
    for r in _load(name)["runs"]:
        model = OPERAND_MODELS.get(r["model"], r["model"])
        f32, bf16 = r.get("f32_operands"), r.get("bf16_operands")
        memory = f"{r['mem_ratio']:.2f}x"
        if f32 and bf16:
            memory = (
                f"{f32['temp_bytes'] / 1e6:,.1f} -> {bf16['temp_bytes'] / 1e6:,.1f} MB ({memory})"
            )
        time = f"{r['time_ratio']:.2f}x" if "time_ratio" in r else "not run"
        rows.append([model, f"{r['params']:,}", memory, time])
    header = [
        "model",
        "parameters",
        "temp memory, float32 -> bf16 operands",
        "step time, bf16 / float32 operands",
    ]
    return _table(header, rows)


def gpt2_checkpoint(name: str) -> str:
    """Loading a GPT-2-small-sized checkpoint, and a forward pass, per stored dtype."""
    data = _load(name)
    rows = [
        [
            r["stored_dtype"],
            f"{r['file_bytes'] / 1e6:,.0f} MB",
            f"{r['load_s']:.2f} s",
            f"{r['compile_and_first_forward_s']:.1f} s",
            f"{r['forward_s']:.1f} s",
        ]
        for r in data["rows"]
    ]
    header = [
        f"{data['rows'][0]['params']:,} parameters, stored as",
        "file",
        "load",
        "compile and first forward",
        f"forward, {data['tokens']} tokens ({data['policy']})",
    ]
    return _table(header, rows)


# -- reproductions.md: benchmarks/reproductions/tramer_boneh.py and `dpmp tune` -----------------

NOT_MEASURED = "not yet measured"
# Tramer & Boneh (ICLR 2021), Fashion-MNIST at (epsilon 3, delta 1e-5): the models of
# their table, in its order, and its test accuracy (their Table 1 and README); a
# measured row of the results file carries its own ``published_accuracy``.
PAPER_ROWS = {
    "cnn": "end-to-end CNN (tanh)",
    "scatter_linear": "ScatterNet + linear",
    "scatter_cnn": "ScatterNet + CNN",
}
PAPER_ACCURACY = {"cnn": 0.860, "scatter_linear": 0.897, "scatter_cnn": 0.890}
# Their noise multipliers: the --noise_multiplier of the fmnist commands in the README
# of their code (repository ftramer/Handcrafted-DP): cnns.py 2.15 (with and without
# --use_scattering), baselines.py 4.05.
PAPER_NOISE_MULTIPLIER = {"cnn": 2.15, "scatter_linear": 4.05, "scatter_cnn": 2.15}


def _optional(name: str) -> dict | None:
    """A results file, or None while it is not committed yet."""
    return _load(name) if (RESULTS / name).is_file() else None


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def _measured_rows(name: str) -> tuple[dict, dict[str, dict]]:
    """The results file (``{}`` while absent) and its measured rows by name."""
    data = _optional(name) or {}
    return data, {r["row"]: r for r in data.get("rows", [])}


def _where(row: dict, data: dict) -> str:
    """Where a row ran: its own host and device (a file of one machine has them at the
    top)."""
    host = row.get("host", data.get("host", "-"))
    platform = row.get("platform", data.get("platform"))
    device = row.get("device", data.get("device"))
    return host if platform in (None, "cpu") else f"{host}, {device}"


def reproduction(name: str) -> str:
    """Each model of the paper's table: its accuracy and noise multiplier beside dpmp's
    runs (mean accuracy and range, epsilon, noise multiplier, time a run, host)."""
    data, measured = _measured_rows(name)
    rows = []
    for key, label in PAPER_ROWS.items():
        r = measured.get(key)
        paper = _percent(r["published_accuracy"] if r else PAPER_ACCURACY[key])
        sigma = f"{PAPER_NOISE_MULTIPLIER[key]:.2f}"
        if r is None:
            rows.append([label, paper, *[NOT_MEASURED] * 3, sigma, NOT_MEASURED, "-"])
            continue
        acc, n = r["test_accuracy"], r["runs"]
        spread = f"{acc['min'] * 100:.1f}-{acc['max'] * 100:.1f}"
        rows.append(
            [
                label,
                paper,
                f"{_percent(acc['mean'])} ({spread}), {n} run{'s' if n != 1 else ''}",
                f"{r['epsilon']:#.4g}",
                f"{r['noise_multiplier']:.2f}",
                sigma,
                f"{r['wall_s']['mean'] / 60:.1f} min",
                _where(r, data),
            ]
        )
    header = [
        "model",
        "paper, epsilon 3",
        "dpmp: test accuracy, mean (min-max), runs",
        "dpmp: epsilon",
        "dpmp: noise multiplier",
        "paper: noise multiplier",
        "time a run, mean",
        "host",
    ]
    return _table(header, rows)


def reproduction_runs(name: str) -> str:
    """What rerunning each row takes: its config, steps and expected batch (the
    measured settings, else the config's), the measured time a step and a run, and
    the data's loading (once a row)."""
    data, measured = _measured_rows(name)
    rows = []
    for key, label in PAPER_ROWS.items():
        config = f"configs/fashion_mnist_{key}.toml"
        r = measured.get(key)
        t = r["settings"] if r else tomllib.loads((ROOT / config).read_text())["training"]
        cells = [label, f"`{config}`", f"{t['steps']:,} x {t['expected_batch_size']:,}"]
        if r is None:
            rows.append([*cells, NOT_MEASURED, NOT_MEASURED, NOT_MEASURED])
            continue
        wall = {k: v / 60 for k, v in r["wall_s"].items() if v is not None}
        rows.append(
            [
                *cells,
                f"{r['wall_s']['mean'] / t['steps']:.2f} s",
                f"{wall['mean']:.1f} min ({wall['min']:.1f}-{wall['max']:.1f})",
                f"{r['data_s']:.1f} s",
            ]
        )
    header = [
        "model",
        "config",
        "steps x expected batch",
        "a step (on the row's host, above)",
        "a run, mean (min-max)",
        "data and features, once",
    ]
    return _table(header, rows)


# What produces tune_fashion_mnist.json's search, until the file says what did.
TUNE_COMMAND = (
    "dpmp tune --config configs/fashion_mnist_scatter_linear.toml "
    "--range training.learning_rate=log:8:32 --candidates negative-binomial:-0.5:2 "
    "--out runs/fm_tune"
)
COUNT_NAMES = {"poisson": "Poisson", "truncated_negative_binomial": "truncated negative binomial"}


def _candidates(count: dict) -> str:
    """The distribution of K, its mean (``CandidateCount.record()``) and what drew K."""
    kind = count["distribution"]
    params = ", ".join(f"{k} {count[k]:.4g}" for k in ("eta", "gamma") if k in count)
    shape = COUNT_NAMES.get(kind, kind) + (f" ({params})" if params else "")
    return f"{shape}, mean {count['mean']:.3g}; drawn from {count.get('drawn_from', '-')}"


def _chosen(tune: dict, best: dict) -> tuple[str, str]:
    """The chosen candidate's hyperparameters and released test accuracy."""
    chosen = tune["chosen"]
    if not chosen:
        return "none: the search drew no candidate", "-"
    values = ", ".join(
        f"`{k}` = {f'{v:.3g}' if isinstance(v, float) else v}"
        for k, v in chosen["hyperparameters"].items()
    )
    accuracy = chosen.get("test_accuracy")
    accuracy = best.get("test_accuracy") if accuracy is None else accuracy
    return values, "-" if accuracy is None else _percent(accuracy)


def _candidate_time(data: dict) -> str:
    """The chosen candidate's own training time: one run, which says nothing of K."""
    seconds = (data.get("best_report") or {}).get("train_s")
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def tune_search(name: str) -> str:
    """A ``dpmp tune`` search's release (its ``tune.json``, under ``"tune"``) with the
    command and machine that produced it and the chosen candidate's own training
    time (never the search's: it grows with the secret number of candidates); while
    the file is not committed, the command that will, and that it is not measured."""
    data = _optional(name)
    header = ["dpmp tune", "released"]
    if data is None:
        return _table(header, [["command", f"`{TUNE_COMMAND}`"], ["result", NOT_MEASURED]])
    tune = data["tune"]
    plan, score = tune["candidate_plan"], tune["score"]
    values, accuracy = _chosen(tune, data.get("best_report") or {})
    better = "higher" if score["higher_is_better"] else "lower"
    warnings = "; ".join(tune["privacy_warnings"])
    rows = [
        ["command", f"`{data['command']}`"],
        ["target epsilon", f"{tune['target_epsilon']:g}"],
        ["the whole search: epsilon, delta", f"{tune['epsilon']:#.4g}, {tune['delta']:g}"],
        ["candidates K (K itself is secret)", _candidates(tune["candidates"])],
        ["noise multiplier of each candidate", f"{plan['noise_multiplier']:.2f}"],
        [
            "one candidate's epsilon alone (by RDP, as the search accounts)",
            f"{plan['epsilon_alone']:#.4g}",
        ],
        ["ranges", ", ".join(f"`{k}={v}`" for k, v in tune["ranges"].items())],
        # tune.json's score.source: the held-out split, public data, no epsilon spent
        ["score", f"`{score['name']}` ({better} is better), held-out test split: public"],
        ["chosen", values],
        ["released test accuracy", accuracy],
        ["private", "yes" if tune["private"] else f"no: {warnings}"],
        # no wall time for the search: it grows with K, which is secret
        ["one candidate's run", _candidate_time(data)],
        ["machine", f"{data['host']}, commit {data['commit']}"],
    ]
    return _table(header, rows)


TABLES: dict[str, Callable[..., str]] = {
    "clipping": clipping,
    "bf16_speedup": bf16_speedup,
    "peers": peers,
    "step_profile": step_profile,
    "gpu_profile": gpu_profile,
    "noise_stage": noise_stage,
    "noise_memory": noise_memory,
    "noise_residual": noise_residual,
    "noise_step": noise_step,
    "ndtri": ndtri,
    "xla_components": xla_components,
    "xla_profile": xla_profile,
    "xla_options": xla_options,
    "donation": donation,
    "lora": lora,
    "lora_compile": lora_compile,
    "gpt2_step": gpt2_step,
    "llm_families": llm_families,
    "user_level": user_level,
    "privacy_units": privacy_units,
    "gpt2_checkpoint": gpt2_checkpoint,
    "ghost_operands": ghost_operands,
    "reproduction": reproduction,
    "reproduction_runs": reproduction_runs,
    "tune_search": tune_search,
}


def placeholders(markdown: str) -> list[tuple[str, tuple, dict]]:
    """``(kind, files, options)`` of each ``{{ table(...) }}`` line of a page."""
    found = []
    for m in PLACEHOLDER.finditer(markdown):
        call = ast.parse(f"table({m.group('args')})", mode="eval").body
        args = tuple(ast.literal_eval(a) for a in call.args)
        options = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        found.append((args[0], args[1:], options))
    return found


def render(kind: str, files: tuple, options: dict) -> str:
    if kind not in TABLES:
        raise ValueError(f"table({kind!r}): no such table; known: {', '.join(sorted(TABLES))}")
    return TABLES[kind](*files, **options)


def expand(markdown: str) -> str:
    """The page with each placeholder replaced by its table."""

    def one(m: re.Match) -> str:  # indented as the placeholder is (inside a list item)
        ((kind, files, options),) = placeholders(m.group(0))
        return "\n".join(
            m.group("indent") + line for line in render(kind, files, options).split("\n")
        )

    return PLACEHOLDER.sub(one, markdown)


def on_page_markdown(markdown: str, **kwargs) -> str:
    """mkdocs hook: the page's benchmark tables, from ``benchmarks/results/``."""
    return expand(markdown)
