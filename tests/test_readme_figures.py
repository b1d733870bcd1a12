"""The benchmark tables of docs/performance.md are the committed JSON's numbers, row by row."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"
NAMES = {"guide_vit": "guide ViT", "lm": "LM"}

# (results file, how the non-private column prints its time and memory)
TABLES = {
    "cpu_2core.json": lambda s, b: f"{s * 1e3:,.0f} ms, {b / 1e6:.1f} MB",
    "cpu_2core_transformers.json": lambda s, b: f"{s * 1e3:,.0f} ms, {b / 1e6:,.0f} MB",
    "gpu_h100_transformers.json": lambda s, b: f"{s * 1e3:,.2f} ms, {b / 1e6:,.0f} MB",
    "gpu_h100_transformers_gpt2.json": lambda s, b: f"{s * 1e3:,.2f} ms, {b / 1e6:,.0f} MB",
}
# a file whose "lm" is another shape
MODEL_NAMES = {"gpu_h100_transformers_gpt2.json": {"lm": "GPT-2 shape"}}


def _rows(name: str) -> list[str]:
    data = json.loads((RESULTS / name).read_text())
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for r in data["runs"]:
        runs.setdefault((r["model"], r["policy"]), {})[r["method"]] = r
    rows = []
    for (model, policy), by_method in runs.items():
        base = by_method["nonprivate"]
        first = TABLES[name](base["median_s"], base["temp_bytes"])
        names = {**NAMES, **MODEL_NAMES.get(name, {})}
        cells = [names.get(model, model), policy, first]
        for method in ("jaxprivacy", "dpmp_vmap", "dpmp_ghost"):
            if method not in by_method:  # a run without that method: its table has no column
                continue
            r = by_method[method]
            cells.append(f"{r['time_ratio']:.2f}x time, {r['mem_ratio']:.2f}x mem")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


@pytest.mark.parametrize("name", sorted(TABLES))
def test_benchmark_rows_are_the_committed_results(name):
    text = PAGE.read_text()
    missing = [row for row in _rows(name) if row not in text]
    assert not missing, (
        f"docs/performance.md's table for benchmarks/results/{name} does not match the file; "
        "expected rows:\n" + "\n".join(missing)
    )


NOISE = RESULTS / "cpu_2core_noise.json"


def noise_rows(data: dict) -> list[str]:
    """The docs' rows for benchmarks/noise.py's results."""
    rows = [
        "| coordinates | plain (float32 `jax.random.normal`) | snapped (default) | time ratio |",
        "|---|---|---|---|",
    ]
    for r in data["noise_stage"]:
        ns, b = r["ns_per_coordinate"], r["temp_bytes_per_coordinate"]
        cells = [f"{ns[k]:.1f} ns, {b[k]:.1f} B temp per coordinate" for k in ("plain", "snapped")]
        rows.append(f"| {r['size']:,} | {cells[0]} | {cells[1]} | {r['time_ratio']:.2f}x |")
    rows += [
        "",
        "| MLP, bf16, batch 64 (compiled, not run) | non-private step (`jax.grad`, Adam) "
        "| private step (ghost clipping, snapped noise, Adam) | ratio |",
        "|---|---|---|---|",
    ]
    for r in data["step_memory"]:
        m = r["memory"]
        rows.append(
            f"| {r['params']:,} parameters | {m['nonprivate']['total'] / 2**20:,.1f} MiB "
            f"| {m['private']['total'] / 2**20:,.1f} MiB | {r['ratio']:.2f}x |"
        )
    steps = sorted({r["steps"] for r in data["residual"]})
    rows += [
        "",
        "| epsilon added (RDP, q 0.01, sigma 1, delta 1e-5; summing every cell's bound "
        "instead) | " + " | ".join(f"{s:,} steps" for s in steps) + " |",
        "|---" * (len(steps) + 1) + "|",
    ]
    by_params: dict[int, dict[int, dict]] = {}
    for r in data["residual"]:
        by_params.setdefault(r["params"], {})[r["steps"]] = r
    for params, row in by_params.items():
        cells = [f"{row[s]['residual']:.2g} ({row[s]['summed_cells_bound']:.3g})" for s in steps]
        rows.append(f"| {params:,} parameters | " + " | ".join(cells) + " |")
    s = data["private_step"]
    rows += [
        "",
        f"The default run's private step: {1e3 * s['seconds']['plain']:.2f} ms with plain "
        f"noise, {1e3 * s['seconds']['snapped']:.2f} ms snapped ({s['time_ratio']:.2f}x).",
    ]
    return rows


def test_noise_figures_are_the_committed_results():
    text = PAGE.read_text()
    missing = [row for row in noise_rows(json.loads(NOISE.read_text())) if row not in text]
    assert not missing, (
        "docs/performance.md's noise tables do not match " + str(NOISE) + ":\n" + "\n".join(missing)
    )


def test_lora_table_is_the_committed_results():
    """docs/language-models.md's perplexity table is benchmarks/results/lm_lora.json's."""
    runs = json.loads((RESULTS / "lm_lora.json").read_text())
    text = (ROOT / "docs" / "language-models.md").read_text()
    rows = {
        "from scratch": "| random (`configs/lm.toml`) | all 137,538 parameters | {} |",
        "LoRA after public pre-training": "| public pre-training (`configs/lm_lora.toml`) "
        "| LoRA rank 8: 21,008 adapter parameters | {} |",
        "full fine-tuning after public pre-training": "| public pre-training | all 137,538 "
        "parameters (`lora_rank = 0`, learning rate 3e-3) | {} |",
    }
    for mode, row in rows.items():
        by_eps = {r["target_epsilon"]: r["test_perplexity"] for r in runs if r["mode"] == mode}
        cells = [f"{by_eps[e]:.2f}" for e in (1.0, 2.0, 8.0)]
        if mode.startswith("LoRA"):
            cells = [f"**{c}**" for c in cells]
        assert row.format(" | ".join(cells)) in text, mode


def test_lora_compile_table_is_the_committed_results():
    """docs/language-models.md's compile table is benchmarks/results/lora_compile.json's."""
    rows = json.loads((RESULTS / "lora_compile.json").read_text())["rows"]
    text = (ROOT / "docs" / "language-models.md").read_text()
    by = {(r["dim"], r["depth"], r["step"]): r for r in rows}
    for dim, depth in sorted({(r["dim"], r["depth"]) for r in rows}):
        p, n = by[dim, depth, "private"], by[dim, depth, "non-private"]
        name = f"{dim} x {depth}" + (" (GPT-2 shape)" if (dim, depth) == (768, 12) else "")
        base = p["base_params"] / 1e6
        cells = [
            name,
            f"{base:.2g}M" if base < 10 else f"{base:.1f}M",
            f"{p['hlo_text_mb']:.2f} / {n['hlo_text_mb']:.2f} MB",
            f"{p['compile_s']:.1f} / {n['compile_s']:.1f} s ({p['compile_vs_non_private']:.2f}x)",
            f"{p['compiled_mb']:,.0f} / {n['compiled_mb']:,.0f} MB",
        ]
        row = "| " + " | ".join(cells) + " |"
        assert row in text, f"docs/language-models.md lacks the row:\n{row}"


GPT2_ROWS = {
    "lora": "LoRA rank 8 (`configs/gpt2_lora.toml`) | {:,} adapter parameters",
    "full": "full fine-tuning (`model.lora_rank = 0`) | all {:,} parameters",
}


def gpt2_rows(data: dict) -> list[str]:
    """docs/language-models.md's rows for benchmarks/gpt2.py's results."""
    by_step = {(r["row"], r["step"]): r for r in data["rows"]}
    first = data["rows"][0]
    rows = [
        f"| GPT-2 small, bf16, batch {first['batch']} x {first['tokens']} tokens | trained "
        "| clip method (`auto`) | non-private step | private step | private / non-private |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ratio in data["ratios"]:
        name = ratio["row"]
        steps = [by_step[name, kind] for kind in ("non-private", "private")]
        cells = [GPT2_ROWS[name].format(steps[0]["trainable_params"]), ratio["clip_method"]]
        for r in steps:
            time = f"{r['step_s']:,.2f} s" if "step_s" in r else "not timed"
            cells.append(f"{time}, {r['compiled_mb']:,.0f} MB, compiled in {r['compile_s']:.1f} s")
        times = f"{ratio['time_ratio']:.2f}x time, " if "time_ratio" in ratio else ""
        memory = f"{ratio['memory_ratio']:.2f}x memory"
        cells.append(f"{times}{memory}, {ratio['compile_ratio']:.1f}x compile time")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def test_gpt2_step_table_is_the_committed_results():
    """docs/language-models.md's GPT-2-small step table is benchmarks/gpt2.py's results."""
    data = json.loads((RESULTS / "cpu_2core_gpt2.json").read_text())
    text = (ROOT / "docs" / "language-models.md").read_text()
    missing = [row for row in gpt2_rows(data) if row not in text]
    assert not missing, "expected rows:\n" + "\n".join(missing)


PEER_COLUMNS = (
    "jax_nonprivate",
    "dpmp",
    "dpmp_plain",
    "dpmp_f32sum",
    "dpmp_nonoise",
    "jaxprivacy",
    "torch_nonprivate",
    "opacus_hooks",
    "opacus_ghost",
    "opacus_functorch",
)


def peers_rows(data: dict, ms_format: str = ",.0f") -> list[str]:
    """docs/performance.md's rows for benchmarks/peers.py's results: each variant's
    milliseconds a step (in ``ms_format``) and its ratio to its own framework's
    non-private step, for the variants the run timed, then dpmp's default step over
    the fastest Opacus mode's."""
    rows = []
    for model, rec in data["models"].items():
        v = rec["variants"]
        cells = [f"{model}, {rec['params']:,} params, batch {rec['batch']}"]
        for name in (n for n in PEER_COLUMNS if n in v):
            ms = f"{v[name]['median_s'] * 1e3:{ms_format}} ms"
            own = v[name]["x_own_nonprivate"]
            cells.append(ms if name.endswith("nonprivate") else f"{ms}, {own:.2f}x")
        cells.append(f"{v['dpmp']['x_fastest_opacus']:.2f}x ({rec['fastest_opacus']})")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


