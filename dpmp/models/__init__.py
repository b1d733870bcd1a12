"""Models: the built-in families, adapters for flax linen/nnx, Equinox and
plain-function models, and LoRA adapters.
"""

from dpmp.models._adapters import as_model as as_model
from dpmp.models._lora import init_adapters as init_adapters
from dpmp.models._lora import merge as merge

__all__ = [
    "as_model",
    "init_adapters",
    "merge",
]
