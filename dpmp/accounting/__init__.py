"""Privacy accounting of a dpmp run, on dp-accounting events.

``epsilon``, ``calibrate_noise_multiplier`` and ``calibrate_steps`` answer
one-shot questions about a plan; ``BudgetTracker`` follows a run step by step.
Every release of a run is composed: the DP-SGD steps and, when a private
dynamic loss scale is used, its noised overflow counts; and every epsilon
covers the floating-point residual of the noise dpmp draws (``noise_residual``)
for the ``noised_coordinates`` each function requires.
"""

from dpmp.accounting._accounting import ACCOUNTANTS as ACCOUNTANTS
from dpmp.accounting._accounting import MAX_EPSILON as MAX_EPSILON
from dpmp.accounting._accounting import MAX_NOISE_MULTIPLIER as MAX_NOISE_MULTIPLIER
from dpmp.accounting._accounting import MAX_STEPS as MAX_STEPS
from dpmp.accounting._accounting import MIN_CALIBRATED_NOISE as MIN_CALIBRATED_NOISE
from dpmp.accounting._accounting import NEIGHBORING_RELATIONS as NEIGHBORING_RELATIONS
from dpmp.accounting._accounting import REPORT_DISCRETIZATION as REPORT_DISCRETIZATION
from dpmp.accounting._accounting import REQUIRED as REQUIRED
from dpmp.accounting._accounting import RESIDUAL_DELTA_SHARE as RESIDUAL_DELTA_SHARE
from dpmp.accounting._accounting import SNAP_TAIL as SNAP_TAIL
from dpmp.accounting._accounting import TRACKING_DISCRETIZATION as TRACKING_DISCRETIZATION
from dpmp.accounting._accounting import BudgetExceededError as BudgetExceededError
from dpmp.accounting._accounting import BudgetTracker as BudgetTracker
from dpmp.accounting._accounting import EpsilonBreakdown as EpsilonBreakdown
from dpmp.accounting._accounting import NoiseResidual as NoiseResidual
from dpmp.accounting._accounting import PrivacyBudget as PrivacyBudget
from dpmp.accounting._accounting import calibrate_noise_multiplier as calibrate_noise_multiplier
from dpmp.accounting._accounting import calibrate_steps as calibrate_steps
from dpmp.accounting._accounting import count_releases as count_releases
from dpmp.accounting._accounting import dpsgd_event as dpsgd_event
from dpmp.accounting._accounting import effective_noise_multiplier as effective_noise_multiplier
from dpmp.accounting._accounting import epsilon as epsilon
from dpmp.accounting._accounting import epsilon_breakdown as epsilon_breakdown
from dpmp.accounting._accounting import noise_residual as noise_residual

__all__ = [
    "ACCOUNTANTS",
    "MAX_EPSILON",
    "MAX_NOISE_MULTIPLIER",
    "MAX_STEPS",
    "MIN_CALIBRATED_NOISE",
    "NEIGHBORING_RELATIONS",
    "REPORT_DISCRETIZATION",
    "REQUIRED",
    "RESIDUAL_DELTA_SHARE",
    "SNAP_TAIL",
    "TRACKING_DISCRETIZATION",
    "BudgetExceededError",
    "BudgetTracker",
    "EpsilonBreakdown",
    "NoiseResidual",
    "PrivacyBudget",
    "calibrate_noise_multiplier",
    "calibrate_steps",
    "count_releases",
    "dpsgd_event",
    "effective_noise_multiplier",
    "epsilon",
    "epsilon_breakdown",
    "noise_residual",
]
