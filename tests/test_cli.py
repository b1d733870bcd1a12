"""The dpmp command: every error path exits 2 with one line naming the problem."""

import json
import subprocess
import sys

import dp_accounting
import pytest

from dpmp import cli


def run_cli(*argv):
    """Runs the real console entry point in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "dpmp.cli", *argv], capture_output=True, text=True, timeout=600
    )


def test_budget_epsilon_matches_dp_accounting(capsys):
    assert (
        cli.main(
            [
                "budget",
                "--noise-multiplier",
                "10",
                "--steps",
                "875",
                "--batch-size",
                "4096",
                "--num-examples",
                "50000",
                "--accountant",
                "rdp",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(4096 / 50000, dp_accounting.GaussianDpEvent(10.0)), 875
    )
    assert out["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)


def test_budget_calibration_hits_target(capsys):
    assert (
        cli.main(
            [
                "budget",
                "--target-epsilon",
                "2",
                "--steps",
                "224",
                "--sampling-prob",
                "0.178",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(
            0.178, dp_accounting.GaussianDpEvent(out["noise_multiplier"])
        ),
        224,
    )
    assert acc.get_epsilon(1e-5) == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["budget", "--steps", "3"], "--sampling-prob"),
        (["budget", "--sampling-prob", "0.1", "--steps", "3"], "exactly one"),
        (
            ["budget", "--sampling-prob", "2", "--noise-multiplier", "1", "--steps", "3"],
            "sampling_prob",
        ),
        (["budget", "--sampling-prob", "0.1", "--noise-multiplier", "1"], "--steps"),
        (
            [
                "budget",
                "--sampling-prob",
                "0.1",
                "--noise-multiplier",
                "1",
                "--steps",
                "3",
                "--delta",
                "1.5",
            ],
            "delta",
        ),
        (
            [
                "budget",
                "--batch-size",
                "8",
                "--num-examples",
                "0",
                "--noise-multiplier",
                "1",
                "--steps",
                "3",
            ],
            "--num-examples",
        ),
        (["report", "/nonexistent/run"], "no such run directory"),
    ],
)
def test_error_paths_exit_2_with_one_line(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_report_of_unfinished_run(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "report.json" in capsys.readouterr().err


def test_argparse_errors_exit_2():
    out = run_cli("budget", "--accountant", "moments")
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = run_cli("nonsense")
    assert out.returncode == 2
    out = run_cli("--help")
    assert out.returncode == 0 and "train" in out.stdout and "audit" in out.stdout
