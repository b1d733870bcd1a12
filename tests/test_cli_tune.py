"""``dpmp tune`` and ``dpmp.app.tune``: ranges, what a search releases, the command.

The search's logic runs here with a stand-in for ``dpmp.train`` (it writes a run
folder whose score is a known function of the hyperparameters); one slow test
runs the real command on the digits.
"""

import json
import os
import stat

import pytest

from dpmp.accounting._tuning import PoissonCount
from dpmp.app import cli
from dpmp.app.config import Config, ConfigError, load_config
from dpmp.app.tune import parse_range, ranges_from_toml, tune

from .test_cli import assert_one_line_error

TINY = ["training.steps=4", "model.hidden=[16]"]


class FixedCount(PoissonCount):
    """A Poisson search's accounting with a chosen K (tests only: K must be secret)."""

    def __init__(self, k: int, mean: float = 2.0):
        super().__init__(mean)
        object.__setattr__(self, "k", k)

    def draw(self, rng) -> int:
        rng.random()  # as a real draw, it uses the generator
        return self.k


def fake_train(score_of):
    """A stand-in for ``dpmp.train``: a run folder with the public files, a
    private/ and a checkpoints/ folder, and ``score_of(config)`` as test accuracy."""

    def train(config, *, out_dir, resume, progress, callback):
        assert resume is False and progress is False
        os.makedirs(os.path.join(out_dir, "private"))
        os.makedirs(os.path.join(out_dir, "checkpoints"))
        acc = score_of(config)
        for step in range(1, config.training.steps + 1):
            callback(step, {"epsilon": 0.1 * step})
        report = {"test_accuracy": acc, "test_loss": 1 - acc, "private": True,
                  "privacy_warnings": [], "steps": config.training.steps}  # fmt: skip
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f)
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": config.training.steps, "test_accuracy": acc}) + "\n")
        return report

    return train


def closest_to_a_hundredth(config):
    return 1.0 - abs(config.training.learning_rate - 0.01)


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """One search of 5 candidates over two keys, with the stand-in trainer."""
    out = tmp_path_factory.mktemp("search") / "out"
    release = tune(
        load_config(None, TINY),
        ["training.learning_rate=log:1e-3:1e-1", "training.optimizer=choice:adam,sgd"],
        out_dir=out,
        candidates=FixedCount(5),
        train=fake_train(closest_to_a_hundredth),
        progress=False,
    )
    return out, release


def test_a_search_releases_only_the_chosen_run(search):
    """Public: tune.json and best/ (the chosen run); K, every candidate's values
    and scores in private/ (owner-only), the other run folders deleted."""
    out, release = search
    assert sorted(os.listdir(out)) == ["best", "private", "tune.json"]
    assert sorted(os.listdir(out / "private")) == ["README.txt", "search.json"]
    assert stat.S_IMODE(os.stat(out / "private").st_mode) == 0o700
    secret = json.loads((out / "private" / "search.json").read_text())
    assert secret["candidates_drawn"] == 5 and len(secret["candidates"]) == 5
    best = max(secret["candidates"], key=lambda c: c["score"])
    assert secret["chosen"] == best["index"]
    assert release["chosen"]["hyperparameters"] == best["hyperparameters"]
    assert release["chosen"]["score"] == best["score"]
    assert json.loads((out / "best" / "report.json").read_text())["test_accuracy"] == best["score"]
    public = (out / "tune.json").read_text()
    assert json.loads(public) == release
    assert "candidates_drawn" not in public and "tiebreak" not in public
    for other in secret["candidates"]:
        if other["index"] != best["index"]:
            assert repr(other["score"]) not in public
            assert repr(other["hyperparameters"]["training.learning_rate"]) not in public


def test_a_search_states_one_guarantee_within_its_target(search):
    out, release = search
    assert release["epsilon"] <= release["target_epsilon"] == 2.0
    assert release["delta"] == 1e-5
    assert release["private"] is True and release["privacy_warnings"] == []
    assert release["candidates"]["distribution"] == "poisson"
    assert release["candidates"]["drawn_from"] == "OS entropy (secret)"
    assert release["score"]["name"] == "test_accuracy" and "held-out" in release["score"]["source"]
    plan = release["candidate_plan"]
    assert plan["noise_multiplier"] == release["config"]["privacy"]["noise_multiplier"]
    # one candidate alone costs less than the whole search
    assert plan["epsilon_alone"] < release["epsilon"]
    parts = release["accounting"]
    assert parts["delta_rdp"] + parts["delta_residual_and_truncation"] == pytest.approx(1e-5)


