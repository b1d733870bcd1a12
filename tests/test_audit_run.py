"""The one-run audit of a whole run: its statistics against independent references,
its end-to-end verdicts (slow), and the command's usage errors."""

import json

import jax
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
from jax_privacy import auditing as jp_auditing

from dpmp import cli
from dpmp.app.audit_run import _setup, _train, audit_run
from dpmp.app.audit_users import zero_out_users
from dpmp.app.config import Config, ConfigError, load_config
from dpmp.app.inputs import load_data
from dpmp.audit._one_run import auc, epsilon_lower_bound, exact_gaussian_game, guess
from dpmp.data._sampling import SampledBatch
from dpmp.step import _step as step_module


def _p_value(m, k, c, eps, delta):
    """P[W >= c] bound of Steinke, Nasr & Jagielski (2023), written out from the
    paper with scipy: beta + 2 m delta max_i (P[B >= c - i] - beta) / i."""
    p = scipy.special.expit(eps)
    beta = scipy.stats.binom.sf(c - 1, k, p)
    i = np.arange(1, c + 1)
    alpha = np.max((scipy.stats.binom.sf(c - i - 1, k, p) - beta) / i)
    return min(beta + 2 * m * delta * alpha, 1.0)


def _bound_delta_zero(k, c, significance=0.05):
    """delta = 0: the epsilon where P[Binomial(k, e^eps / (1 + e^eps)) >= c] = significance."""

    def excess(eps):
        return scipy.stats.binom.sf(c - 1, k, scipy.special.expit(eps)) - significance

    return 0.0 if excess(0.0) > 0 else scipy.optimize.brentq(excess, 0.0, 50.0, xtol=1e-12)


# ---- the bound from counts ---------------------------------------------------------


@pytest.mark.parametrize("k, c", [(200, 140), (200, 180), (100, 100), (50, 36), (1000, 560)])
def test_bound_is_the_binomial_tail_at_delta_zero(k, c):
    expected = _bound_delta_zero(k, c)
    assert expected > 0
    assert epsilon_lower_bound(1000, k, c, delta=0.0) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("k, c", [(200, 150), (200, 190), (100, 100)])
def test_bound_with_delta_is_where_the_papers_p_value_meets_the_significance(k, c):
    m, delta = 1000, 1e-5
    eps = epsilon_lower_bound(m, k, c, delta=delta)
    assert 0 < eps < _bound_delta_zero(k, c)
    assert _p_value(m, k, c, eps, delta) == pytest.approx(0.05, abs=1e-4)
    assert _p_value(m, k, c, 0.98 * eps, delta) < 0.05 < _p_value(m, k, c, 1.02 * eps, delta)


def test_bound_grows_with_correct_guesses_and_shrinks_with_delta():
    bounds = [epsilon_lower_bound(1000, 200, c, delta=1e-5) for c in range(90, 201)]
    assert bounds[0] == 0.0 and bounds[-1] > 4
    assert all(b <= a for b, a in zip(bounds, bounds[1:]))
    by_delta = [epsilon_lower_bound(1000, 200, 180, delta=d) for d in (0.0, 1e-6, 1e-5, 1e-4)]
    assert all(b >= a for b, a in zip(by_delta, by_delta[1:]))


def test_bound_agrees_with_jax_privacy_public_one_run_audit():
    """One-sided guesses above a threshold: the count-based bound is what
    ``CanaryScoreAuditor.epsilon_one_run`` gives for the same threshold."""
    rng = np.random.default_rng(0)
    member = rng.random(1000) < 0.5
    scores = rng.normal(size=1000) + 1.5 * member
    threshold = np.quantile(scores, 0.9)
    auditor = jp_auditing.CanaryScoreAuditor(scores[member], scores[~member])
    theirs = auditor.epsilon_one_run(
        0.05, 1e-5, threshold_strategy=jp_auditing.Explicit(threshold=threshold)
    )
    above = scores >= threshold
    ours = epsilon_lower_bound(1000, int(above.sum()), int((above & member).sum()), delta=1e-5)
    assert ours > 0.5 and ours == pytest.approx(theirs, abs=1e-9)


