"""The empirical privacy audit against independent references.

Each claim is held against something the audit does not compute itself: the
theoretical epsilon from dp-accounting's PLD, binomial confidence intervals
around the exact share of impossible outputs, and numpy statistics of the
enumerated noise values.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.special
from dp_accounting.pld import privacy_loss_distribution as pld

import dpmp
from dpmp import cli
from dpmp.audit import _privacy as audit_privacy


def _agrees_with_exact(share, mass, n, z=5.0):
    """The share seen in ``n`` releases is within z binomial sds of the exact mass."""
    sd = math.sqrt(max(mass * (1 - mass), 1e-12) / n)
    return abs(share - mass) <= z * sd + 1.0 / n


@pytest.mark.slow  # ~5 s each; the audit's precision tests catch bf16 noise by default
@pytest.mark.parametrize("sigma", [1.0, 2.0])
def test_the_naive_bf16_pipeline_is_broken(sigma):
    """bf16 noise added to a bf16 sum (what jax-privacy does for a bf16 sum): the
    audit's epsilon lower bound is above 8, far above the theoretical epsilon."""
    r = dpmp.privacy_audit(sigma, mechanism="naive", num_releases=1_000_000, prng_key=0)
    theory = pld.from_gaussian_mechanism(standard_deviation=sigma).get_epsilon_for_delta(1e-5)
    assert r.epsilon_theory == pytest.approx(theory, rel=1e-3)
    assert r.epsilon_empirical > 8 > r.epsilon_theory, r
    assert r.release_dtype == "bfloat16" and not r.ok
    assert r.distinct_noise_values <= 256  # 7 mantissa bits of noise
    assert _agrees_with_exact(r.impossible_share, r.impossible_mass, r.num_releases)
    if sigma == 1.0:  # the noise stops at ~2.9 sigma: a threshold beyond it is decisive
        assert r.epsilon_threshold > 8, r


@pytest.mark.slow  # ~5 s each; the default noise's own audit stays in the default suite
@pytest.mark.parametrize("sigma", [1.0, 2.0, 7.2])
def test_the_plain_float32_sampler_has_outputs_impossible_under_the_neighbour(sigma):
    """jax.random.normal in float32 (``sampler="plain"``): most releases with the
    canary are values no noise draw gives without it, so the exact-value lookup
    attack beats theory, while the threshold attack (which sees only a smooth
    distribution) stays within it."""
    r = dpmp.privacy_audit(sigma, mechanism="plain", num_releases=100_000, prng_key=1)
    assert r.release_dtype == "float32" and r.distinct_noise_values == 2**23
    assert 0.5 < r.impossible_mass < 1 and 0.5 < r.impossible_share_reverse
    assert _agrees_with_exact(r.impossible_share, r.impossible_mass, r.num_releases)
    assert r.epsilon_lookup > r.epsilon_theory
    assert r.epsilon_threshold <= r.epsilon_theory
    assert not r.ok and "cannot produce without it" in str(r)


@pytest.mark.parametrize(
    "sigma", [1.0, *(pytest.param(s, marks=pytest.mark.slow) for s in (2.0, 7.2))]
)
def test_the_default_noise_has_no_output_impossible_under_the_neighbour(sigma):
    """dpmp's default (snapped) noise, 1e6 releases per dataset: no release is
    impossible under the neighbour, the exact Gaussian mass of the impossible
    outputs (beyond the sampler's 10.08 sigma reach) is below the delta the
    accountant adds for the tails (``noise_residual``, one coordinate, one release)
    and below 1e-5, and neither attack's lower bound passes the theoretical epsilon."""
    r = dpmp.privacy_audit(sigma, num_releases=1_000_000, prng_key=4)
    residual = dpmp.accounting.noise_residual(
        coordinates=1, releases=1, noise_multiplier=sigma, delta=1e-5
    )
    assert r.impossible_share == 0 and r.impossible_share_reverse == 0
    assert r.impossible_mass <= residual.delta_tail < 1e-5
    assert r.epsilon_lookup <= r.epsilon_theory and r.epsilon_threshold <= r.epsilon_theory
    # the support is every grid cell within the sampler's reach (its uniform's floor
    # 2^-78): 2 * 10.08 * r cells
    grid = dpmp.snap_grid(sigma)
    reach = -scipy.special.ndtri(2.0**-78)
    assert r.distinct_noise_values == pytest.approx(2 * reach * sigma / grid, rel=0.01)
    assert r.ok and "verdict: OK" in str(r)


