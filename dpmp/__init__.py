"""dpmp: differentially private training in JAX with precision controls.

Importing dpmp creates no arrays, starts no backend and imports no JAX: the
public names below are imported on first use (PEP 562), so ``dpmp --help``
and other work that needs none of them stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, attribute); attribute None: the module itself.
_PUBLIC = {
    "accounting": ("dpmp.accounting", None),
    "AUDIT_KINDS": ("dpmp._src.audit", "KINDS"),
    "Finding": ("dpmp._src.audit", "Finding"),
    "PrecisionAuditError": ("dpmp._src.audit", "PrecisionAuditError"),
    "PrecisionReport": ("dpmp._src.audit", "PrecisionReport"),
    "audit_precision": ("dpmp._src.audit", "audit_precision"),
    "NumericReport": ("dpmp._src.audit_numeric", "NumericReport"),
    "fp_sum_sensitivity": ("dpmp._src.audit_numeric", "fp_sum_sensitivity"),
    "numeric_audit": ("dpmp._src.audit_numeric", "numeric_audit"),
    "PrivacyAuditReport": ("dpmp._src.audit_privacy", "PrivacyAuditReport"),
    "privacy_audit": ("dpmp._src.audit_privacy", "privacy_audit"),
    "RunAuditReport": ("dpmp._src.audit_run", "RunAuditReport"),
    "audit_run": ("dpmp._src.audit_run", "audit_run"),
    "cast_function": ("dpmp._src.casting", "cast_function"),
    "cast_tree": ("dpmp._src.casting", "cast_tree"),
    "force_full_precision": ("dpmp._src.casting", "force_full_precision"),
    "load_params": ("dpmp._src.checkpoint", "load_params"),
    "PrivateGrad": ("dpmp._src.clipping", "PrivateGrad"),
    "PrivateGradFn": ("dpmp._src.clipping", "PrivateGradFn"),
    "PrivateGradStats": ("dpmp._src.clipping", "PrivateGradStats"),
    "private_grad": ("dpmp._src.clipping", "private_grad"),
    "Config": ("dpmp._src.config", "Config"),
    "ConfigError": ("dpmp._src.config", "ConfigError"),
    "load_config": ("dpmp._src.config", "load_config"),
    "DataError": ("dpmp._src.data", "DataError"),
    "Dataset": ("dpmp._src.data", "Dataset"),
    "init_lora": ("dpmp._src.lora", "init_adapters"),
    "merge_lora": ("dpmp._src.lora", "merge"),
    "DynamicLossScale": ("dpmp._src.loss_scale", "DynamicLossScale"),
    "NoOpLossScale": ("dpmp._src.loss_scale", "NoOpLossScale"),
    "StaticLossScale": ("dpmp._src.loss_scale", "StaticLossScale"),
    "all_finite": ("dpmp._src.loss_scale", "all_finite"),
    "select_tree": ("dpmp._src.loss_scale", "select_tree"),
    "NoiseSharding": ("dpmp._src.noise", "NoiseSharding"),
    "gaussian_privatizer": ("dpmp._src.noise", "gaussian_privatizer"),
    "private_optimizer": ("dpmp._src.noise", "private_optimizer"),
    "snap_grid": ("dpmp._src.noise", "snap_grid"),
    "snapped_gaussian": ("dpmp._src.noise", "snapped_gaussian"),
    "Policy": ("dpmp._src.policy", "Policy"),
    "PrecisionError": ("dpmp._src.policy", "PrecisionError"),
    "PrivateDynamicLossScale": ("dpmp._src.private_loss_scale", "PrivateDynamicLossScale"),
    "PoissonSampler": ("dpmp._src.sampling", "PoissonSampler"),
    "SampledBatch": ("dpmp._src.sampling", "SampledBatch"),
    "ShuffledSampler": ("dpmp._src.sampling", "ShuffledSampler"),
    "ScaledGrad": ("dpmp._src.scaled_grad", "ScaledGrad"),
    "update_if_finite": ("dpmp._src.scaled_grad", "update_if_finite"),
    "value_and_grad": ("dpmp._src.scaled_grad", "value_and_grad"),
    "train": ("dpmp._src.trainer", "train"),
}

if TYPE_CHECKING:  # what static tools and IDEs see
    from dpmp import accounting as accounting
    from dpmp._src.audit import KINDS as AUDIT_KINDS
    from dpmp._src.audit import Finding as Finding
    from dpmp._src.audit import PrecisionAuditError as PrecisionAuditError
    from dpmp._src.audit import PrecisionReport as PrecisionReport
    from dpmp._src.audit import audit_precision as audit_precision
    from dpmp._src.audit_numeric import NumericReport as NumericReport
    from dpmp._src.audit_numeric import fp_sum_sensitivity as fp_sum_sensitivity
    from dpmp._src.audit_numeric import numeric_audit as numeric_audit
    from dpmp._src.audit_privacy import PrivacyAuditReport as PrivacyAuditReport
    from dpmp._src.audit_privacy import privacy_audit as privacy_audit
    from dpmp._src.audit_run import RunAuditReport as RunAuditReport
    from dpmp._src.audit_run import audit_run as audit_run
    from dpmp._src.casting import cast_function as cast_function
    from dpmp._src.casting import cast_tree as cast_tree
    from dpmp._src.casting import force_full_precision as force_full_precision
    from dpmp._src.checkpoint import load_params as load_params
    from dpmp._src.clipping import PrivateGrad as PrivateGrad
    from dpmp._src.clipping import PrivateGradFn as PrivateGradFn
    from dpmp._src.clipping import PrivateGradStats as PrivateGradStats
    from dpmp._src.clipping import private_grad as private_grad
    from dpmp._src.config import Config as Config
    from dpmp._src.config import ConfigError as ConfigError
    from dpmp._src.config import load_config as load_config
    from dpmp._src.data import DataError as DataError
    from dpmp._src.data import Dataset as Dataset
    from dpmp._src.lora import init_adapters as init_lora
    from dpmp._src.lora import merge as merge_lora
    from dpmp._src.loss_scale import DynamicLossScale as DynamicLossScale
    from dpmp._src.loss_scale import NoOpLossScale as NoOpLossScale
    from dpmp._src.loss_scale import StaticLossScale as StaticLossScale
    from dpmp._src.loss_scale import all_finite as all_finite
    from dpmp._src.loss_scale import select_tree as select_tree
    from dpmp._src.noise import NoiseSharding as NoiseSharding
    from dpmp._src.noise import gaussian_privatizer as gaussian_privatizer
    from dpmp._src.noise import private_optimizer as private_optimizer
    from dpmp._src.noise import snap_grid as snap_grid
    from dpmp._src.noise import snapped_gaussian as snapped_gaussian
    from dpmp._src.policy import Policy as Policy
    from dpmp._src.policy import PrecisionError as PrecisionError
    from dpmp._src.private_loss_scale import PrivateDynamicLossScale as PrivateDynamicLossScale
    from dpmp._src.sampling import PoissonSampler as PoissonSampler
    from dpmp._src.sampling import SampledBatch as SampledBatch
    from dpmp._src.sampling import ShuffledSampler as ShuffledSampler
    from dpmp._src.scaled_grad import ScaledGrad as ScaledGrad
    from dpmp._src.scaled_grad import update_if_finite as update_if_finite
    from dpmp._src.scaled_grad import value_and_grad as value_and_grad
    from dpmp._src.trainer import train as train


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'dpmp' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__version__ = "0.1.0"

__all__ = [
    "AUDIT_KINDS",
    "Config",
    "ConfigError",
    "DataError",
    "Dataset",
    "Finding",
    "NumericReport",
    "PrecisionAuditError",
    "PrecisionReport",
    "accounting",
    "audit_precision",
    "fp_sum_sensitivity",
    "numeric_audit",
    "privacy_audit",
    "PrivacyAuditReport",
    "audit_run",
    "RunAuditReport",
    "DynamicLossScale",
    "NoOpLossScale",
    "NoiseSharding",
    "Policy",
    "PoissonSampler",
    "PrecisionError",
    "PrivateDynamicLossScale",
    "PrivateGrad",
    "PrivateGradFn",
    "PrivateGradStats",
    "SampledBatch",
    "ScaledGrad",
    "ShuffledSampler",
    "StaticLossScale",
    "all_finite",
    "cast_function",
    "cast_tree",
    "force_full_precision",
    "gaussian_privatizer",
    "load_config",
    "init_lora",
    "load_params",
    "merge_lora",
    "private_grad",
    "private_optimizer",
    "snap_grid",
    "snapped_gaussian",
    "train",
    "select_tree",
    "update_if_finite",
    "value_and_grad",
]
