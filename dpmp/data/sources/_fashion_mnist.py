"""``fashion_mnist``: Zalando's Fashion-MNIST, from Debian's package ``dataset-fashion-mnist``.

70,000 grey 28 x 28 images of 10 classes of clothing (Xiao, Rasul and
Vollgraf 2017), in the idx files the package installs under
``/usr/share/datasets/fashion-mnist``. The published 60,000 / 10,000
train/test split is used as it is (public and fixed, never a function of the
records); pixels 0..255 are scaled by that public range to [0, 1], float32
``[n, 28, 28, 1]``. Every label must be one of the 10 classes.

Without the package: ``apt-get install dataset-fashion-mnist``, or put the
four files in a folder and set ``data.dataset = "idx"`` with ``data.path``.
"""

from __future__ import annotations

from pathlib import Path

from dpmp.data._dataset import DataError, Dataset
from dpmp.data._idx import idx_dataset
from dpmp.data.sources._base import SourceOptions, register_source

__all__ = ["CLASSES", "FOLDER", "FashionMNIST"]

# Where Debian's dataset-fashion-mnist installs the files.
FOLDER = Path("/usr/share/datasets/fashion-mnist")
CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_FILES = {
    "train images": "train-images-idx3-ubyte.gz",
    "train labels": "train-labels-idx1-ubyte.gz",
    "test images": "t10k-images-idx3-ubyte.gz",
    "test labels": "t10k-labels-idx1-ubyte.gz",
}


class FashionMNIST:
    """Fashion-MNIST from the idx files in ``folder`` (Debian's package by default)."""

    name = "fashion_mnist"
    needs_path = False
    task = "classify"

    def __init__(self, folder: str | Path = FOLDER):
        self.folder = Path(folder)

    def files(self) -> dict[str, Path]:
        """``{role: file}`` of the four files.

        Raises:
          DataError: a file is missing; the message says how to install them.
        """
        files = {role: self.folder / name for role, name in _FILES.items()}
        missing = [f for f in files.values() if not f.is_file()]
        if missing:
            raise DataError(
                f"{missing[0]}: no such file; Fashion-MNIST is not installed: run "
                '`apt-get install dataset-fashion-mnist`, or set data.dataset = "idx" and '
                "data.path to a folder of its four idx files"
            )
        return files

    def load(self, options: SourceOptions) -> Dataset:
        what = f"Fashion-MNIST ({self.folder})"
        return idx_dataset(self.files(), num_classes=len(CLASSES), what=what)


register_source(FashionMNIST())
