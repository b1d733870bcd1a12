"""The README is a front door: its install line, its commands and its example are true.

Its example (``dpmp.private_step`` in a loop of one's own) runs here as a script and
must learn: the held-out accuracy it prints is far above chance.
"""

import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str) -> list[str]:
    return [code for kind, code in FENCE.findall(README) if kind == lang]


def _lines(code: str) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in code.splitlines() if line.strip()]


def test_the_install_line_installs_this_checkout():
    """``pip install .`` names this repository's own project, and no index claims it."""
    installs = [line for code in _blocks("bash") for line in _lines(code) if "pip install" in line]
    assert installs == ["pip install ."]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "dpmp"
    assert "PyPI" not in README or "not on PyPI" in README


def test_the_commands_are_the_makefiles_and_the_test_command_is_cis():
    makefile = (ROOT / "Makefile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for code in _blocks("bash") for line in _lines(code)]
    assert [c for c in commands if c.startswith("make ")] == ["make setup", "make run", "make test"]
    for target in ("setup", "run", "test", "docs"):
        assert re.search(rf"^{target}:", makefile, re.M), target
    # CI runs the README's test command, then the slow tests and the docs, as it says
    ci_commands = [line.strip() for line in ci.splitlines() if not line.strip().startswith("#")]
    assert "make test" in ci_commands and "make docs" in ci_commands
    slow = re.search(r"`(\.venv/bin/python -m pytest[^`]*)`", README).group(1)
    assert slow in ci_commands
    test_recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    pytest_args = re.search(r"`pytest ([^`]*)`", README).group(1)
    assert f"-m pytest -q {pytest_args}" in test_recipe


@pytest.mark.slow
def test_the_private_step_example_runs_and_learns(tmp_path):
    (code,) = _blocks("python")
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    accuracy = float(re.search(r"held-out accuracy ([\d.]+)", out.stdout).group(1))
    # 500 held-out points, balanced labels: chance is 0.5 with a standard deviation
    # of sqrt(0.25 / 500) = 0.022; ten of them above it is no accident
    assert accuracy > 0.5 + 10 * math.sqrt(0.25 / 500), out.stdout
