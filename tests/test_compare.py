"""dpmp compare: its numbers are the compiled steps' own, measured independently."""

import jax
import numpy as np
import pytest

from dpmp import cli
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer.compare import KINDS, compare, format_table
from dpmp.app.trainer.step import build_private_step

SMALL = ["training.expected_batch_size=64", "privacy.noise_multiplier=1.0"]


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


@pytest.fixture(scope="module")
def rows(digits):
    return compare(load_config(None, SMALL), data=digits, policies=("fp32", "bf16"), repeats=1)


def test_rows_are_the_steps_own_sizes(rows, digits):
    assert [(r["preset"], r["step"]) for r in rows] == [
        (p, k) for p in ("fp32", "bf16") for k in KINDS
    ]
    for policy in ("fp32", "bf16"):
        step = build_private_step(load_config(None, [*SMALL, f"policy={policy}"]), digits)
        params = step.example_args[0]
        # by hand: the default MLP 64-256-10 in float32 master weights
        assert sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)) == 4 * 19210
        private = next(r for r in rows if r["preset"] == policy and r["step"] == "private")
        assert private["param_bytes"] == 4 * 19210 and private["param_dtype"] == "float32"
        temp = step.step_fn.lower(*step.example_args).compile().memory_analysis()
        assert private["temp_bytes"] == temp.temp_size_in_bytes
        assert private["clip_method"] == "ghost"  # the default, auto, on a supported MLP


def test_shares_add_up_to_the_private_step(rows):
    for private in (r for r in rows if r["step"] == "private"):
        nonprivate, clipped = (
            r for r in rows if r["preset"] == private["preset"] and r["step"] != "private"
        )
        rest = nonprivate["step_s"] / private["step_s"]
        assert private["clip_share"] + private["noise_share"] + rest == pytest.approx(1.0)
        assert (
            nonprivate["temp_bytes"] + private["clip_temp_bytes"] + private["noise_temp_bytes"]
            == private["temp_bytes"]
        )
    text = format_table(rows)
    assert "bf16: " in text and "of the private step's time" in text


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