def test_ties_go_to_the_secret_tiebreak(tmp_path):
    """Equal scores: the candidate with the largest secret uniform draw is chosen."""
    out = tmp_path / "out"
    tune(load_config(None, TINY), ["training.learning_rate=log:1e-3:1e-1"], out_dir=out,
         candidates=FixedCount(4), train=fake_train(lambda c: 0.5), progress=False)  # fmt: skip
    secret = json.loads((out / "private" / "search.json").read_text())
    assert secret["chosen"] == max(secret["candidates"], key=lambda c: c["tiebreak"])["index"]


def test_no_candidate_releases_nothing_but_the_guarantee(tmp_path, capsys):
    """K = 0 (Poisson): no best/, tune.json says nothing was chosen; the progress
    lines print the plan and never a score."""
    out = tmp_path / "out"
    ranges = ["training.learning_rate=log:1e-3:1e-1"]
    release = tune(load_config(None, TINY), ranges, out_dir=out, candidates=FixedCount(0),
                   train=fake_train(lambda c: 0.5))  # fmt: skip
    assert release["chosen"] is None and "K = 0" in release["nothing_chosen"]
    assert sorted(os.listdir(out)) == ["private", "tune.json"]
    err = capsys.readouterr().err
    assert "noise multiplier" in err and "keep them private" in err


def test_a_seeded_search_says_it_is_not_private(tmp_path, capsys):
    """A public seed draws K, the hyperparameters and the tie-breaks: NOT private.
    The progress lines count the candidates and show no score."""
    release = tune(load_config(None, TINY), ["training.learning_rate=log:1e-3:1e-1"],
                   out_dir=tmp_path / "out", candidates=FixedCount(2), seed=7,
                   train=fake_train(closest_to_a_hundredth))  # fmt: skip
    assert release["private"] is False
    assert release["candidates"]["drawn_from"] == "public seed"
    warnings = release["privacy_warnings"]
    assert any("seed = 7" in w and "NOT differentially private" in w for w in warnings)
    err = capsys.readouterr().err
    assert "candidates done: 2" in err
    assert "test_accuracy" not in err and "0.99" not in err  # no score is shown


def test_a_folder_with_a_search_is_refused(search):
    out, _ = search
    with pytest.raises(ConfigError, match="holds a search already"):
        tune(load_config(None, TINY), ["training.learning_rate=log:1e-3:1e-1"], out_dir=out,
             train=fake_train(lambda c: 0.5))  # fmt: skip


# ---- ranges ----------------------------------------------------------------------


def test_ranges_draw_within_their_bounds():
    import numpy as np

    rng = np.random.default_rng(0)
    log = parse_range("training.learning_rate=log:1e-4:1e-1")
    values = [log.draw(rng) for _ in range(2000)]
    assert 1e-4 <= min(values) and max(values) <= 1e-1
    # log-uniform: about half the draws below the geometric mean (binomial, 5 sigma)
    below = sum(v < 10**-2.5 for v in values)
    assert abs(below - 1000) < 5 * (2000 * 0.25) ** 0.5
    ints = parse_range("training.microbatch_size=int:2:4")
    assert {ints.draw(rng) for _ in range(200)} == {2, 3, 4}
    choice = parse_range("training.optimizer=choice:adam, sgd,momentum")
    assert choice.choices == ("adam", "sgd", "momentum")
    assert parse_range("privacy.l2_clip_norm=choice:0.1,1").choices == (0.1, 1)


