"""The idx format of MNIST, Fashion-MNIST, EMNIST and KMNIST: a reader that checks every field.

An idx file (LeCun et al., "THE MNIST DATABASE of handwritten digits") is::

    byte 0, 1   0, 0                                  magic: two zero bytes
    byte 2      the element type: 0x08 unsigned byte, 0x09 signed byte,
                0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64
    byte 3      the number of dimensions, d
    4 d bytes   each dimension's size, a big-endian unsigned 32-bit integer
    the rest    the elements, big-endian, in C order: exactly the product of
                the sizes times the element's width

optionally gzip-compressed (recognised by gzip's own magic bytes, whatever the
file's name). ``read_idx`` refuses a file that breaks any of this with a
``DataError`` of one line naming the file and the problem; ``read_idx_pair``
reads an images file and a labels file and checks that they agree;
``idx_files`` finds the four files of a folder (train and test, images and
labels) and ``idx_dataset`` makes them a ``Dataset``.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from dpmp.data._dataset import DataError, Dataset, _assemble

__all__ = ["IDX_DTYPES", "idx_dataset", "idx_files", "read_idx", "read_idx_pair"]

# The element types of the format, by their code (byte 2 of the header); big-endian.
IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"

# What each of the four files is called (after an optional prefix, before an optional .gz).
_ROLES = {
    "train images": ("train-images-idx3-ubyte",),
    "train labels": ("train-labels-idx1-ubyte",),
    "test images": ("t10k-images-idx3-ubyte", "test-images-idx3-ubyte"),
    "test labels": ("t10k-labels-idx1-ubyte", "test-labels-idx1-ubyte"),
}


def idx_files(folder: Path) -> dict[str, Path]:
    """``{role: file}`` for the four roles of ``_ROLES`` in ``folder``: exactly one file each.

    Raises:
      DataError: the folder is missing, or a role has no file or several.
    """
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "no such folder"
        raise DataError(f"data.path: {what} {str(folder)!r} (idx data is a folder of idx files)")
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    found = {}
    for role, stems in _ROLES.items():
        matches = [n for n in names if any(_is(n, stem) for stem in stems)]
        if len(matches) != 1:
            wanted = " or ".join(f"[prefix]{s}[.gz]" for s in stems)
            what = "no file" if not matches else f"{len(matches)} files ({', '.join(matches)})"
            raise DataError(
                f"{folder}: {what} for the {role}, named {wanted}; keep one set per folder"
            )
        found[role] = folder / matches[0]
    return found


def _is(name: str, stem: str) -> bool:
    base = name[:-3] if name.endswith(".gz") else name
    return base == stem or base.endswith("-" + stem)


def idx_dataset(files: dict[str, Path], *, num_classes: int | None, what: str) -> Dataset:
    """The ``Dataset`` of the four idx ``files`` (``idx_files``): pixels / 255 as float32
    ``[n, h, w, 1]``, the files' own split; ``what`` opens the description."""
    x_train, y_train = read_idx_pair(
        files["train images"], files["train labels"], num_classes=num_classes
    )
    x_test, y_test = read_idx_pair(
        files["test images"], files["test labels"], num_classes=num_classes
    )
    if x_test.shape[1:] != x_train.shape[1:]:
        raise DataError(
            f"{files['test images']}: images of {x_test.shape[1]}x{x_test.shape[2]}, but the "
            f"training images are {x_train.shape[1]}x{x_train.shape[2]}"
        )
    h, w = x_train.shape[1:]
    description = (
        f"{what}: {len(x_train):,} train / {len(x_test):,} test {h}x{w} grey images, "
        "pixels 0..255 scaled to [0, 1]; the files' own train/test split"
    )
    return _assemble(_scaled(x_train), y_train, _scaled(x_test), y_test, description)


def _scaled(images: np.ndarray) -> np.ndarray:
    """``[n, h, w]`` bytes as float32 ``[n, h, w, 1]`` in [0, 1] (the public range 0..255)."""
    return (images.astype(np.float32) / np.float32(255))[..., None]