# (results file, how its table prints milliseconds)
PEER_TABLES = {
    "cpu_2core_peers.json": ",.0f",
    "gpu_h100_peers.json": ",.2f",
    "gpu_h100_peers_bf16.json": ",.2f",
}


@pytest.mark.parametrize("name", sorted(PEER_TABLES))
def test_peers_table_is_the_committed_results(name):
    """docs/performance.md's tables against Opacus and jax-privacy are benchmarks/peers.py's."""
    data = json.loads((RESULTS / name).read_text())
    missing = [row for row in peers_rows(data, PEER_TABLES[name]) if row not in PAGE.read_text()]
    assert not missing, f"{name}: expected rows:\n" + "\n".join(missing)


PROFILE_STAGES = (
    "forward_backward",
    "norms",
    "clipped_sum",
    "noise",
    "optimizer",
    "rest",
    "unnamed",
)


def profile_rows(data: dict) -> list[str]:
    """docs/performance.md's rows for benchmarks/step_profile.py's results: the steps'
    times, then the private step's kernel (thunk) milliseconds by stage."""
    rows = []
    for model, rec in data["models"].items():
        n, p = rec["non-private"], rec["private"]
        cells = [
            f"{model}, batch {rec['batch']}",
            f"{n['ms_per_step']:,.0f} ms",
            f"{p['ms_per_step']:,.0f} ms, {p['ms_per_step'] / n['ms_per_step']:.2f}x",
        ]
        by_stage = p["kernel_ms_by_stage"]
        cells += [f"{by_stage[s]:,.1f}" if s in by_stage else "-" for s in PROFILE_STAGES]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def test_step_profile_table_is_the_committed_results():
    data = json.loads((RESULTS / "cpu_2core_step_profile.json").read_text())
    missing = [row for row in profile_rows(data) if row not in PAGE.read_text()]
    assert not missing, "expected rows:\n" + "\n".join(missing)


