"""Every extension point is one registry type (``dpmp._registry.Registry``), and
accountants and noise samplers are registered variants: a new one is an object
and one registration, picked up by name everywhere and asked about itself,
never by its name (each toy here lives in this file, as a user's would in
theirs)."""

import ast
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmp
import dpmp.accounting as acc
from dpmp import noise
from dpmp._registry import Registry, members
from dpmp.accounting._registry import ACCOUNTANT_REGISTRY
from dpmp.noise._mechanisms import MECHANISM_REGISTRY
from dpmp.noise._registry import SAMPLER_REGISTRY

TOY_ORDERS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
PLAN = dict(noise_multiplier=1.2, sampling_prob=0.02, steps=300, delta=1e-5)


@dataclasses.dataclass(frozen=True)
class CoarseRdp:
    """RDP at six orders only: a valid, looser bound than dp-accounting's default."""

    name: str = "toy_rdp"
    neighboring_relations: tuple[str, ...] = ("add_or_remove",)
    bounded_first: bool = False

    def make(self, neighboring, interval=None):
        del neighboring, interval  # its orders are its only setting
        return dp_accounting.rdp.RdpAccountant(orders=TOY_ORDERS)

    def curve(self, releases, *, neighboring, delta, interval=None):
        """Composes every query afresh."""
        del delta, interval

        def epsilon_at(counts):
            composed = self.make(neighboring)
            for kind, n in counts.items():
                if n > 0:
                    composed.compose(dp_accounting.SelfComposedDpEvent(releases[kind].event(), n))
            return composed.get_epsilon

        return epsilon_at

    def for_tracking(self):
        return self


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


class Undrawn:
    """A toy sampler object that cannot add its noise (it has no ``update``)."""

    name = "toy"
    contract = None
    jit_name = None
    min_noise_bits = 32
    privacy_warning = None

    def release_grid(self, value, stddev):
        del value, stddev


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


# ---- the one registry type ---------------------------------------------------------


class Colour:
    """A toy variant: a name and a value."""

    def __init__(self, name, value=0):
        self.name, self.value = name, value


class Coloured:
    """A toy protocol: what a driver reads of a ``Colour``."""

    name: str
    value: int


def test_a_registry_registers_gets_lists_and_refuses_by_name():
    r = Registry("colour", protocol=Coloured)
    red, blue = r.register(Colour("red")), r.register(Colour("blue"))
    assert r.names() == ("red", "blue") and list(r) == [red, blue] and len(r) == 2
    assert "red" in r and "green" not in r and 3 not in r and ["red"] not in r
    assert r.get("red") is red and r.find("red") is red and r.find("green") is None
    with pytest.raises(ValueError, match="colour 'red' is already registered; pass replace"):
        r.register(Colour("red"))
    assert r.get("red") is red  # the refused one replaced nothing
    dark = r.register(Colour("red", 1), replace=True)
    assert r.get("red") is dark and r.names() == ("red", "blue")
    assert r.register(red, name="crimson") is red and r.get("crimson") is red
    # an unknown name: one message naming the kind, the name and the registered names
    with pytest.raises(ValueError) as e:
        r.get("green")
    assert str(e.value) == f"colour must be one of {r.names()}, got 'green'."
    assert r.unregister("crimson") is red and "crimson" not in r
    with pytest.raises(ValueError, match=re.escape(f"colour must be one of {r.names()}")):
        r.unregister("crimson")
    for bad in ("", 3):
        with pytest.raises(ValueError, match="a name must be a non-empty string"):
            r.register(Colour("x"), name=bad)
    with pytest.raises(ValueError, match="a name must be a non-empty string, got None"):
        r.register(Colour(None))
    # what the protocol declares is checked, and what is missing is named
    assert members(Coloured) == ("name", "value")

    class Valueless:
        name = "grey"

    with pytest.raises(TypeError, match=r"colour: Valueless 'grey' lacks value \(see Coloured\)"):
        r.register(Valueless())
    scratch = r.copy()
    scratch.register(Colour("green"))
    assert "green" in scratch and "green" not in r and scratch.kind == r.kind


TOY_BUILTIN = """
class Lazy:
    name = "lazy"
    value = 1

LAZY = Lazy()
VALUELESS = object()
"""


