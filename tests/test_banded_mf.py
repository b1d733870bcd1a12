"""Banded matrix factorization (``privacy.mechanism = "banded_mf"``): the stream's
covariance against the strategy's (float64 numpy), its decoding, its rounding bound
against exact arithmetic, resume bit for bit, no copy of a donated ring, the
b-cyclic sampler, the accounting against jax-privacy's event composed by
dp-accounting, bad inputs, a tiny run."""

import math
from fractions import Fraction

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax_privacy.experimental import accounting as jp_accounting

import dpmp.accounting as accounting
from dpmp.app import cli
from dpmp.app.checkpoint import load_checkpoint, save_checkpoint
from dpmp.app.config import Config, ConfigError, load_config
from dpmp.data._cyclic_sampling import CyclicPoissonSampler
from dpmp.noise import snap_grid
from dpmp.noise._banded_mf import BandedMF, _weighted
from dpmp.noise._mechanisms import MECHANISM_REGISTRY, dpsgd_prefix_rmse, mechanism

STEPS, BANDS = 8, 3


@pytest.fixture(scope="module")
def strategy():
    """jax-privacy's max-error Toeplitz coefficients cut to 3 bands, normalised (the
    optimiser's own are checked by the slow run): any banded strategy will do."""
    coefs = np.array([1.0, 0.5, 0.375])
    coefs = (coefs / np.linalg.norm(coefs)).astype(np.float32)
    return BandedMF(steps=STEPS, coefs=tuple(float(c) for c in coefs))


def _stream(strategy, sums, *, stddev=1.0, key=0, state=None, steps=None, update=None):
    """``x_t`` for each of ``sums`` (a list of arrays), and the state after them
    (``update``: a jitted privatizer update to reuse)."""
    priv = strategy.privatizer(stddev=stddev, prng_key=key, policy="bf16")
    state = priv.init(sums[0]) if state is None else state
    update = jax.jit(priv.update) if update is None else update
    out = []
    for g in sums[:steps]:
        x, state = update(g, state)
        out.append(np.asarray(x, np.float64))
    return np.stack(out), state


def test_strategy_is_column_normalised_and_banded(strategy):
    c = strategy.matrix()
    assert np.allclose(np.linalg.norm(c, axis=0), 1.0, atol=1e-7)  # float32 coefficients
    assert np.all(np.triu(c, 1) == 0) and np.all(np.tril(c, -BANDS) == 0)
    # the constants of the sensitivity factor, recomputed from the dense matrix
    largest = np.linalg.norm(c, axis=0).max()
    assert largest <= strategy.column_norm() <= largest * (1 + 2e-12)
    assert strategy.row_l1() == pytest.approx(np.abs(c).sum(axis=1).max(), rel=1e-12)


def test_noise_covariance_is_the_strategys(strategy):
    """x_t - g_t over many independent coordinates has covariance sigma^2 C'^-1 C'^-T
    (plus the snapping grid's grid^2 / 12 per draw); every entry within 5 standard
    errors of its sample estimate, and a DP-SGD stream (identity) is rejected."""
    k, sigma = 40_000, 1.0
    g = [jnp.full((k,), float(t + 1), jnp.float32) for t in range(STEPS)]
    x, _ = _stream(strategy, g, stddev=sigma)
    noise = x - np.arange(1, STEPS + 1)[:, None]
    inv = np.linalg.inv(strategy.matrix())
    var = sigma**2 + snap_grid(sigma) ** 2 / 12
    cov = var * inv @ inv.T
    sample = noise @ noise.T / k
    se = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / k)
    assert np.all(np.abs(sample - cov) < 5 * se), np.abs(sample - cov) / se
    assert np.all(np.abs(noise.mean(axis=1)) < 5 * np.sqrt(np.diag(cov) / k))
    assert np.max(np.abs(sample - var * np.eye(STEPS)) / se) > 20  # not independent noise


