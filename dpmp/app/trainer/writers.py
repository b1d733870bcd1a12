"""Where a run's numbers go: public and private metric writers.

Two kinds, apart by type, so that a number cannot leave by the wrong door
(after clu's ``metric_writers``): a ``PublicWriter`` receives only what a run
releases -- epsilon, the loss scale, noised overflow counts, the held-out
evaluation (``dpmp.app.release.public_record``) -- and a ``PrivateWriter`` the
exact statistics of the private data (``release.private_record``: never to be
published)::

    public:   MetricsFile          metrics.jsonl                 training.writers "jsonl"
              TensorBoardWriter    tensorboard/events.out.tfevents.*   "tensorboard"
              Callback(fn)         fn(step, info): the ``train`` callback
    private:  PrivateMetricsFile   private/metrics.jsonl

The run's public writers are the ``training.writers`` named in ``PUBLIC_WRITERS``;
a writer of one's own is handed to a ``Log`` action
(``dpmp.app.trainer.actions``) passed to ``dpmp.train(..., actions=[...])``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dpmp.app import release
from dpmp.app.run_dir import RunDir
from dpmp.app.trainer.mesh import is_primary

__all__ = [
    "PUBLIC_WRITERS",
    "TENSORBOARD_DIR",
    "Callback",
    "MetricsFile",
    "PrivateMetricsFile",
    "PrivateWriter",
    "PublicWriter",
    "TensorBoardWriter",
    "public_writers",
]

# The run directory's folder of TensorBoard event files (public).
TENSORBOARD_DIR = "tensorboard"


class PublicWriter(abc.ABC):
    """Writes a step's public record: released numbers only."""

    @abc.abstractmethod
    def write(self, step: int, record: dict[str, Any]) -> None:
        """Writes ``record`` (``release.public_record``) of the 1-based ``step``."""

    def close(self) -> None:  # noqa: B027 -- a writer with nothing open needs none
        """Called once when the run's loop ends."""


class PrivateWriter(abc.ABC):
    """Writes a step's exact statistics of the private data (never published)."""

    @abc.abstractmethod
    def write(self, step: int, record: dict[str, Any]) -> None:
        """Writes ``record`` (``release.private_record``) of the 1-based ``step``."""

    def close(self) -> None:  # noqa: B027 -- a writer with nothing open needs none
        """Called once when the run's loop ends."""


class MetricsFile(PublicWriter):
    """One line of ``metrics.jsonl`` in the run directory per record."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.run_dir.append_metrics(record)


class TensorBoardWriter(PublicWriter):
    """Each record's numbers as TensorBoard scalars (tag: the record's key, step:
    its step) in ``DIR/events.out.tfevents.<first step>.dpmp``, one file per
    session of the run, written with tensorboardX (no TensorFlow needed).

    The file name holds no time, host or process id, and its events no wall
    time (0): like ``train.log``, a public file carries no timestamp. A run
    started afresh (``first_step`` 1) deletes the event files of the run it
    replaces; a resumed one opens its file with a purge at ``first_step``, so
    TensorBoard drops what an interrupted session wrote past the checkpoint
    (as ``metrics.jsonl`` is truncated there).

    Args:
      folder: the folder of the event files (created if needed).
      first_step: the 1-based step this session starts at.
    """

    def __init__(self, folder: str | Path, first_step: int = 1):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if first_step <= 1:
            for old in self.folder.glob("events.out.tfevents.*"):
                old.unlink()
        self.path = self.folder / f"events.out.tfevents.{first_step:010d}.dpmp"
        self._file = RecordWriter(str(self.path))
        self._emit(Event(step=first_step, wall_time=0.0, file_version="brain.Event:2"))
        if first_step > 1:
            start = SessionLog(status=SessionLog.START)
            self._emit(Event(step=first_step, wall_time=0.0, session_log=start))
        self._file.flush()

    def _emit(self, event) -> None:
        self._file.write(event.SerializeToString())

    def write(self, step: int, record: dict[str, Any]) -> None:
        values = [
            self._summary.Value(tag=key, simple_value=float(value))
            for key, value in record.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
        ]
        summary = self._summary(value=values)
        self._emit(self._event(step=step, wall_time=0.0, summary=summary))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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


def _tensorboard(run_dir: RunDir, first_step: int) -> PublicWriter | None:
    # process 0 writes the run directory of a run of several processes
    return TensorBoardWriter(run_dir.path / TENSORBOARD_DIR, first_step) if is_primary() else None


# ``training.writers`` names: name -> factory(run_dir, first_step) of a PublicWriter (or None).
PUBLIC_WRITERS: dict[str, Callable[[RunDir, int], PublicWriter | None]] = {
    "jsonl": lambda run_dir, first_step: MetricsFile(run_dir),
    "tensorboard": _tensorboard,
}


def public_writers(
    names: Sequence[str], run_dir: RunDir, first_step: int = 1
) -> list[PublicWriter]:
    """The public writers ``training.writers`` names, for a session of the run in
    ``run_dir`` starting at ``first_step``."""
    made = (PUBLIC_WRITERS[name](run_dir, first_step) for name in names)
    return [writer for writer in made if writer is not None]
