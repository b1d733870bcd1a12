"""The trainer's periodic actions (``dpmp.app.trainer.actions``).

Unit checks with a fake run: when each action runs (``every_steps``,
``every_secs`` on a fake clock, the last step), what it returns, that the
order of the list does not matter (producers run before their readers), and
that only an action with ``reads_private`` sees exact statistics. Then (slow)
a tiny ``dpmp.train`` with an action of the caller's: it runs after every step
and sees the numbers ``metrics.jsonl`` publishes, nothing else; and the run's
own actions shuffled write the same files.
"""

import json
import random

import jax
import numpy as np
import pytest

import dpmp
from dpmp.app.config import Config, load_config
from dpmp.app.inputs import load_data
from dpmp.app.run_dir import read_metrics
from dpmp.app.trainer import loop
from dpmp.app.trainer.actions import (
    Actions,
    Checkpoint,
    Evaluate,
    Log,
    PeriodicAction,
    PrivateStepEnd,
    StepEnd,
    extra_actions,
    order,
)
from dpmp.app.trainer.writers import PrivateWriter, PublicWriter

# what a run's evaluation holds: held-out (public) and training-split (private) metrics
PUBLIC_EVAL = {"test_accuracy", "test_loss"}
PRIVATE_EVAL = {"train_accuracy", "train_loss"}


class _Public(PublicWriter):
    def __init__(self):
        self.records = []

    def write(self, step, record):
        self.records.append(dict(record))


class _Private(PrivateWriter):
    def __init__(self):
        self.records = []

    def write(self, step, record):
        self.records.append(dict(record))


class _Stats:
    """Exact statistics of a batch, as the step returns them (private)."""

    loss_mean, num_nonfinite, num_clipped, num_examples = 0.5, 0, 3, 8
    norm_mean, norm_max = 1.0, 2.0


def _end(step, *, last=False, time=0.0):
    return PrivateStepEnd(
        step=step,
        last=last,
        time=time,
        released={"step": step, "epsilon": 0.1 * step},
        params={"w": np.ones(2)},
        stats=_Stats(),
        totals={"overflow": 0, "elapsed_s": 0.0},
        started=0.0,
    )


class _FakeRun:
    def __init__(self):
        self.completed, self.evaluated, self.saved = 0, [], []

    def evaluate(self):
        self.evaluated.append(self.completed)
        return {"step": self.completed, "test_accuracy": 0.5, "test_loss": 1.0}

    def save(self, *, finished):
        self.saved.append((self.completed, finished))


def _run(actions, run, steps):
    runner = Actions(actions)
    outputs = []
    for t in range(1, steps + 1):
        run.completed = t
        outputs.append(runner(_end(t, last=t == steps)))
    return outputs


def _own(run, public):
    return [
        Evaluate(run.evaluate, every_steps=3),
        Log(every_steps=2, public=[public], name="metrics"),
        Checkpoint(run.save, every_steps=5),
    ]


def test_actions_run_on_their_periods_and_after_the_last_step():
    run, public = _FakeRun(), _Public()
    outputs = _run(_own(run, public), run, steps=7)
    assert run.evaluated == [3, 6, 7]
    assert [r["step"] for r in public.records] == [2, 3, 4, 6, 7]  # every 2nd, every evaluated
    assert run.saved == [(5, False), (7, True)]
    evaluation = {"test_accuracy": 0.5, "test_loss": 1.0}
    assert public.records[1] == {"step": 3, "epsilon": pytest.approx(0.3), **evaluation}
    # the outputs of a step, by name: the evaluation, and the record Log wrote
    assert outputs[2] == {"evaluation": {"step": 3, **evaluation}, "metrics": public.records[1]}
    assert outputs[0] == {} and list(outputs[1]) == ["metrics"]


def test_the_order_of_the_list_does_not_matter():
    """Every order of the run's own actions writes the same records and saves alike:
    the producers of what an action reads run first."""
    results = set()
    for seed in range(6):
        run, public = _FakeRun(), _Public()
        actions = _own(run, public)
        random.Random(seed).shuffle(actions)
        _run(actions, run, steps=7)
        results.add(json.dumps([public.records, run.evaluated, run.saved], sort_keys=True))
    assert len(results) == 1


class _Every(PeriodicAction):
    """Returns the step it ran after."""

    def _apply(self, end, outputs):
        return end.step


