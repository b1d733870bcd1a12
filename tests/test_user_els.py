"""Example-level sampling of users (ELS): every record Poisson-sampled and clipped on
its own, at most k records per user, accounted at the user level as the binomial
mixture of Gaussians (``dpmp.accounting._groups``)."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import stats

import dpmp.accounting as acc
from dpmp.accounting._groups import dominating_poisson, has_mixture, rdp_compatible, unit_event
from dpmp.accounting._residual import _outside_mass, _outside_mass_split

PLAN = dict(sampling_prob=0.02, steps=60, delta=1e-5, noised_coordinates=None)


def _eps(**kw):
    return acc.epsilon(**{**PLAN, **kw})


def test_one_record_per_unit_is_the_poisson_subsampled_gaussian():
    """k = 1: the mixture is (1 - q) N(0) + q N(1), dp-accounting's Poisson-subsampled
    Gaussian; dpmp's plan keeps it exactly as before."""
    one = unit_event(1.1, 0.02, 1)
    assert one == dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1))
    mixture = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(1.1, [0.0, 1.0], [0.98, 0.02])
    a = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    b = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    a.compose(one, 60)
    b.compose(mixture, 60)
    # the two PLD constructions (connect-the-dots vs the Gaussian's own) of one mechanism
    assert a.get_epsilon(1e-5) == pytest.approx(b.get_epsilon(1e-5), rel=2e-3)
    assert _eps(noise_multiplier=1.1, records_per_unit=1) == _eps(noise_multiplier=1.1)


@pytest.mark.slow
def test_user_level_epsilon_equals_jax_privacy_user_level_accountant():
    """jax-privacy's DpsgdTrainingUserLevelAccountant composes the same mixture (Ganesh
    2024): dpmp's epsilon (the PLD at its coarser 1e-3 interval for mixtures) is an
    upper bound within that interval's rounding of jax-privacy's at 1e-3."""
    from jax_privacy.accounting import accountants, analysis

    k, sigma, n, batch = 2, 1.3, 5000, 100
    params = analysis.DpParams(
        noise_multipliers=sigma, num_samples=n, delta=1e-5, batch_size=batch, examples_per_user=k
    )
    config = accountants.PldAccountantConfig(value_discretization_interval=1e-3)
    theirs = analysis.DpsgdTrainingUserLevelAccountant(config).compute_epsilon(60, params)
    ours = _eps(noise_multiplier=sigma, sampling_prob=batch / n, records_per_unit=k)
    # pessimistic PLDs at interval 1e-3 over 60 steps: within 60 x 1e-3 of each other
    assert ours == pytest.approx(theirs, abs=60 * 1e-3)
    assert ours > _eps(noise_multiplier=sigma, sampling_prob=batch / n)  # more than 1 record


@pytest.mark.slow
def test_user_level_epsilon_grows_with_k_and_stays_below_group_privacy():
    """More records per user: more epsilon. Below the group-privacy conversion of the
    record-level guarantee at delta' = delta / (k e^((k-1) eps)) (Vadhan's lemma)."""
    sigma = 2.0
    eps = [_eps(noise_multiplier=sigma, records_per_unit=k) for k in (1, 2, 4)]
    assert eps[0] < eps[1] < eps[2]
    for k, e in ((2, eps[1]), (4, eps[2])):
        # group privacy: (k eps1, k e^((k-1) eps1) delta1)-DP; find eps1 at delta1
        delta1 = 1e-5 / (k * math.exp((k - 1) * 10))  # eps1 <= 10: a smaller delta1 is safe
        group = k * _eps(noise_multiplier=sigma, delta=delta1)
        assert e < group


@pytest.mark.slow
def test_the_dominating_poisson_step_dominates_the_mixture():
    """The Poisson step of rate 1 - p_0 and noise sigma / k has a hockey-stick
    divergence at least the mixture's at every epsilon, both directions
    (dp-accounting's PLDs)."""
    k, q, sigma = 4, 0.05, 1.5
    mixture = unit_event(sigma, q, k)
    dominating = dominating_poisson(mixture)
    assert dominating.sampling_probability == pytest.approx(1 - (1 - q) ** k, rel=1e-12)
    assert dominating.event.noise_multiplier == pytest.approx(sigma / k)
    mog = pld_lib.from_mixture_gaussian_mechanism(
        sigma, mixture.sensitivities, mixture.sampling_probs, value_discretization_interval=1e-3
    )
    poisson = pld_lib.from_gaussian_mechanism(
        sigma / k, sampling_prob=1 - (1 - q) ** k, value_discretization_interval=1e-3
    )
    # Both PLDs are pessimistic: a loss rounded up by at most the interval, so the
    # mixture's computed delta at e is at most its exact one at e - 1e-3, at most the
    # Poisson step's exact one there, at most its computed one.
    for e in (0.1, 0.5, 1.0, 2.0, 4.0):
        assert mog.get_delta_for_epsilon(e) <= poisson.get_delta_for_epsilon(e - 1e-3)