def test_gpu_profile_table_is_the_committed_results():
    """The GPU profile's private rows (step, busy time, loops and conditionals) and the
    range of its non-private step's times are benchmarks/results/gpu_h100_step_profile.json's."""
    data = json.loads((RESULTS / "gpu_h100_step_profile.json").read_text())
    page = PAGE.read_text()
    labels = {
        "pieces of chunk_size, a conditional each (d1f8d58)": "private, noise in pieces, "
        "a conditional each (as measured above)",
        "pieces of chunk_size, no conditional": "private, noise in pieces, no conditional",
        "one piece per leaf up to SNAP_CHUNK, no conditional": "private, noise one piece per "
        "leaf (now)",
    }
    nonprivate, busy = [], []
    for run, label in labels.items():
        rec = data["runs"][run]["f32"]["guide_vit"]
        p, n = rec["private"], rec["non-private"]
        nonprivate.append(n["ms_per_step"])
        busy.append(n["device_busy_ms_per_step"])
        flow = p["control_flow"]
        row = (
            f"| {label} | {p['ms_per_step']:.1f} ms | {p['device_busy_ms_per_step']:.1f} ms | "
            f"{flow.get('while', 0)}, {flow.get('conditional', 0)} |"
        )
        assert row in page, row
    row = (
        f"| non-private | {min(nonprivate):.1f}-{max(nonprivate):.1f} ms | "
        f"{min(busy):.1f}-{max(busy):.1f} ms | 0, 0 |"
    )
    assert row in page, row


def test_donation_table_is_the_committed_results():
    """docs/own-model.md's float32 rows are benchmarks/results/cpu_2core_donation.json's."""
    data = json.loads((RESULTS / "cpu_2core_donation.json").read_text())
    page = (ROOT / "docs" / "own-model.md").read_text()
    for r in data["rows"]:
        if r["policy"] != "fp32":
            continue
        n = r["params"]
        row = (
            f"| {n:,} parameters, batch {r['batch']} | {r['kept']['total'] / n:.1f} | "
            f"{r['donated']['total'] / n:.1f} |"
        )
        assert row in page, row


def test_ndtri_table_is_the_committed_results():
    """docs/performance.md's ndtri table is benchmarks/results/cpu_2core_ndtri.json's."""
    text = PAGE.read_text()
    for r in json.loads((RESULTS / "cpu_2core_ndtri.json").read_text())["ndtri"]:
        ns, up, cup = r["ns_per_coordinate"], r["speedup"], r["cpu_speedup"]
        row = (
            f"| {r['size']:,} | {ns['draw_jax']:.1f} ns | {ns['draw_dpmp']:.1f} ns | "
            f"{up['draw']:.2f}x, {cup['draw']:.2f}x | {ns['ndtri_jax']:.1f} ns | "
            f"{ns['ndtri_dpmp']:.1f} ns | {up['ndtri']:.2f}x, {cup['ndtri']:.2f}x |"
        )
        assert row in text, row
