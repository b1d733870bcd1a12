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


def test_train_report_and_audit_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "train",
        "--out",
        str(out),
        "--quiet",
        "--set",
        "training.steps=6",
        "--set",
        "training.log_every=2",
        "--set",
        "privacy.target_epsilon=1",
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "test accuracy" in text and "audit" in text
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 6 and report["audit"]["ok"] is True
    assert report["epsilon"] <= 1.0 + 1e-6
    assert (out / "privacy_utility.png").stat().st_size > 1000
    assert (out / "precision.png").stat().st_size > 1000
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 3
    assert cli.main(["report", str(out)]) == 0
    assert "epsilon" in capsys.readouterr().out
    assert cli.main(["report", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 6


def test_audit_passes_default_and_fails_unsafe_noise(capsys):
    assert cli.main(["audit"]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["audit", "--json", "--set", 'policy="bf16,noise=bf16,unsafe=true"']) == 1
    report = json.loads(capsys.readouterr().out)
    bad = [f for f in report["findings"] if not f["ok"]]
    assert bad and all(f["kind"] == "noise_sample" and f["out_dtype"] == "bf16" for f in bad)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--set", "privacy.delta=2"], "privacy.delta"),
        (["train", "--set", "model.kind=cnn"], "model.kind"),
        (["train", "--set", "trainig.steps=3"], "unknown section"),
        (["train", "--set", "training.stepz=3"], "unknown key training.stepz"),
        (["train", "--set", "policy=bfloat"], "preset"),
        (["train", "--set", "policy=bf16,noise=bf16"], "noise"),
        (["train", "--set", "nodot"], "section.key=value"),
        (["train", "--config", "/nonexistent.toml"], "no such file"),
        (["train", "--data", "/nonexistent.npz"], "no such file"),
        (["train", "--data", "x.csv"], ".npz"),
        (["audit", "--set", "loss_scale.kind=huge"], "loss_scale.kind"),
    ],
)
def test_train_and_audit_config_errors(argv, needle, capsys, tmp_path):
    assert (
        cli.main([*argv[:1], *(["--out", str(tmp_path)] if argv[0] == "train" else []), *argv[1:]])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_bad_toml_and_bad_npz(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[privacy\n")
    assert cli.main(["train", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    npz = tmp_path / "d.npz"
    import numpy as np

    np.savez(npz, x=np.ones((10, 3)), y=np.zeros(9, np.int32))
    assert cli.main(["train", "--data", str(npz), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "y" in err