def test_rdp_accounts_a_mixture_through_its_dominating_step():
    sigma = 2.0
    rdp = _eps(noise_multiplier=sigma, records_per_unit=3, accountant="rdp")
    pld = _eps(noise_multiplier=sigma, records_per_unit=3)
    assert rdp >= pld  # an upper bound, looser
    run = dp_accounting.SelfComposedDpEvent(unit_event(sigma, 0.02, 3), 60)
    assert has_mixture(run) and not has_mixture(rdp_compatible(run))
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(rdp_compatible(run))
    assert rdp == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.slow
def test_snapped_residual_with_units_of_k_records():
    """The residual at k = 1 is the record-level one; it grows with k (the shift is
    up to k / sigma) and stays small at a realistic size."""
    plan = dict(PLAN, noise_multiplier=2.0, noised_coordinates=10**7)
    base = acc.epsilon_breakdown(**plan).noise_residual
    assert acc.epsilon_breakdown(**plan, records_per_unit=1).noise_residual == base
    r4 = acc.epsilon_breakdown(**plan, records_per_unit=4).noise_residual
    assert base < r4 < 1e-2


def test_split_outside_mass_is_a_bound_on_crafted_shifts():
    """sum_i P(|Z + t_i| > L) for shifts that put the norm on few coordinates, or
    spread it: below the split bound (the exact normal tails, scipy)."""
    n, reach, t_max = 1000, 6.0, 3.0
    bound = _outside_mass_split(reach, n, t_max)
    for few in (1, 2, 9, 100, 1000):
        t = np.zeros(n)
        t[:few] = t_max / math.sqrt(few)
        exact = np.sum(stats.norm.sf(reach - t) + stats.norm.cdf(-reach - t))
        assert exact <= bound
    assert bound <= _outside_mass(reach, n, t_max)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(records_per_unit=0), "records_per_unit"),
        (dict(records_per_unit=2.5), "records_per_unit"),
        (dict(records_per_unit=2, neighboring="replace_one"), "add_or_remove"),
        (dict(records_per_unit=2, bands=4), "banded"),
    ],
)
def test_bad_records_per_unit_is_refused_in_one_line(kw, match):
    with pytest.raises((ValueError, TypeError), match=match) as e:
        _eps(noise_multiplier=2.0, **kw)
    assert "\n" not in str(e.value)


# ---- the sampler: records kept per user, then Poisson over records ------------------


def _users(rng, n_users=40, n=600):
    users = rng.integers(0, n_users, size=n)
    users[: n_users * 2] = np.repeat(np.arange(n_users), 2)  # every user has records
    users[-50:] = 3  # one user with many records
    return users


def test_each_user_keeps_at_most_k_of_its_own_records():
    from dpmp.data._capped_sampling import CappedUserSampler, kept_records

    rng = np.random.default_rng(0)
    users, k = _users(rng), 4
    kept = kept_records(users, k, seed=7)
    counts = np.bincount(users)
    assert (np.bincount(users[kept], minlength=len(counts)) == np.minimum(counts, k)).all()
    assert len(np.unique(kept)) == len(kept)
    assert not np.array_equal(kept, kept_records(users, k, seed=8))  # the seed chooses
    sampler = CappedUserSampler(users, 20, records_per_user=k, seed=7)
    assert sampler.num_examples == np.minimum(counts, k).sum()
    for step in range(30):
        b = sampler.batch(step)
        real = b.indices[~b.is_padding_example]
        assert np.isin(real, kept).all() and len(np.unique(real)) == len(real)
        assert (b.indices[b.is_padding_example] == -1).all()


