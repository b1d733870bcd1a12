"""What a run does between two steps: small periodic actions (after clu's
``periodic_actions``).

After every step the loop hands each action, in this order, the step's
``StepEnd``; an action runs when it is due::

    BudgetStop()                 every step: stop before a step that would
                                 spend more than the target epsilon
    Evaluate(eval_every)         test (public) and train (private) loss and
                                 accuracy; also after the last step
    Log(log_every, public=[MetricsFile], private=[PrivateMetricsFile])
                                 also after every evaluation
    Progress(bar)                every step; drawn at once when logged
    Checkpoint(checkpoint_every) also after the last step
    Log(1, public=[Callback(fn)])  the ``train`` callback, every step

A new action is a ``PeriodicAction`` with its own ``apply``, put in the list
``run_actions`` returns.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dpmp.app import release
from dpmp.app.config import Config
from dpmp.app.run_dir import ProgressBar, RunDir
from dpmp.app.trainer.writers import (
    Callback,
    MetricsFile,
    PrivateMetricsFile,
    PrivateWriter,
    PublicWriter,
)

__all__ = [
    "BudgetStop",
    "Checkpoint",
    "Evaluate",
    "Log",
    "PeriodicAction",
    "Progress",
    "Run",
    "StepEnd",
    "run_actions",
]


class Run(Protocol):
    """What the actions read and change of a run in progress."""

    completed: int  # steps done
    stopped: dict[str, Any] | None  # why the run stops early, or None
    totals: dict[str, Any]  # running totals (exact ones among them)

    def stop_reason(self) -> dict[str, Any] | None: ...
    def evaluate(self) -> dict[str, Any]: ...
    def public_record(self, end: StepEnd) -> dict[str, Any]: ...
    def save(self, *, finished: bool) -> None: ...


@dataclasses.dataclass
class StepEnd:
    """A step just done, as the actions see it (and fill in, in order).

    Attributes:
      step: the 1-based number of the step.
      stats: its exact clipping statistics (``PrivateGradStats``: private).
      epsilon: the epsilon spent after it.
      next_scale: the loss scale of the next step.
      started: ``time.perf_counter()`` when the step started.
      last: no step follows (the planned steps are done, or the budget stops).
      evaluation: the evaluation after it, if one was due.
      logged: whether its metrics were written to the files.
    """

    step: int
    stats: Any
    epsilon: float
    next_scale: float
    started: float
    last: bool = False
    evaluation: dict[str, Any] | None = None
    logged: bool = False
    _public: dict[str, Any] | None = None

    def public(self, run: Run) -> dict[str, Any]:
        """The step's public record (once any evaluation is in)."""
        if self._public is None:
            self._public = run.public_record(self)
        return self._public


class PeriodicAction:
    """Runs ``apply`` after every ``every``-th step (never with ``every`` 0), and
    after the last step too with ``on_last``."""

    def __init__(self, every: int = 1, *, on_last: bool = False):
        self.every, self.on_last = every, on_last

    def due(self, end: StepEnd) -> bool:
        periodic = self.every > 0 and end.step % self.every == 0
        return periodic or (self.on_last and end.last)

    def __call__(self, run: Run, end: StepEnd) -> None:
        if self.due(end):
            self.apply(run, end)

    def apply(self, run: Run, end: StepEnd) -> None:
        raise NotImplementedError


class BudgetStop(PeriodicAction):
    """Stops the run (``run.stopped``) before a step that would exceed the target
    epsilon; marks the step ``last`` when none follows."""

    def __init__(self, steps: int):
        super().__init__(1)
        self.steps = steps

    def apply(self, run: Run, end: StepEnd) -> None:
        run.stopped = run.stop_reason()
        end.last = run.completed >= self.steps or run.stopped is not None


class Evaluate(PeriodicAction):
    """Loss and accuracy on the test split (public) and the training split (private)."""

    def __init__(self, every: int):
        super().__init__(every, on_last=True)

    def apply(self, run: Run, end: StepEnd) -> None:
        end.evaluation = run.evaluate()


class Log(PeriodicAction):
    """The step's public record to the ``public`` writers and its exact statistics
    to the ``private`` ones; due also after every evaluation (always recorded)."""

    def __init__(
        self,
        every: int,
        *,
        public: Sequence[PublicWriter] = (),
        private: Sequence[PrivateWriter] = (),
    ):
        super().__init__(every)
        if not all(isinstance(w, PublicWriter) for w in public):
            raise TypeError("public: PublicWriter instances only (they get released numbers)")
        if not all(isinstance(w, PrivateWriter) for w in private):
            raise TypeError("private: PrivateWriter instances only")
        self.public, self.private = tuple(public), tuple(private)

    def due(self, end: StepEnd) -> bool:
        return super().due(end) or end.evaluation is not None

    def apply(self, run: Run, end: StepEnd) -> None:
        end.logged = True
        for writer in self.public:
            writer.write(end.step, end.public(run))
        if self.private:
            record = release.private_record(
                step=end.step,
                stats=end.stats,
                totals=run.totals,
                step_time_s=time.perf_counter() - end.started,
                evaluation=end.evaluation,
            )
            for writer in self.private:
                writer.write(end.step, record)


class Progress(PeriodicAction):
    """The progress bar's public fields, drawn at once on a logged step."""

    def __init__(self, bar: ProgressBar):
        super().__init__(1)
        self.bar = bar

    def apply(self, run: Run, end: StepEnd) -> None:
        self.bar.update(end.step, release.progress_fields(end.public(run)), force=end.logged)


class Checkpoint(PeriodicAction):
    """A checkpoint of the whole state (secret); also after the last step."""

    def __init__(self, every: int):
        super().__init__(every, on_last=True)

    def apply(self, run: Run, end: StepEnd) -> None:
        run.save(finished=end.last)


def run_actions(
    config: Config,
    run_dir: RunDir,
    bar: ProgressBar,
    callback: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[PeriodicAction]:
    """The actions of a run of ``config``, in the order they run after each step."""
    t = config.training
    actions = [
        BudgetStop(t.steps),
        Evaluate(t.eval_every),
        Log(t.log_every, public=[MetricsFile(run_dir)], private=[PrivateMetricsFile(run_dir)]),
        Progress(bar),
        Checkpoint(t.checkpoint_every),
    ]
    if callback is not None:
        actions.append(Log(1, public=[Callback(callback)]))
    return actions
