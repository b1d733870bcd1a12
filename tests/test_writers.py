"""Where a run's public numbers go (``dpmp.app.trainer.writers``, ``training.writers``).

The TensorBoard event files are read back with a reader written here from the
TFRecord layout (length, masked CRC-32C of it, the event, masked CRC-32C of it;
the CRC computed bit by bit, independently of the writer's table) and
tensorboardX's protobuf classes: their scalars are ``metrics.jsonl``'s numbers,
within float32 rounding (TensorBoard stores ``simple_value`` as float32), and no
key of the private records appears among them.
"""

import json
import math
import struct

import pytest

import dpmp
from dpmp.app import release
from dpmp.app.config import WRITERS, Config, ConfigError, load_config
from dpmp.app.inputs import load_data
from dpmp.app.run_dir import RunDir, read_metrics
from dpmp.app.trainer.writers import PUBLIC_WRITERS, TensorBoardWriter, public_writers

# float32 keeps 24 significant bits: a float64 number stored as one is within half
# an ulp, 2^-24 relative (TensorBoard's simple_value is a float32)
FLOAT32_REL = 2.0**-24


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(path):
    """The events of one TFRecord file, each record's two checksums checked."""
    from tensorboardX.proto.event_pb2 import Event

    data, events, i = path.read_bytes(), [], 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[i + 8 : i + 12])
        body = data[i + 12 : i + 12 + n]
        (body_crc,) = struct.unpack("<I", data[i + 12 + n : i + 16 + n])
        assert header_crc == _masked(_crc32c(header)) and body_crc == _masked(_crc32c(body))
        events.append(Event.FromString(body))
        i += 16 + n
    return events


def scalars(folder):
    """``{step: {tag: value}}`` of every event file in ``folder``, in name order,
    with TensorBoard's purge: a session's start at step s drops the steps >= s
    that earlier files wrote."""
    out = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in read_events(path):
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                out = {s: v for s, v in out.items() if s < event.step}
            for value in event.summary.value:
                out.setdefault(event.step, {})[value.tag] = value.simple_value
    return out


def _same(tensorboard, metrics):
    """``tensorboard`` holds each number of ``metrics`` (its float32) and nothing else."""
    assert set(tensorboard) == {r["step"] for r in metrics}
    for record in metrics:
        numbers = {k: v for k, v in record.items() if k != "step"}
        got = tensorboard[record["step"]]
        assert set(got) == set(numbers)
        for key, value in numbers.items():
            assert got[key] == pytest.approx(value, rel=FLOAT32_REL, abs=0)


def test_the_event_file_holds_each_records_numbers(tmp_path):
    writer = TensorBoardWriter(tmp_path)
    records = [
        {"step": 2, "epsilon": 0.123456789, "delta": 1e-5, "loss_scale": 1.0},
        {"step": 4, "epsilon": 0.2, "delta": 1e-5, "loss_scale": 2.0, "test_accuracy": 0.5},
    ]
    for r in records:
        writer.write(r["step"], r)
    writer.close()
    (path,) = tmp_path.iterdir()
    # no time, host or process id in its name, no wall time in its events
    assert path.name == "events.out.tfevents.0000000001.dpmp"
    assert {e.wall_time for e in read_events(path)} == {0.0}
    _same(scalars(tmp_path), records)


def test_a_fresh_run_replaces_the_files_and_a_resumed_one_purges_what_follows(tmp_path):
    first = TensorBoardWriter(tmp_path)
    for step in (2, 4, 6):
        first.write(step, {"step": step, "epsilon": step / 10})
    first.close()
    resumed = TensorBoardWriter(tmp_path, first_step=5)  # a checkpoint of step 4
    resumed.write(6, {"step": 6, "epsilon": 0.65})
    resumed.close()
    assert {s: v["epsilon"] for s, v in scalars(tmp_path).items()} == pytest.approx(
        {2: 0.2, 4: 0.4, 6: 0.65}, rel=FLOAT32_REL
    )
    TensorBoardWriter(tmp_path).close()  # started afresh: the old files go
    assert [p.name for p in tmp_path.iterdir()] == ["events.out.tfevents.0000000001.dpmp"]


def test_training_writers_are_checked_and_each_name_makes_a_writer(tmp_path):
    assert set(PUBLIC_WRITERS) == set(WRITERS)
    assert Config().training.writers == ("jsonl",)  # what a run wrote before
    both = load_config(None, ['training.writers=["jsonl", "tensorboard"]'])
    assert both.training.writers == ("jsonl", "tensorboard")
    made = public_writers(both.training.writers, RunDir(tmp_path))
    assert [type(w).__name__ for w in made] == ["MetricsFile", "TensorBoardWriter"]
    for writer in made:
        writer.close()
    for bad, words in (
        ('["tensorboard"]', '"jsonl" once'),
        ('["jsonl", "jsonl"]', '"jsonl" once'),
        ('["jsonl", "csv"]', "'csv' is not allowed; allowed: jsonl, tensorboard"),
        ("3", "must be a list of names"),
    ):
        with pytest.raises(ConfigError, match=f"training.writers: .*{words}"):
            load_config(None, [f"training.writers={bad}"])


@pytest.fixture(scope="module")
def digits():
    return load_data(Config().data, seed=0)


@pytest.mark.slow  # a tiny run compiles its step: ~10 s on 2 cores
def test_a_runs_tensorboard_scalars_are_its_metrics_and_nothing_private(digits, tmp_path):
    config = load_config(
        None,
        [
            "model.hidden=[8]",
            "privacy.noise_multiplier=1.0",
            "training.steps=4",
            "training.expected_batch_size=32",
            "training.eval_every=2",
            "training.log_every=3",
            'training.writers=["jsonl", "tensorboard"]',
        ],
    )
    dpmp.train(config, out_dir=tmp_path, progress=False, data=digits)
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [2, 3, 4]
    tensorboard = scalars(tmp_path / "tensorboard")
    _same(tensorboard, metrics)
    # none of the exact statistics' keys (private/metrics.jsonl) is a tag
    private = read_metrics(tmp_path / "private" / "metrics.jsonl")[1:]
    private_keys = set().union(*private) - {"step"}
    tags = set().union(*tensorboard.values())
    assert private_keys and not private_keys & tags
    assert all(math.isfinite(v) for step in tensorboard.values() for v in step.values())
    # the folder is listed with the files that may be published
    assert "tensorboard/" in release.file_inventory(tmp_path)["public"]
    assert "tensorboard/" in (tmp_path / "train.log").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["config"]["training"]["writers"] == [
        "jsonl",
        "tensorboard",
    ]