def test_kept_records_are_uniform_among_a_users_records():
    """A user of 10 records keeping 3: each record is kept with probability 3/10; over
    2,000 seeds the counts are within z standard deviations (Bonferroni over 10)."""
    from dpmp.data._capped_sampling import kept_records

    users = np.array([0] * 10 + [1] * 2)
    hits = np.zeros(10)
    seeds = 2000
    for seed in range(seeds):
        kept = kept_records(users, 3, seed)
        hits[kept[kept < 10]] += 1
    z = stats.norm.isf(1e-6 / 20)
    sd = math.sqrt(seeds * 0.3 * 0.7)
    assert np.abs(hits - seeds * 0.3).max() <= z * sd


def test_records_are_included_at_the_sampling_rate_and_the_sampler_resumes():
    from dpmp.data._capped_sampling import CappedUserSampler

    rng = np.random.default_rng(1)
    users = _users(rng)
    q, steps = 0.1, 400
    sampler = CappedUserSampler(users, sampling_prob=q, records_per_user=3, seed=3)
    total = sum(int((~sampler.batch(t).is_padding_example).sum()) for t in range(steps))
    n = sampler.num_examples
    z = stats.norm.isf(1e-6 / 2)
    assert abs(total - steps * n * q) <= z * math.sqrt(steps * n * q * (1 - q))
    a = CappedUserSampler(users, 20, records_per_user=3, seed=5, num_steps=10)
    for _ in range(4):
        next(a)
    b = a.from_state_dict(a.state_dict(), num_steps=10)
    assert b.step == 4 and (next(b).indices == next(a).indices).all()
    # the padded size is that of k more records, a neighbour's most
    assert a.truncation_probability <= 1e-6 or a.padded_batch_size >= 20


# ---- a whole run ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_records_sampled_user_level_run_accounts_k_records_per_user(tmp_path, capsys):
    import json

    from dpmp.app import cli
    from dpmp.data._dataset import split_positions

    rng = np.random.default_rng(0)
    n = 600
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    ids = rng.integers(0, 150, size=n)
    np.savez(tmp_path / "people.npz", x=x, y=y, people=np.array([f"p{u}" for u in ids]))
    out = tmp_path / "run"
    sets = [
        "data.dataset=npz",
        f"data.path={tmp_path / 'people.npz'}",
        "data.user_field=people",
        "privacy.unit=user",
        "privacy.user_sampling=records",
        "privacy.user_records=2",
        "privacy.target_epsilon=3",
        "privacy.delta=1e-3",
        "training.steps=3",
        "training.expected_batch_size=40",
        "training.eval_every=0",
        "model.hidden=[8]",
    ]
    argv = ["train", "--out", str(out)]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    train_ids = ids[split_positions(n, 0.2, 0)[0]]
    kept = int(np.minimum(np.unique(train_ids, return_counts=True)[1], 2).sum())
    assert report["user_sampling"] == "records" and report["user_records"] == 2
    assert report["sampling"]["sampling_prob"] == pytest.approx(40 / kept)
    assert report["clipping"]["unit"] == "example" and report["private"] is True
    assert 0 < report["epsilon"] <= 3.0
    # the accountant's epsilon is that of k = 2 records per user at the run's plan
    sigma = report["noise_multiplier"]
    e2 = acc.epsilon(
        noise_multiplier=sigma, sampling_prob=40 / kept, steps=3, delta=1e-3,
        noised_coordinates=None, records_per_unit=2,
    )  # fmt: skip
    e1 = acc.epsilon(
        noise_multiplier=sigma, sampling_prob=40 / kept, steps=3, delta=1e-3,
        noised_coordinates=None,
    )  # fmt: skip
    assert report["epsilon"] >= e2 * (1 - 1e-3) > e1


def test_budget_accounts_records_per_user(capsys):
    """``dpmp budget --records-per-user K`` prints the k-record epsilon of the library."""
    import json

    from dpmp import cli

    argv = ["budget", "--noise-multiplier", "2", "--steps", "60", "--sampling-prob", "0.02"]
    argv += ["--exact-gaussian", "--json"]
    assert cli.main([*argv, "--records-per-user", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["records_per_user"] == 2
    assert got["epsilon"] == pytest.approx(_eps(noise_multiplier=2.0, records_per_unit=2))
    assert cli.main([*argv, "--records-per-user", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--records-per-user" in err and len(err.splitlines()) == 1
