"""The docs' benchmark figures are the committed results.

Every table is generated from ``benchmarks/results/*.json`` when the site is
built (``docs/hooks.py``): each placeholder of the docs must name a table kind
and committed files, and expand to a well-formed table. The few figures that
prose still states by hand are checked against the files they come from.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted(DOCS.rglob("*.md"))


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


def _placeholders() -> list:
    return [
        pytest.param(kind, files, options, id=f"{page.name}:{kind}:{','.join(files)}")
        for page in PAGES
        for kind, files, options in hooks.placeholders(page.read_text())
    ]


def test_the_docs_have_generated_tables_and_no_placeholder_is_malformed():
    for page in PAGES:
        text = page.read_text()
        # a placeholder the hook would not see (not alone on its line) would stay raw
        assert text.count("{{ table(") == len(hooks.placeholders(text)), page.name
    assert len(_placeholders()) >= 20


@pytest.mark.parametrize(("kind", "files", "options"), _placeholders())
def test_each_placeholder_expands_to_a_table_of_its_committed_file(kind, files, options):
    for name in files:
        assert (RESULTS / name).is_file(), f"benchmarks/results/{name} is not there"
    lines = hooks.render(kind, files, options).splitlines()
    header, rule, *rows = lines
    width = header.count(" | ")
    assert set(rule.replace("|", "").split()) == {"---"} and rule.count(" | ") == width
    assert rows and all(row.count(" | ") == width for row in rows), lines
    assert not any("nan" in row.split(" | ") for row in rows)


def test_an_unknown_table_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="no such table.*clipping"):
        hooks.expand('{{ table("clipping_typo", "cpu_2core.json") }}')


def test_a_table_is_indented_as_its_placeholder():
    text = hooks.expand('- a list item\n\n  {{ table("donation", "cpu_2core_donation.json") }}\n')
    table = text.split("\n\n", 1)[1].rstrip("\n").splitlines()
    assert len(table) >= 3 and all(line.startswith("  | ") for line in table)


def test_a_generated_row_is_the_files_numbers():
    """One row re-derived from the JSON by hand, independently of the hook's code."""
    runs = json.loads((RESULTS / "cpu_2core.json").read_text())["runs"]
    by = {(r["model"], r["policy"], r["method"]): r for r in runs}
    base, ghost = by["mlp", "f32", "nonprivate"], by["mlp", "f32", "dpmp_ghost"]
    ms, mb = round(base["median_s"] * 1000), round(base["temp_bytes"] / 1e6, 1)
    table = hooks.render("clipping", ("cpu_2core.json",), {"mb": ".1f"})
    row = next(line for line in table.splitlines() if line.startswith("| mlp | f32 |"))
    assert f"| {ms} ms, {mb} MB |" in row
    assert row.endswith(f"| {ghost['time_ratio']:.2f}x time, {ghost['mem_ratio']:.2f}x mem |")


# -- the figures prose states by hand -----------------------------------------------------------


def _residual(params: int, steps: int) -> float:
    rows = json.loads((RESULTS / "cpu_2core_noise.json").read_text())["residual"]
    (row,) = [r for r in rows if r["params"] == params and r["steps"] == steps]
    return row["residual"]


def _xla_cnn_default(part: str) -> float:
    data = json.loads((RESULTS / "cpu_2core_xla_gap.json").read_text())
    return data[part]["default"]["models"]["cnn"]["jax_over_torch"]


def _params(name: str, model: str) -> int:
    return json.loads((RESULTS / name).read_text())["models"][model]["params"]


def _norm_growth(model: str) -> str:
    runs = json.loads((RESULTS / "cpu_2core_ghost_operands.json").read_text())["runs"]
    (run,) = [r for r in runs if r["model"] == model]
    return f"{(run['norm_mean_ratio'] - 1) * 100:.2f}"


def _bf16_speedup(name: str, model: str, method: str) -> str:
    runs = json.loads((RESULTS / name).read_text())["runs"]
    by = {r["policy"]: r for r in runs if r["model"] == model and r["method"] == method}
    return f"{by['f32']['median_s'] / by['bf16']['median_s']:.2f}"


def _result(name: str, *keys, scale: float = 1.0, fmt: str = ".1f") -> str:
    value = json.loads((RESULTS / name).read_text())
    for key in keys:
        value = value[key]
    return f"{value / scale:{fmt}}"


