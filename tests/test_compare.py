"""dpmp compare: its numbers are the compiled steps' own, measured independently."""

import collections

import jax
import numpy as np
import pytest

import dpmp
from dpmp.app import cli
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer.compare import KINDS, _steps, compare, format_table
from dpmp.app.trainer.step import build_private_step
from dpmp.noise._snapped import GROUP_MAX

SMALL = ["training.expected_batch_size=64", "privacy.noise_multiplier=1.0"]


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


@pytest.fixture(scope="module")
def rows(digits):
    return compare(load_config(None, SMALL), data=digits, policies=("fp32", "bf16"), repeats=1)


@pytest.mark.slow  # compiles and times six steps (the rows), then builds them again
def test_rows_are_the_steps_own_sizes(rows, digits):
    assert [(r["preset"], r["step"]) for r in rows] == [
        (p, k) for p in ("fp32", "bf16") for k in KINDS
    ]
    for policy in ("fp32", "bf16"):
        step = build_private_step(load_config(None, [*SMALL, f"policy={policy}"]), digits)
        params = step.example_args[0]
        # by hand: the default MLP 64-256-10 in float32 master weights
        mlp = 64 * 256 + 256 + 256 * 10 + 10
        assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)) == 4 * mlp
        private = next(r for r in rows if r["preset"] == policy and r["step"] == "private")
        assert private["param_bytes"] == 4 * mlp and private["param_dtype"] == "float32"
        temp = step.step_fn.lower(*step.example_args).compile().memory_analysis()
        assert private["temp_bytes"] == temp.temp_size_in_bytes
        assert private["clip_method"] == "ghost"  # the default, auto, on a supported MLP


def _sites(fn, args, policy) -> collections.Counter:
    """How many sites of each kind the precision audit finds in ``fn(*args)``."""
    report = dpmp.audit_precision(fn, *args, policy=policy, batch_argnums=1)
    return collections.Counter(f.kind for f in report.findings)


@pytest.mark.slow  # three audits of compiled steps a policy
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_each_share_measures_one_stage(rows, digits, policy):
    """The clipping share is the clipped step less the non-private one, which
    differ by the per-example norms and their clipped sum only; the noise share is
    the private step less the clipped one, which differ by the noise draws and
    additions only: for the leaves of more than ``GROUP_MAX`` coordinates one per
    size and dtype on XLA:CPU (drawn together) and one per leaf elsewhere, one per
    dtype for the smaller leaves, drawn together (the audit's sites of each step)."""
    config = load_config(None, [*SMALL, f"policy={policy}"])
    step = build_private_step(config, digits)
    steps = _steps(step, config)
    sites = {kind: _sites(f, args, config.precision) for kind, (f, args) in steps.items()}
    params = jax.tree.leaves(step.example_args[0])
    leaves = len(params)
    small = {p.dtype for p in params if p.size <= GROUP_MAX}
    big = [(p.size, p.dtype) for p in params if p.size > GROUP_MAX]
    draws = (len(set(big)) if jax.default_backend() == "cpu" else len(big)) + len(small)
    assert not {"norm", "noise_sample", "noise_add"} & set(sites["non-private"])
    clipping = sites["clipped"] - sites["non-private"]
    assert set(clipping) == {"norm", "batch_reduction"} and clipping["norm"] >= leaves
    assert not sites["non-private"] - sites["clipped"]
    assert sites["private"] - sites["clipped"] == {"noise_sample": draws, "noise_add": draws}
    assert not sites["clipped"] - sites["private"]

    # each row's bytes are its own compiled step's, and the stages' shares with the
    # non-private step's time make up the private step's time
    nonprivate, clipped, private = (r for r in rows if r["preset"] == policy)
    assert (nonprivate["step"], clipped["step"], private["step"]) == KINDS
    for row, kind in zip((nonprivate, clipped, private), KINDS, strict=True):
        fn, args = steps[kind]
        temp = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
        assert row["temp_bytes"] == temp, kind
    t = private["step_s"]
    shares = nonprivate["step_s"] / t + private["clip_share"] + private["noise_share"]
    assert shares == pytest.approx(1.0, rel=1e-9)
    stage_bytes = private["clip_temp_bytes"] + private["noise_temp_bytes"]
    assert nonprivate["temp_bytes"] + stage_bytes == private["temp_bytes"]
    assert f"{policy}: {private['policy']}, clipping by ghost: clipping " in format_table(rows)


@pytest.mark.slow  # ~24 s on 2 cores
def test_the_command_prints_the_table_and_refuses_a_bad_policy(capsys):
    argv = [
        "compare",
        "--policies",
        "fp32",
        "--repeats",
        "1",
        *sum((["--set", s] for s in SMALL), []),
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["policy", "step", "params"]
    assert len([line for line in out.splitlines() if line.startswith("fp32 ")]) == 3
    assert cli.main(["compare", "--policies", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "policy" in err[0] and "fp8" in err[0]
