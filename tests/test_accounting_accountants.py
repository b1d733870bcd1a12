"""Accountants are configured objects (``PldAccountant``, ``RdpAccountant``),
accepted wherever a registered name is; each question has one spelling that
takes a plan or its fields. References: dp-accounting's accountants built here
with the same settings."""

import dataclasses
import json
import math

import dp_accounting
import pytest

import dpmp.accounting as acc

COARSE_PLD = acc.PldAccountant(value_discretization_interval=2e-3)
COARSER_PLD = acc.PldAccountant(value_discretization_interval=5e-3)
FEW_ORDERS = (1.5, 2.0, 3.0, 5.0, 8.0, 16.0, 32.0, 64.0)
COARSE_RDP = acc.RdpAccountant(orders=FEW_ORDERS)
PLAN = dict(noise_multiplier=1.3, sampling_prob=0.03, delta=1e-5)


def _reference(
    settings, event, delta, relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
):
    """dp-accounting's accountant with the same settings, built directly."""
    kind, value = settings
    if kind == "pld":
        made = dp_accounting.pld.PLDAccountant(
            neighboring_relation=relation, value_discretization_interval=value
        )
    else:
        made = dp_accounting.rdp.RdpAccountant(orders=value, neighboring_relation=relation)
    return made.compose(event).get_epsilon(delta)


def _run(q, sigma, steps, sigma_c=None, every=1):
    """The run's event, written out: a count of the step's own sample joins its
    Gaussian (whitened sensitivity ``sqrt(sigma^-2 + sigma_c^-2)``, see
    ``dpmp.accounting._events``)."""

    def step(noise):
        return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise))

    with_count = 0 if sigma_c is None else steps // every
    parts = [(step(sigma), steps - with_count)]
    if with_count:
        parts.append((step((sigma**-2 + sigma_c**-2) ** -0.5), with_count))
    return dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(e, n) for e, n in parts if n > 0]
    )


CONFIGURED = [
    pytest.param(COARSE_PLD, ("pld", 2e-3), id="pld-2e-3"),
    pytest.param(COARSER_PLD, ("pld", 5e-3), id="pld-5e-3"),
    pytest.param(COARSE_RDP, ("rdp", FEW_ORDERS), id="rdp-8-orders"),
]


@pytest.mark.parametrize("accountant,settings", CONFIGURED)
@pytest.mark.parametrize("counts", [None, (6.0, 3)])
def test_a_configured_accountant_gives_dp_accountings_epsilon_at_its_settings(
    accountant, settings, counts
):
    sigma_c, every = counts or (None, 1)
    got = acc.epsilon(
        **PLAN,
        steps=60,
        accountant=accountant,
        count_noise_stddev=sigma_c,
        count_every=every,
        noised_coordinates=None,
    )
    want = _reference(settings, _run(0.03, 1.3, 60, sigma_c, every), 1e-5)
    assert got == pytest.approx(want, rel=1e-9)
    # its settings matter: the default-configured one gives another number
    default = acc.epsilon(
        **PLAN,
        steps=60,
        accountant=accountant.name,
        count_noise_stddev=sigma_c,
        count_every=every,
        noised_coordinates=None,
    )
    assert got != default


@pytest.mark.parametrize("accountant,settings", CONFIGURED)
def test_the_tracker_and_calibration_run_a_configured_accountant(accountant, settings):
    budget = acc.PrivacyBudget(
        **PLAN, target_epsilon=1.5, accountant=accountant, noised_coordinates=None
    )
    assert budget.accountant == accountant
    tracker = acc.BudgetTracker(budget)
    for _ in range(20):
        tracker.step()
    # a discretisation given is the tracker's too (only the default's is coarser)
    want = _reference(settings, _run(0.03, 1.3, 20), 1e-5)
    assert tracker.spent() == pytest.approx(want, rel=1e-6)
    n = acc.calibrate_steps(
        **PLAN, target_epsilon=1.5, accountant=accountant, noised_coordinates=None
    )
    assert _reference(settings, _run(0.03, 1.3, n), 1e-5) <= 1.5
    assert _reference(settings, _run(0.03, 1.3, n + 1), 1e-5) > 1.5
    sigma = acc.calibrate_noise_multiplier(
        sampling_prob=0.03,
        steps=60,
        delta=1e-5,
        target_epsilon=1.5,
        accountant=accountant,
        noised_coordinates=None,
    )
    eps = _reference(settings, _run(0.03, sigma, 60), 1e-5)
    assert eps <= 1.5 and eps == pytest.approx(1.5, rel=1e-2)


