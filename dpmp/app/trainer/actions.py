"""What a run does between two steps: periodic actions (after clu's
``periodic_actions``).

After every step the loop makes a ``StepEnd`` and calls every action with it;
an action runs when it is due (``every_steps``, ``every_secs``, the last step)
and returns its output. The run's own actions::

    Evaluate(evaluate, every_steps=eval_every)   "evaluation": held-out (public) and
                                                 training-split (private) loss and
                                                 accuracy; also after the last step
    Log(every_steps=log_every, public=[MetricsFile, ...], private=[PrivateMetricsFile],
        name="metrics")                          "metrics": the public record written;
                                                 also on every evaluated step
    Progress(bar)                                every step; drawn at once when logged
    Checkpoint(save, every_steps=checkpoint_every)  also after the last step

then the ``train`` callback (a ``Log`` to ``Callback(fn)`` every step) and the
user's (``dpmp.train(..., actions=[...])``). The budget stop is not an action:
the loop itself refuses a step past the target epsilon and marks the step
before it ``last``.

Outputs are the one channel between actions. An action with a ``name`` hands
its output (when it ran and returned one) to the actions that list that name
in ``reads``; ``order`` puts every producer before its readers, so the order
of the list does not matter (``Log`` reads the evaluation; ``Progress`` reads
the evaluation and the record ``Log`` wrote; ``Checkpoint`` reads the
evaluation, which the checkpoint keeps).

What an action may read: the ``StepEnd`` (the step number, whether it is the
last, the time, the step's released numbers, the parameters: all public under
differential privacy) and the public part of the outputs it reads
(``PeriodicAction.public``: of an evaluation, the held-out metrics). Exact
statistics of the private data reach only an action whose ``reads_private`` is
true (the labelled private channel: ``Log`` with private writers): it gets a
``PrivateStepEnd`` and the whole outputs (the training-split metrics too).

A new action is a ``PeriodicAction`` subclass with its ``_apply``, passed to
``dpmp.train(..., actions=[...])``.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from dpmp.app import release
from dpmp.app.config import Config
from dpmp.app.run_dir import ProgressBar, RunDir
from dpmp.app.trainer.writers import (
    Callback,
    PrivateMetricsFile,
    PrivateWriter,
    PublicWriter,
    public_writers,
)

__all__ = [
    "BUILT_IN_OUTPUTS",
    "Actions",
    "Checkpoint",
    "Evaluate",
    "Log",
    "PeriodicAction",
    "PrivateStepEnd",
    "Progress",
    "StepEnd",
    "extra_actions",
    "order",
    "run_actions",
]

# The held-out metrics of an evaluation: what of it is public.
PUBLIC_EVALUATION = ("test_accuracy", "test_loss")
# The names the run's own actions give their outputs.
BUILT_IN_OUTPUTS = ("evaluation", "metrics")

_NONE: Mapping[str, Any] = MappingProxyType({})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepEnd:
    """A step just done, as every action sees it: public numbers only.

    Attributes:
      step: the 1-based number of the step.
      last: no step follows (the planned steps are done, or the next one would
        spend more than the target epsilon).
      time: ``time.monotonic()`` when the step was done (``every_secs`` counts it).
      released: the step's released numbers (``release.public_record`` without
        an evaluation): ``epsilon``, ``delta``, ``loss_scale``,
        ``next_loss_scale``, ``loss_scale_changes``, with a private dynamic loss
        scale ``noised_overflow`` and ``noised_overflow_total``.
      params: the parameters after the step (the adapters, with LoRA), on the
        mesh if there is one. A step that donates its state (the trainer's)
        writes the next parameters into their buffers: copy what you keep
        (``jax.device_get``).
    """

    step: int
    last: bool
    time: float
    released: Mapping[str, Any]
    params: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivateStepEnd(StepEnd):
    """A ``StepEnd`` with the step's exact statistics of the private data (NOT
    private: only actions with ``reads_private`` get it).

    Attributes:
      stats: the step's exact clipping statistics (``PrivateGradStats``).
      totals: the run's running totals, exact ones among them.
      started: ``time.perf_counter()`` when the step started.
    """

    stats: Any
    totals: Mapping[str, Any]
    started: float

    def public_view(self) -> StepEnd:
        """This step as actions without ``reads_private`` see it."""
        fields = (f.name for f in dataclasses.fields(StepEnd))
        return StepEnd(**{name: getattr(self, name) for name in fields})


class PeriodicAction(abc.ABC):
    """Something done between steps, when it is due; ``_apply`` returns its output.

    It runs after a step whose number ``every_steps`` divides, once ``every_secs``
    seconds have passed since it last ran (or since the first step it saw), and
    with ``on_last`` after the last step; any of them may be given. A subclass
    may widen ``due``.

    Class attributes a subclass may set:
      name: its output is handed under this name to the actions that read it
        (None: to none).
      reads: the names of the outputs it reads; the actions making them run
        first (``order``), and it gets those that were made this step.
      reads_private: it gets a ``PrivateStepEnd`` and the whole outputs it
        reads, exact statistics of the private data among them; what it does
        with them must not be published.

    Args:
      every_steps: run after every step this number divides (None or 0: never
        by steps).
      every_secs: run once this many seconds have passed since it last ran.
      on_last: run after the last step too.
    """

    name: str | None = None
    reads: tuple[str, ...] = ()
    reads_private: bool = False

    def __init__(
        self,
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
        on_last: bool = False,
    ):
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 0):
            raise ValueError(f"every_steps: an integer >= 0 or None, got {every_steps!r}")
        if every_secs is not None and not every_secs > 0:
            raise ValueError(f"every_secs: a number of seconds > 0 or None, got {every_secs!r}")
        self.every_steps, self.every_secs, self.on_last = every_steps, every_secs, on_last
        self._ran_at: float | None = None  # when it last ran, or the first step it saw

    def due(self, end: StepEnd, outputs: Mapping[str, Any]) -> bool:
        """Whether it runs after ``end`` (``outputs``: the ones it reads, made this step)."""
        if self.every_steps and end.step % self.every_steps == 0:
            return True
        if self.every_secs is not None and self._ran_at is not None:
            if end.time - self._ran_at >= self.every_secs:
                return True
        return self.on_last and end.last

    def __call__(self, end: StepEnd, outputs: Mapping[str, Any] = _NONE) -> Any:
        """Runs it if it is due; returns its output (None when it did not run)."""
        if self._ran_at is None:
            self._ran_at = end.time
        if not self.due(end, outputs):
            return None
        output = self._apply(end, outputs)
        self._ran_at = end.time
        return output

    @abc.abstractmethod
    def _apply(self, end: StepEnd, outputs: Mapping[str, Any]) -> Any:
        """Does the action after ``end``; returns its output (or None)."""

    def public(self, output: Any) -> Any:
        """What actions without ``reads_private`` see of ``output`` (all of it, unless
        a subclass whose output holds exact statistics says otherwise)."""
        return output

    def close(self) -> None:  # noqa: B027 -- an action with nothing to close needs none
        """Called once when the loop ends (files to close)."""


def _test_metrics(evaluation: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: evaluation[k] for k in PUBLIC_EVALUATION} if evaluation else {}


class Evaluate(PeriodicAction):
    """Loss and accuracy on the held-out split (public) and the training split
    (private); also after the last step. Its output, ``"evaluation"``, is the dict
    ``evaluate()`` returns; actions without ``reads_private`` see its held-out
    metrics only (``test_accuracy``, ``test_loss``)."""

    name = "evaluation"

    def __init__(
        self,
        evaluate: Callable[[], dict[str, Any]],
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
    ):
        super().__init__(every_steps=every_steps, every_secs=every_secs, on_last=True)
        self.evaluate = evaluate

    def _apply(self, end: StepEnd, outputs: Mapping[str, Any]) -> dict[str, Any]:
        return self.evaluate()

    def public(self, output: dict[str, Any]) -> dict[str, Any]:
        return _test_metrics(output)


class Log(PeriodicAction):
    """The step's public record (its released numbers and held-out evaluation) to
    the ``public`` writers, its exact statistics to the ``private`` ones; due also
    on every evaluated step (always recorded). Its output is the public record."""

    reads = ("evaluation",)

    def __init__(
        self,
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
        public: Sequence[PublicWriter] = (),
        private: Sequence[PrivateWriter] = (),
        name: str | None = None,
    ):
        super().__init__(every_steps=every_steps, every_secs=every_secs)
        if not all(isinstance(w, PublicWriter) for w in public):
            raise TypeError("public: PublicWriter instances only (they get released numbers)")
        if not all(isinstance(w, PrivateWriter) for w in private):
            raise TypeError("private: PrivateWriter instances only")
        self.public_writers, self.private_writers = tuple(public), tuple(private)
        self.name = name
        self.reads_private = bool(private)  # exact statistics go to its private writers

    def due(self, end: StepEnd, outputs: Mapping[str, Any]) -> bool:
        return super().due(end, outputs) or "evaluation" in outputs

    def _apply(self, end: StepEnd, outputs: Mapping[str, Any]) -> dict[str, Any]:
        evaluation = outputs.get("evaluation")
        record = {**end.released, **_test_metrics(evaluation)}
        for writer in self.public_writers:
            writer.write(end.step, record)
        if self.private_writers:
            private = release.private_record(
                step=end.step,
                stats=end.stats,
                totals=end.totals,
                step_time_s=time.perf_counter() - end.started,
                evaluation=evaluation,
            )
            for writer in self.private_writers:
                writer.write(end.step, private)
        return record

    def close(self) -> None:
        for writer in (*self.public_writers, *self.private_writers):
            writer.close()


class Progress(PeriodicAction):
    """The progress bar's public fields, every step; drawn at once on a logged step."""

    reads = ("evaluation", "metrics")

    def __init__(self, bar: ProgressBar):
        super().__init__(every_steps=1)
        self.bar = bar

    def _apply(self, end: StepEnd, outputs: Mapping[str, Any]) -> None:
        logged = "metrics" in outputs
        record = outputs["metrics"] if logged else {**end.released, **outputs.get("evaluation", {})}
        self.bar.update(end.step, release.progress_fields(record), force=logged)


