"""``idx``: a folder of idx files, the format of MNIST, Fashion-MNIST, EMNIST and KMNIST.

``data.path`` is a folder holding one train and one test pair of an images
file (idx3, unsigned bytes) and a labels file (idx1), gzip-compressed or
not, named as their publishers name them: ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
``t10k-labels-idx1-ubyte`` (``test`` for ``t10k`` and a prefix such as
``emnist-balanced-`` are accepted), each optionally ending ``.gz``. The
files' own train/test split is used as it is: it is public and fixed,
never a function of the records. Pixels 0..255 are scaled by that public
range to [0, 1] (float32, ``[n, h, w, 1]``); no statistic of the data is
read. EMNIST stores its images transposed; they are used as stored.
"""

from __future__ import annotations

from pathlib import Path

from dpmp.data._dataset import DataError, Dataset
from dpmp.data._idx import idx_dataset, idx_files
from dpmp.data.sources._base import SourceOptions, register_source

__all__ = ["IdxFolder"]


class IdxFolder:
    """The four idx files of the folder ``options.path``."""

    name = "idx"
    needs_path = True
    task = "classify"

    def load(self, options: SourceOptions) -> Dataset:
        if not options.path:
            raise DataError(f'data.path: required when data.dataset = "{self.name}"')
        folder = Path(options.path)
        return idx_dataset(idx_files(folder), num_classes=None, what=f"{folder.name}/ (idx)")


register_source(IdxFolder())
