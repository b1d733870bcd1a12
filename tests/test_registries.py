"""Accountants and noise samplers are registered variants: a new one is an object
and one registration, picked up by name everywhere (each toy here lives in this
file, as a user's would in theirs)."""

import dataclasses
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmp
import dpmp.accounting as acc
from dpmp import noise
from dpmp.accounting._registry import ACCOUNTANT_REGISTRY
from dpmp.noise._registry import SAMPLER_REGISTRY

TOY_ORDERS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
PLAN = dict(noise_multiplier=1.2, sampling_prob=0.02, steps=300, delta=1e-5)


@dataclasses.dataclass(frozen=True)
class CoarseRdp:
    """RDP at six orders only: a valid, looser bound than dp-accounting's default."""

    name: str = "toy_rdp"
    neighboring_relations: tuple[str, ...] = ("add_or_remove",)
    bounded_first: bool = False

    def make(self, neighboring, interval):
        del neighboring, interval
        return dp_accounting.rdp.RdpAccountant(orders=TOY_ORDERS)

    def curve(self, releases, *, neighboring, interval, delta):
        del delta
        return acc.composing_curve(self, releases, neighboring, interval)


@dataclasses.dataclass(frozen=True)
class FlatContract:
    """A toy noise contract: each release costs a fixed log-ratio, no delta."""

    sampler: str = "toy"
    tail: float = 10.0
    per_release: float = 1e-4

    def residual(self, *, coordinates, releases, noise_multiplier, delta, neighboring):
        del coordinates, noise_multiplier, delta, neighboring
        lam = self.per_release * releases
        return acc.NoiseResidual(2 * lam, lam, 0.0)


@dataclasses.dataclass(frozen=True)
class ShiftSampler:
    """A toy sampler: adds exactly +stddev to every coordinate (no randomness)."""

    name: str = "toy"
    contract: FlatContract = FlatContract()
    jit_name: str | None = None
    min_noise_bits: int = 32
    privacy_warning: str | None = "the toy sampler adds no randomness: NOT private"

    def update(self, inner, grads, state, *, stddev, sharding):
        del inner, sharding
        return jax.tree.map(lambda g: g + jnp.asarray(stddev, g.dtype), grads), state

    def release_grid(self, value, stddev):
        """Its one release, ``value + stddev``."""
        shifted = float(np.asarray(value, np.float64)[0]) + stddev
        return shifted, shifted, stddev


@pytest.fixture
def toy_accountant():
    obj = acc.register_accountant(CoarseRdp())
    yield obj
    ACCOUNTANT_REGISTRY.unregister(obj.name)


@pytest.fixture
def toy_sampler():
    obj = noise.register_sampler(ShiftSampler())
    yield obj
    SAMPLER_REGISTRY.unregister(obj.name)