def test_ranges_from_a_toml_table(tmp_path):
    path = tmp_path / "ranges.toml"
    path.write_text(
        '[tune]\n"training.learning_rate" = "log:1e-3:1e-1"\n'
        '[tune.privacy]\nl2_clip_norm = "uniform:0.1:2"\n'
    )
    ranges = ranges_from_toml(path)
    assert [(r.key, r.spec()) for r in ranges] == [
        ("training.learning_rate", "log:0.001:0.1"),
        ("privacy.l2_clip_norm", "uniform:0.1:2.0"),
    ]
    path.write_text("[training]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"has no \[tune\] table"):
        ranges_from_toml(path)


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--range", "training.learning_rate=log:0.1:0.01"], ["the range is empty", "LOW 0.1"]),
        (["--range", "training.learning_rate=uniform:1:1"], ["the range is empty"]),
        (["--range", "training.microbatch_size=int:8:4"], ["the range is empty"]),
        (["--range", "training.optimizer=choice:"], ["the range is empty (no choices)"]),
        (["--range", "training.learning_rate=log:fast:1"], ["'fast' is not a number"]),
        (["--range", "training.microbatch_size=int:2:4.5"], ["'4.5' is not an integer"]),
        (["--range", "training.learning_rate=log:0:1"], ["a log range needs LOW > 0"]),
        (["--range", "training.learning_rate=log:1e-3:inf"], ["not a finite number"]),
        (["--range", "training.learning_rate=between:1:2"], ["the kind must be one of"]),
        (["--range", "training.learning_rate"], ["expected KEY=log:LOW:HIGH"]),
        (["--range", "training.steps=int:10:20"], ["range training.steps", "one privacy plan"]),
        (["--range", "privacy.delta=log:1e-6:1e-5"], ["range privacy.delta", "one privacy plan"]),
        (["--range", "model.hidden=choice:16"], ["range model.hidden", "one privacy plan"]),
        (["--range", "training.rate=log:1:2"], ["range training.rate", "unknown key"]),
        ([], ["give the keys to search"]),
        (["--ranges", "/nonexistent/ranges.toml"], ["cannot read", "ranges.toml"]),
        (["--range", "training.learning_rate=log:1e-3:1e-1", "--candidates", "poisson"],
         ["--candidates: expected poisson:MEAN"]),
        (["--range", "training.learning_rate=log:1e-3:1e-1", "--candidates", "poisson:x"],
         ["'x' is not numbers"]),
    ],
)  # fmt: skip
def test_a_bad_range_is_one_line_and_exit_2(capsys, argv, needles):
    """Checked before JAX starts: each is one line naming the range, status 2."""
    assert cli.main(["tune", *argv]) == 2
    assert_one_line_error(capsys, "tune", *needles)


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--range", "training.optimizer=choice:adam,rmsprop"],
         ["range training.optimizer=choice:adam,rmsprop", "training.optimizer", "rmsprop"]),
        (["--range", "training.microbatch_size=uniform:1:4"],
         ["range training.microbatch_size", "must be an integer"]),
        (["--range", "training.learning_rate=log:1e-3:1e-1", "--range",
          "training.learning_rate=log:1e-2:1"], ["a key has two ranges: training.learning_rate"]),
        (["--range", "training.learning_rate=log:1e-3:1e-1", "--candidates", "poisson:0.5"],
         ["--candidates 'poisson:0.5'", "must be >= 1"]),
        (["--range", "training.learning_rate=log:1e-3:1e-1", "--set",
          "privacy.noise_multiplier=3"], ["privacy.noise_multiplier: the search calibrates it"]),
    ],
)  # fmt: skip
def test_a_range_the_config_refuses_is_one_line_and_exit_2(capsys, tmp_path, argv, needles):
    """Checked against the config before any data is read or anything written."""
    out = tmp_path / "out"
    assert cli.main(["tune", *argv, "--out", str(out)]) == 2
    assert_one_line_error(capsys, "tune", *needles)
    assert not out.exists()


def test_the_command_is_registered():
    from dpmp.app.cli.entry import COMMANDS

    assert COMMANDS.get("tune").run.__module__ == "dpmp.app.cli.tune"


@pytest.mark.slow
def test_dpmp_tune_on_the_digits(tmp_path, capsys):
    """The real command: a Poisson(2) search of tiny runs on the default digits
    config. tune.json states one epsilon within the target; best/ is the only run
    folder; the count of candidates is in private/ alone. (Seeded, so that it runs
    a known number of candidates: it says it is NOT private.)"""
    out = tmp_path / "search"
    argv = ["tune", "--set", "training.steps=3", "--set", "training.eval_every=3",
            "--set", "model.hidden=[16]", "--range", "training.learning_rate=log:1e-3:1e-1",
            "--candidates", "poisson:2", "--seed", "1", "--out", str(out), "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    release = json.loads((out / "tune.json").read_text())
    assert release["epsilon"] <= Config().privacy.target_epsilon
    assert f"search: epsilon {release['epsilon']:.5g}" in printed
    assert sorted(os.listdir(out)) == ["best", "private", "tune.json", "tune.png"]
    report = json.loads((out / "best" / "report.json").read_text())
    assert report["noise_multiplier"] == release["candidate_plan"]["noise_multiplier"]
    assert report["test_accuracy"] == release["chosen"]["score"]
    secret = json.loads((out / "private" / "search.json").read_text())
    assert secret["candidates_drawn"] >= 1
    assert "candidates_drawn" not in (out / "tune.json").read_text()
    assert release["private"] is False  # seeded
