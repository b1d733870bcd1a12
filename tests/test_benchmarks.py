"""benchmarks/peers.py reads its arguments without torch, and its two frameworks' models match.

The benchmark itself is not part of the test suite (it takes minutes and needs
an idle machine); these checks run its command line and its model builders.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers.py"


def _run_without_torch(*args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/peers.py ARGS`` with torch and opacus made unimportable."""
    code = (
        "import runpy, sys\n"
        "sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
        "sys.modules['opacus'] = None\n"
        f"sys.argv = ['peers.py', *{list(args)!r}]\n"
        f"runpy.run_path({str(PEERS)!r}, run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_peers_help_needs_no_torch():
    out = _run_without_torch("--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--quick", "--json", "--threads", "--models", "--variants"):
        assert flag in out.stdout


def test_peers_without_torch_says_what_to_install():
    out = _run_without_torch("--models", "cnn", "--quick")
    assert out.returncode != 0
    assert "pip install -e '.[bench]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # ~40 s on 2 CPU cores: six models built in both frameworks
def test_peers_models_have_equal_parameter_counts():
    """The JAX and PyTorch models the benchmark compares, at their full sizes (the
    benchmark asserts it too, but only when it runs)."""
    pytest.importorskip("torch")
    pytest.importorskip("opacus")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(PEERS.parent)!r})\n"
        "import jax, peers\n"
        "for m in peers.MODELS:\n"
        "    _, params, _, sizes = peers.jax_model(m, 2, quick=False)\n"
        "    n = sum(x.size for x in jax.tree.leaves(params))\n"
        "    t = sum(p.numel() for p in peers.torch_module(m, sizes).parameters())\n"
        "    print(m, n, t)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    counts = {
        m: (int(n), int(t)) for m, n, t in (line.split() for line in out.stdout.split("\n") if line)
    }
    assert counts == {
        "mlp": (2_913_290, 2_913_290),
        "cnn": (25_578, 25_578),
        "vit": (74_954, 74_954),
        "lm": (3_323_648, 3_323_648),
        "guide_vit": (10_694_794, 10_694_794),
        "gpt2": (162_399_313, 162_399_313),
    }
