"""The dpmp command: every error path exits 2 with one line naming the problem."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dp_accounting
import numpy as np
import pytest

import dpmp
from dpmp.app import cli
from dpmp.app.cli.command import Command, UsageError
from dpmp.app.cli.entry import COMMANDS
from dpmp.app.cli.summary import summary


def run_cli(*argv):
    """Runs the real console entry point in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "dpmp", *argv], capture_output=True, text=True, timeout=600
    )


def assert_one_line_error(capsys, command, *needles):
    """The error contract: one line ``dpmp COMMAND: error: ...`` naming the problem."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"dpmp {command}: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


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
                "--exact-gaussian",
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


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
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
                "--exact-gaussian",
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


def test_budget_with_params_accounts_the_snapped_noise(capsys):
    """``--params N``: the epsilon of dpmp's snapped noise on N parameters, as the
    library gives it, above the exact Gaussian's by the residual; a calibration to a
    target keeps the residual within it."""
    plan = ["--steps", "5000", "--sampling-prob", "0.01", "--accountant", "rdp", "--json"]
    assert cli.main(["budget", "--noise-multiplier", "1", "--params", "125000000", *plan]) == 0
    out = json.loads(capsys.readouterr().out)
    expect = dpmp.accounting.epsilon(
        noise_multiplier=1.0,
        sampling_prob=0.01,
        steps=5000,
        delta=1e-5,
        accountant="rdp",
        noised_coordinates=125_000_000,
    )
    assert out["epsilon"] == pytest.approx(expect, rel=1e-9)
    assert 0 < out["epsilon_noise_residual"] < 0.01 and out["noised_coordinates"] == 125_000_000
    assert cli.main(["budget", "--target-epsilon", "4", "--params", "125000000", *plan]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 3.99 < out["epsilon"] <= 4.0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["budget", "--steps", "3"], "--sampling-prob"),
        (["budget", "--sampling-prob", "0.1", "--steps", "3", "--params", "9"], "exactly one"),
        (
            ["budget", "--sampling-prob", "0.1", "--noise-multiplier", "1", "--steps", "3"],
            "--params",
        ),
        (
            ["budget", "--sampling-prob", "0.1", "--noise-multiplier", "1", "--steps", "3"]
            + ["--params", "0"],
            "--params: must be >= 1",
        ),
        (
            ["budget", "--sampling-prob", "2", "--noise-multiplier", "1", "--steps", "3"]
            + ["--exact-gaussian"],
            "sampling_prob",
        ),
        (
            ["budget", "--sampling-prob", "0.1", "--noise-multiplier", "1", "--params", "9"],
            "--steps",
        ),
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
                "--params",
                "9",
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


def test_argparse_errors_exit_2(capsys):
    for argv in (["budget", "--accountant", "moments"], ["nonsense"], ["budget", "--steps", "x"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "invalid" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:
        cli.main([])  # a command is required
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("train", "audit", "budget", "report"))


def test_console_entry_point_exit_status():
    """``python -m dpmp`` passes main's status to the shell, error line on stderr;
    so do the installed ``dpmp`` script and ``python -m dpmp.cli``."""
    from importlib import metadata

    out = run_cli("budget", "--steps", "3")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        "dpmp budget: error: give --sampling-prob, or --batch-size and --num-examples"
    )
    (script,) = metadata.entry_points(group="console_scripts", name="dpmp")
    assert script.value == "dpmp.app.cli:console" and script.load() is cli.console
    old = subprocess.run(
        [sys.executable, "-m", "dpmp.cli", "budget", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (old.returncode, old.stdout, old.stderr) == (2, "", out.stderr)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--set", "model.dimm=3", "--out"], "unknown key model.dimm; allowed: kind, "),
        (["audit", "--set", "privcy.delta=1e-6", "--out"], "unknown section 'privcy'"),
        (["compare", "--config", "no/such.toml"], "config: no such file 'no/such.toml'"),
    ],
)
def test_a_config_typo_is_named_before_jax_is_imported(argv, needle, tmp_path):
    """The key check reads names only, so it answers before the libraries load."""
    code = (
        "import sys; from dpmp.app.cli.entry import main; "
        f"status = main({argv + [str(tmp_path / 'run')] * (argv[-1] == '--out')!r}); "
        "print(status, 'jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def _toy_arguments(p):
    p.add_argument("--times", type=int, default=1, help="how many greetings")


def _toy_run(args):
    if args.times < 1:
        raise UsageError(f"--times: must be >= 1, got {args.times}")
    print("hello " * args.times)
    return 0


TOY = Command(
    name="hello",
    help="say hello",
    description="Say hello a number of times.",
    add_arguments=_toy_arguments,
    run=_toy_run,
)


def test_a_command_is_one_module_and_one_registration(capsys):
    """Each command is a Command in a module of its own; registering one more is
    all a new command needs: it is in the help, runs, and its usage errors are
    one line with status 2, as the built-in commands' are."""
    # the documented commands among them (more may be registered)
    documented = {"train", "tune", "audit", "compare", "budget", "report", "export", "generate"}
    assert documented <= {c.name for c in COMMANDS}
    assert [c.run.__module__ for c in COMMANDS] == [f"dpmp.app.cli.{c.name}" for c in COMMANDS]
    commands = (*COMMANDS, TOY)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"], commands=commands)
    assert exit_.value.code == 0 and "say hello" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["hello", "--help"], commands=commands)
    assert exit_.value.code == 0 and "how many greetings" in capsys.readouterr().out
    assert cli.main(["hello", "--times", "2"], commands=commands) == 0
    assert capsys.readouterr().out.split() == ["hello", "hello"]
    assert cli.main(["hello", "--times", "0"], commands=commands) == 2
    assert_one_line_error(capsys, "hello", "--times: must be >= 1, got 0")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["hello"])  # registered in a list of its own only
    assert exit_.value.code == 2


