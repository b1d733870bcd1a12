"""Feature maps: a fixed function applied to each record alone, once, before training.

A feature map (``data.features``) replaces every example's features, in the
training and the test split, by a fixed function of that example alone: the
scattering transform of an image, say. It reads no other record and no
statistic of the data, so DP-SGD on the mapped data set is DP-SGD on the
records themselves (each record's contribution is still one mapped record):
the map costs no epsilon. A map that looked at other records (a mean, a
PCA basis, a learned encoder trained on the private data) would not be one.

A new map is one file and one registration::

    class Clip:
        name = "clip"

        def describe(self) -> str:
            return "pixels clipped to [0, 0.5]"

        def apply(self, data: Dataset) -> Dataset:
            return dataclasses.replace(
                data, x_train=np.minimum(data.x_train, 0.5), x_test=np.minimum(data.x_test, 0.5)
            )

    register_feature_map(Clip())

Built in: ``"none"`` (the examples as they are) and ``"scattering"`` (the
2-D scattering transform, J = 2, L = 8: Tramer and Boneh's ScatterNet
features; ``dpmp.data._scattering``), computed once and cached on disk.

The cache. Features of the private data are as secret as the data: they are
kept under ``$XDG_CACHE_HOME/dpmp/features`` (``~/.cache/dpmp/features``), a
folder readable by its owner only, in a file named by a digest of the map and
of the data's arrays, so that another data set or map never reads them; nothing
about them is written to a report or a log.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from dpmp._registry import Registry
from dpmp.data._dataset import DataError, Dataset, fingerprint

__all__ = [
    "FEATURE_MAPS",
    "FeatureMap",
    "Identity",
    "ScatteringFeatures",
    "cache_folder",
    "register_feature_map",
]


@runtime_checkable
class FeatureMap(Protocol):
    """A fixed per-record function of the features (module docstring).

    Attributes:
      name: the name it is registered and configured by (``data.features``).
    """

    name: str

    def describe(self) -> str:
        """One line for the data's description (public: no statistic of the data)."""
        ...

    def apply(self, data: Dataset) -> Dataset:
        """``data`` with each example's features (both splits) replaced by the map's.

        Raises:
          DataError: the map does not fit the data (its shape, its task).
        """
        ...


FEATURE_MAPS: Registry[FeatureMap] = Registry("feature map", protocol=FeatureMap)


def register_feature_map(feature_map: FeatureMap, *, replace: bool = False) -> FeatureMap:
    """Makes ``feature_map.name`` a valid ``data.features``; returns it.

    Raises:
      TypeError: it lacks a member of ``FeatureMap`` (named).
      ValueError: the name is taken and ``replace`` is false.
    """
    return FEATURE_MAPS.register(feature_map, replace=replace)


class Identity:
    """The examples as they are."""

    name = "none"

    def describe(self) -> str:
        return "no feature map"

    def apply(self, data: Dataset) -> Dataset:
        return data