def test_chance_guesses_give_no_bound_and_perfect_guesses_a_large_one():
    rng = np.random.default_rng(1)
    chance = []
    for _ in range(50):
        member = rng.random(1000) < 0.5
        chance.append(
            epsilon_lower_bound(1000, 200, guess(rng.normal(size=1000), member, 200), delta=1e-5)
        )
    assert np.median(chance) == 0.0 and sum(b > 0 for b in chance) <= 8
    member = rng.random(1000) < 0.5  # no noise: the score is the membership
    perfect = guess(member + 1e-3 * rng.normal(size=1000), member, 200)
    assert perfect == 200
    assert epsilon_lower_bound(1000, 200, perfect, delta=1e-5) > 4


@pytest.mark.parametrize(
    "args, needle",
    [
        ((1000, 0, 0), "num_guesses"),
        ((1000, 1001, 10), "num_guesses"),
        ((1000, 200, 201), "num_correct"),
    ],
)
def test_bound_refuses_impossible_counts(args, needle):
    with pytest.raises(ValueError, match=needle):
        epsilon_lower_bound(*args, delta=1e-5)


# ---- guesses and AUC ----------------------------------------------------------------


def test_guesses_take_the_highest_as_in_and_the_lowest_as_out():
    scores = np.array([0.1, 0.9, 0.5, 0.3])
    member = np.array([False, True, True, False])
    assert guess(scores, member, 2) == 2  # in: 0.9 (right); out: 0.1 (right)
    assert guess(scores, member, 3) == 3  # in: 0.9; out: 0.1, 0.3
    assert guess(scores, member, 4) == 4
    assert guess(scores, ~member, 4) == 0
    with pytest.raises(ValueError, match="num_guesses"):
        guess(scores, member, 5)


def test_auc_is_the_probability_that_in_outscores_out():
    assert auc([2.0, 3.0], [1.0, 2.0]) == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    rng = np.random.default_rng(2)
    assert abs(auc(rng.normal(size=5000), rng.normal(size=5000)) - 0.5) < 0.015
    shifted = auc(rng.normal(size=20000) + 1.0, rng.normal(size=20000))
    assert shifted == pytest.approx(scipy.stats.norm.cdf(1 / np.sqrt(2)), abs=0.006)


# ---- the exact Gaussian game ---------------------------------------------------------


def test_exact_game_auc_is_the_gaussian_shift_of_the_composed_mechanism():
    """q = 1: each canary's log-likelihood ratio is Gaussian with means +-mu^2/2 and
    variance mu^2, mu = sqrt(steps) / sigma, so the optimal test's AUC is
    Phi(mu / sqrt(2))."""
    game = exact_gaussian_game(
        noise_multiplier=10.0,
        sampling_prob=1.0,
        steps=100,
        num_canaries=1000,
        num_guesses=200,
        delta=1e-5,
        games=20,
    )
    assert game.auc == pytest.approx(scipy.stats.norm.cdf(1 / np.sqrt(2)), abs=0.01)
    assert game.epsilon_low <= game.epsilon_median <= game.epsilon_high
    assert 1.0 < game.epsilon_median < 2.5


def test_exact_game_without_privacy_and_with_pure_noise():
    common = dict(num_canaries=1000, num_guesses=200, delta=1e-5, games=20)
    loud = exact_gaussian_game(noise_multiplier=0.05, sampling_prob=0.5, steps=10, **common)
    assert loud.auc > 0.999 and loud.epsilon_median > 4
    quiet = exact_gaussian_game(noise_multiplier=1e3, sampling_prob=0.5, steps=10, **common)
    assert abs(quiet.auc - 0.5) < 0.02 and quiet.epsilon_median == 0.0


