"""Privacy accounting of a dpmp run, on dp-accounting events.

An ``AccountingPlan`` records what a run releases: the DP-SGD steps and, when
a private dynamic loss scale is used, its noised overflow counts, a one-off
preprocessing release, the accountant, and the noise's accounting contract
with the coordinates it noises. Each question has one function, which takes a
plan or the plan's fields as keyword arguments: ``epsilon`` (with
``breakdown=True``, its parts), ``calibrate_noise_multiplier`` and
``calibrate_steps``; ``BudgetTracker`` follows a run step by step against a
``PrivacyBudget``. (``epsilon_breakdown``, ``plan_epsilon``,
``plan_epsilon_breakdown`` and ``calibrate_plan`` are the same questions under
earlier names.) Every release of a run is composed, and every epsilon covers
the floating-point residual of the noise dpmp draws (``noise_residual``) for
the ``noised_coordinates`` each function requires.

Formal Guarantees:
  * The events of a run and what they assume: see ``dpmp.accounting._events``.
  * Accountants are objects that carry their settings, registered by name
    (``register_accountant``) as default-configured instances:
    ``RdpAccountant(orders=...)`` (``accountant="rdp"``), Renyi DP of the
    sampled Gaussian mechanism (Mironov 2017; Mironov, Talwar & Zhang 2019),
    an upper bound at any orders, typically loose by 5-20 percent;
    ``PldAccountant(value_discretization_interval=...)``
    (``accountant="pld"``), privacy loss distributions (Koskela, Jalko &
    Honkela 2020; Doroshenko et al. 2022) with dp-accounting's *pessimistic*
    discretisation, an upper bound for every interval.
  * ``neighboring="add_or_remove"`` (default) is adjacency by adding or
    removing one example, the relation under which Poisson sampling is
    analysed. ``"replace_one"`` (substitute one example) is supported where an
    accountant lists it in ``neighboring_relations`` (the PLD's); its count
    analysis is conservative (it allows a count to move by 2 where a
    substitution moves it by at most 1). Its analysis is dp-accounting's
    ``REPLACE_ONE``: the two substituted records' clipped gradients colinear
    and opposite (``g' = -g``, ``|g| = C``). That this one-dimensional pair
    dominates every pair of clipped gradients is
    assumed, not proved (the step's ``(1-q) N(mu) + q N(mu + g)`` against
    ``(1-q) N(mu) + q N(mu + g')``; the pair puts ``g`` and ``g'`` furthest
    apart); a replace-one epsilon rests on it, the noise residual's included.
  * The events assume exactly Gaussian noise. Every function here takes
    ``noised_coordinates`` (the trainable parameter count; required, no silent
    default), so that each epsilon covers the noise dpmp actually draws, by the
    accounting contract of its sampler (``NoiseContract``, handed down by
    ``dpmp.noise``): for ``dpmp.snapped_gaussian``, ``noise_residual`` bounds
    its deviation from the Gaussian per grid cell and composes it over the run,
    concentrated within each step (it grows like the square root of the
    coordinates). ``noised_coordinates=None`` accounts an exact Gaussian
    sampler instead.

Reference point: De et al. 2022 ("Unlocking high-accuracy differentially
private image classification through scale"), CIFAR-10 with q = 4096/50000,
sigma = 10, 875 steps, delta = 1e-5, reports epsilon = 1; this module gives
0.9877 with RDP and 0.9028 with PLD for exact Gaussian noise, and 0.9879 with
RDP for dpmp's snapped noise on its 2.75M parameters.

The names are imported on first use (PEP 562): listing the accountants (the
config's choices, ``dpmp --help``) imports no dp-accounting.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, attribute)
_PUBLIC = {
    "MAX_EPSILON": ("dpmp.accounting._validate", "MAX_EPSILON"),
    "MAX_NOISE_MULTIPLIER": ("dpmp.accounting._validate", "MAX_NOISE_MULTIPLIER"),
    "MAX_STEPS": ("dpmp.accounting._validate", "MAX_STEPS"),
    "MIN_CALIBRATED_NOISE": ("dpmp.accounting._validate", "MIN_CALIBRATED_NOISE"),
    "NEIGHBORING_RELATIONS": ("dpmp.accounting._validate", "NEIGHBORING_RELATIONS"),
    "REPORT_DISCRETIZATION": ("dpmp.accounting._validate", "REPORT_DISCRETIZATION"),
    "REQUIRED": ("dpmp.accounting._validate", "REQUIRED"),
    "TRACKING_DISCRETIZATION": ("dpmp.accounting._validate", "TRACKING_DISCRETIZATION"),
    "NEIGHBOURING_RELATION_NOTE": ("dpmp.accounting._events", "NEIGHBOURING_RELATION_NOTE"),
    "Release": ("dpmp.accounting._events", "Release"),
    "count_releases": ("dpmp.accounting._events", "count_releases"),
    "dpsgd_event": ("dpmp.accounting._events", "dpsgd_event"),
    "effective_noise_multiplier": ("dpmp.accounting._events", "effective_noise_multiplier"),
    "Accountant": ("dpmp.accounting._accountants", "Accountant"),
    "PldAccountant": ("dpmp.accounting._pld", "PldAccountant"),
    "RdpAccountant": ("dpmp.accounting._rdp", "RdpAccountant"),
    "composing_curve": ("dpmp.accounting._accountants", "composing_curve"),
    "get_accountant": ("dpmp.accounting._accountants", "get_accountant"),
    "register_accountant": ("dpmp.accounting._accountants", "register_accountant"),
    "DEFAULT_NOISE_SAMPLER": ("dpmp.accounting._contract", "DEFAULT_NOISE_SAMPLER"),
    "RESIDUAL_DELTA_SHARE": ("dpmp.accounting._residual", "RESIDUAL_DELTA_SHARE"),
    "GridNoiseContract": ("dpmp.accounting._residual", "GridNoiseContract"),
    "NoiseContract": ("dpmp.accounting._contract", "NoiseContract"),
    "NoiseResidual": ("dpmp.accounting._contract", "NoiseResidual"),
    "noise_contract": ("dpmp.accounting._contract", "noise_contract"),
    "register_noise_contract": ("dpmp.accounting._contract", "register_noise_contract"),
    "AccountingPlan": ("dpmp.accounting._plan", "AccountingPlan"),
    "EpsilonBreakdown": ("dpmp.accounting._plan", "EpsilonBreakdown"),
    "PlanFields": ("dpmp.accounting._functions", "PlanFields"),
    "plan_epsilon": ("dpmp.accounting._functions", "plan_epsilon"),
    "plan_epsilon_breakdown": ("dpmp.accounting._functions", "plan_epsilon_breakdown"),
    "calibrate_plan": ("dpmp.accounting._functions", "calibrate_plan"),
    "BudgetExceededError": ("dpmp.accounting._tracker", "BudgetExceededError"),
    "BudgetTracker": ("dpmp.accounting._tracker", "BudgetTracker"),
    "PrivacyBudget": ("dpmp.accounting._tracker", "PrivacyBudget"),
    "calibrate_noise_multiplier": ("dpmp.accounting._functions", "calibrate_noise_multiplier"),
    "calibrate_steps": ("dpmp.accounting._functions", "calibrate_steps"),
    "epsilon": ("dpmp.accounting._functions", "epsilon"),
    "epsilon_breakdown": ("dpmp.accounting._functions", "epsilon_breakdown"),
    "noise_residual": ("dpmp.accounting._functions", "noise_residual"),
    "SEARCH_ORDERS": ("dpmp.accounting._tuning", "SEARCH_ORDERS"),
    "CandidateCount": ("dpmp.accounting._tuning", "CandidateCount"),
    "CandidatePlan": ("dpmp.accounting._tuning", "CandidatePlan"),
    "PoissonCount": ("dpmp.accounting._tuning", "PoissonCount"),
    "SearchGuarantee": ("dpmp.accounting._tuning", "SearchGuarantee"),
    "TruncatedNegativeBinomialCount": ("dpmp.accounting._tuning", "TruncatedNegativeBinomialCount"),
    "calibrate_search_noise": ("dpmp.accounting._tuning", "calibrate_search_noise"),
    "search_epsilon": ("dpmp.accounting._tuning", "search_epsilon"),
    "search_guarantee": ("dpmp.accounting._tuning", "search_guarantee"),
}

if TYPE_CHECKING:
    from dpmp.accounting._accountants import Accountant as Accountant
    from dpmp.accounting._accountants import composing_curve as composing_curve
    from dpmp.accounting._accountants import get_accountant as get_accountant
    from dpmp.accounting._accountants import register_accountant as register_accountant
    from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER as DEFAULT_NOISE_SAMPLER
    from dpmp.accounting._contract import NoiseContract as NoiseContract
    from dpmp.accounting._contract import NoiseResidual as NoiseResidual
    from dpmp.accounting._contract import noise_contract as noise_contract
    from dpmp.accounting._contract import register_noise_contract as register_noise_contract
    from dpmp.accounting._events import NEIGHBOURING_RELATION_NOTE as NEIGHBOURING_RELATION_NOTE
    from dpmp.accounting._events import Release as Release
    from dpmp.accounting._events import count_releases as count_releases
    from dpmp.accounting._events import dpsgd_event as dpsgd_event
    from dpmp.accounting._events import effective_noise_multiplier as effective_noise_multiplier
    from dpmp.accounting._functions import PlanFields as PlanFields
    from dpmp.accounting._functions import calibrate_noise_multiplier as calibrate_noise_multiplier
    from dpmp.accounting._functions import calibrate_plan as calibrate_plan
    from dpmp.accounting._functions import calibrate_steps as calibrate_steps
    from dpmp.accounting._functions import epsilon as epsilon
    from dpmp.accounting._functions import epsilon_breakdown as epsilon_breakdown
    from dpmp.accounting._functions import noise_residual as noise_residual
    from dpmp.accounting._functions import plan_epsilon as plan_epsilon
    from dpmp.accounting._functions import plan_epsilon_breakdown as plan_epsilon_breakdown
    from dpmp.accounting._plan import AccountingPlan as AccountingPlan
    from dpmp.accounting._plan import EpsilonBreakdown as EpsilonBreakdown
    from dpmp.accounting._pld import PldAccountant as PldAccountant
    from dpmp.accounting._rdp import RdpAccountant as RdpAccountant
    from dpmp.accounting._residual import RESIDUAL_DELTA_SHARE as RESIDUAL_DELTA_SHARE
    from dpmp.accounting._residual import GridNoiseContract as GridNoiseContract
    from dpmp.accounting._tracker import BudgetExceededError as BudgetExceededError
    from dpmp.accounting._tracker import BudgetTracker as BudgetTracker
    from dpmp.accounting._tracker import PrivacyBudget as PrivacyBudget
    from dpmp.accounting._tuning import SEARCH_ORDERS as SEARCH_ORDERS
    from dpmp.accounting._tuning import CandidateCount as CandidateCount
    from dpmp.accounting._tuning import CandidatePlan as CandidatePlan
    from dpmp.accounting._tuning import PoissonCount as PoissonCount
    from dpmp.accounting._tuning import SearchGuarantee as SearchGuarantee
    from dpmp.accounting._tuning import (
        TruncatedNegativeBinomialCount as TruncatedNegativeBinomialCount,
    )
    from dpmp.accounting._tuning import calibrate_search_noise as calibrate_search_noise
    from dpmp.accounting._tuning import search_epsilon as search_epsilon
    from dpmp.accounting._tuning import search_guarantee as search_guarantee
    from dpmp.accounting._validate import MAX_EPSILON as MAX_EPSILON
    from dpmp.accounting._validate import MAX_NOISE_MULTIPLIER as MAX_NOISE_MULTIPLIER
    from dpmp.accounting._validate import MAX_STEPS as MAX_STEPS
    from dpmp.accounting._validate import MIN_CALIBRATED_NOISE as MIN_CALIBRATED_NOISE
    from dpmp.accounting._validate import NEIGHBORING_RELATIONS as NEIGHBORING_RELATIONS
    from dpmp.accounting._validate import REPORT_DISCRETIZATION as REPORT_DISCRETIZATION
    from dpmp.accounting._validate import REQUIRED as REQUIRED
    from dpmp.accounting._validate import TRACKING_DISCRETIZATION as TRACKING_DISCRETIZATION

    ACCOUNTANTS: tuple[str, ...]
    SNAP_TAIL: float


def __getattr__(name: str) -> Any:
    # Derived from the registries on every access, so that a registered variant shows.
    if name == "ACCOUNTANTS":
        from dpmp.accounting._registry import accountant_names

        return accountant_names()
    if name == "SNAP_TAIL":  # the default sampler's accurate reach, in stddevs
        from dpmp.accounting._contract import DEFAULT_NOISE_SAMPLER, noise_contract

        return noise_contract(DEFAULT_NOISE_SAMPLER).tail
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'dpmp.accounting' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "AccountingPlan",
    "BudgetExceededError",
    "BudgetTracker",
    "CandidateCount",
    "CandidatePlan",
    "DEFAULT_NOISE_SAMPLER",
    "EpsilonBreakdown",
    "GridNoiseContract",
    "MAX_EPSILON",
    "MAX_NOISE_MULTIPLIER",
    "MAX_STEPS",
    "MIN_CALIBRATED_NOISE",
    "NEIGHBORING_RELATIONS",
    "NEIGHBOURING_RELATION_NOTE",
    "NoiseContract",
    "NoiseResidual",
    "PlanFields",
    "PldAccountant",
    "PoissonCount",
    "PrivacyBudget",
    "REPORT_DISCRETIZATION",
    "REQUIRED",
    "RESIDUAL_DELTA_SHARE",
    "RdpAccountant",
    "Release",
    "SEARCH_ORDERS",
    "SNAP_TAIL",
    "SearchGuarantee",
    "TRACKING_DISCRETIZATION",
    "TruncatedNegativeBinomialCount",
    "calibrate_noise_multiplier",
    "calibrate_plan",
    "calibrate_search_noise",
    "calibrate_steps",
    "composing_curve",
    "count_releases",
    "dpsgd_event",
    "effective_noise_multiplier",
    "epsilon",
    "epsilon_breakdown",
    "get_accountant",
    "noise_contract",
    "noise_residual",
    "plan_epsilon",
    "plan_epsilon_breakdown",
    "register_accountant",
    "register_noise_contract",
    "search_epsilon",
    "search_guarantee",
]