def _by_hand(sigma, q, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    return dp_accounting.rdp.RdpAccountant(orders=TOY_ORDERS).compose(event).get_epsilon(delta)


def test_builtin_registries_list_their_names():
    assert acc.ACCOUNTANTS == ("rdp", "pld")
    assert noise.sampler_names() == ("snapped", "plain")
    assert noise.sampler("snapped").contract.tail == acc.SNAP_TAIL == 9.9
    assert noise.sampler("plain").contract is None
    with pytest.raises(ValueError, match=r"accountant must be one of \('rdp', 'pld'\)"):
        acc.get_accountant("moments")
    with pytest.raises(ValueError, match="already registered"):
        acc.register_accountant(dataclasses.replace(CoarseRdp(), name="rdp"))
    with pytest.raises(TypeError, match="does not implement"):
        acc.register_accountant(object())


def test_a_registered_accountant_is_used_by_name(toy_accountant):
    assert "toy_rdp" in acc.ACCOUNTANTS
    want = _by_hand(PLAN["noise_multiplier"], PLAN["sampling_prob"], PLAN["steps"], 1e-5)
    got = acc.epsilon(**PLAN, accountant="toy_rdp", noised_coordinates=None)
    assert got == pytest.approx(want, rel=1e-12)
    # fewer orders: a looser bound than the built-in RDP accountant's
    assert got > acc.epsilon(**PLAN, accountant="rdp", noised_coordinates=None)
    # the tracker and calibration take it too
    budget = acc.PrivacyBudget(
        noise_multiplier=1.2,
        sampling_prob=0.02,
        delta=1e-5,
        target_epsilon=got,
        accountant="toy_rdp",
        noised_coordinates=None,
    )
    tracker = acc.BudgetTracker(budget)
    assert tracker.remaining_steps(1000) == 300
    for _ in range(3):
        tracker.step()
    assert tracker.spent() == pytest.approx(_by_hand(1.2, 0.02, 3, 1e-5), rel=1e-12)
    sigma = acc.calibrate_noise_multiplier(
        target_epsilon=got,
        sampling_prob=0.02,
        steps=300,
        delta=1e-5,
        accountant="toy_rdp",
        noised_coordinates=None,
    )
    assert sigma == pytest.approx(1.2, rel=1e-3)
    with pytest.raises(ValueError, match="replace-one"):
        acc.epsilon(
            **PLAN, accountant="toy_rdp", neighboring="replace_one", noised_coordinates=None
        )


def test_a_registered_samplers_contract_is_accounted_by_name(toy_sampler):
    assert "toy" in noise.sampler_names()
    coordinates = 1000
    got = acc.epsilon(**PLAN, noised_coordinates=coordinates, noise_sampler="toy")
    lam = 1e-4 * PLAN["steps"]
    ideal = math.exp(-lam) * PLAN["delta"]
    exact_at_ideal = acc.epsilon(**{**PLAN, "delta": ideal}, noised_coordinates=None)
    assert got == pytest.approx(exact_at_ideal + 2 * lam, rel=1e-12)
    breakdown = acc.epsilon_breakdown(
        **PLAN, count_noise_stddev=None, noised_coordinates=coordinates, noise_sampler="toy"
    )
    assert breakdown.noise_residual == pytest.approx(got - breakdown.dpsgd, rel=1e-12)
    # the same plan as one record
    plan = acc.AccountingPlan(
        **PLAN, noised_coordinates=coordinates, noise=acc.noise_contract("toy")
    )
    assert acc.plan_epsilon(plan) == got
    # the plain sampler is accounted as exact, whatever the coordinates
    plain = acc.epsilon(**PLAN, noised_coordinates=coordinates, noise_sampler="plain")
    assert plain == acc.epsilon(**PLAN, noised_coordinates=None)


def test_a_registered_sampler_draws_by_name(toy_sampler):
    policy = dpmp.Policy.parse("f32")
    assert noise.drawn_sampler("toy", policy) is toy_sampler
    opt = dpmp.private_optimizer(
        optax.sgd(1.0),
        noise_multiplier=1.5,
        l2_clip_norm=2.0,
        expected_batch_size=1.0,
        prng_key=0,
        policy=policy,
        sampler="toy",
    )
    params = {"w": jnp.zeros(3, jnp.float32)}
    updates, _ = opt.update({"w": jnp.zeros(3, jnp.float32)}, opt.init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.full(3, -3.0, np.float32))
    with pytest.raises(ValueError, match="sampler: must be one of"):
        dpmp.gaussian_privatizer(stddev=1.0, policy=policy, sampler="nope")


def test_variants_registered_after_a_config_is_used_are_valid_choices():
    """The config checks the registries when a value is checked, not when it was
    imported: an accountant and a sampler registered after the first config are
    accepted, listed in the key reference, and refused again once unregistered."""
    from dpmp.app.config import ConfigError, load_config
    from dpmp.app.config_reference import markdown_table

    load_config(None)  # the config module is in use before the registrations
    with pytest.raises(ConfigError, match="privacy.accountant: 'toy_rdp' is not allowed"):
        load_config(None, ["privacy.accountant=toy_rdp"])
    acc.register_accountant(CoarseRdp())
    noise.register_sampler(ShiftSampler())
    try:
        config = load_config(None, ["privacy.accountant=toy_rdp", "privacy.noise_sampler=toy"])
        assert (config.privacy.accountant, config.privacy.noise_sampler) == ("toy_rdp", "toy")
        reference = markdown_table()
        assert '"toy_rdp"' in reference and '"toy"' in reference
    finally:
        ACCOUNTANT_REGISTRY.unregister("toy_rdp")
        SAMPLER_REGISTRY.unregister("toy")
    with pytest.raises(ConfigError, match="privacy.noise_sampler: 'toy' is not allowed"):
        load_config(None, ["privacy.noise_sampler=toy"])


def test_a_registered_sampler_is_warned_about_and_audited_as_itself(toy_sampler):
    """The report's warnings and the privacy audit ask the sampler object: the
    toy's own warning is the run's, and the audit reads its releases from its
    ``release_grid`` (a deterministic shift: every release under D is impossible
    under D', which the lookup attack sees)."""
    from dpmp.app.config import load_config
    from dpmp.app.release import privacy_warnings

    config = load_config(None, ["privacy.noise_sampler=toy"])
    assert toy_sampler.privacy_warning in privacy_warnings(config, num_train=1437)
    assert privacy_warnings(load_config(None), num_train=1437) == []
    for mechanism in (toy_sampler, "toy"):
        report = dpmp.privacy_audit(
            1.0, policy="f32", mechanism=mechanism, num_releases=200, prng_key=0
        )
        assert "toy noise" in report.mechanism
        assert report.impossible_share == report.impossible_share_reverse == 1.0
        assert report.distinct_noise_values == 1 and report.epsilon_lookup > 3.0


@jax.jit
def toy_normal_sample(key, like):
    """The toy sampler's draw: a named jit over a typed key, as a user would write."""
    return jax.random.normal(key, like.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class KeyedSampler:
    """A toy sampler that draws float32 normals by a named jit of its own."""

    name: str = "toy_keyed"
    contract: FlatContract | None = None
    jit_name: str | None = toy_normal_sample.__name__
    min_noise_bits: int = 32
    privacy_warning: str | None = None

    def update(self, inner, grads, state, *, stddev, sharding):
        del inner, sharding
        key, rest = state
        key, sub = jax.random.split(key)
        leaves, treedef = jax.tree.flatten(grads)
        keys = jax.random.split(sub, len(leaves))
        noisy = [g + stddev * toy_normal_sample(k, g) for k, g in zip(keys, leaves, strict=True)]
        return jax.tree.unflatten(treedef, noisy), (key, rest)

    def release_grid(self, value, stddev):
        del value, stddev  # its releases are enumerated


@pytest.mark.slow  # a 2-step run through dpmp train (~15 s)
def test_variants_registered_after_a_config_train_through_dpmp_train(tmp_path, capsys):
    """An accountant and a sampler registered after the first config train through
    ``dpmp train`` and are audited as themselves: the precision audit finds the
    sampler's named draw (over a typed key) and its noise, and the report names both."""
    import json

    from dpmp.app import cli
    from dpmp.app.config import load_config

    load_config(None)
    acc.register_accountant(CoarseRdp())
    noise.register_sampler(KeyedSampler())
    try:
        sets = ["privacy.accountant=toy_rdp", "privacy.noise_sampler=toy_keyed"]
        sets += ["training.steps=2", "model.hidden=[16]"]
        argv = ["train", "--quiet", "--out", str(tmp_path)]
        for item in sets:
            argv += ["--set", item]
        assert cli.main(argv) == 0, capsys.readouterr().err
    finally:
        ACCOUNTANT_REGISTRY.unregister("toy_rdp")
        SAMPLER_REGISTRY.unregister("toy_keyed")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["audit"]["ok"] is True and report["private"] is True
    assert report["audit"]["missing"] == [] and "noise_sample" in report["audit"]["expect"]
    assert report["audit"]["counts"]["noise_sample"] >= 1, report["audit"]["counts"]
    assert report["config"]["privacy"]["accountant"] == "toy_rdp"


@pytest.mark.parametrize("module", [acc, noise])
def test_every_public_name_of_the_layer_imports(module):
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