# ---- the audit run: its data, its plan, zero-out ------------------------------------


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
def test_audit_run_keeps_the_configs_noise_and_rate_on_n_plus_m_records():
    config = Config()
    base = load_data(config.data, config.training.seed)
    setup = _setup(config, base, 100, seed=0)
    own, step = setup.own, setup.step
    n, records = base.num_train, base.num_train + 100
    assert step.data.num_train == records and own.data.num_train == n
    assert step.plan.noise_multiplier == own.plan.noise_multiplier and own.plan.calibrated
    assert abs(step.plan.sampling_prob - own.plan.sampling_prob) <= 0.5 / records
    assert setup.audit_config.training.steps == config.training.steps
    np.testing.assert_array_equal(step.data.x_train[n:], setup.x)  # appended, in order
    np.testing.assert_array_equal(step.data.y_train[n:], setup.y)
    assert set(np.unique(setup.x)) == {-1.0, 1.0} and setup.y.max() < base.num_classes
    assert 30 < setup.member.sum() < 70


def test_zero_out_makes_excluded_records_padding():
    sampled = SampledBatch(np.array([3, 7, 1, -1], np.int32), np.array([0, 0, 0, 1], bool))
    out = np.zeros(8, bool)
    out[7] = True
    got = zero_out_users(sampled, out)
    np.testing.assert_array_equal(got.is_padding_example, [False, True, False, True])
    np.testing.assert_array_equal(got.indices, sampled.indices)


@pytest.mark.slow  # two audit trainings, ~10 s
def test_excluded_canaries_contribute_nothing():
    """Bit for bit: training with every canary out gives the same parameters
    whatever the canaries are (same keys: reproducible noise and sampling), and
    other parameters with them in."""
    config = load_config(
        None,
        ["privacy.reproducible_noise=true", "training.steps=3", "model.hidden=[16]"],
    )
    base = load_data(config.data, config.training.seed)
    setups = [_setup(config, base, 200, seed=seed) for seed in (0, 1)]
    assert not np.array_equal(setups[0].x, setups[1].x)
    out = np.zeros(base.num_train + 200, bool)
    out[base.num_train :] = True
    steps = config.training.steps
    first, second = (jax.tree.leaves(_train(s.step, steps, out, progress=False)) for s in setups)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    included = jax.tree.leaves(_train(setups[0].step, steps, np.zeros_like(out), progress=False))
    assert any(not np.array_equal(a, b) for a, b in zip(first, included))


def test_audit_run_refuses_what_it_cannot_check():
    with pytest.raises(ConfigError, match="privacy.sampling"):
        audit_run(load_config(None, ['privacy.sampling="shuffle"']), progress=False)
    with pytest.raises(ValueError, match="num_canaries"):
        audit_run(num_canaries=5, progress=False)
    with pytest.raises(ValueError, match="num_guesses"):
        audit_run(num_canaries=100, num_guesses=101, progress=False)


