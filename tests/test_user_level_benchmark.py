"""benchmarks/user_level.py: a run at a tiny size steps the same records a step at
both units, clips per user only at user level, and reports its rows' own ratios;
the committed result's rows are the sizes its docstring claims."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "user_level.py"
RESULT = ROOT / "benchmarks" / "results" / "cpu_2core_user_level.json"


def _module():
    """The script as a module; its folder on the path only while it imports (the
    folder holds a ``transformers.py`` that would hide the package)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("user_level", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def _check_ratios(result: dict) -> None:
    """Each ratio is its two rows' own numbers; both rows train the same model on the
    same records a step, the user-level one clipping per user."""
    for ratio in result["ratios"]:
        steps = {
            r["unit"]: r
            for r in result["rows"]
            if (r["row"], r["method"]) == (ratio["row"], ratio["method"])
        }
        record, user = steps["record"], steps["user"]
        assert ratio["memory_ratio"] == round(user["compiled_mb"] / record["compiled_mb"], 3)
        if "time_ratio" in ratio:
            assert ratio["time_ratio"] == round(user["step_s"] / record["step_s"], 3)
        assert record["trainable_params"] == user["trainable_params"]
        assert record["batch"] == ratio["users_per_step"] * ratio["user_records"]
        assert user["batch"] == ratio["users_per_step"]
        assert (record["clip_unit"], user["clip_unit"]) == ("example", "user")
        assert user["clip_method"] == record["clip_method"] == ratio["method"]


@pytest.mark.slow  # builds and compiles two steps and times them (about a minute)
def test_a_tiny_run_reports_its_own_ratios():
    ul = _module()
    argv = ["--rows", "small", "--methods", "ghost", "--batch", "4", "--user-records", "2"]
    result = ul.main([*argv, "--records-per-user", "3", "--tokens", "8", "--time", "1"])
    assert [(r["row"], r["method"]) for r in result["ratios"]] == [("small", "ghost")]
    assert "time_ratio" in result["ratios"][0]
    _check_ratios(result)


def test_the_committed_result_is_its_own_rows():
    result = json.loads(RESULT.read_text())
    _check_ratios(result)
    params = {r["row"]: r["trainable_params"] for r in result["rows"]}
    assert 95e6 < params["100m"] < 105e6  # "about 99 million parameters"
    assert all("step_s" not in r for r in result["rows"] if r["row"] == "100m")  # never run
