"""The docs' benchmark figures are the committed results.

Every table is generated from ``benchmarks/results/*.json`` when the site is
built (``docs/hooks.py``): each placeholder of the docs must name a table kind
and committed files, and expand to a well-formed table. The few figures that
prose still states by hand are checked against the files they come from.
"""

import importlib.util
import json
import re
import tomllib
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
    missing = [name for name in files if not (RESULTS / name).is_file()]
    table = hooks.render(kind, files, options)
    # a file not committed yet: its table says so (none renders a table from nothing)
    assert not missing or hooks.NOT_MEASURED in table, f"benchmarks/results/{missing} not there"
    lines = table.splitlines()
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


# -- reproductions.md: the paper's table beside dpmp's runs, and the search ----------------------

TRAMER_BONEH = "tramer_boneh.json"


def _cells(table: str) -> dict[str, list[str]]:
    """The body rows of a generated table, by their first cell."""
    rows = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    return {row[0]: row[1:] for row in rows}


def _published() -> dict[str, float]:
    """The paper's accuracies as the benchmark script states them (stdlib imports only)."""
    path = ROOT / "benchmarks" / "reproductions" / "tramer_boneh.py"
    spec = importlib.util.spec_from_file_location("tramer_boneh", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PUBLISHED


def _close(cell: str, value: float, digits: int) -> bool:
    """``cell`` (a number, then words) is ``value`` to ``digits`` decimals."""
    return abs(float(cell.split()[0].rstrip("%,")) - value) <= 0.5 * 10**-digits + 1e-12


def test_the_reproduction_table_is_the_files_numbers():
    """Every model of the paper, in a row; a measured one shows the file's mean accuracy
    to one decimal, its range, runs, epsilon, noise multiplier and time; the others say
    that they are not measured."""
    data = json.loads((RESULTS / TRAMER_BONEH).read_text())
    measured = {r["row"]: r for r in data["rows"]}
    published = _published()
    cells = _cells(hooks.render("reproduction", (TRAMER_BONEH,), {}))
    assert len(cells) == len(published) == 3 and measured
    for name, accuracy in published.items():
        row = cells[hooks.PAPER_ROWS[name]]
        assert row[0] == f"{round(accuracy * 100, 1)}%"
        r = measured.get(name)
        if r is None:
            assert row[1:4] == [hooks.NOT_MEASURED] * 3 and row[5] == hooks.NOT_MEASURED
            continue
        acc = r["test_accuracy"]
        assert r["published_accuracy"] == accuracy
        assert row[1].startswith(f"{round(acc['mean'] * 100, 1)}% (")
        assert (
            f"({round(acc['min'] * 100, 1)}-{round(acc['max'] * 100, 1)}), {r['runs']} run"
            in row[1]
        )
        # four significant digits of an epsilon near 3: within half a unit of the third decimal
        assert _close(row[2], r["epsilon"], 3)
        assert _close(row[3], r["noise_multiplier"], 2)
        # the page's claim: PLD of the snapped noise calibrates less noise than the paper's RDP
        assert float(row[3]) < float(row[4])
        assert _close(row[5], r["wall_s"]["mean"] / 60, 1)
        # where the row ran: its own host, with the accelerator where it had one
        host = r.get("host", data.get("host"))
        assert row[6] == host if r.get("platform", "cpu") == "cpu" else row[6].startswith(host)


@pytest.mark.parametrize("content", [None, {"host": "a host", "rows": [], "runs": []}])
def test_a_reproduction_without_measurements_says_so(content, tmp_path, monkeypatch):
    """No file yet, or a file without rows: three rows, the paper's figures, and
    "not yet measured" in every cell of dpmp's, never a blank or a number."""
    if content is not None:
        (tmp_path / TRAMER_BONEH).write_text(json.dumps(content))
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    cells = _cells(hooks.render("reproduction", (TRAMER_BONEH,), {}))
    for name, accuracy in _published().items():
        row = cells[hooks.PAPER_ROWS[name]]
        assert row[0] == f"{round(accuracy * 100, 1)}%"
        assert [row[i] for i in (1, 2, 3, 5)] == [hooks.NOT_MEASURED] * 4
    runs = _cells(hooks.render("reproduction_runs", (TRAMER_BONEH,), {}))
    assert all(row[2:] == [hooks.NOT_MEASURED] * 3 for row in runs.values())


def test_the_rerun_table_is_the_configs_and_the_files_times():
    data = json.loads((RESULTS / TRAMER_BONEH).read_text())
    measured = {r["row"]: r for r in data["rows"]}
    cells = _cells(hooks.render("reproduction_runs", (TRAMER_BONEH,), {}))
    for name, label in hooks.PAPER_ROWS.items():
        config = f"configs/fashion_mnist_{name}.toml"
        row = cells[label]
        training = tomllib.loads((ROOT / config).read_text())["training"]
        r = measured.get(name)
        steps = r["settings"]["steps"] if r else training["steps"]
        assert row[0] == f"`{config}`" and row[1].startswith(f"{steps:,} x ")
        if r is None:
            assert row[2:] == [hooks.NOT_MEASURED] * 3
            continue
        per_step = [x["s_per_step"] for x in data["runs"] if x["row"] == name]
        # the runs' own seconds a step were rounded to 1 ms before they were written
        assert abs(float(row[2].split()[0]) - sum(per_step) / len(per_step)) <= 0.005 + 0.0005
        assert _close(row[3], r["wall_s"]["mean"] / 60, 1)
        assert (
            f"({round(r['wall_s']['min'] / 60, 1)}-{round(r['wall_s']['max'] / 60, 1)})" in row[3]
        )


def test_a_search_not_committed_yet_shows_the_command_that_makes_it(tmp_path, monkeypatch):
    """No tune_fashion_mnist.json: "not yet measured", and a command `dpmp tune` accepts
    (its arguments, config, range and distribution checked as the command checks them
    before training)."""
    import argparse
    import shlex

    from dpmp.app.cli import tune as tune_command

    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    cells = _cells(hooks.render("tune_search", ("tune_fashion_mnist.json",), {}))
    assert cells["result"] == [hooks.NOT_MEASURED]
    words = shlex.split(cells["command"][0].strip("`"))
    assert words[:2] == ["dpmp", "tune"]
    parser = argparse.ArgumentParser()
    tune_command._arguments(parser)
    args = parser.parse_args(words[2:])
    monkeypatch.chdir(ROOT)
    args.precheck(args)
    assert tune_command._candidates(args.candidates).mean == pytest.approx(2.0)


def _keys(tree: dict, skip=("hyperparameters", "ranges", "config")) -> set[str]:
    out = set()
    for key, value in tree.items():
        out.add(key)
        if isinstance(value, dict) and key not in skip:
            out |= _keys(value)
    return out


def _written_keys() -> set[str]:
    """The keys tune.json can hold: the dict keys `_release` and the candidate counts'
    `record` write (read from the source: nothing imported)."""
    import ast

    found = set()
    for path, names in (("app/tune.py", {"_release"}), ("accounting/_tuning.py", {"record"})):
        tree = ast.parse((ROOT / "dpmp" / path).read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name in names:
                for node in ast.walk(fn):
                    if isinstance(node, ast.Dict):
                        found |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
    return found


def _tune_release(chosen: bool) -> dict:
    """A release with tune.json's keys (checked against the writer's source)."""
    return {
        "private": True,
        "privacy_warnings": [],
        "epsilon": 2.99812,
        "delta": 1e-5,
        "target_epsilon": 3.0,
        "chosen": {
            "run_dir": "best",
            "hyperparameters": {"training.learning_rate": 12.3456},
            "score": 0.89137,
            "test_accuracy": 0.89137,
            "test_loss": 0.61,
        }
        if chosen
        else None,
        "score": {"name": "test_accuracy", "higher_is_better": True, "source": "held out"},
        "ranges": {"training.learning_rate": "log:8.0:32.0"},
        "candidates": {
            "distribution": "truncated_negative_binomial",
            "eta": -0.5,
            "gamma": 0.0571,
            "mean": 2.0,
            "drawn_from": "OS entropy (secret)",
        },
        "candidate_plan": {"noise_multiplier": 4.4567, "epsilon_alone": 1.8765},
    }


@pytest.mark.parametrize("chosen", [True, False])
def test_a_committed_search_shows_its_release(chosen, tmp_path, monkeypatch):
    release = _tune_release(chosen)
    assert _keys(release) <= _written_keys()
    result = {"command": "dpmp tune --out x", "host": "h", "commit": "c"}
    best = {"test_accuracy": 0.5, "epsilon": 1.9, "train_s": 543.2}
    result |= {"tune": release, "best_report": best}
    (tmp_path / "tune.json").write_text(json.dumps(result))
    monkeypatch.setattr(hooks, "RESULTS", tmp_path)
    cells = {k: v[0] for k, v in _cells(hooks.render("tune_search", ("tune.json",), {})).items()}
    assert cells["command"] == f"`{result['command']}`"
    assert _close(cells["the whole search: epsilon, delta"], release["epsilon"], 3)
    assert cells["the whole search: epsilon, delta"].endswith(f", {release['delta']:g}")
    assert _close(cells["noise multiplier of each candidate"], 4.4567, 2)
    assert "eta -0.5" in cells["candidates K (K itself is secret)"]
    assert "mean 2" in cells["candidates K (K itself is secret)"]
    assert _close(cells["one candidate's run"], best["train_s"] / 60, 1)
    assert not any("wall" in k for k in cells)  # the search's time grows with the secret K
    if chosen:
        assert cells["released test accuracy"] == f"{round(0.89137 * 100, 1)}%"
        assert "`training.learning_rate` = 12.3" in cells["chosen"]
    else:
        assert cells["released test accuracy"] == "-" and cells["chosen"].startswith("none")


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
UNITS = "cpu_2core_privacy_units.json"
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
    ("language-models.md", "22% above the record-level", lambda: _unit_ppl_gap()),
    (
        "language-models.md",
        "needs noise 4.32 and",
        lambda: f"{_unit_row('els')['noise_multiplier']:.2f}",
    ),
    (
        "language-models.md",
        "does worse, 9.76",
        lambda: f"{_unit_row('els')['test_perplexity']:.2f}",
    ),
    (
        "language-models.md",
        "would need noise 4.94",
        lambda: _result(UNITS, "group_privacy", "noise_multiplier", fmt=".2f"),
    ),
]


def _unit_row(run: str) -> dict:
    rows = json.loads((RESULTS / UNITS).read_text())["rows"]
    (row,) = [r for r in rows if r["run"] == run]
    return row


def _unit_ppl_gap() -> str:
    users, records = _unit_row("uls")["test_perplexity"], _unit_row("record")["test_perplexity"]
    return f"{100 * (users / records - 1):.0f}"


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


def test_the_llm_families_table_is_the_files_numbers():
    """Each family's row: its parameters, what trains, and the private / non-private
    ratios recomputed here from the two steps' own compiled memory and compile CPU
    seconds."""
    name = "cpu_2core_llm_families.json"
    data = json.loads((RESULTS / name).read_text())
    lines = hooks.render("llm_families", (name,), {}).splitlines()[2:]
    assert len(lines) == len(data["ratios"]) > 0
    for line, ratio in zip(lines, data["ratios"], strict=True):
        cells = line.strip("| ").split(" | ")
        steps = {
            r["step"]: r
            for r in data["rows"]
            if (r["family"], r["row"]) == (ratio["family"], ratio["row"])
        }
        private, base = steps["private"], steps["non-private"]
        count = base["base_params"] or base["trainable_params"]
        assert cells[0] == f"{hooks.LLM_FAMILIES[ratio['family']]}, {count:,} parameters"
        assert f"{base['trainable_params']:,}" in cells[1]
        memory = private["compiled_mb"] / base["compiled_mb"]
        compile_cpu = private["compile_cpu_s"] / base["compile_cpu_s"]
        assert _close(cells[5].split("x memory")[0], memory, 2)
        assert _close(cells[5].split(", ")[1].split("x compile")[0], compile_cpu, 2)
        assert f"{private['compiled_mb']:,.0f} MB" in cells[4]
