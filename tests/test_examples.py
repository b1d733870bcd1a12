"""Every example runs and prints the result its docstring promises."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def run(name, *args):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_mixed_precision_step_agrees_with_hand_written():
    out = run("mixed_precision_step.py")
    assert "by hand and dpmp agree exactly: True" in out
    losses = [float(line.split()[1]) for line in out.splitlines()[1:-1]]
    assert len(losses) == 5 and all(a > b for a, b in zip(losses, losses[1:]))


@pytest.mark.parametrize(
    "name", sorted(p.name for p in EXAMPLES.glob("*.py") if p.name != "mixed_precision_step.py")
)
def test_other_examples_run(name):
    run(name)


def test_readme_quick_start_runs():
    """The README's quick start is code that works, not prose."""
    import re

    readme = (EXAMPLES.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    code += (
        "\nassert out.grads['w'].dtype == jnp.float32"
        "\nassert float(abs(params['w']).max()) > 0\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
