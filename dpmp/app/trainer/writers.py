"""Where a run's numbers go: public and private metric writers.

Two kinds, apart by type, so that a number cannot leave by the wrong door
(after clu's ``metric_writers``): a ``PublicWriter`` receives only what a run
releases -- epsilon, the loss scale, noised overflow counts, the held-out
evaluation (``dpmp.app.release.public_record``) -- and a ``PrivateWriter`` the
exact statistics of the private data (``release.private_record``: never to be
published)::

    public:   MetricsFile          metrics.jsonl
              Callback(fn)         fn(step, info): the ``train`` callback
    private:  PrivateMetricsFile   private/metrics.jsonl

A new destination is a new writer of the right kind, handed to the loop's
``Log`` action (``dpmp.app.trainer.actions``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from dpmp.app import release
from dpmp.app.run_dir import RunDir

__all__ = ["Callback", "MetricsFile", "PrivateMetricsFile", "PrivateWriter", "PublicWriter"]


class PublicWriter(abc.ABC):
    """Writes a step's public record: released numbers only."""

    @abc.abstractmethod
    def write(self, step: int, record: dict[str, Any]) -> None:
        """Writes ``record`` (``release.public_record``) of the 1-based ``step``."""


class PrivateWriter(abc.ABC):
    """Writes a step's exact statistics of the private data (never published)."""

    @abc.abstractmethod
    def write(self, step: int, record: dict[str, Any]) -> None:
        """Writes ``record`` (``release.private_record``) of the 1-based ``step``."""


class MetricsFile(PublicWriter):
    """One line of ``metrics.jsonl`` in the run directory per record."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.run_dir.append_metrics(record)


class Callback(PublicWriter):
    """``fn(step, info)``, ``info`` the public record less its step
    (``release.public_info``)."""

    def __init__(self, fn: Callable[[int, dict[str, Any]], None]):
        self.fn = fn

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.fn(step, release.public_info(record))


class PrivateMetricsFile(PrivateWriter):
    """One line of ``private/metrics.jsonl`` per record (the file opens with a note
    that it must not be published)."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.run_dir.append_private_metrics(record)
