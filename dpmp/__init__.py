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
    "AUDIT_KINDS": ("dpmp.audit", "KINDS"),
    "Finding": ("dpmp.audit", "Finding"),
    "PrecisionAuditError": ("dpmp.audit", "PrecisionAuditError"),
    "PrecisionReport": ("dpmp.audit", "PrecisionReport"),
    "audit_precision": ("dpmp.audit", "audit_precision"),
    "NumericReport": ("dpmp.audit", "NumericReport"),
    "fp_sum_sensitivity": ("dpmp.audit", "fp_sum_sensitivity"),
    "numeric_audit": ("dpmp.audit", "numeric_audit"),
    "PrivacyAuditReport": ("dpmp.audit", "PrivacyAuditReport"),
    "privacy_audit": ("dpmp.audit", "privacy_audit"),
    "RunAuditReport": ("dpmp.app.audit_run", "RunAuditReport"),
    "audit_run": ("dpmp.app.audit_run", "audit_run"),
    "cast_function": ("dpmp.precision", "cast_function"),
    "cast_tree": ("dpmp.precision", "cast_tree"),
    "force_full_precision": ("dpmp.precision", "force_full_precision"),
    "load_params": ("dpmp.app.checkpoint", "load_params"),
    "export_params": ("dpmp.app.export", "export_params"),
    "delete_secrets": ("dpmp.app.export", "delete_secrets"),
    "PrivateGrad": ("dpmp.clipping", "PrivateGrad"),
    "PrivateGradFn": ("dpmp.clipping", "PrivateGradFn"),
    "PrivateGradStats": ("dpmp.clipping", "PrivateGradStats"),
    "private_grad": ("dpmp.clipping", "private_grad"),
    "Config": ("dpmp.app.config", "Config"),
    "ConfigError": ("dpmp.app.config", "ConfigError"),
    "load_config": ("dpmp.app.config", "load_config"),
    "DataError": ("dpmp.data", "DataError"),
    "Dataset": ("dpmp.data", "Dataset"),
    "init_lora": ("dpmp.models", "init_adapters"),
    "merge_lora": ("dpmp.models", "merge"),
    "DynamicLossScale": ("dpmp.precision", "DynamicLossScale"),
    "NoOpLossScale": ("dpmp.precision", "NoOpLossScale"),
    "StaticLossScale": ("dpmp.precision", "StaticLossScale"),
    "all_finite": ("dpmp.precision", "all_finite"),
    "select_tree": ("dpmp.precision", "select_tree"),
    "NoiseSharding": ("dpmp.noise", "NoiseSharding"),
    "gaussian_privatizer": ("dpmp.noise", "gaussian_privatizer"),
    "private_optimizer": ("dpmp.noise", "private_optimizer"),
    "snap_grid": ("dpmp.noise", "snap_grid"),
    "snapped_gaussian": ("dpmp.noise", "snapped_gaussian"),
    "Policy": ("dpmp.precision", "Policy"),
    "PrecisionError": ("dpmp.precision", "PrecisionError"),
    "PrivateDynamicLossScale": ("dpmp.clipping", "PrivateDynamicLossScale"),
    "PoissonSampler": ("dpmp.data", "PoissonSampler"),
    "SampledBatch": ("dpmp.data", "SampledBatch"),
    "ShuffledSampler": ("dpmp.data", "ShuffledSampler"),
    "ScaledGrad": ("dpmp.precision", "ScaledGrad"),
    "update_if_finite": ("dpmp.precision", "update_if_finite"),
    "value_and_grad": ("dpmp.precision", "value_and_grad"),
    "DataParallelMesh": ("dpmp.step", "DataParallelMesh"),
    "PrivateStepFn": ("dpmp.step", "PrivateStepFn"),
    "StepState": ("dpmp.step", "StepState"),
    "private_step": ("dpmp.step", "private_step"),
    "train": ("dpmp.app.trainer", "train"),
    "tune": ("dpmp.app.tune", "tune"),
    "PeriodicAction": ("dpmp.app.trainer.actions", "PeriodicAction"),
    "StepEnd": ("dpmp.app.trainer.actions", "StepEnd"),
}