def test_replace_one_with_a_configured_pld_is_dp_accountings():
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    got = acc.epsilon(
        **PLAN,
        steps=60,
        accountant=COARSE_PLD,
        neighboring="replace_one",
        noised_coordinates=None,
    )
    want = _reference(("pld", 2e-3), _run(0.03, 1.3, 60), 1e-5, relation)
    assert got == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match='needs accountant="pld": the rdp accountant has no'):
        acc.epsilon(
            **PLAN,
            steps=60,
            accountant=COARSE_RDP,
            neighboring="replace_one",
            noised_coordinates=None,
        )


def test_the_registered_accountants_are_default_configured_objects():
    pld, rdp = acc.get_accountant("pld"), acc.get_accountant("rdp")
    assert pld == acc.PldAccountant() and rdp == acc.RdpAccountant()
    assert (pld.name, rdp.name) == ("pld", "rdp")
    # the default PLD's one-shot grid is dp-accounting's default; its tracker's
    # is the coarser TRACKING_DISCRETIZATION; a grid given is kept for both
    assert pld.for_tracking() == acc.PldAccountant(
        value_discretization_interval=acc.TRACKING_DISCRETIZATION
    )
    assert COARSE_PLD.for_tracking() == COARSE_PLD and rdp.for_tracking() == rdp
    cheap = dict(noise_multiplier=4.0, sampling_prob=0.1, delta=1e-5, steps=10)
    assert acc.epsilon(**cheap, noised_coordinates=None) == pytest.approx(
        _reference(("pld", acc.REPORT_DISCRETIZATION), _run(0.1, 4.0, 10), 1e-5), rel=1e-9
    )


def test_an_object_is_accepted_wherever_a_name_is():
    fields = dict(**PLAN, steps=50, noised_coordinates=None)
    by_name = acc.AccountingPlan(**fields, accountant="rdp")
    by_object = acc.AccountingPlan(**fields, accountant=acc.get_accountant("rdp"))
    assert by_name == by_object and by_name.accountant == acc.RdpAccountant()
    budget = dict(**PLAN, target_epsilon=3.0, noised_coordinates=None)
    assert acc.PrivacyBudget(**budget, accountant="pld") == acc.PrivacyBudget(
        **budget, accountant=acc.PldAccountant()
    )
    with pytest.raises(TypeError, match="accountant must be a registered name"):
        acc.AccountingPlan(**fields, accountant=3)
    with pytest.raises(ValueError, match="accountant must be one of"):
        acc.PrivacyBudget(**budget, accountant="moments")


@pytest.mark.parametrize("accountant", ["pld", COARSE_PLD, COARSE_RDP])
def test_a_budget_with_its_accountant_round_trips_through_json(accountant):
    budget = acc.PrivacyBudget(
        **PLAN, target_epsilon=3.0, accountant=accountant, noised_coordinates=None
    )
    tracker = acc.BudgetTracker(budget, steps=25)
    state = json.loads(tracker.to_json())
    # a registered accountant is recorded by its name, a configured one by its settings
    recorded = state["budget"]["accountant"]
    assert recorded == "pld" if accountant == "pld" else recorded["name"] == accountant.name
    resumed = acc.BudgetTracker.from_state_dict(state)
    assert resumed.budget == budget and resumed.spent() == tracker.spent()


def test_one_spelling_per_question_takes_a_plan_or_its_fields():
    fields = dict(**PLAN, steps=120, count_noise_stddev=5.0, count_every=2, noised_coordinates=None)
    plan = acc.AccountingPlan(**fields, accountant=COARSE_RDP)
    eps = acc.epsilon(**fields, accountant=COARSE_RDP)
    assert acc.epsilon(plan) == eps == acc.plan_epsilon(plan)
    parts = acc.epsilon(plan, breakdown=True)
    assert parts == acc.epsilon(**fields, accountant=COARSE_RDP, breakdown=True)
    assert parts == acc.plan_epsilon_breakdown(plan)
    assert parts == acc.epsilon_breakdown(**fields, accountant=COARSE_RDP)
    assert parts.total == eps and parts.counts > 0
    sigma = acc.calibrate_noise_multiplier(plan, target_epsilon=2.0)
    assert sigma == acc.calibrate_plan(plan, 2.0)
    assert sigma == acc.calibrate_noise_multiplier(
        **{k: v for k, v in fields.items() if k != "noise_multiplier"},
        accountant=COARSE_RDP,
        target_epsilon=2.0,
    )
    n = acc.calibrate_steps(plan, target_epsilon=2.0)  # the plan's own steps ignored
    assert n == acc.calibrate_steps(
        **{k: v for k, v in fields.items() if k != "steps"},
        accountant=COARSE_RDP,
        target_epsilon=2.0,
    )
    assert acc.epsilon(plan.replace(steps=n)) <= 2.0 < acc.epsilon(plan.replace(steps=n + 1))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda p: acc.epsilon(p, steps=3), "give a plan or its fields as keywords, not both"),
        (lambda p: acc.epsilon(dataclasses.asdict(p)), "plan must be an AccountingPlan"),
        (lambda p: acc.epsilon(noise_multipler=1.0), "unexpected argument 'noise_multipler'"),
        (
            lambda p: acc.calibrate_noise_multiplier(
                **PLAN, steps=10, target_epsilon=1.0, noised_coordinates=None
            ),
            "unexpected argument 'noise_multiplier'",
        ),
        (
            lambda p: acc.calibrate_steps(
                **PLAN, steps=10, target_epsilon=1.0, noised_coordinates=None
            ),
            "unexpected argument 'steps'",
        ),
    ],
)
def test_a_question_refuses_a_plan_and_fields_together_or_an_unknown_field(call, message):
    plan = acc.AccountingPlan(**PLAN, steps=10, noised_coordinates=None)
    with pytest.raises(TypeError, match=message):
        call(plan)