def test_budget_accountants_are_the_accounting_layers(capsys, monkeypatch):
    """``--accountant`` offers what ``dpmp.accounting.ACCOUNTANTS`` lists, no copy."""
    with pytest.raises(SystemExit):
        cli.main(["budget", "--help"])
    names = ",".join(sorted(dpmp.accounting.ACCOUNTANTS))
    assert f"--accountant {{{names}}}" in capsys.readouterr().out
    monkeypatch.setattr(dpmp.accounting, "ACCOUNTANTS", (*dpmp.accounting.ACCOUNTANTS, "toy"))
    with pytest.raises(SystemExit):
        cli.main(["budget", "--help"])
    assert f"--accountant {{{names},toy}}" in capsys.readouterr().out
    # argparse lets the new name through; the accounting layer answers for it
    argv = ["budget", "--accountant", "toy", "--sampling-prob", "0.01", "--steps", "10"]
    assert cli.main([*argv, "--noise-multiplier", "1", "--params", "10"]) == 2
    assert_one_line_error(capsys, "budget", "accountant", "'toy'")


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
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
    assert "private" in text and "yes (differentially private; zero-out neighbours)" in text
    assert "safe to publish: report.json, metrics.jsonl, train.log" in text
    assert "private (non-private diagnostics: do not publish; owner-only, 0700): private/" in text
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 6 and report["audit"]["ok"] is True
    assert report["epsilon"] <= 1.0 + 1e-6
    assert (out / "privacy_utility.png").stat().st_size > 1000
    assert (out / "precision.png").stat().st_size > 1000
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 3
    assert cli.main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "epsilon" in text and "wall time" not in text  # timings stay in private/
    lines = text.splitlines()
    assert (
        "safe to publish: report.json, metrics.jsonl, train.log, privacy_utility.png, "
        "precision.png" in lines
    )
    assert "private (non-private diagnostics: do not publish; owner-only, 0700): private/" in lines
    assert any(line.startswith("secret (noise keys") and "checkpoints/" in line for line in lines)
    assert cli.main(["report", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 6
    # the run directory now holds a checkpoint of another config: refused before any work
    assert cli.main([*argv, "--set", "training.learning_rate=0.1"]) == 2
    assert_one_line_error(capsys, "train", "training.learning_rate", "--fresh")
    # a report.json that is not a report
    (out / "report.json").write_text("[1, 2]")
    assert cli.main(["report", str(out)]) == 2
    assert_one_line_error(capsys, "report", "report.json", "expected a JSON object")
    (out / "report.json").write_text("{")
    assert cli.main(["report", str(out)]) == 2
    assert_one_line_error(capsys, "report", "report.json", "not valid JSON")


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_audit_passes_default_and_fails_unsafe_noise(capsys):
    assert cli.main(["audit"]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli.main(["audit", "--json", "--set", 'policy="bf16,noise=bf16,unsafe=true"']) == 1
    report = json.loads(capsys.readouterr().out)
    bad = [f for f in report["findings"] if not f["ok"]]
    assert bad and all(f["kind"] == "noise_sample" and f["out_dtype"] == "bf16" for f in bad)
    # the text names the policy it judged by, not the unsafe one it was given
    assert cli.main(["audit", "--set", 'policy="bf16,noise=bf16,unsafe=true"']) == 1
    head, checked = capsys.readouterr().out.splitlines()[:2]
    assert "noise=bf16" in head and "FAILED" in head
    assert checked.startswith("checked against: ") and "noise=f32" in checked


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


# ---- every other error path: exit 2, one line naming the field or file -------------


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["training.steps=abc"], ["training.steps", "'abc'"]),
        (["training.steps=0"], ["training.steps", "> 0"]),
        (["training.steps=2.5"], ["training.steps", "integer"]),
        (["training.steps=true"], ["training.steps", "integer"]),
        (["training.seed=-1"], ["training.seed", "[0, 2^32 - 1]"]),
        (["training.optimizer=lamb"], ["training.optimizer", "'lamb'", "adam, sgd, momentum"]),
        (["training.learning_rate=inf"], ["training.learning_rate", "inf"]),
        (["training.microbatch_size=0"], ["training.microbatch_size"]),
        (["training.expected_batch_size=5000"], ["training.expected_batch_size", "1437"]),
        (["model.hidden=[0]"], ["model.hidden"]),
        (["model.hidden=abc"], ["model.hidden", "list"]),
        (["model.heads=3"], ["model.heads", "model.dim"]),
        (["model.kind=vit", "model.patch=3"], ["model.patch", "8x8"]),
        (["privacy.target_epsilon=-1"], ["privacy.target_epsilon"]),
        (["privacy.target_epsilon=1e-9"], ["privacy.target_epsilon", "cannot be reached"]),
        (["privacy.accountant=moments"], ["privacy.accountant", "pld, rdp"]),
        (["privacy.delta="], ["privacy.delta"]),
        (["privacy.="], ["unknown key privacy."]),
        (["loss_scale.factor=1"], ["loss_scale.factor", "> 1"]),
        (["loss_scale.min_scale=10", "loss_scale.max_scale=1"], ["loss_scale.min_scale"]),
        (["data.dataset=npz"], ["data.path", "required"]),
        (["data.path=mine.npz"], ["data.path", 'data.dataset = "digits" reads no file']),
        (["data.dataset=npz", "data.path=3"], ["data.path", "string"]),
        (["data.standardize=yes"], ["data.standardize", "'yes'", "none, private, nonprivate"]),
        (["data.standardize=true"], ["data.standardize", "no longer allowed", '"nonprivate"']),
        (["data.test_fraction=1"], ["data.test_fraction", "(0, 1)"]),
        (["policy=fp8"], ["policy", "fp32, bf16, fp16"]),
        (["policy=bf16,compute=int8"], ["compute", "int8"]),
        (["policy=bf16,foo=f32"], ["policy", "'foo'"]),
        (["policy="], ["policy", "empty"]),
        (["=3"], ["section.key=value"]),
        (["privacy=3"], ["section.key=value"]),
    ],
)
def test_bad_set_values(overrides, needles, capsys, tmp_path):
    sets = [a for o in overrides for a in ("--set", o)]
    assert cli.main(["train", "--quiet", "--out", str(tmp_path), *sets]) == 2
    assert_one_line_error(capsys, "train", *needles)


