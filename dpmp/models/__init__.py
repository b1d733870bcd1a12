"""Models: what the trainer needs of one (``Model``), the built-in families by
name (a registry: ``dpmp.models.families``), adapters for flax linen/nnx,
Equinox and plain-function models, and LoRA adapters.
"""

from dpmp.models._adapters import as_model as as_model
from dpmp.models._lora import init_adapters as init_adapters
from dpmp.models._lora import merge as merge
from dpmp.models._model import Model as Model
from dpmp.models.families import Architecture as Architecture
from dpmp.models.families import ModelFamily as ModelFamily
from dpmp.models.families import build_model as build_model
from dpmp.models.families import register_family as register_family

__all__ = [
    "Architecture",
    "Model",
    "ModelFamily",
    "as_model",
    "build_model",
    "init_adapters",
    "merge",
    "register_family",
]
