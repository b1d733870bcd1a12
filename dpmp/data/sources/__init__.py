"""Data sources by name: the registry behind ``data.dataset`` and ``pretrain.dataset``.

Each built-in source is one module that defines it and registers it; a new
source (yours included) is one more ``register_source`` call (see
``dpmp.data.sources._base``). The import order below is the order the
config lists the choices in.
"""

from dpmp.data.sources._base import PUBLIC_TEXT as PUBLIC_TEXT
from dpmp.data.sources._base import SOURCES as SOURCES
from dpmp.data.sources._base import DataSource as DataSource
from dpmp.data.sources._base import SourceOptions as SourceOptions
from dpmp.data.sources._base import TextCorpus as TextCorpus
from dpmp.data.sources._base import TextSource as TextSource
from dpmp.data.sources._base import load_dataset as load_dataset
from dpmp.data.sources._base import register_public_text as register_public_text
from dpmp.data.sources._base import register_source as register_source

# Built-in sources, registered on import (in the order the config lists them).
from dpmp.data.sources import _digits  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _npz  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _npy  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _fashion_mnist  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _idx  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _python_docs  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _python_stdlib  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _text_file  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _chat  # noqa: F401, E402  isort: skip
from dpmp.data.sources import _shakespeare  # noqa: F401, E402  isort: skip

__all__ = [
    "PUBLIC_TEXT",
    "SOURCES",
    "DataSource",
    "SourceOptions",
    "TextCorpus",
    "TextSource",
    "load_dataset",
    "register_public_text",
    "register_source",
]