def test_rounding_of_the_release_query_within_its_bound(strategy):
    """a_t formed in float64 from float32 sums (as the stream forms it) against the
    exact rational sum: within gamma_{b+1} sum |C'[t, t-j]| |g_{t-j}| per coordinate."""
    rng = np.random.default_rng(0)
    c = strategy.matrix()
    t = STEPS - 1  # a row with every band, the last column's own scale
    w = c[t, t - np.arange(BANDS)]
    g = rng.standard_normal((BANDS, 64)).astype(np.float32) * 1e3
    with jax.enable_x64(True):
        weights = jnp.asarray(w[1:], jnp.float64)
        ring = {"p": jnp.asarray(g[1:])}
        formed = np.asarray(_weighted({"p": jnp.asarray(g[0])}, w[0], ring, weights)["p"])
    u = np.finfo(np.float64).eps / 2
    gamma = (BANDS + 1) * u / (1 - (BANDS + 1) * u)
    for i in range(g.shape[1]):
        exact = sum(Fraction(float(w[j])) * Fraction(float(g[j, i])) for j in range(BANDS))
        err = abs(Fraction(float(formed[i])) - exact)
        bound = gamma * float(np.sum(np.abs(w) * np.abs(g[:, i].astype(np.float64))))
        assert float(err) <= bound
    # the factor the noise is drawn for: column norm + 2 sqrt(b) gamma row_l1 B
    b = 256
    expected = strategy.column_norm() + 2 * math.sqrt(BANDS) * gamma * strategy.row_l1() * b
    assert strategy.sensitivity_factor(b) == pytest.approx(expected, rel=1e-15)
    assert 1 <= strategy.sensitivity_factor(b) < 1 + 1e-6


def test_resume_continues_the_stream_bit_for_bit(strategy, tmp_path):
    g = [jnp.asarray(np.random.default_rng(t).standard_normal(5), jnp.float32) for t in range(6)]
    priv = strategy.privatizer(stddev=1.0, prng_key=7, policy="bf16")
    update = jax.jit(priv.update)
    whole, _ = _stream(strategy, g, key=7, update=update)
    first, state = _stream(strategy, g, key=7, steps=3, update=update)
    save_checkpoint(tmp_path, step=3, state=state, meta={})
    # a fresh process's privatizer, another key: the stream's key is the checkpoint's
    template = strategy.privatizer(stddev=1.0, prng_key=99, policy="bf16").init(g[0])
    (ckpt,) = sorted(tmp_path.glob("*.npz"))
    restored, _ = load_checkpoint(ckpt, template)
    rest, _ = _stream(strategy, g[3:], state=restored, update=update)
    np.testing.assert_array_equal(np.concatenate([first, rest]), whole)


def test_a_donated_stream_keeps_no_copy_of_its_rings():
    """Compiled with its state donated (as the step donates it), a step of the stream at
    16 bands holds as temporaries only the float64 query ``a_t`` (8 bytes a
    parameter, drawn on in place) and at most one float32 vector more: no copy of a
    ring (60 bytes a parameter). A ring read and then updated in place is copied
    (XLA orders the update after the reads only by data dependence): the stream
    so had 68 bytes a parameter of temporaries here."""
    bands, shape = 16, (256, 256)
    coefs = np.cumprod(np.r_[1.0, (2 * np.arange(1, bands) - 1) / (2 * np.arange(1, bands))])
    coefs = (coefs / np.linalg.norm(coefs)).astype(np.float32)
    mf = BandedMF(steps=64, coefs=tuple(float(c) for c in coefs))
    params = {
        "w": jax.ShapeDtypeStruct(shape, jnp.float32),
        "b": jax.ShapeDtypeStruct(shape[1:], jnp.float32),
    }
    n = math.prod(shape) + shape[1]
    priv = mf.privatizer(stddev=1.0, prng_key=0, policy="bf16")
    state = jax.eval_shape(priv.init, params)
    memory = jax.jit(priv.update, donate_argnums=1).lower(params, state).compile().memory_analysis()
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    assert state_bytes >= 2 * (bands - 1) * 4 * n  # the two rings are there
    assert memory.alias_size_in_bytes == state_bytes  # all of it updated in place
    assert memory.temp_size_in_bytes <= (8 + 4) * n, memory.temp_size_in_bytes / n


