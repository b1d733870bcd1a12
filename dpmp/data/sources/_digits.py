"""``digits``: scikit-learn's handwritten digits, shipped with scikit-learn.

1,797 grey 8 x 8 images of 10 classes, ``[n, 8, 8, 1]``. Their pixels are
0..16 by the data set's definition, so ``x / 8 - 1`` maps that public range
to [-1, 1] without reading any statistic of the data. The test split is the
positions a permutation seeded by ``options.seed`` holds out
(``split_positions``), whatever the images and labels.
"""

from __future__ import annotations

import numpy as np

from dpmp.data._dataset import Dataset, _assemble, split_positions
from dpmp.data.sources._base import SourceOptions, register_source


class Digits:
    """scikit-learn's digits, pixels mapped to [-1, 1], split by ``options.seed``."""

    name = "digits"
    needs_path = False
    task = "classify"

    def load(self, options: SourceOptions) -> Dataset:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = digits.images.astype(np.float32)[..., None] / np.float32(8) - np.float32(1)
        y = digits.target.astype(np.int32)
        fraction, seed = options.test_fraction, options.seed
        train, test = split_positions(len(y), fraction, seed)
        description = (
            f"scikit-learn digits: {x.shape[0]} 8x8 grey images, 10 classes, pixels 0..16 "
            f"mapped to [-1, 1]; split test_fraction={fraction}, seed={seed}"
        )
        return _assemble(x[train], y[train], x[test], y[test], description)


register_source(Digits())
