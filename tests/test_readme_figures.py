"""The README's benchmark tables are the committed JSON's numbers, row for row."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
NAMES = {"guide_vit": "guide ViT", "lm": "LM"}

# (results file, how the non-private column prints its time and memory)
TABLES = {
    "cpu_2core.json": lambda s, b: f"{s * 1e3:,.0f} ms, {b / 1e6:.1f} MB",
    "cpu_2core_transformers.json": lambda s, b: f"{s * 1e3:,.0f} ms, {b / 1e6:,.0f} MB",
    "gpu_h100_transformers.json": lambda s, b: f"{s * 1e3:,.2f} ms, {b / 1e6:,.0f} MB",
}


def _rows(name: str) -> list[str]:
    data = json.loads((RESULTS / name).read_text())
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for r in data["runs"]:
        runs.setdefault((r["model"], r["policy"]), {})[r["method"]] = r
    rows = []
    for (model, policy), by_method in runs.items():
        base = by_method["nonprivate"]
        first = TABLES[name](base["median_s"], base["temp_bytes"])
        cells = [NAMES.get(model, model), policy, first]
        for method in ("jaxprivacy", "dpmp_vmap", "dpmp_ghost"):
            r = by_method[method]
            cells.append(f"{r['time_ratio']:.2f}x time, {r['mem_ratio']:.2f}x mem")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


@pytest.mark.parametrize("name", sorted(TABLES))
def test_readme_benchmark_rows_are_the_committed_results(name):
    text = README.read_text()
    missing = [row for row in _rows(name) if row not in text]
    assert not missing, (
        f"README.md's table for benchmarks/results/{name} does not match the file; "
        "expected rows:\n" + "\n".join(missing)
    )