def test_the_enumerated_float32_noise_is_the_23_bit_gaussian():
    """Every value jax.random.normal can draw in float32, from the audit's
    enumeration: 2^23 of them, within [-5.42, 5.22], with mean 0 and variance 1
    (numpy, float64), and random draws all among them."""
    priv = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="f32", sampler="plain")
    values, probs = audit_privacy._support(priv, jnp.zeros((1,), jnp.float32))
    z = values.view(np.float32).astype(np.float64)
    assert len(z) == 2**23 and np.allclose(probs, 2.0**-23)
    assert z.min() == pytest.approx(-5.42, abs=0.01) and z.max() == pytest.approx(5.22, abs=0.01)
    assert abs(np.sum(z * probs)) < 1e-3 and abs(np.sum(z**2 * probs) - 1) < 1e-3
    draws = np.asarray(jax.random.normal(jax.random.key(3), (10_000,), jnp.float32))
    assert not audit_privacy._impossible(draws.view(np.uint32), (values, probs)).any()


def _snapped_privatizer(stddev, grid):
    """Float32 noise, the noisy value then rounded to a power-of-two grid."""

    def init(params):
        return (jax.random.key(0),)

    def update(s, state, params=None):
        key, sub = jax.random.split(state[0])
        noisy = s + stddev * jax.random.normal(sub, s.shape, jnp.float32)
        return jnp.round(noisy / grid) * grid, (key,)

    return optax.GradientTransformation(init, update)


@pytest.mark.slow  # ~4 s on 2 cores
def test_snapping_a_23_bit_sampler_leaves_its_tails_exposed():
    """Snapped to a grid of 2^-6, the lattice is gone where the sampler's spacing is
    finer than the grid, but past about 4.7 sigma the 23-bit uniform's points are
    further apart than 2^-6 (and none lie past 5.22): the outputs impossible under
    the neighbour are exactly those a numpy float32 re-implementation predicts, and
    more than truncation alone would give."""
    grid = np.float32(2.0**-6)
    priv = _snapped_privatizer(1.0, grid)
    r = dpmp.privacy_audit(1.0, mechanism=priv, num_releases=200_000, prng_key=2)
    base = dpmp.gaussian_privatizer(stddev=1.0, prng_key=0, policy="f32", sampler="plain")
    z = audit_privacy._support(base, jnp.zeros((1,), jnp.float32))[0].view(np.float32)
    without = np.round(z / grid) * grid  # numpy float32, rounding half to even as XLA
    with_canary = np.round((np.float32(1) + z) / grid) * grid
    expected = np.mean(~np.isin(with_canary, without))
    truncation = np.mean(z + 1 > z.max())
    assert 1e-5 < truncation < expected < 1e-4
    assert r.impossible_mass == pytest.approx(expected, rel=1e-6)
    assert _agrees_with_exact(r.impossible_share, expected, r.num_releases)
    assert r.epsilon_threshold <= r.epsilon_theory and not r.ok


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="mechanism"):
        dpmp.privacy_audit(1.0, mechanism="bogus")
    with pytest.raises(ValueError, match="noise_multiplier"):
        dpmp.privacy_audit(0.0)
    with pytest.raises(ValueError, match="num_releases"):
        dpmp.privacy_audit(1.0, num_releases=10)
    keyless = optax.GradientTransformation(lambda p: (), lambda s, st, p=None: (s, st))
    with pytest.raises(ValueError, match="no jax.random key"):
        dpmp.privacy_audit(1.0, mechanism=keyless, num_releases=1000)


@pytest.mark.slow  # a CLI run of 1e6 releases (~6 s)
def test_cli_audit_privacy_prints_both_epsilons(capsys):
    rc = cli.main(["audit", "--privacy", "--releases", "20000"])
    out = capsys.readouterr().out
    assert "theoretical epsilon" in out and "threshold attack, epsilon >=" in out
    assert "exact-value lookup attack, epsilon >=" in out
    assert rc == 0 and "verdict: OK" in out and "snapped noise" in out


@pytest.mark.slow  # the same audit as the plain-sampler test, through the CLI
def test_cli_audit_privacy_says_what_the_plain_sampler_leaks(capsys, tmp_path):
    config = tmp_path / "plain.toml"
    config.write_text('[privacy]\nnoise_sampler = "plain"\n')
    rc = cli.main(["audit", "--privacy", "--releases", "20000", "--config", str(config)])
    out = capsys.readouterr().out
    assert rc == 1 and "verdict: LEAKS" in out and "cannot produce without it" in out
    with pytest.raises(SystemExit) as e:
        cli.main(["audit", "--privacy", "--releases", "ten"])
    assert e.value.code == 2 and "--releases" in capsys.readouterr().err