class Checkpoint(PeriodicAction):
    """A checkpoint of the whole state (secret); also after the last step. It reads
    the evaluation because the checkpoint keeps the run's last one."""

    reads = ("evaluation",)

    def __init__(
        self,
        save: Callable[..., None],
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
    ):
        super().__init__(every_steps=every_steps, every_secs=every_secs, on_last=True)
        self.save = save

    def _apply(self, end: StepEnd, outputs: Mapping[str, Any]) -> None:
        self.save(finished=end.last)


def order(actions: Iterable[PeriodicAction]) -> list[PeriodicAction]:
    """``actions`` with every producer of an output before the actions that read it
    (otherwise in the order given); two producers of one name, or actions that
    read each other's outputs, are a ``ValueError``."""
    actions = list(actions)
    makers: dict[str, PeriodicAction] = {}
    for action in actions:
        if not isinstance(action, PeriodicAction):
            raise TypeError(f"actions: PeriodicAction instances only, got {action!r}")
        if action.name is not None:
            if action.name in makers:
                raise ValueError(f"actions: two actions output {action.name!r}")
            makers[action.name] = action
    done: list[PeriodicAction] = []
    waiting = actions
    while waiting:
        ready = [
            a
            for a in waiting
            if all(makers.get(n) is None or makers[n] in done or makers[n] is a for n in a.reads)
        ]
        if not ready:
            names = ", ".join(type(a).__name__ for a in waiting)
            raise ValueError(f"actions: {names} read each other's outputs (a cycle)")
        done += ready
        waiting = [a for a in waiting if a not in ready]
    return done