def test_one_band_is_dpsgd():
    one = BandedMF.optimized(5, 1)
    assert one.coefs == (1.0,) and one.sensitivity_factor(10**6) == 1.0
    assert one.prefix_rmse() == pytest.approx(dpsgd_prefix_rmse(5), rel=1e-12)


def test_prefix_rmse_is_jax_privacys_and_beats_independent_noise(strategy):
    from jax_privacy.matrix_factorization import banded

    with jax.enable_x64(True):
        ref = banded.ColumnNormalizedBanded.from_banded_toeplitz(
            STEPS, jnp.asarray(strategy.coefs, jnp.float64)
        )
        per_query = np.asarray(banded.per_query_error(ref))
    assert strategy.prefix_rmse() == pytest.approx(math.sqrt(per_query.mean()), rel=1e-12)
    # independently: the prefix-sum workload times C'^-1, in numpy
    b = np.tril(np.ones((STEPS, STEPS))) @ np.linalg.inv(strategy.matrix())
    assert strategy.prefix_rmse() == pytest.approx(
        math.sqrt(np.mean(np.sum(b**2, axis=1))), rel=1e-6
    )
    assert strategy.prefix_rmse() < dpsgd_prefix_rmse(STEPS)


def test_cyclic_sampler_samples_one_group_per_step():
    n, b, size, steps = 600, 4, 30, 400
    sampler = CyclicPoissonSampler(n, size, groups=b, seed=3, num_steps=steps)
    q = size / (n // b)
    assert sampler.sampling_prob == pytest.approx(q)
    seen = np.zeros((steps, n), bool)
    for t, batch in enumerate(sampler):
        seen[t, batch.indices[~batch.is_padding_example]] = True
    group_of = {}
    for t in range(steps):
        for i in np.flatnonzero(seen[t]):
            assert group_of.setdefault(i, t % b) == t % b  # only its group's steps
    # each record of a group is sampled at its group's steps with probability q
    rounds = steps // b
    counts = seen.sum(axis=0)[list(group_of)]
    assert abs(counts.mean() - rounds * q) < 5 * math.sqrt(rounds * q * (1 - q) / len(counts))
    restored = CyclicPoissonSampler.from_state_dict(sampler.state_dict())
    assert restored.batch(5).indices.tolist() == sampler.batch(5).indices.tolist()


def _epsilons(steps, bands, q, sigma, delta, accountant):
    """(dp-accounting's epsilon of jax-privacy's event, dpmp's) under ``accountant``."""
    event = jp_accounting.amplified_bandmf_event(sigma, steps, num_bands=bands, sampling_prob=q)
    make = {
        "rdp": dp_accounting.rdp.RdpAccountant,
        "pld": lambda: dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4),
    }[accountant]
    ref = make().compose(event).get_epsilon(delta)
    ours = accounting.epsilon(
        noise_multiplier=sigma,
        sampling_prob=q,
        steps=steps,
        delta=delta,
        bands=bands,
        accountant=accountant,
        noised_coordinates=None,
    )
    return ref, ours


@pytest.mark.parametrize("steps,bands,q,calibrate", [(100, 4, 0.05, True), (37, 5, 0.2, False)])
def test_accounting_is_jax_privacys_amplified_event(steps, bands, q, calibrate):
    sigma, delta = 1.3, 1e-6
    ref, ours = _epsilons(steps, bands, q, sigma, delta, "rdp")
    assert ours == pytest.approx(ref, rel=1e-9)
    # fewer rounds than DP-SGD's steps at the same q: less epsilon
    plain = accounting.epsilon(
        noise_multiplier=sigma,
        sampling_prob=q,
        steps=steps,
        delta=delta,
        accountant="rdp",
        noised_coordinates=None,
    )
    assert ours < plain
    # the tracker's budget composes as many rounds (an upper bound: a coarser grid)
    budget = accounting.PrivacyBudget(
        noise_multiplier=sigma,
        sampling_prob=q,
        delta=delta,
        target_epsilon=100,
        accountant="rdp",
        bands=bands,
        noised_coordinates=None,
    )
    tracker = accounting.BudgetTracker(budget, steps=steps)
    assert tracker.spent() == pytest.approx(ref, rel=1e-9)
    tracker = accounting.BudgetTracker(budget, steps=steps - 1)
    assert tracker.step() == pytest.approx(ref, rel=1e-9)
    if not calibrate:
        return
    found = accounting.calibrate_noise_multiplier(
        target_epsilon=ref,
        sampling_prob=q,
        steps=steps,
        delta=delta,
        bands=bands,
        accountant="rdp",
        noised_coordinates=None,
    )
    assert found == pytest.approx(sigma, rel=1e-3)


