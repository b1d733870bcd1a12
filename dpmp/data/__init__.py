"""Data: datasets in memory, memory-mapped or from random-access sources, the
named sources behind ``data.dataset`` (a registry: ``dpmp.data.sources``),
their preprocessing, and the Poisson and shuffled samplers.
"""

from dpmp.data._dataset import DataError as DataError
from dpmp.data._dataset import Dataset as Dataset
from dpmp.data._dataset import split_positions as split_positions
from dpmp.data._sampling import PoissonSampler as PoissonSampler
from dpmp.data._sampling import SampledBatch as SampledBatch
from dpmp.data._sampling import ShuffledSampler as ShuffledSampler
from dpmp.data.sources import DataSource as DataSource
from dpmp.data.sources import SourceOptions as SourceOptions
from dpmp.data.sources import TextCorpus as TextCorpus
from dpmp.data.sources import load_dataset as load_dataset
from dpmp.data.sources import register_public_text as register_public_text
from dpmp.data.sources import register_source as register_source

__all__ = [
    "DataError",
    "DataSource",
    "Dataset",
    "PoissonSampler",
    "SampledBatch",
    "ShuffledSampler",
    "SourceOptions",
    "TextCorpus",
    "load_dataset",
    "register_public_text",
    "register_source",
    "split_positions",
]