def test_built_ins_load_from_their_module_on_first_use_only(tmp_path, monkeypatch):
    """Listing names, ``in`` and ``len`` import no built-in's module; ``get`` does,
    once, and checks the loaded variant against the protocol."""
    (tmp_path / "toy_builtin_colours.py").write_text(TOY_BUILTIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "toy_builtin_colours", raising=False)
    builtins = {"lazy": "toy_builtin_colours:LAZY", "broken": "toy_builtin_colours:VALUELESS"}
    r = Registry("colour", builtins, protocol=Coloured)
    assert r.names() == ("lazy", "broken") and "lazy" in r and len(r) == 2
    assert "toy_builtin_colours" not in sys.modules
    assert r.get("lazy").value == 1 and "toy_builtin_colours" in sys.modules
    assert r.get("lazy") is sys.modules["toy_builtin_colours"].LAZY
    with pytest.raises(TypeError, match="colour: object lacks name, value"):
        r.get("broken")
    assert r.unregister("broken") is None  # never loaded
    with pytest.raises(ValueError, match="'module:attribute'"):
        Registry("colour", {"x": "no_colon"})


def test_listing_the_registries_imports_neither_jax_nor_dp_accounting():
    code = (
        "import sys\n"
        "from dpmp.accounting._registry import accountant_names\n"
        "from dpmp.noise._registry import sampler_names\n"
        "from dpmp.app.cli.entry import COMMANDS\n"
        "assert accountant_names() and sampler_names() and 'train' in COMMANDS\n"
        "print(sorted(m for m in ('jax', 'dp_accounting', 'numpy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"], done.stdout


def _registries():
    from dpmp.app.cli.entry import COMMANDS
    from dpmp.audit.rules import RULES as AUDIT_RULES
    from dpmp.clipping.ghost._rule import RULES as GHOST_RULES
    from dpmp.data.sources import PUBLIC_TEXT, SOURCES
    from dpmp.models.families import FAMILIES

    return {
        "accountant": ACCOUNTANT_REGISTRY,
        "sampler": SAMPLER_REGISTRY,
        "mechanism": MECHANISM_REGISTRY,
        "data source": SOURCES,
        "public text": PUBLIC_TEXT,
        "model family": FAMILIES,
        "ghost rule": GHOST_RULES,
        "audit rule": AUDIT_RULES,
        "command": COMMANDS,
    }


@pytest.mark.parametrize("kind", list(_registries()))
def test_every_extension_point_is_the_one_registry_type(kind):
    """Each kind of variant sits in a ``Registry`` that says an unknown name alike
    and holds only variants with what its protocol declares."""
    registry = _registries()[kind]
    assert isinstance(registry, Registry) and registry.kind == kind
    with pytest.raises(ValueError) as e:
        registry.get("no such variant")
    assert str(e.value) == f"{kind} must be one of {registry.names()}, got 'no such variant'."
    assert registry.names(), kind
    for variant in registry:
        registry.check(variant)  # every built-in has what the driver reads


# ---- accountants and samplers -------------------------------------------------------


def test_the_built_in_samplers_and_accountants_are_registered():
    assert {"rdp", "pld"} <= set(acc.ACCOUNTANTS) and {"snapped", "plain"} <= set(
        noise.sampler_names()
    )
    assert noise.sampler("snapped").contract.tail == acc.SNAP_TAIL == 9.9
    assert noise.sampler("plain").contract is None
    with pytest.raises(ValueError, match=re.escape(f"accountant must be one of {acc.ACCOUNTANTS}")):
        acc.get_accountant("moments")
    with pytest.raises(ValueError, match="already registered"):
        acc.register_accountant(dataclasses.replace(CoarseRdp(), name="rdp"))
    with pytest.raises(TypeError, match="does not implement"):
        acc.register_accountant(object())
    lacks = r"sampler: Undrawn 'toy' lacks update \(see NoiseSampler\)"
    with pytest.raises(TypeError, match=lacks):
        noise.register_sampler(Undrawn())
    assert "toy" not in noise.sampler_names()


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


@pytest.mark.slow  # over 8 s on 2 cores: the fast suite stays under 3 minutes
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
    with pytest.raises(
        ValueError, match=re.escape(f"sampler must be one of {SAMPLER_REGISTRY.names()}")
    ):
        dpmp.gaussian_privatizer(stddev=1.0, policy=policy, sampler="nope")