@pytest.mark.parametrize(
    "text,needles",
    [
        ("[privacy\n", ["cfg.toml", "not valid TOML", "line 1"]),
        ("privacy = 3\n", ["privacy", "expected a table"]),
        ("[privacy]\nepsilon = 3\n", ["unknown key privacy.epsilon", "target_epsilon"]),
        ('[privacy]\ndelta = "x"\n', ["privacy.delta", "'x'"]),
        ("[optim]\nlr = 3\n", ["unknown section 'optim'", "loss_scale"]),
        ('policy = "fp8"\n', ["policy", "fp8"]),
        (b"\xff\xfe", ["cfg.toml", "not UTF-8"]),
    ],
)
def test_bad_config_files(text, needles, capsys, tmp_path):
    path = tmp_path / "cfg.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    for command in ("train", "audit"):
        out = ["--out", str(tmp_path / "run")] if command == "train" else []
        assert cli.main([command, "--config", str(path), *out]) == 2
        assert_one_line_error(capsys, command, *needles)


def test_config_file_errors_with_set(capsys, tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text("privacy = 3\n")
    argv = ["train", "--config", str(path), "--set", "privacy.delta=0.1", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, "train", "privacy", "expected a table")
    assert cli.main(["train", "--config", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, "train", "no such file")  # a directory is not a config


_NPZ_CASES = {
    "no_x": (dict(y=np.zeros(20, np.int32)), ["missing array 'x'", "found ['y']"]),
    "no_y": (dict(x=np.ones((20, 3))), ["missing array 'y'"]),
    "lengths": (dict(x=np.ones((20, 3)), y=np.zeros(19, np.int32)), ["x and y", "20", "19"]),
    "five_dims": (dict(x=np.ones((20, 2, 2, 2, 2)), y=np.zeros(20, np.int32)), ["x:", "4 dim"]),
    "one_dim": (dict(x=np.ones(20), y=np.zeros(20, np.int32)), ["x:", "shape (20,)"]),
    "strings": (dict(x=np.full((20, 3), "a"), y=np.zeros(20, np.int32)), ["x:", "numeric"]),
    "objects": (dict(x=np.array([{}] * 20, dtype=object), y=np.zeros(20)), ["Python objects"]),
    "nan": (dict(x=np.full((20, 3), np.nan), y=np.zeros(20, np.int32)), ["x:", "NaN"]),
    "negative_y": (dict(x=np.ones((20, 3)), y=-np.ones(20, np.int32)), ["y:", "-1"]),
    "fractional_y": (dict(x=np.ones((20, 3)), y=np.full(20, 0.5)), ["y:", "non-integer"]),
    "one_hot_y": (dict(x=np.ones((20, 3)), y=np.eye(20, 3)), ["y:", "one-hot"]),
    "bool_y": (dict(x=np.ones((20, 3)), y=np.zeros(20, bool)), ["y:", "bool"]),
    "x_test_alone": (
        dict(x=np.ones((20, 3)), y=np.zeros(20, np.int32), x_test=np.ones((5, 3))),
        ["'x_test'", "'y_test'"],
    ),
    "x_test_shape": (
        dict(
            x=np.ones((20, 3)),
            y=np.zeros(20, np.int32),
            x_test=np.ones((5, 4)),
            y_test=np.zeros(5, np.int32),
        ),
        ["x_test:", "(4,)", "(3,)"],
    ),
    "too_few": (dict(x=np.ones((5, 3)), y=np.zeros(5, np.int32)), ["x:", "too few"]),
    "empty": (dict(x=np.ones((0, 3)), y=np.zeros(0, np.int32)), ["x:", "no examples"]),
    "small_for_batch": (
        dict(x=np.ones((40, 3)), y=np.arange(40) % 2),
        ["training.expected_batch_size", "512", "32 training examples"],
    ),
}


@pytest.mark.parametrize("case", sorted(_NPZ_CASES))
def test_bad_data_files(case, capsys, tmp_path):
    arrays, needles = _NPZ_CASES[case]
    path = tmp_path / f"{case}.npz"
    np.savez(path, **arrays)
    assert cli.main(["train", "--quiet", "--data", str(path), "--out", str(tmp_path / "r")]) == 2
    assert_one_line_error(capsys, "train", *needles)


def test_data_that_is_not_an_npz_archive(capsys, tmp_path):
    (tmp_path / "text.npz").write_text("hello")
    (tmp_path / "dir.npz").mkdir()
    np.savez(tmp_path / "ok.npz", x=np.ones((40, 3)), y=np.arange(40) % 2)
    (tmp_path / "cut.npz").write_bytes((tmp_path / "ok.npz").read_bytes()[:200])
    for name, needle in (("text", "not a readable .npz"), ("cut", "not a readable .npz")):
        argv = ["train", "--data", str(tmp_path / f"{name}.npz"), "--out", str(tmp_path / "r")]
        assert cli.main(argv) == 2
        assert_one_line_error(capsys, "train", f"{name}.npz", needle)
    assert cli.main(["audit", "--data", str(tmp_path / "dir.npz")]) == 2
    assert_one_line_error(capsys, "audit", "--data", "is a folder without x_train.npy")
    assert cli.main(["audit", "--data", str(tmp_path / "absent.npz")]) == 2
    assert_one_line_error(capsys, "audit", "--data", "no such file")
    vit = ["--set", "model.kind=vit"]
    assert cli.main(["audit", "--data", str(tmp_path / "ok.npz"), *vit]) == 2
    assert_one_line_error(capsys, "audit", "model.kind = 'vit'", "image")


@pytest.mark.slow  # end to end; the default suite keeps a cheaper check of the same rule
def test_resume_on_other_data_is_refused(capsys, tmp_path):
    """The run directory's checkpoint was made on other data: one line, exit 2."""
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    arrays = dict(x=rng.normal(size=(60, 3)), y=np.arange(60) % 2)
    np.savez(data, **arrays)
    argv = ["train", "--quiet", "--data", str(data), "--out", str(tmp_path / "run")]
    argv += ["--set", "training.steps=2", "--set", "training.expected_batch_size=8"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    arrays["x"][7, 1] += 1.0  # the same file, one value of one record changed
    np.savez(data, **arrays)
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, "train", "different training data", "--fresh")


@pytest.mark.slow  # end to end (two steps)
def test_a_runs_secrets_stay_owner_only_and_end_with_an_export(capsys, tmp_path):
    """private/ and checkpoints/ are owner-only, report.json names the data file
    alone, no .lock is left, a non-private run's files are not called safe to
    publish, and `dpmp export` writes the parameters alone and deletes the secrets."""
    data = tmp_path / "my-folder" / "data.npz"
    data.parent.mkdir()
    np.savez(data, x=np.random.default_rng(0).normal(size=(60, 3)), y=np.arange(60) % 2)
    out = tmp_path / "run"
    argv = ["train", "--quiet", "--data", str(data.resolve()), "--out", str(out)]
    argv += ["--set", "training.steps=2", "--set", "training.expected_batch_size=8"]
    assert cli.main([*argv, "--set", "privacy.reproducible_noise=true"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("safe to publish") for line in lines)
    assert any("NOT differentially private" in line and "report.json" in line for line in lines)
    report = (out / "report.json").read_text()
    assert json.loads(report)["config"]["data"]["path"] == "data.npz"
    assert "my-folder" not in report
    assert not (out / ".lock").exists()
    for folder in ("private", "checkpoints"):
        assert (out / folder).stat().st_mode & 0o777 == 0o700
        for file in (out / folder).iterdir():
            assert file.stat().st_mode & 0o777 == 0o600, file
    assert cli.main([*argv, "--fresh"]) == 0  # a private run
    assert "safe to publish: report.json" in capsys.readouterr().out
    assert cli.main(["export", str(out), "--delete-secrets"]) == 0
    text = capsys.readouterr().out
    assert f"parameters: {out / 'params.npz'} (differentially private: safe to publish)" in text
    assert f"deleted: {out / 'checkpoints'}" in text
    assert not (out / "checkpoints").exists()
    params = np.load(out / "params.npz")
    assert len(params.files) == 1 + 4  # two dense layers' kernels and biases
    assert cli.main(["report", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("safe to publish") and "params.npz" in line for line in lines)
    assert not any(line.startswith("secret") for line in lines)
    assert cli.main(["export", str(out)]) == 2
    assert_one_line_error(
        capsys, "export", "checkpoints were deleted", f"already exported: {out / 'params.npz'}"
    )


def test_summary_says_whether_a_run_is_private():
    base = {"policy": "bf16", "steps": 3, "test_accuracy": 0.5, "epsilon": 1.0, "delta": 1e-5}
    text = summary({**base, "private": True, "privacy_warnings": []})
    assert "yes (differentially private; zero-out neighbours)" in text
    warning = "privacy.reproducible_noise = true: ... NOT differentially private."
    text = summary({**base, "private": False, "privacy_warnings": [warning]})
    assert "NO: this run is NOT differentially private" in text and warning in text
    assert "wall time" not in text and "overflowed examples" not in text  # private numbers


@pytest.mark.slow
def test_nonprivate_runs_say_so_in_the_summary(capsys, tmp_path):
    """The end-of-run summary, dpmp report, train.log and report.json all say it."""
    argv = ["train", "--quiet", "--out", str(tmp_path), "--set", "training.steps=1"]
    argv += ["--set", "privacy.reproducible_noise=true", "--set", "data.standardize=nonprivate"]
    argv += ["--set", "model.hidden=[8]"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "NO: this run is NOT differentially private" in text
    assert "privacy.reproducible_noise = true" in text and "data.standardize = 'nonprivate'" in text
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "NO: this run is NOT differentially private" in capsys.readouterr().out
    log = (tmp_path / "train.log").read_text()
    assert "WARNING: privacy.reproducible_noise = true" in log
    assert "NOT differentially private (see privacy_warnings)" in log
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["private"] is False and len(report["privacy_warnings"]) == 2


def test_out_that_is_a_file(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert cli.main(["train", "--out", str(tmp_path / "file")]) == 2
    assert_one_line_error(capsys, "train", "--out", "not a directory")


@pytest.mark.slow  # ~4 s on 2 cores
def test_a_fixed_noise_multiplier_too_small_is_refused_before_training(capsys, tmp_path):
    argv = ["train", "--out", str(tmp_path), "--set", "privacy.noise_multiplier=0.7"]
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, "train", "privacy.noise_multiplier: 0.7 spends target epsilon")
    assert not (tmp_path / "checkpoints").exists()


def test_a_noise_multiplier_too_small_for_the_snapped_noise_names_the_setting(capsys, tmp_path):
    """sigma 0.1: the chance that some coordinate lands beyond the sampler's reach
    exceeds delta. The line names the setting and a value that fits (it said
    "noised_coordinates: the noise residual's tail delta 8.93e+24 ...")."""
    argv = ["train", "--out", str(tmp_path), "--set", "privacy.noise_multiplier=0.1"]
    assert cli.main(argv) == 2
    assert_one_line_error(
        capsys, "train", "privacy.noise_multiplier: 0.1 is too small", "(about 0.3", "privacy.delta"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_fixed_noise_multiplier_too_small_is_refused_before_pre_training(capsys, tmp_path):
    """With a [pretrain] section the refusal comes before the public pre-training
    (checked on exact Gaussian noise, which the snapped residual only adds to),
    not after minutes of it."""
    config = Path(__file__).resolve().parents[1] / "configs" / "lm_lora.toml"
    argv = ["train", "--config", str(config), "--out", str(tmp_path)]
    assert cli.main([*argv, "--set", "privacy.noise_multiplier=0.7"]) == 2
    assert_one_line_error(capsys, "train", "privacy.noise_multiplier: 0.7 spends target epsilon")
    assert not (tmp_path / "pretrained").exists() and not (tmp_path / "checkpoints").exists()


def test_a_second_writer_is_refused_and_changes_nothing(capsys, tmp_path):
    from dpmp.app.run_dir import locked

    out = tmp_path / "run"
    with locked(out):  # as a running `dpmp train` holds it
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        assert cli.main(["train", "--out", str(out), "--set", "training.steps=1"]) == 2
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_one_line_error(capsys, "train", str(out), f"another dpmp run (pid {os.getpid()})")


def test_a_run_that_stops_before_writing_leaves_no_folder_of_only_the_lock(capsys, tmp_path):
    """A run refused (or interrupted) after taking the lock of a new run directory
    removed nothing: a folder holding only ``.lock`` was left. One it did not
    create is kept."""
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--set", "privacy.noise_multiplier=0.7"]
    assert cli.main(argv) == 2
    assert_one_line_error(capsys, "train", "privacy.noise_multiplier: 0.7")
    assert not out.exists()
    out.mkdir()
    assert cli.main(argv) == 2
    capsys.readouterr()
    assert out.is_dir()


def test_ctrl_c_with_no_message_still_says_it_was_interrupted(capsys):
    """A KeyboardInterrupt without a message (Ctrl-C during start-up) printed
    "dpmp hello: " and nothing else."""

    def interrupted(args):
        raise KeyboardInterrupt

    toy = Command(
        name="hello", help="", description="", add_arguments=_toy_arguments, run=interrupted
    )
    assert cli.main(["hello"], commands=(toy,)) == 130
    assert capsys.readouterr().err == "dpmp hello: interrupted; nothing new was saved\n"


def test_a_report_that_is_not_dpmps_is_never_overwritten(capsys, tmp_path):
    mine = tmp_path / "report.json"
    for text in ('{"my": "results"}', "not json"):
        mine.write_text(text)
        assert cli.main(["train", "--out", str(tmp_path), "--set", "training.steps=1"]) == 2
        assert_one_line_error(capsys, "train", "report.json: not a dpmp report")
        assert mine.read_text() == text
        assert not (tmp_path / "train.log").exists()


def test_report_errors(capsys, tmp_path):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert_one_line_error(capsys, "report", "no such run directory")
    (tmp_path / "file").write_text("x")
    assert cli.main(["report", str(tmp_path / "file")]) == 2
    assert_one_line_error(capsys, "report", "no such run directory")
    assert cli.main(["report", str(tmp_path)]) == 2  # unfinished: no report.json yet
    assert_one_line_error(capsys, "report", "report.json not found", "has not finished")
    (tmp_path / "report.json").write_bytes(b"\xff")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "report", "not valid JSON")
    (tmp_path / "report.json").write_text('{"policy": "mine", "steps": 3}')  # not dpmp's
    assert cli.main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().out == ""  # no table before the error
    (tmp_path / "report.json").write_text('{"policy": "mine"}')
    assert cli.main(["report", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "report", "report.json: not a dpmp report", str(tmp_path))
    (tmp_path / "report.json").write_text('{"versions": {"dpmp": "0"}}')  # no metrics
    assert cli.main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().out == ""
    assert cli.main(["report", str(tmp_path)]) == 2
    assert_one_line_error(capsys, "report", "no metrics.jsonl records")


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["--noise-multiplier", "1", "--steps", "3"], ["--sampling-prob", "--batch-size"]),
        (["--noise-multiplier", "1", "--steps", "3", "--batch-size", "5"], ["--num-examples"]),
        (
            ["--noise-multiplier", "1", "--steps", "3", "--sampling-prob", "0.1"]
            + ["--batch-size", "5", "--num-examples", "10"],
            ["not both"],
        ),
        (
            ["--target-epsilon", "2", "--noise-multiplier", "1", "--steps", "3"]
            + ["--sampling-prob", "0.1"],
            ["exactly one"],
        ),
        (["--sampling-prob", "0.1", "--steps", "3"], ["exactly one"]),
        (["--target-epsilon", "2", "--sampling-prob", "0.1"], ["--steps", "--target-epsilon"]),
        (["--target-epsilon", "-2", "--steps", "3", "--sampling-prob", "0.1"], ["target_epsilon"]),
        (["--noise-multiplier", "-1", "--steps", "3", "--sampling-prob", "0.1"], ["noise_mult"]),
        (["--noise-multiplier", "nan", "--steps", "3", "--sampling-prob", "0.1"], ["NaN"]),
        (["--noise-multiplier", "1", "--steps", "-3", "--sampling-prob", "0.1"], ["steps"]),
        (
            ["--noise-multiplier", "1", "--steps", "1000000000", "--sampling-prob", "0.1"],
            ["steps must be at most 1,000,000"],
        ),
        pytest.param(  # a PLD of epsilon 36: one line after the bracket reaches its floor
            ["--target-epsilon", "50", "--steps", "10", "--sampling-prob", "0.1"],
            ["noise multiplier 0.3 already spends only epsilon 35.66"],
            marks=pytest.mark.slow,  # the PLD at that epsilon takes a minute on 2 cores
        ),
        (["--noise-multiplier", "1", "--steps", "3", "--sampling-prob", "0"], ["sampling_prob"]),
        (
            ["--noise-multiplier", "1", "--steps", "3", "--batch-size", "100"]
            + ["--num-examples", "10"],
            ["sampling_prob", "10.0"],
        ),
        (
            ["--noise-multiplier", "1", "--steps", "3", "--sampling-prob", "0.1"]
            + ["--count-noise-stddev", "-1"],
            ["count_noise_stddev"],
        ),
    ],
)
def test_budget_argument_errors(argv, needles, capsys):
    assert cli.main(["budget", "--exact-gaussian", *argv]) == 2
    assert_one_line_error(capsys, "budget", *needles)


def test_debug_mode_reraises(monkeypatch):
    from dpmp.app.config import ConfigError

    monkeypatch.setenv("DPMP_DEBUG", "1")
    with pytest.raises(ConfigError, match="training.steps"):
        cli.main(["audit", "--set", "training.steps=0"])


def test_version_is_the_installed_one(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert (
        e.value.code == 0 and capsys.readouterr().out.strip() == f"dpmp {metadata.version('dpmp')}"
    )


@pytest.mark.slow  # two subprocesses (~8 s)
def test_a_closed_pipe_stops_quietly():
    """``dpmp budget ... | head``: the reader goes away; dpmp stops without an error
    line, with status 128 + SIGPIPE, as Unix tools do (it printed 'Broken pipe' and
    exited 2)."""
    import subprocess

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpmp",
            "budget",
            "--target-epsilon",
            "2",
            "--steps",
            "224",
            "--batch-size",
            "256",
            "--num-examples",
            "1437",
            "--params",
            "19210",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader closes before dpmp writes
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Broken pipe" not in err, err


@pytest.mark.slow  # a subprocess run (~20 s)
def test_train_own_model_from_its_file_on_a_npy_folder(tmp_path):
    """The acceptance run: a linen module in the user's own file, named by
    ``model.kind``, its folder on PYTHONPATH, data a folder of .npy files."""
    import json
    import os

    import numpy as np

    from dpmp.app.inputs import load_data

    (tmp_path / "their_module.py").write_text(
        "import flax.linen as nn\n\n"
        "class Net(nn.Module):\n"
        "    k: int\n\n"
        "    @nn.compact\n"
        "    def __call__(self, x):\n"
        "        return nn.Dense(self.k)(nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1)))))\n\n"
        "def factory(input_shape, num_classes):\n"
        "    return Net(num_classes)\n"
    )
    data = load_data(None, 0)
    folder = tmp_path / "digits"
    folder.mkdir()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.save(folder / f"{name}.npy", getattr(data, name))
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "dpmp", "train", "--out", str(out), "--data", str(folder)]
    argv += ["--set", "model.kind=their_module:factory", "--set", "training.steps=20"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["kind"] == "their_module:factory"
    assert report["epsilon"] == pytest.approx(2.0, rel=1e-3) and report["test_accuracy"] > 0.5
    assert "memory-mapped" in report["data"]["description"]
    assert (out / "checkpoints").is_dir()


@pytest.mark.slow  # ~6 s on 2 cores
@pytest.mark.parametrize(
    "sets, needle",
    [
        (
            ["privacy.noise_multiplier=0.7", "training.steps=30"],
            "the privacy budget stopped it early: step 1 would spend epsilon",
        ),
        pytest.param(
            ['policy="bf16,clip=bf16,unsafe=true"', "training.steps=2"],
            "the precision audit of the step found violations",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            # the scale cannot back off from 2^24: every fp16 example overflows
            [
                "policy=fp16",
                "loss_scale.kind=private_dynamic",
                "loss_scale.initial=16777216.0",
                "loss_scale.min_scale=16777216.0",
                "loss_scale.count_noise_stddev=8.0",
                "training.steps=3",
            ],
            "of the examples overflowed (noised count",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_run_that_did_not_do_what_was_asked_exits_3_and_says_why(
    sets, needle, capsys, tmp_path, monkeypatch
):
    from dpmp.app.trainer import loop

    # a too-small fixed sigma is refused before training; the stop is the guarantee
    # behind that refusal, reached here with the refusal switched off
    monkeypatch.setattr(loop, "_check_fixed_noise", lambda *args: None)
    argv = ["train", "--quiet", "--out", str(tmp_path)]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err
    failures = [line for line in err.splitlines() if line.startswith("dpmp train: run failed: ")]
    assert len(failures) == 1 and needle in failures[0], err
    assert "overflowed" not in (tmp_path / "train.log").read_text()  # no public file says it
    report = json.loads((tmp_path / "report.json").read_text())
    if "audit" in needle:  # an unsafe policy whose audit fails is not called private
        assert report["private"] is False
        assert any("precision audit" in w for w in report["privacy_warnings"])


@pytest.mark.slow  # a 3-step fp16 run
def test_an_overflow_seen_only_in_exact_counts_sets_no_exit_status(capsys, tmp_path):
    """A static scale releases no overflow count: every example overflows, yet the
    exit status, stderr and the public files say nothing of it (an exit status read
    from the exact count is one unaccounted bit of the data); the diagnosis is in
    private/diagnostics.json."""
    sets = ["policy=fp16", "loss_scale.kind=static", "loss_scale.initial=1e9"]
    argv = ["train", "--quiet", "--out", str(tmp_path), "--set", "training.steps=3"]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "overflowed" not in captured.err and "overflowed" not in captured.out
    for name in ("train.log", "report.json", "metrics.jsonl"):
        assert "overflowed" not in (tmp_path / name).read_text()
    diagnostics = json.loads((tmp_path / "private" / "diagnostics.json").read_text())
    (diagnosis,) = diagnostics["overflow_diagnosis"]
    assert diagnosis.startswith("most of the examples overflowed")


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_a_run_whose_audit_could_not_check_the_step_is_not_private(capsys, tmp_path, monkeypatch):
    """Fail closed: an audit that crashes (``ok`` None) leaves the guarantee
    unchecked, so the report says ``"private": false`` with the reason and the
    command exits 3."""
    from dpmp.app.trainer import step

    def broken(*args, **kwargs):
        raise RuntimeError("cannot read the step")

    monkeypatch.setattr(step, "audit_step", broken)
    argv = ["train", "--quiet", "--out", str(tmp_path), "--set", "training.steps=2"]
    assert cli.main(argv) == 3
    err = capsys.readouterr().err
    assert "run failed: the precision audit of the step could not check it" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["audit"]["ok"] is None and report["private"] is False
    assert any("could not check" in w for w in report["privacy_warnings"])


@pytest.mark.slow  # three subprocess starts (~15 s)
@pytest.mark.parametrize("delay_s", [0.4, 1.2, 2.5])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, delay_s):
    """SIGINT while jax and the data load, or while the step compiles: one line,
    status 130, no traceback; the run directory is left usable (its lock freed).
    An interrupt inside jaxlib's native start-up gave an ImportError traceback,
    or was lost and the run trained on; one during compilation crashed the
    interpreter's exit (SIGSEGV)."""
    import signal
    import time

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "dpmp", "train", "--out", str(out)]
    argv += ["--set", "training.steps=4", "--set", "training.eval_every=4"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Error" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("dpmp train: interrupted"), err  # it said "dpmp train: "
    assert not (out / "report.json").exists()
    if out.exists():  # nothing half-written: a second run in the same place starts
        assert sorted(p.name for p in out.iterdir()) != [".lock"]
        from dpmp.app.run_dir import locked

        with locked(out):
            pass


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_sigterm_during_a_run_saves_a_checkpoint_says_so_and_exits_143(
    capsys, tmp_path, monkeypatch
):
    """SIGTERM (SLURM, Kubernetes, ``timeout``) is Ctrl-C's twin: the step in
    progress ends, its checkpoint is saved, one line says how to resume, status
    128 + 15. It exited 143 with no message and no checkpoint."""
    import signal

    from dpmp.app.trainer import loop

    advance = loop._Run._advance

    def advance_then_sigterm(self):
        out = advance(self)
        if self.completed == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(loop._Run, "_advance", advance_then_sigterm)
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--quiet", "--set", "training.steps=4"]
    handler = signal.getsignal(signal.SIGTERM)
    assert cli.main(argv) == 143
    assert capsys.readouterr().err.splitlines() == [
        f"dpmp train: stopped by SIGTERM after step 2 of 4; a checkpoint of that step is in "
        f"{out / 'checkpoints'}: run again in the same directory to resume"
    ]
    assert (out / "checkpoints" / "checkpoint_00000002.npz").is_file()
    assert signal.getsignal(signal.SIGTERM) is handler  # put back


@pytest.mark.slow  # ~6 s on 2 cores
def test_a_full_disk_names_the_checkpoint_leaves_no_temporary_file_and_says_how_to_resume(
    capsys, tmp_path, monkeypatch
):
    """ENOSPC while a checkpoint is written: one line naming the file, what was
    kept and how to resume; no temporary file is left. It said "[Errno 28] No
    space left on device" with no file named and left ``.checkpoint_*.tmp-*``."""
    import errno

    savez, calls = np.savez, []

    def savez_on_a_disk_that_fills(file, **arrays):
        calls.append(1)
        if len(calls) == 1:
            return savez(file, **arrays)
        file.write(b"PK\x03\x04 half a zip")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", savez_on_a_disk_that_fills)
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--quiet"]
    argv += ["--set", "training.steps=4", "--set", "training.checkpoint_every=2"]
    assert cli.main(argv) == 2
    ckpt = out / "checkpoints"
    assert_one_line_error(
        capsys,
        "train",
        f"{ckpt / 'checkpoint_00000004.npz'}: cannot write the checkpoint: No space left on "
        "device; "
        f"the newest checkpoint is of step 2 ({ckpt / 'checkpoint_00000002.npz'}): free space "
        "and run again in the same directory to resume",
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["checkpoint_00000002.npz"]


def _disk_full_for(monkeypatch, file: Path, after: int):
    """Writes to ``file`` (or its temporary twin) fail with ENOSPC, a real one from
    /dev/full, once ``after`` writes of it have succeeded."""
    from dpmp.app import run_dir

    create, opened = run_dir._create, []

    def create_on_a_disk_that_fills(path, flags, secret):
        fd = create(path, flags, secret)
        twin = path.parent == file.parent and path.name.startswith(f".{file.name}.tmp-")
        if path == file or twin:
            opened.append(path)
            if len(opened) > after:
                full = os.open("/dev/full", os.O_WRONLY)
                os.dup2(full, fd)
                os.close(full)
        return fd

    monkeypatch.setattr(run_dir, "_create", create_on_a_disk_that_fills)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, after, folder",
    [("metrics.jsonl", 2, ""), ("report.json", 0, ""), ("diagnostics.json", 0, "private")],
)
def test_a_full_disk_while_writing_run_files_names_the_file_and_resumes(
    name, after, folder, capsys, tmp_path, monkeypatch
):
    """ENOSPC on a run file: one line naming it, the checkpoint kept and how to go on;
    no temporary file is left, and the run started again finishes with whole files."""
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--quiet", "--set", "training.steps=4"]
    argv += ["--set", "training.checkpoint_every=2", "--set", "training.log_every=1"]
    with monkeypatch.context() as patch:
        _disk_full_for(patch, out / folder / name, after)
        assert cli.main(argv) == 2
    newest = 2 if name == "metrics.jsonl" else 4
    ckpt = out / "checkpoints" / f"checkpoint_{newest:08d}.npz"
    assert_one_line_error(
        capsys,
        "train",
        f"{out / folder / name}: cannot write the file: No space left on device; the newest "
        f"checkpoint is of step {newest} ({ckpt}): free space and run again in the same "
        "directory to resume",
    )
    assert not list(out.rglob(".*.tmp-*"))
    assert cli.main(argv) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()  # no torn line is left
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]
    assert json.loads((out / "report.json").read_text())["steps"] == 4


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_a_finished_run_run_again_says_it_is_finished_and_how_to_start_afresh(capsys, tmp_path):
    """It said "resumed from checkpoint_00000002.npz (step 2, ...)", as if training went on."""
    argv = ["train", "--out", str(tmp_path / "run"), "--set", "training.steps=2"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "resumed" not in err
    assert "this run is finished (2 steps, checkpoint_00000002.npz)" in err
    assert "To train afresh: dpmp train --fresh" in err


_GC_INTERRUPT = """
import gc, os, signal, sys
from dpmp.app import cli
from dpmp.app.trainer import loop

build = loop._build_step


def interrupted_in_a_gc_callback(*args, **kwargs):
    def callback(phase, info):
        gc.callbacks.remove(callback)
        os.kill(os.getpid(), signal.SIGINT)  # delivered while the callback runs

    gc.callbacks.append(callback)
    gc.collect()
    return build(*args, **kwargs)


loop._build_step = interrupted_in_a_gc_callback
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow  # a subprocess that imports jax and compiles a step (~25 s of CPU)
def test_ctrl_c_that_python_swallows_in_a_gc_callback_still_stops_the_run(tmp_path):
    """Python ignores a KeyboardInterrupt raised inside a garbage-collector callback
    (JAX registers one): the run printed "Exception ignored in: <function
    _xla_gc_callback ...>" and trained to its end. It is remembered and stops the
    run before its first step: one line, status 130, a checkpoint of step 0."""
    script = tmp_path / "gc_interrupt.py"
    script.write_text(_GC_INTERRUPT)
    out = tmp_path / "run"
    argv = [sys.executable, str(script), "train", "--out", str(out), "--quiet"]
    argv += ["--set", "training.steps=2"]
    # 40 s on two cores under a load of 6; 120 s ran out on a busier machine
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"dpmp train: interrupted after step 0 of 2; a checkpoint of that step is in "
        f"{out / 'checkpoints'}: run again in the same directory to resume"
    ]
    assert not (out / "report.json").exists()


def test_audit_refuses_an_accumulate_dtype_the_step_cannot_honour(capsys):
    # clip=f32 summed in bf16 is impossible: the sum stayed float32 and the audit passed
    assert cli.main(["audit", "--set", 'policy="bf16,accumulate=bf16,unsafe=true"']) == 2
    assert_one_line_error(capsys, "audit", "accumulate=bf16 is not at least as wide as clip=f32")


@pytest.mark.parametrize(
    "setting, needle",
    [
        ("training.physical_batch_size=100000000000", "exceeds the 1437 training examples"),
        ("training.microbatch_size=100000", "exceeds the 1437 training examples"),
        ("training.expected_batch_size=100000000000", "exceeds the 1437 training examples"),
        ("model.lora_rank=100000000000", "model.lora_rank = 100000000000: "),
        ("model.hidden=[1048576, 1048576]", "model.hidden = [1048576, 1048576]: "),
    ],
)
def test_sizes_beyond_the_data_or_the_machine_are_one_line_before_any_allocation(
    capsys, setting, needle
):
    """A physical batch of 10^11 allocated a 373 GiB index array; a 10^11-wide
    model died in accounting with a message about the noise residual."""
    assert cli.main(["audit", "--set", setting]) == 2
    assert_one_line_error(capsys, "audit", needle)


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_the_memory_check_counts_parameters_gradients_and_adam_state(capsys, monkeypatch, tmp_path):
    """The default MLP (64-256-10: 19,210 float32 parameters, by hand) needs at least
    6 copies of them with Adam in the audit's step (the parameters, two moments, and
    the new parameters and moments): refused below that many bytes, built above. The
    trainer's step writes the new state in place: 3 copies."""
    from dpmp.app.trainer import step

    params = 64 * 256 + 256 + 256 * 10 + 10
    need = 6 * 4 * params
    monkeypatch.setattr(step, "_memory_bytes", lambda: need - 1)
    assert cli.main(["audit", "--set", "training.steps=2"]) == 2
    assert_one_line_error(capsys, "audit", "model.hidden = [256]: 19,210 parameters")
    monkeypatch.setattr(step, "_memory_bytes", lambda: need)
    assert cli.main(["audit", "--set", "training.steps=2"]) == 0
    capsys.readouterr()
    train = ["train", "--set", "training.steps=2", "--out", str(tmp_path / "run"), "--quiet"]
    monkeypatch.setattr(step, "_memory_bytes", lambda: 3 * 4 * params - 1)
    assert cli.main(train) == 2
    assert_one_line_error(capsys, "train", "model.hidden = [256]: 19,210 parameters")
    monkeypatch.setattr(step, "_memory_bytes", lambda: 3 * 4 * params)
    cli.main(train)  # past the shapes' check: the compiled step's own may still refuse
    assert "19,210 parameters" not in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_is():
    """``dpmp COMMAND --help`` explains each flag (none is a bare name)."""
    import argparse

    from dpmp.app.cli.entry import parser

    top = parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    bare = [
        f"{name} {action.option_strings[0]}"
        for name, p in sub.choices.items()
        for action in p._actions
        if action.option_strings and not action.help
    ]
    assert not bare, bare


def test_the_default_run_directory_is_stated(capsys):
    """``dpmp train`` writes runs/default when no --out is given: --help and the
    docs' synopsis say so."""
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "(default: runs/default)" in " ".join(capsys.readouterr().out.split())
    page = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert "RUN_DIR defaults to runs/default" in page


def _read_only(monkeypatch, folder: Path) -> None:
    """Files opened for writing in ``folder`` fail as in a read-only folder (EPERM),
    whoever runs the tests (root may write anywhere)."""
    import errno

    from dpmp.app import run_dir

    def refused(path):
        if Path(path).is_relative_to(folder):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))

    create = run_dir._create
    monkeypatch.setattr(run_dir, "open", lambda p, *a, **k: refused(p) or open(p, *a, **k), False)
    monkeypatch.setattr(run_dir, "_create", lambda p, *a: refused(p) or create(p, *a))


def test_a_read_only_run_directory_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    """It said "[Errno 1] Operation not permitted"."""
    out = tmp_path / "run"
    out.mkdir()
    _read_only(monkeypatch, out)
    assert cli.main(["train", "--quiet", "--out", str(out)]) == 2
    assert_one_line_error(
        capsys, "train", f"{out}: cannot write the run directory: Operation not permitted"
    )
    assert not list(out.iterdir())


def _finished_run(folder: Path) -> Path:
    folder.mkdir()
    report = {"versions": {"dpmp": "x"}, "policy": "bf16", "steps": 3, "test_accuracy": 0.5}
    report |= {"epsilon": 1.0, "delta": 1e-5, "private": True, "privacy_warnings": []}
    (folder / "report.json").write_text(json.dumps(report))
    record = {"step": 3, "epsilon": 1.0, "loss_scale": 1.0, "test_accuracy": 0.5, "test_loss": 1}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return folder


def test_report_leaves_a_read_only_run_directory_as_it_is(capsys, tmp_path):
    """It rewrote the plots of a folder marked read-only (as root, who may)."""
    run = _finished_run(tmp_path / "run")
    run.chmod(0o555)
    try:
        assert cli.main(["report", str(run)]) == 0
    finally:
        run.chmod(0o755)
    printed = capsys.readouterr()
    assert "epsilon" in printed.out and "plot:" not in printed.out
    assert printed.err == f"dpmp report: {run} is read-only: its plots were not rewritten\n"
    assert not list(run.glob("*.png"))


def test_report_says_once_that_it_could_not_write_the_plots(capsys, tmp_path, monkeypatch):
    import errno

    from matplotlib.figure import Figure

    def refused(self, path, **kwargs):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))

    monkeypatch.setattr(Figure, "savefig", refused)
    run = _finished_run(tmp_path / "run")
    assert cli.main(["report", str(run)]) == 0
    printed = capsys.readouterr()
    assert "epsilon" in printed.out and "plot:" not in printed.out
    assert printed.err == (
        f"dpmp report: plots not rewritten: {run / 'privacy_utility.png'}: cannot write the "
        "plot: Operation not permitted\n"
    )
