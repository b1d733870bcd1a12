"""The trainer's periodic actions and metric writers (``dpmp.app.trainer.actions``).

A fake run of 7 steps checks when each action runs (evaluation every 3 steps
and after the last, logs on their period and on every evaluation, checkpoints on
their period and after the last, the budget stop ending the run early), and
that a private writer cannot be handed public records or the other way round.
"""

import pytest

from dpmp.app.trainer.actions import BudgetStop, Checkpoint, Evaluate, Log, StepEnd
from dpmp.app.trainer.writers import PrivateWriter, PublicWriter


class _Public(PublicWriter):
    def __init__(self):
        self.steps = []

    def write(self, step, record):
        self.steps.append((step, dict(record)))


class _Private(PrivateWriter):
    def write(self, step, record):
        raise AssertionError("not reached")


class _FakeRun:
    """A run that stops early, by budget, after ``stop_after`` steps."""

    def __init__(self, stop_after):
        self.completed, self.stopped, self.totals = 0, None, {}
        self.stop_after, self.evaluated, self.saved = stop_after, [], []

    def stop_reason(self):
        return {"step": self.completed} if self.completed >= self.stop_after else None

    def evaluate(self):
        self.evaluated.append(self.completed)
        return {"step": self.completed, "test_accuracy": 0.5}

    def public_record(self, end):
        return {"step": end.step, "epsilon": end.epsilon, **(end.evaluation or {})}

    def save(self, *, finished):
        self.saved.append((self.completed, finished))


def _run(steps, stop_after):
    run, public = _FakeRun(stop_after), _Public()
    actions = [BudgetStop(steps), Evaluate(3), Log(2, public=[public]), Checkpoint(5)]
    while run.completed < steps and run.stopped is None:
        run.completed += 1
        end = StepEnd(run.completed, None, 0.1 * run.completed, 1.0, started=0.0)
        for action in actions:
            action(run, end)
    return run, [s for s, _ in public.steps], public


def test_actions_run_on_their_periods_and_after_the_last_step():
    run, logged, public = _run(steps=7, stop_after=99)
    assert run.evaluated == [3, 6, 7]
    assert logged == [2, 3, 4, 6, 7]  # every 2nd, and every evaluated step
    assert run.saved == [(5, False), (7, True)]
    assert public.steps[1][1] == {"step": 3, "epsilon": pytest.approx(0.3), "test_accuracy": 0.5}


def test_the_budget_stop_makes_the_step_it_stops_after_the_last():
    run, logged, _ = _run(steps=7, stop_after=4)
    assert run.stopped == {"step": 4} and run.completed == 4
    assert run.evaluated == [3, 4] and run.saved == [(4, True)]
    assert logged == [2, 3, 4]


def test_writers_go_through_the_door_of_their_kind():
    with pytest.raises(TypeError, match="public: PublicWriter instances only"):
        Log(1, public=[_Private()])
    with pytest.raises(TypeError, match="private: PrivateWriter instances only"):
        Log(1, private=[_Public()])
    Log(1, public=[_Public()], private=[])  # the right kinds are accepted