@pytest.mark.slow  # the PLD at its report grid (~6 s)
def test_pld_accounting_is_jax_privacys_amplified_event():
    ref, ours = _epsilons(100, 4, 0.05, 1.3, 1e-6, "pld")
    assert ours == pytest.approx(ref, rel=1e-9)


def test_mechanisms_answer_for_themselves():
    for name in MECHANISM_REGISTRY.names():
        mech = mechanism(name)
        assert mech.name == name and isinstance(mech.cyclic, bool)
        assert mech.strategy(4, 1) is None or mech.strategy(4, 1).bands == 1


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["privacy.bands=0"], "privacy.bands: must be an integer in [1, 10^6]"),
        (["privacy.mechanism=banded_mf", "privacy.bands=301"], "is more than training.steps"),
        (["privacy.mechanism=banded_mf", "privacy.sampling=shuffle"], "privacy.sampling"),
        (["privacy.mechanism=banded_mf", "privacy.unit=user"], "privacy.unit"),
        (["privacy.mechanism=blt"], "privacy.mechanism: 'blt' is not allowed"),
    ],
)
def test_bad_inputs_are_one_line_exit_2(overrides, needle, capsys):
    with pytest.raises(ConfigError, match=needle.split(":")[0]):
        load_config(None, overrides)
    argv = ["train"] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_more_bands_than_the_batch_allows_is_one_line(capsys, tmp_path):
    argv = ["train", "--set", "privacy.mechanism=banded_mf", "--set", "privacy.bands=200"]
    argv += ["--out", str(tmp_path / "run")]
    assert cli.main(argv) == 2  # 1,437 digits in 200 groups of 7 < 512 per step
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "privacy.bands" in err and "Traceback" not in err


