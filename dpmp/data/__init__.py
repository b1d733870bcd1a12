"""Data: datasets in memory, memory-mapped or from random-access sources, their
preprocessing, and the Poisson and shuffled samplers.
"""

from dpmp.data._dataset import DataError as DataError
from dpmp.data._dataset import Dataset as Dataset
from dpmp.data._sampling import PoissonSampler as PoissonSampler
from dpmp.data._sampling import SampledBatch as SampledBatch
from dpmp.data._sampling import ShuffledSampler as ShuffledSampler

__all__ = [
    "DataError",
    "Dataset",
    "PoissonSampler",
    "SampledBatch",
    "ShuffledSampler",
]
