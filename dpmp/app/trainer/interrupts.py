"""Ctrl-C and SIGTERM during a run: the step in progress ends, then the run stops.

``Interrupts`` holds the first signal while the training loop runs (the loop
then saves a checkpoint and raises ``RunInterrupted``, whose message says how to
resume); outside the loop, or at a second signal, it interrupts at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

__all__ = ["Interrupts", "RunInterrupted"]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run between two steps, after saving a checkpoint;
    the message says how to resume, ``signum`` which signal it was."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT):
        super().__init__(message)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """Ctrl-C (SIGINT) or SIGTERM (what SLURM, Kubernetes and ``timeout`` send
    before they kill) during a run. It raises KeyboardInterrupt at once, except
    inside ``held()`` (the loop), where the first is held until the step in
    progress is done, so that the run stops at a whole state; a second interrupts
    at once. Every one is remembered in ``requested``: Python ignores an exception
    raised inside a garbage-collector callback (JAX registers one; it printed
    "Exception ignored in: <function _xla_gc_callback ...>" and the run trained to
    its end), so one swallowed before the loop stops the run before its first
    step, and Python's "Exception ignored" traceback of it is not printed. Only
    in the main thread (elsewhere Python delivers no signal)."""

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGINT  # the first signal received
        self._holding = False
        self._previous = None

    def _handler(self, signum, frame):
        again, self.requested = self.requested, True
        if not again:
            self.signum = signum
        if again or not self._holding:
            stop = KeyboardInterrupt()
            stop.signum = signum  # the command's exit status is 128 + signum
            raise stop

    def _unraisable(self, info):
        if not isinstance(info.exc_value, KeyboardInterrupt):  # remembered in requested
            self._previous_hook(info)

    @contextlib.contextmanager
    def held(self):
        self._holding = True
        try:
            yield self
        finally:
            self._holding = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in _STOP_SIGNALS}
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            for s, previous in self._previous.items():
                signal.signal(s, previous)
            sys.unraisablehook = self._previous_hook