MESH, NOISE_COMPILE = "cpu_mesh.json", "mesh_noise_compile.json"
DIFFS = ("runs", "4_devices", "max_param_diff_relative")
MEMORY = ("memory_per_device_mlp_1024x1024",)

HAND_WRITTEN = [
    ("devices.md", "compiles in 5.8 s", lambda: _result(NOISE_COMPILE, "together", "compile_s")),
    (
        "devices.md",
        "against 40.4 s leaf",
        lambda: _result(NOISE_COMPILE, "leaf_by_leaf", "compile_s"),
    ),
    ("devices.md", "(CPU time 3.8 s", lambda: _result(NOISE_COMPILE, "together", "cpu_s")),
    ("devices.md", "28.1 s), and draws", lambda: _result(NOISE_COMPILE, "leaf_by_leaf", "cpu_s")),
    (
        "devices.md",
        "the same sigma (12.38)",
        lambda: _result(MESH, "runs", "4_devices", "noise_multiplier", fmt=".2f"),
    ),
    ("devices.md", "difference of 2.1e-4", lambda: _result(MESH, *DIFFS, 4, scale=1e-4)),
    ("devices.md", "growing to 1.6e-3", lambda: _result(MESH, *DIFFS, -1, scale=1e-3)),
    ("devices.md", "holds 3.4 MB", lambda: _result(MESH, *MEMORY, "sharded", "argument_mb")),
    (
        "devices.md",
        "instead of 13.6 MB",
        lambda: _result(MESH, *MEMORY, "replicated", "argument_mb"),
    ),
    (
        "devices.md",
        "from 105 MB to",
        lambda: _result(MESH, *MEMORY, "replicated", "temp_mb", fmt=".0f"),
    ),
    (
        "devices.md",
        "34 MB (`benchmarks/mesh.py`)",
        lambda: _result(MESH, *MEMORY, "sharded", "temp_mb", fmt=".0f"),
    ),
    ("precision.md", "grew by 0.08% on the guide", lambda: _norm_growth("guide_vit")),
    ("precision.md", "by 0.10% on the LM", lambda: _norm_growth("lm")),
    (
        "precision.md",
        "gradient up 1.43x on the guide ViT",
        lambda: _bf16_speedup("gpu_h100_transformers.json", "guide_vit", "dpmp_ghost"),
    ),
    (
        "precision.md",
        "1.39x at GPT-2 small's shape",
        lambda: _bf16_speedup("gpu_h100_transformers_gpt2.json", "lm", "dpmp_ghost"),
    ),
    ("limits.md", "0.0085 epsilon for 125M", lambda: f"{_residual(125_000_000, 5000):.2g}"),
    ("limits.md", "0.012 for 7B over 1,000", lambda: f"{_residual(7_000_000_000, 1000):.2g}"),
    ("limits.md", "0.16 for 10B over 10,000", lambda: f"{_residual(10_000_000_000, 10000):.2g}"),
    ("performance.md", "from 1.60x to", lambda: f"{_xla_cnn_default('options'):.2f}"),
    ("performance.md", "to 1.20x between", lambda: f"{_xla_cnn_default('options_cnn'):.2f}"),
    (
        "performance.md",
        "(10.7M parameters, batch 64)",
        lambda: f"{_params('gpu_h100_peers.json', 'guide_vit') / 1e6:.1f}",
    ),
    (
        "performance.md",
        "(3.3M, batch",
        lambda: f"{_params('cpu_2core_peers.json', 'lm') / 1e6:.1f}",
    ),
    (
        "performance.md",
        "projection: 162.4M parameters",
        lambda: f"{_params('gpu_h100_transformers_gpt2.json', 'lm') / 1e6:.1f}",
    ),
    (
        "performance.md",
        "for 2.9M coordinates",
        lambda: f"{_params('cpu_2core_peers.json', 'mlp') / 1e6:.1f}",
    ),
]


# ids from the page and the phrase alone (a function's repr differs between
# processes, and pytest-xdist's workers must collect the same ids)
@pytest.mark.parametrize(
    ("page", "phrase", "figure"), HAND_WRITTEN, ids=[f"{p}-{f[:30]}" for p, f, _ in HAND_WRITTEN]
)
def test_figures_in_prose_are_the_committed_results(page, phrase, figure):
    text = " ".join((DOCS / page).read_text().split())
    assert phrase in text, f"docs/{page} no longer says {phrase!r}: update this list"
    number = re.search(r"\d[\d,.]*\d|\d", phrase).group(0)
    assert number == figure(), f"docs/{page}: {phrase!r}, but the file gives {figure()}"