def test_every_secs_runs_once_that_many_seconds_have_passed():
    """On a fake clock (the ``StepEnd.time`` of each step): 0, 4, 9, 10, 21, 22 s."""
    action = _Every(every_secs=10.0)
    times = {1: 0.0, 2: 4.0, 3: 9.0, 4: 10.0, 5: 21.0, 6: 22.0}
    ran = [action(_end(t, time=s)) for t, s in times.items()]
    # from the first step seen (0 s): due at 10 s; then from 10 s: due at 21 s
    assert ran == [None, None, None, 4, 5, None]


def test_every_steps_and_every_secs_together_and_on_last():
    action = _Every(every_steps=4, every_secs=5.0, on_last=True)
    times = {1: 0.0, 2: 1.0, 3: 6.0, 4: 7.0, 5: 8.0, 6: 9.0}
    ran = [action(_end(t, time=s, last=t == 6)) for t, s in times.items()]
    assert ran == [None, None, 3, 4, None, 6]  # 5 s at step 3, step 4 by steps, the last
    with pytest.raises(ValueError, match="every_secs"):
        _Every(every_secs=0)
    with pytest.raises(ValueError, match="every_steps"):
        _Every(every_steps=-1)
    with pytest.raises(TypeError):
        PeriodicAction(every_steps=1)  # abstract: _apply is the action


class _Seen(PeriodicAction):
    """Keeps what it was given; reads the evaluation and the logged record."""

    reads = ("evaluation", "metrics")

    def __init__(self, **kwargs):
        super().__init__(every_steps=1)
        self.seen = []
        self.__dict__.update(kwargs)

    def _apply(self, end, outputs):
        # the parameters are the step's own buffers until the next step: copied
        params = [np.asarray(x) for x in jax.tree.leaves(end.params)]
        self.seen.append((end, dict(outputs), params))
        return end.step


def test_only_a_private_reader_sees_exact_statistics():
    """A public action gets a ``StepEnd`` (no stats, no totals) and of an evaluation
    its held-out metrics; one with ``reads_private`` the whole of both."""

    def evaluate():
        return {
            "step": 1,
            "test_accuracy": 0.5,
            "test_loss": 1.0,
            "train_accuracy": 0.9,
            "train_loss": 0.1,
        }

    public, private = _Seen(), _Seen(reads_private=True)
    log = Log(every_steps=1, public=[_Public()], private=[_Private()], name="metrics")
    Actions([public, private, log, Evaluate(evaluate, every_steps=1)])(_end(1))
    ((end, outputs, _),) = public.seen
    assert type(end) is StepEnd and not hasattr(end, "stats") and not hasattr(end, "totals")
    assert set(outputs["evaluation"]) == PUBLIC_EVAL
    assert not PRIVATE_EVAL & set(outputs["metrics"])
    ((end, outputs, _),) = private.seen
    assert isinstance(end, PrivateStepEnd) and end.stats.num_examples == 8
    assert PRIVATE_EVAL <= set(outputs["evaluation"])
    private_record = log.private_writers[0].records[0]
    assert PRIVATE_EVAL <= set(private_record) and private_record["batch_size"] == 8
    assert not PRIVATE_EVAL & set(log.public_writers[0].records[0])


def test_an_action_returns_its_output_and_outputs_go_by_name():
    action = _Every(every_steps=2)
    assert action(_end(1)) is None and action(_end(2)) == 2

    class Named(_Every):
        name = "mine"

    class Reader(_Seen):
        reads = ("mine",)

    reader = Reader()
    outputs = Actions([reader, Named(every_steps=1)])(_end(3))
    assert outputs == {"mine": 3} and reader.seen[0][1] == {"mine": 3}


def test_conflicting_or_circular_actions_are_refused():
    class A(_Every):
        name, reads = "a", ("b",)

    class B(_Every):
        name, reads = "b", ("a",)

    with pytest.raises(ValueError, match="cycle"):
        order([A(every_steps=1), B(every_steps=1)])
    with pytest.raises(ValueError, match="two actions output 'a'"):
        order([A(every_steps=1), A(every_steps=1)])
    with pytest.raises(TypeError, match="PeriodicAction instances only"):
        extra_actions([lambda step: None], None)

    class Evaluation(_Every):
        name = "evaluation"

    with pytest.raises(ValueError, match="'evaluation' is the output of one of the run's own"):
        extra_actions([Evaluation(every_steps=1)], None)


