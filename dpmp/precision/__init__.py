"""The precision core: policies, pytree casting, loss scales and a loss-scaled
``value_and_grad``. It imports nothing else of dpmp and works without any DP.
"""

from dpmp.precision._casting import cast_function as cast_function
from dpmp.precision._casting import cast_tree as cast_tree
from dpmp.precision._casting import force_full_precision as force_full_precision
from dpmp.precision._loss_scale import DynamicLossScale as DynamicLossScale
from dpmp.precision._loss_scale import NoOpLossScale as NoOpLossScale
from dpmp.precision._loss_scale import StaticLossScale as StaticLossScale
from dpmp.precision._loss_scale import all_finite as all_finite
from dpmp.precision._loss_scale import select_tree as select_tree
from dpmp.precision._policy import Policy as Policy
from dpmp.precision._policy import PrecisionError as PrecisionError
from dpmp.precision._scaled_grad import ScaledGrad as ScaledGrad
from dpmp.precision._scaled_grad import update_if_finite as update_if_finite
from dpmp.precision._scaled_grad import value_and_grad as value_and_grad

__all__ = [
    "Policy",
    "PrecisionError",
    "cast_function",
    "cast_tree",
    "force_full_precision",
    "DynamicLossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "all_finite",
    "select_tree",
    "ScaledGrad",
    "update_if_finite",
    "value_and_grad",
]