def cache_folder() -> Path:
    """Where mapped features are kept: ``$XDG_CACHE_HOME/dpmp/features`` (default
    ``~/.cache/dpmp/features``)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "dpmp" / "features"


class ScatteringFeatures:
    """The scattering transform of each image (``dpmp.data._scattering``), cached.

    Images ``[n, h, w, c]`` become ``[n, h / 2^J, w / 2^J, K c]`` features
    (``K = 81`` for ``J = 2, L = 8``: 7 x 7 x 81 for 28 x 28 grey images).
    The features are computed in chunks of ``chunk`` images, showing progress
    on stderr when there are more than ``chunk``, written to a memory-mapped
    ``.npy`` file in ``cache_folder()`` and read from there by later runs.

    Privacy: a fixed function of each image alone (no other record, no
    statistic), so training on the features spends no more epsilon than
    training on the images.
    """

    name = "scattering"
    version = 1  # of the implementation: a change that moves the features bumps it

    def __init__(self, *, J: int = 2, L: int = 8, chunk: int = 512):
        self.J, self.L, self.chunk = J, L, chunk

    def describe(self) -> str:
        return (
            f"scattering features (J = {self.J}, L = {self.L}, kymatio's Morlet filters), "
            "each computed from its image alone"
        )

    def apply(self, data: Dataset, *, progress: Callable[..., None] | None = None) -> Dataset:
        """The features of both splits (computed or read from the cache).

        Args:
          data: images ``[n, h, w, c]``, h and w divisible by ``2^J``.
          progress: called as ``progress(done, offset=, total=)`` after each chunk
            (``offset + done`` of ``total`` images mapped); default: a line on stderr.
        """
        from dpmp.data._scattering import Scattering2D

        shape = tuple(data.input_shape)
        side = 2**self.J
        if data.task != "classify" or len(shape) != 3 or shape[0] % side or shape[1] % side:
            raise DataError(
                f'data.features: "scattering" needs images [n, h, w, c] with h and w divisible '
                f"by 2^J = {side}; the data has {data.task} examples of shape {shape}"
            )
        transform = Scattering2D(J=self.J, L=self.L, shape=shape[:2])
        folder = cache_folder()
        key = hashlib.sha256(
            f"{self.name}:v{self.version}:J={self.J}:L={self.L}:{fingerprint(data)}".encode()
        ).hexdigest()[:32]
        total = data.num_train + data.num_test
        if progress is None:  # shown when there is more than one chunk to compute
            silent = total <= self.chunk
            what = f"scattering features (J = {self.J}, L = {self.L}) of {total:,} images"
            progress = _Progress(what, silent=silent)
        mapped = {}
        for split, offset in (("train", 0), ("test", data.num_train)):
            x = getattr(data, f"x_{split}")
            file = folder / f"scattering-{key}-{split}.npy"
            expected = (len(x), *transform.output_shape(int(shape[-1])))
            mapped[split] = _cached(file, expected)
            if mapped[split] is None:
                done = functools.partial(progress, offset=offset, total=total)
                _compute(transform, x, file, self.chunk, done)
                mapped[split] = np.load(file, mmap_mode="r")
        return dataclasses.replace(
            data,
            x_train=mapped["train"],
            x_test=mapped["test"],
            input_shape=tuple(int(d) for d in mapped["train"].shape[1:]),
            description=f"{data.description}; {self.describe()}, {_shape(mapped['train'])}",
        )


def _shape(x: np.ndarray) -> str:
    return "x".join(str(d) for d in x.shape[1:]) + " per example"


def _cached(file: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """The features cached in ``file`` (memory-mapped), or None when there are none or
    they are unreadable or of another shape (then they are computed again)."""
    if not file.is_file():
        return None
    try:
        x = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return x if x.shape == shape and x.dtype == np.float32 else None


def _compute(transform, x, file: Path, chunk: int, progress: Callable[[int], None]) -> None:
    """Writes ``transform`` of the rows of ``x`` to the ``.npy`` ``file`` (through a
    temporary file renamed at the end: a stopped run leaves no partial cache)."""
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    n = len(x)
    out_shape = (n, *transform.output_shape(int(x.shape[-1])))
    partial = file.with_name(f".{file.name}.{os.getpid()}.partial")
    out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=out_shape)
    try:
        for start in range(0, n, chunk):
            rows = np.asarray(x[start : start + chunk], np.float32)
            padded = np.zeros((chunk, *rows.shape[1:]), np.float32)  # one compiled shape
            padded[: len(rows)] = rows
            out[start : start + len(rows)] = np.asarray(transform(padded))[: len(rows)]
            progress(start + len(rows))
        out.flush()
        del out
        os.replace(partial, file)
    finally:
        partial.unlink(missing_ok=True)


class _Progress:
    """A line on stderr: images done and time left (redrawn on a terminal, else every
    10%)."""

    def __init__(self, what: str, *, silent: bool = False):
        self.what, self.silent, self.start, self.shown = what, silent, time.monotonic(), -1

    def __call__(self, done: int, *, offset: int = 0, total: int) -> None:
        if self.silent:
            return
        done += offset
        tty = sys.stderr.isatty()
        tenth = 10 * done // max(total, 1)
        if not tty and tenth == self.shown:
            return
        self.shown = tenth
        elapsed = time.monotonic() - self.start
        left = elapsed * (total - done) / max(done, 1)
        line = f"{self.what}: {done:,} done ({100 * done // total}%), {left:.0f} s left"
        end = "\n" if not tty or done >= total else ""
        print(("\r" if tty else "") + line, end=end, file=sys.stderr, flush=True)


register_feature_map(Identity())
register_feature_map(ScatteringFeatures())