@pytest.mark.slow  # one small run (~30 s, most of it the strategy and the compile)
def test_tiny_train_run(tmp_path):
    from dpmp.app.inputs import load_data
    from dpmp.app.trainer import train

    data = load_data(Config().data, seed=0)
    overrides = [
        "model.hidden=[32]",
        "training.steps=12",
        "training.expected_batch_size=64",
        "training.eval_every=12",
        "privacy.mechanism=banded_mf",
        "privacy.bands=4",
    ]
    report = train(load_config(None, overrides), out_dir=tmp_path, progress=False, data=data)
    mech = report["noise"]["mechanism"]
    assert (mech["name"], mech["bands"], mech["groups"]) == ("banded_mf", 4, 4)
    assert report["epsilon"] <= report["target_epsilon"] and report["private"] is True
    assert mech["prefix_rmse"] < mech["dpsgd_prefix_rmse_same_epsilon"]
    q = 64 / (data.num_train // 4)
    assert report["sampling"]["sampling_prob"] == pytest.approx(q)


class _Crash(Exception):
    pass


@pytest.mark.slow  # three small runs (~1-2 min on 2 shared cores)
def test_a_crashed_run_resumes_the_same_correlated_stream(tmp_path, monkeypatch):
    """Secret keys from a seeded stand-in for the OS entropy: the uninterrupted run and
    the crashed one draw the same keys; the resumed process gets another stream, so a
    stream, key or sampler partition not taken from the checkpoint would show."""
    from dpmp.app.checkpoint import latest_checkpoint
    from dpmp.app.inputs import load_data
    from dpmp.app.trainer import train

    from . import _entropy

    data = load_data(Config().data, seed=0)
    cfg = load_config(
        None,
        [
            "model.hidden=[16]",
            "training.steps=10",
            "training.expected_batch_size=32",
            "training.eval_every=10",
            "training.checkpoint_every=4",
            "privacy.mechanism=banded_mf",
            "privacy.bands=3",
        ],
    )

    def params(run_dir):
        with np.load(latest_checkpoint(run_dir / "checkpoints")) as npz:
            return [npz[k] for k in sorted(npz.files) if k.startswith("leaf_")]

    _entropy.install(monkeypatch, seed=1)
    ref = train(cfg, out_dir=tmp_path / "whole", progress=False, data=data)

    def crash(step, info):
        if step == 6:  # after the step-4 checkpoint
            raise _Crash

    _entropy.install(monkeypatch, seed=1)
    with pytest.raises(_Crash):
        train(cfg, out_dir=tmp_path / "run", progress=False, data=data, callback=crash)
    _entropy.install(monkeypatch, seed=2)
    resumed = train(cfg, out_dir=tmp_path / "run", progress=False, data=data)
    for a, b in zip(params(tmp_path / "run"), params(tmp_path / "whole"), strict=True):
        np.testing.assert_array_equal(a, b)  # parameters, optimizer state, ring buffers
    assert resumed["epsilon"] == ref["epsilon"]


def test_budget_bands_is_the_amplified_event(capsys):
    """``dpmp budget --bands B``: the epsilon of jax-privacy's amplified event composed
    by dp-accounting, the library's calibrated noise, and q within one of B groups."""
    import json

    steps, bands, q, sigma, delta = 100, 4, 0.05, 1.3, 1e-6
    argv = ["budget", "--steps", str(steps), "--delta", str(delta), "--accountant", "rdp"]
    argv += ["--exact-gaussian", "--json", "--bands", str(bands)]
    assert cli.main([*argv, "--noise-multiplier", str(sigma), "--sampling-prob", str(q)]) == 0
    got = json.loads(capsys.readouterr().out)
    ref, _ = _epsilons(steps, bands, q, sigma, delta, "rdp")
    assert got["bands"] == bands and got["epsilon"] == pytest.approx(ref, rel=1e-9)
    # the batch over one group's records: 1,003 records make 4 groups of 250 (n // b)
    assert (
        cli.main([*argv, "--target-epsilon", "3", "--batch-size", "10", "--num-examples", "1003"])
        == 0
    )
    got = json.loads(capsys.readouterr().out)
    assert got["sampling_prob"] == 10 / 250
    found = accounting.calibrate_noise_multiplier(
        target_epsilon=3, sampling_prob=10 / 250, steps=steps, delta=delta, bands=bands,
        accountant="rdp", noised_coordinates=None,
    )  # fmt: skip
    assert got["noise_multiplier"] == found and got["epsilon"] <= 3


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--bands", "0"], "--bands: must be in [1, --steps], got 0"),
        (["--bands", "101"], "--bands: must be in [1, --steps], got 101"),
        (["--bands", "4", "--records-per-user", "2"], "--records-per-user"),
    ],
)
def test_budget_bad_bands_are_one_line_exit_2(extra, needle, capsys):
    argv = ["budget", "--noise-multiplier", "1", "--steps", "100", "--sampling-prob", "0.1"]
    assert cli.main([*argv, "--exact-gaussian", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


_MESH_STREAM = """
import json
import jax, jax.numpy as jnp, numpy as np
import dpmp
from dpmp.noise._banded_mf import BandedMF
from dpmp.step import DataParallelMesh

assert jax.device_count() == 4
mesh = DataParallelMesh(jax.devices())
coefs = np.array([1.0, 0.5, 0.375, 0.25])
strategy = BandedMF(steps=7, coefs=tuple(float(c) for c in (coefs / np.linalg.norm(coefs))))
rng = np.random.default_rng(0)
# split along either axis, one that no axis of which 4 divides, one smaller than 4
shapes = {"k": (24, 64), "m": (40, 6), "w": (1001,), "b": (3,)}
params = {n: jnp.zeros(s, jnp.float32) for n, s in shapes.items()}
specs = mesh.param_specs(params)
sums = [{n: jnp.asarray(rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}
        for _ in range(strategy.steps)]


def stream(sharding):
    priv = strategy.privatizer(stddev=0.8, prng_key=5, policy="bf16", sharding=sharding)
    state = priv.init(params)
    layout = None
    if sharding is not None:
        layout = mesh.state_shardings({"params": params, "opt_state": state}, specs)
        state = mesh.put(state, layout["opt_state"])
    update = jax.jit(priv.update)
    xs = []
    for g in sums:
        if layout is not None:
            g = mesh.put(g, layout["params"])
        x, state = update(g, state)
        xs.append(jax.tree.map(np.asarray, x))
    return xs, state


one, _ = stream(None)
many, state = stream(dpmp.NoiseSharding(mesh.mesh, "data", specs))
rows = lambda r: [list(s.data.shape) for s in r.addressable_shards]
print("JSON" + json.dumps({
    "equal": [all(np.array_equal(a[n], b[n]) for n in shapes) for a, b in zip(one, many)],
    "specs": {n: list(specs[n]) for n in shapes},
    "sums": {n: rows(state.sums[n]) for n in shapes},
    "outputs": {n: rows(state.outputs[n]) for n in shapes},
}))
"""


@pytest.mark.slow  # a 4-device subprocess (~10 s)
def test_a_mesh_stream_is_the_one_device_stream(tmp_path):
    """On 4 forced CPU devices, with the parameters sharded (FSDP) and the ring buffers
    laid out as the run's state is (``state_shardings``): each device keeps its rows
    of a split parameter's rings, and every x_t equals the one-device stream's bit for
    bit over more steps than bands (the rings wrap)."""
    from ._devices import run_on_host_devices

    got = run_on_host_devices(tmp_path, "banded_mesh.py", _MESH_STREAM, timeout=300)
    assert got["equal"] == [True] * 7, got
    assert got["specs"] == {"k": [None, "data"], "m": ["data"], "w": [], "b": []}, got
    for ring in ("sums", "outputs"):  # 3 slots; a quarter of the split axis each
        assert got[ring]["k"] == [[3, 24, 16]] * 4 and got[ring]["m"] == [[3, 10, 6]] * 4
        assert got[ring]["w"] == [[3, 1001]] * 4 and got[ring]["b"] == [[3, 3]] * 4


_MESH_RUN = """
import json, sys
import jax
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.trainer import train

assert jax.device_count() == 4
cfg = load_config(None, ["model.hidden=[16]", "training.steps=6", "training.eval_every=6",
    "training.expected_batch_size=32", "privacy.mechanism=banded_mf", "privacy.bands=3",
    "training.devices=4", "training.shard_params=true"])
report = train(cfg, out_dir=sys.argv[0] + ".run", progress=False, data=load_data(Config().data, 0))
print("JSON" + json.dumps({"audit": report["audit"], "noise": report["noise"]["mechanism"],
                           "epsilon": report["epsilon"], "target": report["target_epsilon"]}))
"""


@pytest.mark.slow  # a 4-device subprocess training 6 steps (~45 s on 2 cores)
def test_a_banded_run_trains_on_a_mesh(tmp_path):
    """``privacy.mechanism = "banded_mf"`` on 4 devices with sharded parameters: the run
    trains, its precision audit passes (the stream's stages and the all-reduce among
    its sites) and it spends no more than its target."""
    from ._devices import run_on_host_devices

    got = run_on_host_devices(tmp_path, "banded_run.py", _MESH_RUN, timeout=500)
    assert got["audit"]["ok"] is True and "all_reduce" in got["audit"]["expect"], got
    assert (got["noise"]["name"], got["noise"]["bands"]) == ("banded_mf", 3)
    assert got["epsilon"] <= got["target"]