class Actions:
    """The actions of a run, in ``order``; calling it runs them after a step and
    returns the outputs made, by name."""

    def __init__(self, actions: Iterable[PeriodicAction]):
        self.actions = order(actions)

    def __call__(self, end: PrivateStepEnd) -> dict[str, Any]:
        public_end = end.public_view()
        outputs: dict[str, Any] = {}
        public: dict[str, Any] = {}
        for action in self.actions:
            seen = outputs if action.reads_private else public
            given = MappingProxyType({n: seen[n] for n in action.reads if n in seen})
            output = action(end if action.reads_private else public_end, given)
            if output is not None and action.name is not None:
                outputs[action.name] = output
                public[action.name] = action.public(output)
        return outputs

    def close(self) -> None:
        for action in self.actions:
            action.close()


def extra_actions(
    actions: Sequence[PeriodicAction], callback: Callable[[int, dict[str, Any]], None] | None
) -> list[PeriodicAction]:
    """The caller's ``actions`` of a run, with its ``callback`` as a ``Log`` to it
    every step: a ``TypeError`` for one that is not a ``PeriodicAction``, a
    ``ValueError`` for outputs that clash with the run's own or one another's."""
    actions = order(actions)  # the types, the names and the dependencies checked
    clash = [a.name for a in actions if a.name in BUILT_IN_OUTPUTS]
    if clash:
        raise ValueError(f"actions: {clash[0]!r} is the output of one of the run's own actions")
    if callback is not None:
        actions.append(Log(every_steps=1, public=[Callback(callback)]))
    return actions


def run_actions(
    config: Config,
    run_dir: RunDir,
    bar: ProgressBar,
    evaluate: Callable[[], dict[str, Any]],
    save: Callable[..., None],
    completed: int = 0,
) -> list[PeriodicAction]:
    """The run's own actions for ``config`` (``evaluate``: the run's evaluation;
    ``save``: its checkpoint; ``completed``: the steps done before this session)."""
    t = config.training
    return [
        Evaluate(evaluate, every_steps=t.eval_every),
        Log(
            every_steps=t.log_every,
            public=public_writers(t.writers, run_dir, completed + 1),
            private=[PrivateMetricsFile(run_dir)],
            name="metrics",
        ),
        Progress(bar),
        Checkpoint(save, every_steps=t.checkpoint_every),
    ]
