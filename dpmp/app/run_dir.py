"""The run directory: public files, the ``private/`` folder, and how they are written.

Public (what ``dpmp.app.release`` decides may be published):

* ``metrics.jsonl``: one JSON object per logging step, appended and flushed
  (``os.fsync``) as it is written, so a killed run keeps every record up to
  its last logging step. On resume the file is cut back to the records of the
  steps the checkpoint covers (written atomically), so no step appears twice.
* ``train.log``: human-readable lines (calibration, audit verdict, early stop),
  without timestamps (how long a run takes is not a public number).
* ``report.json``: written once at the end, atomically.

Private (``private/``, "non-private diagnostics: do not publish"):

* ``private/metrics.jsonl``: exact per-batch statistics; its first line is a
  record that says so; appended and cut back on resume like ``metrics.jsonl``;
* ``private/diagnostics.json``: the run's exact totals and timings;
* ``private/README.txt``: what the folder holds and why it stays private.

The ``private/`` folder is created 0700 and its files 0600 (readable by
their owner only), as are ``checkpoints/`` and its files (``secret_dir``).

One writer at a time: ``locked(path)`` holds an exclusive ``flock`` on
``path/.lock`` while a run writes there (POSIX; elsewhere no lock is taken),
and a second run in the same directory is refused before it changes
anything. The lock file is removed when the run lets go of it (a run
directory keeps no ``.lock`` to publish or forget). A ``report.json`` that
dpmp did not write is never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: runs are not locked
    fcntl = None

__all__ = [
    "METRICS_FILE",
    "REPORT_FILE",
    "LOG_FILE",
    "RunDir",
    "RunDirError",
    "SilentRunDir",
    "locked",
    "secret_dir",
    "atomic_write_text",
    "read_metrics",
    "to_jsonable",
]

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"
LOG_FILE = "train.log"
PRIVATE_DIR = "private"
DIAGNOSTICS_FILE = "diagnostics.json"
PRIVATE_README_FILE = "README.txt"
PRIVATE_NOTE = "non-private diagnostics: do not publish"


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


def _create(path: Path, flags: int, secret: bool) -> int:
    """Opens ``path`` for writing; ``secret``: readable by its owner only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600 if secret else 0o666)
    if secret and hasattr(os, "fchmod"):
        os.fchmod(fd, 0o600)  # a file that existed keeps its mode otherwise
    return fd


@contextlib.contextmanager
def naming(path: Path, what: str = "", tmp: Path | None = None) -> Iterator[None]:
    """An ``OSError`` while writing ``path`` (a full disk: ``[Errno 28]`` names no
    file) is raised again naming it; ``tmp``, a half-written file, is removed."""
    try:
        yield
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        error = OSError(f"{path}: cannot write {what or 'the file'}: {e.strerror or e}")
        error.errno = e.errno
        raise error from e


def secret_dir(path: str | Path) -> Path:
    """``path`` created if needed, readable by its owner only (0700)."""
    path = Path(path)
    with naming(path, "the owner-only folder"):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)  # an older folder, or one made under a loose umask
    return path


def atomic_write_text(path: str | Path, text: str, *, secret: bool = False) -> None:
    """Writes ``text`` to a temporary file beside ``path``, fsyncs, renames over it
    (``secret``: the file is 0600)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with naming(path, tmp=tmp):
        with os.fdopen(_create(tmp, os.O_TRUNC, secret), "w") as f:
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
    records: list[dict[str, Any]] = []
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


def _append_line(path: Path, record: dict[str, Any], *, secret: bool = False) -> None:
    line = json.dumps(to_jsonable(record), allow_nan=False)
    # a torn last line (a full disk) is skipped by read_metrics and dropped on resume
    with naming(path), os.fdopen(_create(path, os.O_APPEND, secret), "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _truncate(path: Path, last_step: int, *, secret: bool = False) -> None:
    """Keeps the records of steps ``<= last_step`` (and any record without a step)."""
    records = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records), secret=secret)


def _json_text(value: dict[str, Any]) -> str:
    return json.dumps(to_jsonable(value), indent=2, allow_nan=False) + "\n"


class RunDirError(ValueError):
    """The run directory cannot be written: another run holds it, or it holds
    files that are not dpmp's."""


