"""Built-in model families by name: the registry behind ``model.kind`` (a
``dpmp._registry.Registry``).

Each family is one module that defines it and registers it; a new family is
one more ``register_family`` call (see ``dpmp.models.families._base``). The
import order below is the order the config lists the choices in.
"""

from dpmp.models.families._base import FAMILIES as FAMILIES
from dpmp.models.families._base import Architecture as Architecture
from dpmp.models.families._base import CheckpointFamily as CheckpointFamily
from dpmp.models.families._base import ModelFamily as ModelFamily
from dpmp.models.families._base import build_model as build_model
from dpmp.models.families._base import family_reading as family_reading
from dpmp.models.families._base import register_family as register_family

# Built-in families, registered on import (in the order the config lists them).
from dpmp.models.families import _mlp  # noqa: F401, E402  isort: skip
from dpmp.models.families import _nnx_mlp  # noqa: F401, E402  isort: skip
from dpmp.models.families import _linear  # noqa: F401, E402  isort: skip
from dpmp.models.families import _vit  # noqa: F401, E402  isort: skip
from dpmp.models.families import _cnn  # noqa: F401, E402  isort: skip
from dpmp.models.families import _scatter_linear  # noqa: F401, E402  isort: skip
from dpmp.models.families import _scatter_cnn  # noqa: F401, E402  isort: skip
from dpmp.models.families import _lm  # noqa: F401, E402  isort: skip
from dpmp.models.families import _gpt2  # noqa: F401, E402  isort: skip
from dpmp.models.families import _decoder  # noqa: F401, E402  isort: skip

__all__ = [
    "FAMILIES",
    "Architecture",
    "CheckpointFamily",
    "ModelFamily",
    "build_model",
    "family_reading",
    "register_family",
]