def read_idx(file: str | Path, *, ndim: int | None = None) -> np.ndarray:
    """The array of the idx file ``file`` (gzip-compressed or not), in native byte order.

    Args:
      file: the idx file.
      ndim: the number of dimensions the file must have (3 for images, 1 for
        labels), or None for any.

    Raises:
      DataError: the file is missing or unreadable, its magic number, element
        type or number of dimensions is wrong, or it holds fewer or more bytes
        than its header says; one line naming the file.
    """
    file = Path(file)
    raw = _bytes(file)
    if len(raw) < 4:
        raise DataError(f"{file}: truncated: {len(raw)} bytes, shorter than the 4-byte idx magic")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(
            f"{file}: bad magic number 0x{raw[:4].hex()}: not an idx file (it starts 0x0000)"
        )
    code, dims = raw[2], raw[3]
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DataError(f"{file}: unknown idx element type 0x{code:02X} (known: {known})")
    if ndim is not None and dims != ndim:
        raise DataError(f"{file}: {dims} dimensions in its header; expected {ndim}")
    if dims == 0:
        raise DataError(f"{file}: 0 dimensions in its header; an idx array has at least 1")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise DataError(
            f"{file}: truncated: {len(raw)} bytes, shorter than its {header}-byte header"
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=dims, offset=4))
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    found = len(raw) - header
    if found < expected:
        raise DataError(
            f"{file}: truncated: {found:,} bytes of data, its header {shape} needs {expected:,}"
        )
    if found > expected:
        raise DataError(
            f"{file}: {found - expected:,} bytes after the {expected:,} its header {shape} "
            "describes (not one idx array)"
        )
    array = np.frombuffer(raw, dtype, count=expected // dtype.itemsize, offset=header)
    return array.reshape(shape).astype(dtype.newbyteorder("="), copy=False)


def read_idx_pair(
    images_file: str | Path, labels_file: str | Path, *, num_classes: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(images [n, h, w] uint8, labels [n] int32)`` of an images and a labels idx file.

    Args:
      images_file: an idx3 file of unsigned bytes (pixels 0..255).
      labels_file: an idx1 file of integer labels.
      num_classes: K: every label must be in ``0..K-1`` (None: any label >= 0).

    Raises:
      DataError: either file is bad (``read_idx``), the images are not unsigned
        bytes, the labels not integers, their counts differ, or a label is out
        of range; one line naming the file.
    """
    images = read_idx(images_file, ndim=3)
    labels = read_idx(labels_file, ndim=1)
    if images.dtype != np.uint8:
        raise DataError(
            f"{images_file}: pixels of type {images.dtype}; expected unsigned bytes (0x08, "
            "0..255), the public range they are scaled by"
        )
    if labels.dtype.kind not in "iu":
        raise DataError(f"{labels_file}: labels of type {labels.dtype}; expected integers")
    if len(images) != len(labels):
        raise DataError(
            f"{labels_file}: {len(labels):,} labels for the {len(images):,} images of "
            f"{Path(images_file).name}"
        )
    labels = labels.astype(np.int64)
    top = num_classes - 1 if num_classes is not None else None
    bad = (labels < 0) | (labels > top) if top is not None else labels < 0
    if bad.any():
        at = int(np.argmax(bad))
        allowed = f"0..{top}" if top is not None else ">= 0"
        raise DataError(
            f"{labels_file}: label {int(labels[at])} at record {at} is outside {allowed}"
        )
    return images, labels.astype(np.int32)


def _bytes(file: Path) -> bytes:
    """The file's bytes, decompressed when it is gzip (by its magic, not its name)."""
    if not file.is_file():
        raise DataError(f"{file}: no such file")
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise DataError(f"{file}: cannot be read: {e.strerror or e}") from None
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except EOFError:
        raise DataError(f"{file}: truncated gzip stream (the download or copy stopped)") from None
    except (OSError, zlib.error) as e:
        raise DataError(f"{file}: not a readable gzip file: {e}") from None