# ---- the command: usage errors ------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--run", "--privacy"], ["--run and --privacy"]),
        (["--releases", "1000"], ["--releases", "--privacy only"]),
        (["--run", "--releases", "1000"], ["--releases", "--privacy only"]),
        (["--canaries", "100"], ["--canaries", "--run only"]),
        (["--privacy", "--guesses", "10"], ["--guesses", "--run only"]),
        (["--out", "x"], ["--out", "--run only"]),
        (["--quiet"], ["--quiet", "--run only"]),
        (["--run", "--canaries", "100", "--guesses", "101"], ["--guesses", "101", "100"]),
        (["--run", "--guesses", "1001"], ["--guesses", "1001", "1000 canaries"]),
        (["--run", "--out", __file__], ["--out", "not a directory"]),
        (["--run", "--set", 'privacy.sampling="shuffle"'], ["privacy.sampling", "poisson"]),
        (["--run", "--set", "training.stepz=3"], ["unknown key training.stepz"]),
    ],
)
def test_audit_run_usage_errors_exit_2_with_one_line(argv, needles, capsys):
    assert cli.main(["audit", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dpmp audit: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--run", "--canaries", "5"], "--canaries"),
        (["--run", "--canaries", "many"], "--canaries"),
        (["--run", "--guesses", "0"], "--guesses"),
    ],
)
def test_audit_run_bad_numbers_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["audit", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


# ---- end to end (slow) ---------------------------------------------------------------

# A config whose canaries the black-box score reads almost as well as the optimal
# test reads the exact mechanism: 4,096 independent features and 10 classes keep the
# 1,000 canaries' gradients nearly orthogonal (in the digits' 64 pixels they
# interfere, which caps what one run can show), a linear model with a small
# learning rate does not saturate on the canaries it fits, and float32 keeps the
# small loss changes. 200 steps at q = 0.32, about 20 s per audit on 2 CPU cores.
# At a claimed epsilon of 10 ten fresh audits gave lower bounds 2.48-3.21 (193.6
# of 200 guesses right on average; more than 2 needs 185): a wrong verdict needs
# 16 wrong guesses where 6 to 7 are expected.
WIDE = [
    *("--set", 'model.kind="linear"', "--set", "model.hidden=[]", "--set", 'policy="fp32"'),
    *("--set", "training.steps=200", "--set", "training.expected_batch_size=64"),
    *("--set", "training.learning_rate=1e-4"),
]


def _wide_data(path, d=4096, classes=10, n=200):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * n, d)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(d, classes)), 1).astype(np.int32)
    np.savez(path, x=x[:n], y=y[:n], x_test=x[n:], y_test=y[n:])
    return str(path)


def _audit_json(capsys, *argv):
    status = cli.main(["audit", "--run", "--quiet", "--json", *argv])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_claim_10_shows_leakage_that_claim_2_does_not(tmp_path, capsys):
    data = _wide_data(tmp_path / "wide.npz")
    status, high = _audit_json(capsys, "--data", data, *WIDE, "--set", "privacy.target_epsilon=10")
    assert status == 0 and high["ok"], high
    assert 9 < high["epsilon_claimed"] <= 10
    assert high["epsilon_lower"] > 2, high
    out = tmp_path / "audit"
    status, low = _audit_json(
        capsys, "--data", data, *WIDE, "--set", "privacy.target_epsilon=2", "--out", str(out)
    )
    assert status == 0 and low["ok"], low
    assert low["epsilon_claimed"] <= 2 and low["epsilon_lower"] <= 2
    assert low["epsilon_lower"] < high["epsilon_lower"]
    assert low["epsilon_gaussian"] < high["epsilon_gaussian"]
    assert json.loads((out / "audit.json").read_text()) == low
    with np.load(out / "canaries.npz") as saved:
        assert saved["member"].sum() == low["num_in"] and saved["scores"].shape == (1000,)


@pytest.mark.slow
def test_a_step_with_less_noise_than_claimed_is_caught(tmp_path, capsys, monkeypatch):
    """The trainer's optimizer made to add a tenth of the noise it is given: the
    accountant still claims epsilon 2; the audit's lower bound exceeds it, exit 1."""
    real = step_module.private_optimizer

    def leaky(*args, noise_multiplier, **kwargs):
        return real(*args, noise_multiplier=noise_multiplier / 10, **kwargs)

    monkeypatch.setattr(step_module, "private_optimizer", leaky)
    data = _wide_data(tmp_path / "wide.npz")
    status, report = _audit_json(capsys, "--data", data, *WIDE, "--set", "privacy.target_epsilon=2")
    assert status == 1 and not report["ok"], report
    assert report["epsilon_lower"] > report["epsilon_claimed"]
    assert report["verdict"].startswith("LEAKS")


@pytest.mark.slow
def test_default_config_audit(capsys):
    """``dpmp audit --run`` with no config: the digits MLP at epsilon 2, 1,000 canaries."""
    assert cli.main(["audit", "--run", "--quiet"]) == 0
    text = capsys.readouterr().out
    for row in ("claimed epsilon", "epsilon lower bound", "exact Gaussian", "attack AUC"):
        assert row in text
    assert "verdict              OK" in text