def test_narrower_noise_is_drawn_by_the_first_registered_sampler_that_draws_in_it(toy_sampler):
    """A sampler draws unless the policy's noise is narrower than its
    ``min_noise_bits`` (an unsafe opt-in); then the first registered sampler whose
    ``min_noise_bits`` fits draws, whatever was registered later."""
    for spec in ("f32", "f32,noise=bf16,unsafe=true", "f32,noise=f16,unsafe=true"):
        policy = dpmp.Policy.parse(spec)
        bits = jnp.finfo(policy.noise).bits
        fitting = [s for s in SAMPLER_REGISTRY if bits >= s.min_noise_bits]
        for name in SAMPLER_REGISTRY.names():
            chosen = noise.sampler(name)
            drawn = noise.drawn_sampler(name, policy)
            assert drawn is (chosen if chosen in fitting else fitting[0]), (spec, name)
            assert drawn.min_noise_bits <= bits
    half = dpmp.Policy.parse("f32,noise=bf16,unsafe=true")
    assert noise.drawn_sampler("toy", half) is not toy_sampler  # it draws in 32 bits only


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


# ---- no decision by a variant's name -------------------------------------------------

# A literal spelt like a variant's name that means something else: (module, literal).
NOT_A_VARIANT = {
    # config.json's model_type, checked by GPT-2's own checkpoint reader
    ("dpmp.models._gpt2_checkpoint", "gpt2"),
}


def _variant_modules() -> dict[str, set[str]]:
    """name -> the modules a variant of that name may be spoken of by name in: its
    type's module and those of the dpmp objects it holds (a text source's corpus)."""
    from dpmp.data.sources import PUBLIC_TEXT, SOURCES
    from dpmp.models.families import FAMILIES

    out: dict[str, set[str]] = {}
    for registry in (ACCOUNTANT_REGISTRY, SAMPLER_REGISTRY, SOURCES, PUBLIC_TEXT, FAMILIES):
        for variant in registry:
            held = getattr(variant, "__dict__", {}).values()
            modules = {type(v).__module__ for v in (variant, *held)}
            out.setdefault(variant.name, set()).update(m for m in modules if m.startswith("dpmp"))
    return out


def _literals(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _name_uses(source: str) -> list[tuple[int, str]]:
    """``(line, literal)`` of each string literal compared (``==``, ``!=``, ``in``,
    ``not in``, ``is``) or used as a dict literal's key, less the built-in tables
    handed to a ``Registry(...)``."""
    tree = ast.parse(source)
    tables = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Registry")
        for arg in (*node.args, *(k.value for k in node.keywords))
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            found += [(node.lineno, s) for side in sides for s in _literals(side)]
        elif isinstance(node, ast.Dict) and id(node) not in tables:
            found += [(node.lineno, s) for k in node.keys if k is not None for s in _literals(k)]
    return found


def _decisions_by_name(files, variants) -> list[str]:
    out = []
    for path, module in files:
        for line, literal in _name_uses(path.read_text(encoding="utf-8")):
            own = module in variants.get(literal, {module})
            if not own and (module, literal) not in NOT_A_VARIANT:
                out.append(f"{path}:{line}: {literal!r}")
    return out


def test_the_scan_finds_comparisons_and_keys_of_a_variants_name(tmp_path):
    foreign = tmp_path / "foreign.py"
    foreign.write_text(
        '"""Docstrings and defaults may name "snapped" and "mlp"."""\n'
        'DEFAULT = "snapped"\n'
        "def f(s, kind):\n"
        '    if s.name == "snapped" or kind in ("mlp", "vit"):\n'
        '        return {"lm": 1}.get(kind, Registry("x", {"plain": "m:a"}))\n'
    )
    variants = {"snapped": {"dpmp.noise._snapped"}, "mlp": {"own"}, "lm": {"own"}, "vit": {"own"}}
    found = _decisions_by_name([(foreign, "foreign")], variants)
    assert found == [
        f"{foreign}:4: 'snapped'",
        f"{foreign}:4: 'mlp'",
        f"{foreign}:4: 'vit'",
        f"{foreign}:5: 'lm'",
    ]
    assert _decisions_by_name([(foreign, "own")], variants) == [f"{foreign}:4: 'snapped'"]


def test_no_module_decides_by_a_registered_variants_name():
    """Outside the module that defines it, a sampler, accountant, data source, public
    text or model family is asked (its contract, warning, sizes, checkpoint, task),
    never compared by its name: ``if name == "snapped"`` elsewhere is a missing
    method. The names are the registries' own, built-in and registered alike."""
    package = Path(dpmp.__file__).parent
    files = [
        (path, ".".join(path.relative_to(package.parent).with_suffix("").parts))
        for path in sorted(package.rglob("*.py"))
    ]
    files = [(p, m.removesuffix(".__init__")) for p, m in files]
    variants = _variant_modules()
    assert {"snapped", "plain", "rdp", "pld", "mlp", "gpt2", "digits"} <= set(variants)
    found = _decisions_by_name(files, variants)
    assert not found, "a variant's name decides outside its module:\n" + "\n".join(found)