def test_writers_go_through_the_door_of_their_kind():
    with pytest.raises(TypeError, match="public: PublicWriter instances only"):
        Log(every_steps=1, public=[_Private()])
    with pytest.raises(TypeError, match="private: PrivateWriter instances only"):
        Log(every_steps=1, private=[_Public()])
    Log(every_steps=1, public=[_Public()], private=[])  # the right kinds are accepted


# ---- through dpmp.train ------------------------------------------------------------

# A tiny run: 4 steps of q = 32/1437 on a narrow MLP, sigma given (no calibration);
# the noise from the seed, so that two runs in this process are the same run. Its
# first run compiles a step (~10 s on 2 cores): the slow suite.
TINY = [
    "model.hidden=[8]",
    "privacy.noise_multiplier=1.0",
    "training.steps=4",
    "training.expected_batch_size=32",
    "training.eval_every=2",
    "training.log_every=3",
    "training.checkpoint_every=2",
    "privacy.reproducible_noise=true",
]


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


def _files(out):
    """What a run wrote, less the run's timings (private/) and the versions."""
    private = read_metrics(out / "private" / "metrics.jsonl")
    for r in private[1:]:
        del r["step_time_s"], r["elapsed_s"]
    report = json.loads((out / "report.json").read_text())
    return {
        "metrics": read_metrics(out),
        "private": private,
        "report": report,
        "log": (out / "train.log").read_text(),
        "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir()),
    }


@pytest.fixture(scope="module")
def user_run(digits, tmp_path_factory):
    out = tmp_path_factory.mktemp("user_action")
    seen = _Seen()
    dpmp.train(load_config(None, TINY), out_dir=out, progress=False, data=digits, actions=[seen])
    return out, seen


@pytest.mark.slow
def test_a_callers_action_runs_every_step_and_sees_only_public_numbers(user_run):
    out, seen = user_run
    records = {r["step"]: r for r in read_metrics(out)}
    assert [end.step for end, _, _ in seen.seen] == [1, 2, 3, 4]
    assert [end.last for end, _, _ in seen.seen] == [False, False, False, True]
    for end, outputs, params in seen.seen:
        assert type(end) is StepEnd  # no exact statistics
        # its released numbers are what metrics.jsonl publishes for the step
        published = {k: v for k, v in records.get(end.step, {}).items() if k not in PUBLIC_EVAL}
        if published:
            assert dict(end.released) == published
        assert set(outputs) <= {"evaluation", "metrics"}
        if "metrics" in outputs:
            assert outputs["metrics"] == records[end.step]
        if "evaluation" in outputs:  # steps 2 and 4: the held-out metrics only
            assert outputs["evaluation"] == {k: records[end.step][k] for k in PUBLIC_EVAL}
        assert params and all(np.isfinite(x).all() for x in params)
    assert [end.step for end, o, _ in seen.seen if "evaluation" in o] == [2, 4]
    assert [end.step for end, o, _ in seen.seen if "metrics" in o] == [2, 3, 4]
    # the parameters it saw after the last step are the run's final ones
    with np.load(sorted((out / "checkpoints").iterdir())[-1]) as final:
        first, count = json.loads(str(final["__meta__"]))["params_leaves"]
        saved = [final[f"leaf_{i:05d}"] for i in range(first, first + count)]
    assert all(np.array_equal(a, b) for a, b in zip(seen.seen[-1][2], saved, strict=True))


@pytest.mark.slow
def test_the_run_s_own_actions_in_any_order_write_the_same_files(
    user_run, digits, tmp_path, monkeypatch
):
    out, _ = user_run
    own = loop.run_actions

    def shuffled(*args):
        actions = own(*args)
        random.Random(1).shuffle(actions)
        assert [type(a).__name__ for a in actions] != ["Evaluate", "Log", "Progress", "Checkpoint"]
        return actions

    monkeypatch.setattr(loop, "run_actions", shuffled)
    dpmp.train(
        load_config(None, TINY), out_dir=tmp_path, progress=False, data=digits, actions=[_Seen()]
    )
    assert _files(tmp_path) == _files(out)
