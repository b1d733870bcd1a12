"""The run directory: ``metrics.jsonl``, ``train.log`` and ``report.json``.

* ``metrics.jsonl``: one JSON object per logging step, appended and flushed
  (``os.fsync``) as it is written, so a killed run keeps every record up to
  its last logging step. On resume the file is cut back to the records of the
  steps the checkpoint covers (written atomically), so no step appears twice.
* ``train.log``: human-readable lines (calibration, audit verdict, early stop).
* ``report.json``: written once at the end, atomically.

Records hold per-batch statistics of private data (loss, clipped fraction,
exact overflow counts): they are for monitoring, not privatized, and a
report says so.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "METRICS_FILE",
    "REPORT_FILE",
    "LOG_FILE",
    "RunDir",
    "atomic_write_text",
    "read_metrics",
    "to_jsonable",
]

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"
LOG_FILE = "train.log"


def to_jsonable(value: Any) -> Any:
    """numpy/jax scalars and arrays to plain Python; non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, int | np.integer):
        return int(value)
    if hasattr(value, "shape") and getattr(value, "shape", None) != ():
        return to_jsonable(np.asarray(value).tolist())
    if isinstance(value, float | np.floating) or hasattr(value, "dtype"):
        arr = np.asarray(value)
        if arr.dtype.kind in "iu":
            return int(arr)
        if arr.dtype.kind == "b":
            return bool(arr)
        f = float(arr)
        return f if math.isfinite(f) else None
    return value


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Writes ``text`` to a temporary file beside ``path``, fsyncs, renames over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a torn last line, from a crash, is skipped)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    records = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class RunDir:
    """Writes the files of one run under ``path``."""

    def __init__(self, path: str | Path, *, echo: bool = True):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.metrics_path = self.path / METRICS_FILE
        self.report_path = self.path / REPORT_FILE
        self.log_path = self.path / LOG_FILE

    def reset(self) -> None:
        """Starts the run's files afresh (a new run in an existing directory)."""
        for p in (self.metrics_path, self.report_path, self.log_path):
            if p.exists():
                p.unlink()

    def truncate_metrics(self, last_step: int) -> None:
        """Keeps only records of steps ``<= last_step`` (resuming from that step)."""
        records = [r for r in read_metrics(self.metrics_path) if r.get("step", 0) <= last_step]
        text = "".join(json.dumps(r) + "\n" for r in records)
        atomic_write_text(self.metrics_path, text)

    def append_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(to_jsonable(record), allow_nan=False)
        with open(self.metrics_path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log(self, message: str, *, echo: bool | None = None) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(self.log_path, "a") as f:
            f.write(f"{stamp} {message}\n")
        if self.echo if echo is None else echo:
            print(f"dpmp: {message}", file=sys.stderr, flush=True)

    def write_report(self, report: dict[str, Any]) -> None:
        atomic_write_text(
            self.report_path, json.dumps(to_jsonable(report), indent=2, allow_nan=False) + "\n"
        )


class ProgressBar:
    """A one-line progress bar on stderr (``\\r``-redrawn on a terminal).

    Off a terminal (CI logs, pipes) it prints one line every ``line_every``
    updates instead of redrawing, so logs stay readable.
    """

    def __init__(self, total: int, *, enabled: bool = True, stream=None, width: int = 24):
        self.total = max(int(total), 1)
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, step: int, fields: dict[str, str], *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and self.tty and now - self._last_draw < 0.1:
            return
        if not self.tty and not force:
            return
        self._last_draw = now
        done = int(self.width * min(step, self.total) / self.total)
        bar = "#" * done + "." * (self.width - done)
        elapsed = now - self._start
        extra = " ".join(f"{k} {v}" for k, v in fields.items())
        line = f"[{bar}] {step}/{self.total} {extra} {elapsed:.0f}s"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