@pytest.mark.parametrize(
    "make,error,message",
    [
        (
            lambda: acc.PldAccountant(value_discretization_interval=0.0),
            ValueError,
            r"PldAccountant.value_discretization_interval must be in \(0, 1\), got 0.0",
        ),
        (
            lambda: acc.PldAccountant(value_discretization_interval=1.5),
            ValueError,
            r"PldAccountant.value_discretization_interval must be in \(0, 1\)",
        ),
        (
            lambda: acc.PldAccountant(value_discretization_interval="fine"),
            TypeError,
            "PldAccountant.value_discretization_interval must be a real number",
        ),
        (
            lambda: acc.PldAccountant(value_discretization_interval=math.nan),
            ValueError,
            "PldAccountant.value_discretization_interval must not be NaN",
        ),
        (lambda: acc.PldAccountant(name=""), ValueError, "PldAccountant.name must be a non-empty"),
        (
            lambda: acc.RdpAccountant(orders=()),
            ValueError,
            "RdpAccountant.orders must be a non-empty",
        ),
        (
            lambda: acc.RdpAccountant(orders=(0.5, 2.0)),
            ValueError,
            r"RdpAccountant.orders must .* finite reals > 1, got \(0.5, 2.0\) \(not: \[0.5\]\)",
        ),
        (
            lambda: acc.RdpAccountant(orders=(2.0, math.inf)),
            ValueError,
            r"RdpAccountant.orders .*\(not: \[inf\]\)",
        ),
        (lambda: acc.RdpAccountant(orders=8), TypeError, "RdpAccountant.orders must be a sequence"),
        (
            lambda: acc.RdpAccountant(name=None),
            ValueError,
            "RdpAccountant.name must be a non-empty",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_configured_accountant_registered_under_its_own_name_is_chosen_by_it():
    coarse = acc.register_accountant(
        acc.PldAccountant(name="pld_coarse", value_discretization_interval=3e-3)
    )
    try:
        assert "pld_coarse" in acc.ACCOUNTANTS
        got = acc.epsilon(**PLAN, steps=60, accountant="pld_coarse", noised_coordinates=None)
        assert got == acc.epsilon(**PLAN, steps=60, accountant=coarse, noised_coordinates=None)
        want = _reference(("pld", 3e-3), _run(0.03, 1.3, 60), 1e-5)
        assert got == pytest.approx(want, rel=1e-9)
        budget = acc.PrivacyBudget(
            **PLAN, target_epsilon=3.0, accountant="pld_coarse", noised_coordinates=None
        )
        assert budget.to_dict()["accountant"] == "pld_coarse"
    finally:
        from dpmp.accounting._registry import ACCOUNTANT_REGISTRY

        ACCOUNTANT_REGISTRY.unregister("pld_coarse")


@pytest.mark.parametrize("interval", [1e-3, 1e-4])
def test_a_budget_saved_with_its_interval_beside_the_name_resumes_alike(interval):
    """Checkpoints written when the PLD interval was a field of the budget (these
    records are what such a checkpoint holds) load as a budget whose tracker spends
    what a tracker on that interval spends."""
    old = {
        "noise_multiplier": 1.1, "sampling_prob": 0.02, "delta": 1e-05, "target_epsilon": 2.0,
        "accountant": "pld", "neighboring": "add_or_remove", "count_noise_stddev": None,
        "count_every": 1, "value_discretization_interval": interval,
        "preprocessing_noise_multiplier": None, "noised_coordinates": None,
        "noise_sampler": "snapped",
    }  # fmt: skip
    budget = acc.PrivacyBudget.from_dict(old)
    dropped = ("accountant", "value_discretization_interval")
    fields = {k: v for k, v in old.items() if k not in dropped}
    want = acc.PrivacyBudget(
        **fields, accountant=acc.PldAccountant(value_discretization_interval=interval)
    )
    assert budget.accountant.for_tracking() == want.accountant.for_tracking()
    got, ref = acc.BudgetTracker(budget), acc.BudgetTracker(want)
    for _ in range(40):
        assert got.step() == ref.step()
    assert got.spent() > 0
