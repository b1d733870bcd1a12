"""benchmarks/peers.py reads its arguments without torch, and its two frameworks' models match;
benchmarks/step_profile.py attributes a step's kernels to its stages.

The benchmarks themselves are not part of the test suite (they take minutes and
need an idle machine); these checks run their command lines, model builders and
parsers.
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


def test_step_profile_busy_time_is_the_union_of_kernel_intervals(monkeypatch):
    """benchmarks/step_profile.py's device busy time: overlapping kernels count once,
    against a count of busy nanoseconds one by one."""
    # on the path for this test only: benchmarks/transformers.py would hide the package
    monkeypatch.syspath_prepend(str(PEERS.parent))
    import numpy as np
    import step_profile

    rng = np.random.default_rng(0)
    for _ in range(20):
        starts = rng.integers(0, 200, size=12)
        spans = [(int(a), int(a + d)) for a, d in zip(starts, rng.integers(0, 40, size=12))]
        busy = np.zeros(260, bool)
        for a, b in spans:
            busy[a:b] = True
        assert step_profile._union(spans) == busy.sum()


def test_step_profile_reads_instructions_and_their_op_names(monkeypatch):
    monkeypatch.syspath_prepend(str(PEERS.parent))
    import jax
    import jax.numpy as jnp
    import step_profile

    def f(x):
        with jax.named_scope("dpmp_noise"):
            y = jnp.sin(x) * 2
        return jax.lax.fori_loop(0, 3, lambda i, v: v @ x, y)

    x = jnp.ones((8, 8))
    ops = step_profile.instructions(jax.jit(f).lower(x).compile().as_text())
    assert any(opcode == "while" for opcode, _ in ops.values())
    assert any("dpmp_noise/sin" in op for _, op in ops.values())


@pytest.mark.slow  # ~15 s: two tiny models' steps compiled, run and traced
def test_step_profile_attributes_the_private_steps_time_to_its_stages(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [sys.executable, str(PEERS.parent / "step_profile.py"), "--quick", "--models", "mlp",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    import json

    rec = json.loads(out.read_text())["models"]["mlp"]
    private = rec["private"]["kernel_ms_by_stage"]
    for stage in ("forward_backward", "norms", "clipped_sum", "noise", "optimizer"):
        assert private.get(stage, 0) > 0, (stage, private)
    assert set(rec["non-private"]["kernel_ms_by_stage"]) <= {"rest", "unnamed"}
    attributed = sum(private.values())
    assert rec["private"]["unmatched_ms"] < 0.05 * attributed