LOCK_FILE = ".lock"


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[Path]:
    """Holds ``path`` (created if needed) for one writer; checks it holds no
    foreign ``report.json``.

    Raises:
      RunDirError: another process holds the lock, or ``path/report.json`` is
        not a dpmp report.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{path}: exists and is not a directory")
    created = not path.exists()
    lock = path / LOCK_FILE
    with naming(path, "the run directory"):  # read-only: one line naming it
        path.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a+")
    with handle:
        if fcntl is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                raise RunDirError(
                    f"{path}: another dpmp run (pid {holder}) is writing here; wait for it "
                    "to end or use another run directory"
                ) from None
            if not _same_file(handle, lock):  # the holder removed it as we opened it
                fcntl.flock(handle, fcntl.LOCK_UN)
                raise RunDirError(f"{path}: another dpmp run was just writing here; start again")
        try:
            _check_report(path / REPORT_FILE)
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
            yield path
        finally:
            if created:  # no folder is left holding only the lock (an error, Ctrl-C)
                _remove_if_only_lock(path)
            if fcntl is not None:
                lock.unlink(missing_ok=True)  # while held: no run directory keeps a .lock
                fcntl.flock(handle, fcntl.LOCK_UN)


def _same_file(handle, path: Path) -> bool:
    """Whether the open ``handle`` is still the file at ``path``."""
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _remove_if_only_lock(path: Path) -> None:
    """Removes ``path`` if it holds nothing but the lock (a run that wrote nothing)."""
    with contextlib.suppress(OSError):
        if [p.name for p in path.iterdir()] == [LOCK_FILE]:
            (path / LOCK_FILE).unlink()
            path.rmdir()


def _check_report(report: Path) -> None:
    """A ``report.json`` there must be one dpmp wrote (a run's own is replaced)."""
    if not report.exists():
        return
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
        ours = isinstance(data, dict) and "dpmp" in (data.get("versions") or {})
    except (OSError, ValueError):  # unreadable or not JSON: not ours
        ours = False
    if not ours:
        raise RunDirError(
            f"{report}: not a dpmp report; refusing to overwrite it: use another run directory"
        )


class RunDir:
    """Writes the files of one run under ``path``.

    Args:
      path: the run directory (created if needed).
      echo: echo log lines on stderr.
      private_note: the label every private file carries (its first line or key).
      private_readme: the text of ``private/README.txt``.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        echo: bool = True,
        private_note: str = PRIVATE_NOTE,
        private_readme: str = "",
    ):
        self.path = Path(path)
        with naming(self.path, "the run directory"):
            self.path.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.metrics_path = self.path / METRICS_FILE
        self.report_path = self.path / REPORT_FILE
        self.log_path = self.path / LOG_FILE
        self.private_path = self.path / PRIVATE_DIR
        self.private_metrics_path = self.private_path / METRICS_FILE
        self.diagnostics_path = self.private_path / DIAGNOSTICS_FILE
        self.private_note = private_note
        self.private_readme = private_readme or private_note + "\n"

    def reset(self) -> None:
        """Starts the run's files afresh (a new run in an existing directory)."""
        for p in (
            self.metrics_path,
            self.report_path,
            self.log_path,
            self.private_metrics_path,
            self.diagnostics_path,
        ):
            if p.exists():
                p.unlink()

    def truncate_metrics(self, last_step: int) -> None:
        """Keeps only records of steps ``<= last_step`` (resuming from that step)."""
        _truncate(self.metrics_path, last_step)
        if self.private_metrics_path.exists():
            _truncate(self.private_metrics_path, last_step, secret=True)

    def append_metrics(self, record: dict[str, Any]) -> None:
        """A record of public numbers to ``metrics.jsonl``."""
        _append_line(self.metrics_path, record)

    def _private_folder(self) -> None:
        secret_dir(self.private_path)
        readme = self.private_path / PRIVATE_README_FILE
        if not readme.exists() or readme.read_text() != self.private_readme:
            atomic_write_text(readme, self.private_readme, secret=True)

    def append_private_metrics(self, record: dict[str, Any]) -> None:
        """A record of exact training statistics to ``private/metrics.jsonl``; the
        file's first line is ``{"_note": private_note}``."""
        self._private_folder()
        if not self.private_metrics_path.exists():
            _append_line(self.private_metrics_path, {"_note": self.private_note}, secret=True)
        _append_line(self.private_metrics_path, record, secret=True)

    def write_private_diagnostics(self, diagnostics: dict[str, Any]) -> None:
        """``private/diagnostics.json`` (atomically), with ``_note`` first."""
        self._private_folder()
        atomic_write_text(
            self.diagnostics_path,
            _json_text({"_note": self.private_note, **diagnostics}),
            secret=True,
        )

    def log(self, message: str, *, echo: bool | None = None) -> None:
        """A line of ``train.log`` (public: no timestamp), echoed on stderr."""
        with naming(self.log_path), open(self.log_path, "a") as f:
            f.write(f"{message}\n")
        if self.echo if echo is None else echo:
            print(f"dpmp: {message}", file=sys.stderr, flush=True)

    def write_report(self, report: dict[str, Any]) -> None:
        atomic_write_text(self.report_path, _json_text(report))


class ProgressBar:
    """A one-line progress bar on stderr (``\\r``-redrawn on a terminal).

    Off a terminal (CI logs, pipes) it prints a line only on forced updates
    instead of redrawing, so logs stay readable. It shows the step and the
    fields it is given (the trainer gives public numbers only), then the speed
    since it started and the time left. Those are public: a private step's work
    is fixed by shapes (Poisson batches padded to one size, noise drawn in a
    fixed number of pieces, no branch on a value; XLA flushes subnormals), so
    its time depends on the machine and its load, not on the records; whoever
    can watch the process can time it anyway (``docs/privacy.md``, threat model).
    """

    def __init__(self, total: int, *, enabled: bool = True, stream=None, width: int = 24):
        self.total = max(int(total), 1)
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_draw = 0.0
        self._start: tuple[int, float] | None = None  # (step, time) of the first update

    def update(self, step: int, fields: dict[str, str], *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = (step, now)
        if not force and self.tty and now - self._last_draw < 0.1:
            return
        if not self.tty and not force:
            return
        self._last_draw = now
        done = int(self.width * min(step, self.total) / self.total)
        bar = "#" * done + "." * (self.width - done)
        extra = " ".join(f"{k} {v}" for k, v in fields.items())
        line = f"[{bar}] {step}/{self.total} {extra}{self._timing(step, now)}"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _timing(self, step: int, now: float) -> str:
        """`` [12.5 steps/s, ETA 0:24]`` once a step has been timed."""
        first_step, first_time = self._start or (step, now)
        if step <= first_step or now <= first_time:
            return ""
        rate = (step - first_step) / (now - first_time)
        left = max(self.total - step, 0) / rate
        minutes, seconds = divmod(round(left), 60)
        return f" [{rate:.3g} steps/s, ETA {minutes}:{seconds:02d}]"

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class SilentRunDir(RunDir):
    """The run directory as a process other than process 0 of a multi-process run
    sees it: it reads the checkpoints process 0 writes and writes nothing."""

    def __init__(self, path: str | Path, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.echo = False

    def reset(self) -> None:
        pass

    def truncate_metrics(self, last_step: int) -> None:
        pass

    def append_metrics(self, record: dict[str, Any]) -> None:
        pass

    def append_private_metrics(self, record: dict[str, Any]) -> None:
        pass

    def write_private_diagnostics(self, diagnostics: dict[str, Any]) -> None:
        pass

    def log(self, message: str, *, echo: bool | None = None) -> None:
        pass

    def write_report(self, report: dict[str, Any]) -> None:
        pass