if TYPE_CHECKING:  # what static tools and IDEs see
    from dpmp import accounting as accounting
    from dpmp.app.audit_run import RunAuditReport as RunAuditReport
    from dpmp.app.audit_run import audit_run as audit_run
    from dpmp.app.checkpoint import load_params as load_params
    from dpmp.app.config import Config as Config
    from dpmp.app.config import ConfigError as ConfigError
    from dpmp.app.config import load_config as load_config
    from dpmp.app.export import delete_secrets as delete_secrets
    from dpmp.app.export import export_params as export_params
    from dpmp.app.trainer import train as train
    from dpmp.app.trainer.actions import PeriodicAction as PeriodicAction
    from dpmp.app.trainer.actions import StepEnd as StepEnd
    from dpmp.app.tune import tune as tune
    from dpmp.audit import KINDS as AUDIT_KINDS
    from dpmp.audit import Finding as Finding
    from dpmp.audit import NumericReport as NumericReport
    from dpmp.audit import PrecisionAuditError as PrecisionAuditError
    from dpmp.audit import PrecisionReport as PrecisionReport
    from dpmp.audit import PrivacyAuditReport as PrivacyAuditReport
    from dpmp.audit import audit_precision as audit_precision
    from dpmp.audit import fp_sum_sensitivity as fp_sum_sensitivity
    from dpmp.audit import numeric_audit as numeric_audit
    from dpmp.audit import privacy_audit as privacy_audit
    from dpmp.clipping import PrivateDynamicLossScale as PrivateDynamicLossScale
    from dpmp.clipping import PrivateGrad as PrivateGrad
    from dpmp.clipping import PrivateGradFn as PrivateGradFn
    from dpmp.clipping import PrivateGradStats as PrivateGradStats
    from dpmp.clipping import private_grad as private_grad
    from dpmp.data import DataError as DataError
    from dpmp.data import Dataset as Dataset
    from dpmp.data import PoissonSampler as PoissonSampler
    from dpmp.data import SampledBatch as SampledBatch
    from dpmp.data import ShuffledSampler as ShuffledSampler
    from dpmp.models import init_adapters as init_lora
    from dpmp.models import merge as merge_lora
    from dpmp.noise import NoiseSharding as NoiseSharding
    from dpmp.noise import gaussian_privatizer as gaussian_privatizer
    from dpmp.noise import private_optimizer as private_optimizer
    from dpmp.noise import snap_grid as snap_grid
    from dpmp.noise import snapped_gaussian as snapped_gaussian
    from dpmp.precision import DynamicLossScale as DynamicLossScale
    from dpmp.precision import NoOpLossScale as NoOpLossScale
    from dpmp.precision import Policy as Policy
    from dpmp.precision import PrecisionError as PrecisionError
    from dpmp.precision import ScaledGrad as ScaledGrad
    from dpmp.precision import StaticLossScale as StaticLossScale
    from dpmp.precision import all_finite as all_finite
    from dpmp.precision import cast_function as cast_function
    from dpmp.precision import cast_tree as cast_tree
    from dpmp.precision import force_full_precision as force_full_precision
    from dpmp.precision import select_tree as select_tree
    from dpmp.precision import update_if_finite as update_if_finite
    from dpmp.precision import value_and_grad as value_and_grad
    from dpmp.step import DataParallelMesh as DataParallelMesh
    from dpmp.step import PrivateStepFn as PrivateStepFn
    from dpmp.step import StepState as StepState
    from dpmp.step import private_step as private_step


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
    "DataParallelMesh",
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
    "PrivateStepFn",
    "PeriodicAction",
    "SampledBatch",
    "ScaledGrad",
    "ShuffledSampler",
    "StaticLossScale",
    "StepEnd",
    "StepState",
    "all_finite",
    "cast_function",
    "cast_tree",
    "force_full_precision",
    "gaussian_privatizer",
    "load_config",
    "init_lora",
    "load_params",
    "export_params",
    "delete_secrets",
    "merge_lora",
    "private_grad",
    "private_optimizer",
    "private_step",
    "snap_grid",
    "snapped_gaussian",
    "train",
    "tune",
    "select_tree",
    "update_if_finite",
    "value_and_grad",
]
