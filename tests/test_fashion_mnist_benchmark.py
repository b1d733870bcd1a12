"""benchmarks/reproductions/tramer_boneh.py: its command line, its summary of runs,
and (with Debian's dataset-fashion-mnist installed) its --quick run end to end."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dpmp.data.sources._fashion_mnist import FOLDER

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "reproductions" / "tramer_boneh.py"


def _module():
    spec = importlib.util.spec_from_file_location("tramer_boneh", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line_and_its_defaults():
    tb = _module()
    args = tb.parse_args([])
    assert args.rows == ["cnn", "scatter_linear", "scatter_cnn"] and args.runs == 3
    assert args.json.endswith("benchmarks/results/tramer_boneh.json")
    quick = tb.parse_args(["--quick", "--rows", "scatter_linear"])
    assert quick.runs == 1 and quick.json.endswith("tramer_boneh_quick.json")
    with pytest.raises(SystemExit):
        tb.parse_args(["--runs", "0"])
    # every row has its config and the paper's number
    assert all((tb.CONFIGS / f"fashion_mnist_{r}.toml").is_file() for r in tb.PUBLISHED)


def test_the_spread_of_runs_is_statistics():
    tb = _module()
    values = [0.891, 0.887, 0.894]
    got = tb.spread(values)
    assert got["mean"] == pytest.approx(sum(values) / 3, rel=1e-15)
    assert got["std"] == pytest.approx(statistics.stdev(values), rel=1e-15)
    assert (got["min"], got["max"]) == (0.887, 0.894)
    assert tb.spread([0.5])["std"] is None


def test_rows_measured_apart_share_one_file_each_with_its_machine(tmp_path):
    """A file written when rows carried no machine of their own gives each row the
    file's; a row measured again replaces its row and runs, the others stay, in the
    paper's order."""
    tb = _module()
    old = {
        "host": "x86_64, 2 CPU cores",
        "platform": "cpu",
        "command": "python benchmarks/reproductions/tramer_boneh.py --rows scatter_linear",
        "rows": [{"row": "scatter_linear", "runs": 1}, {"row": "scatter_cnn", "runs": 1}],
        "runs": [{"row": "scatter_linear", "run": 1}, {"row": "scatter_cnn", "run": 1}],
    }
    path = tmp_path / "tb.json"
    path.write_text(json.dumps(old))
    previous = tb._previous(path)
    assert all(
        r["host"] == old["host"] and r["command"] == old["command"] for r in previous["rows"]
    )
    new_rows = [{"row": "scatter_cnn", "runs": 2, "host": "gpu box"}, {"row": "cnn", "runs": 2}]
    new_runs = [{"row": r, "run": i} for r in ("scatter_cnn", "cnn") for i in (2, 1)]
    got = tb.merged(previous, new_rows, new_runs, {"benchmark": "tramer_boneh"})
    assert [r["row"] for r in got["rows"]] == ["cnn", "scatter_linear", "scatter_cnn"]
    assert got["rows"][1]["host"] == old["host"] and got["rows"][2]["host"] == "gpu box"
    assert [(r["row"], r["run"]) for r in got["runs"]] == [
        ("cnn", 1),
        ("cnn", 2),
        ("scatter_linear", 1),
        ("scatter_cnn", 1),
        ("scatter_cnn", 2),
    ]
    assert got["benchmark"] == "tramer_boneh" and tb._previous(tmp_path / "none.json") == {}


def test_help_runs_without_importing_jax():
    code = (
        "import runpy, sys\n"
        "sys.argv = ['tramer_boneh.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('jax' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--quick" in out.stdout and out.stdout.strip().endswith("False")


@pytest.mark.slow  # loads Fashion-MNIST and computes or reads its scattering features
@pytest.mark.skipif(
    not (FOLDER / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_a_quick_run_of_one_row_writes_its_json(tmp_path):
    out = tmp_path / "tb.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--rows", "scatter_linear", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["row"] == "scatter_linear" and row["runs"] == 1 and result["quick"]
    (run,) = result["runs"]
    assert run["steps"] == 4 and run["epsilon"] <= 3.0 and run["audit_ok"]
    assert 0.0 <= run["test_accuracy"] <= 1.0 and run["clip_method"] == "ghost"
