"""``npy``: a folder of ``x_train.npy``, ``y_train.npy``, ``x_test.npy`` and ``y_test.npy``.

The features are memory-mapped, never read whole, so they may be larger than
memory and of any numeric dtype (batches are cast to float32); the labels
are read whole. Validation and the fingerprint stream over the rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpmp.data._dataset import DataError, Dataset, _assemble, _features
from dpmp.data.sources._base import SourceOptions, register_source

_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


class Npy:
    """The ``.npy`` files of the folder ``options.path``, features memory-mapped."""

    name = "npy"
    needs_path = True
    task = "classify"

    def load(self, options: SourceOptions) -> Dataset:
        if not options.path:
            raise DataError(f'data.path: required when data.dataset = "{self.name}"')
        folder = Path(options.path)
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "no such folder"
            raise DataError(
                f"data.path: {what} {str(folder)!r} (npy data is a folder of .npy files)"
            )
        arrays = {name: _open(folder, name) for name in _ARRAYS}
        x_train = _features("x_train", arrays["x_train"], copy=False)
        x_test = _features("x_test", arrays["x_test"], copy=False)
        description = (
            f"{folder.name}/*.npy (memory-mapped): {len(x_train)} train / {len(x_test)} test "
            f"examples of shape {tuple(x_train.shape[1:])}, {x_train.dtype}"
        )
        return _assemble(x_train, arrays["y_train"], x_test, arrays["y_test"], description)


def _open(folder: Path, name: str) -> np.ndarray:
    """``folder/name.npy``: memory-mapped for features, read whole for labels."""
    file = folder / f"{name}.npy"
    if not file.is_file():
        raise DataError(
            f"{folder}: missing {file.name} (expected x_train, y_train, x_test, y_test .npy)"
        )
    try:
        mode = "r" if name.startswith("x") else None
        return np.load(file, mmap_mode=mode, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{file}: not a readable .npy array of numbers: {e}") from e


register_source(Npy())
