"""What a run publishes: public records, private records, warnings, the file listing."""

import pytest

from dpmp.app import release
from dpmp.app.config import load_config
from dpmp.clipping._private_grad import PrivateGradStats

EVALUATION = {
    "step": 4,
    "train_accuracy": 0.91,
    "train_loss": 0.3,
    "test_accuracy": 0.88,
    "test_loss": 0.4,
}


def _public(**changes):
    fields = dict(
        step=4,
        epsilon=1.5,
        delta=1e-5,
        loss_scale=2.0,
        next_loss_scale=4.0,
        loss_scale_changes=1,
        noised_overflow=-3.2,
        noised_overflow_total=7.5,
        evaluation=EVALUATION,
    )
    return release.public_record(**{**fields, **changes})


def test_a_public_record_takes_only_test_metrics_from_an_evaluation():
    record = _public()
    assert record["test_accuracy"] == 0.88 and record["test_loss"] == 0.4
    assert "train_accuracy" not in record and "train_loss" not in record
    assert record["noised_overflow"] == -3.2  # a released value, negative or not
    assert release.public_info(record) == {k: v for k, v in record.items() if k != "step"}
    fields = release.progress_fields(record)
    assert fields == {"eps": "1.50000", "scale": "4", "noised overflow": "8", "test acc": "0.880"}
    plain = _public(noised_overflow=None, noised_overflow_total=None, evaluation=None)
    assert set(record) - set(plain) == {
        "noised_overflow",
        "noised_overflow_total",
        "test_accuracy",
        "test_loss",
    }
    assert release.progress_fields(plain) == {"eps": "1.50000", "scale": "4"}


def test_a_private_record_holds_the_exact_statistics():
    stats = PrivateGradStats(
        num_examples=60,
        num_nonfinite=3,
        num_clipped=30,
        norm_mean=1.5,
        norm_max=4.0,
        norm_median=1.2,
        loss_mean=2.25,
        loss_scale=8.0,
        noised_overflow_count=float("nan"),
    )
    totals = {"overflow": 10, "elapsed_s": 3.0}
    record = release.private_record(
        step=4, stats=stats, totals=totals, step_time_s=0.1, evaluation=EVALUATION
    )
    assert record["loss"] == 2.25 and record["overflow"] == 3 and record["overflow_total"] == 10
    assert record["clipped_fraction"] == 0.5 and record["batch_size"] == 60
    assert record["train_accuracy"] == 0.91 and "test_accuracy" not in record


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["privacy.reproducible_noise=true"], "privacy.reproducible_noise = true"),
        (["loss_scale.kind=nonprivate_dynamic"], "loss_scale.kind = 'nonprivate_dynamic'"),
        (["data.standardize=nonprivate"], "data.standardize = 'nonprivate'"),
        (["privacy.sampling=shuffle"], "not Poisson sampling"),
        (["privacy.noise_sampler=plain"], "privacy.noise_sampler = 'plain'"),
    ],
)
def test_every_way_out_of_dp_is_a_warning(overrides, needle):
    assert release.privacy_warnings(load_config(None)) == []
    assert release.privacy_warnings(load_config(None, ["data.standardize=private"])) == []
    (warning,) = release.privacy_warnings(load_config(None, overrides))
    assert needle in warning


def test_how_many_records_were_cut_is_a_private_diagnostic(tmp_path):
    from dpmp.app.inputs import load_data

    (tmp_path / "t.txt").write_text("\n".join(["y" * 100] + [f"line {i}" for i in range(20)]))
    sets = ["data.dataset=text", f"data.path={tmp_path / 't.txt'}", "data.seq_len=8"]
    data = load_data(load_config(None, sets).data)
    totals = {"overflow": 0, "steps_with_overflow": 0, "clipped": 0, "examples": 0}
    diagnostics = release.private_diagnostics(
        totals={**totals, "elapsed_s": 0.0},
        sampler=None,
        evaluation={},
        wall_time_s=0.0,
        data=data,
    )
    cut = diagnostics["records_cut"]
    assert cut["cut_to"] == "8 bytes" and cut["train"] + cut["test"] == 1


def test_file_inventory(tmp_path):
    assert release.file_inventory(tmp_path) == {"public": [], "private": [], "secret": []}
    for name in ("report.json", "metrics.jsonl", "train.log"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "private").mkdir()
    (tmp_path / "checkpoints").mkdir()
    inventory = release.file_inventory(tmp_path)
    assert inventory == {
        "public": ["report.json", "metrics.jsonl", "train.log"],
        "private": ["private/"],
        "secret": ["checkpoints/"],
    }
    lines = release.inventory_lines(tmp_path)
    assert lines[0] == "safe to publish: report.json, metrics.jsonl, train.log"
    assert lines[1] == (
        "private (non-private diagnostics: do not publish; owner-only, 0700): private/"
    )
    assert lines[2].startswith("secret (") and lines[2].endswith("checkpoints/")
    assert release.PRIVATE_README.startswith(release.PRIVATE_NOTE)


def test_an_exported_hugging_face_folder_is_listed_public_and_another_folder_is_not(tmp_path):
    """dpmp export --format hf's folders hold released parameters and privacy.json; a
    folder of that name without privacy.json is not an export and is not listed."""
    from dpmp.app.export_hf import PRIVACY_FILE, export_hf

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf-merged").mkdir()
    assert release.file_inventory(tmp_path)["public"] == []
    (tmp_path / "hf" / PRIVACY_FILE).write_text("{}")
    assert release.file_inventory(tmp_path)["public"] == ["hf/"]
    # the names are export_hf's own defaults
    import inspect

    source = inspect.getsource(export_hf)
    assert all(f'"{name}"' in source for name in release.EXPORTED_FOLDERS)
    assert "hf/ and hf-merged/" in release.PRIVATE_README


def test_a_non_private_run_does_not_end_with_safe_to_publish(tmp_path):
    (tmp_path / "report.json").write_text('{"private": false}')
    (lines,) = release.inventory_lines(tmp_path)
    assert "safe to publish" not in lines and "NOT differentially private" in lines
    assert lines.endswith(": report.json")
    (tmp_path / "report.json").write_text('{"private": true}')
    assert release.inventory_lines(tmp_path) == ["safe to publish: report.json"]


def test_the_published_config_names_a_data_file_not_its_folders(tmp_path):
    data = tmp_path / "secret-project" / "patients.npz"
    config = load_config(None, ["data.dataset=npz", f'data.path="{data}"'])
    published = release.public_config(config)
    assert published["data"]["path"] == "patients.npz"
    assert str(tmp_path) not in str(published)
    assert release.config_dict(config)["data"]["path"] == str(data)  # checkpoints keep it


def test_progress_bar_shows_speed_and_eta(monkeypatch):
    import io

    from dpmp.app import run_dir

    clock = iter([100.0, 102.0, 104.0])
    monkeypatch.setattr(run_dir.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = run_dir.ProgressBar(100, stream=out)
    for step in (10, 20, 30):
        bar.update(step, {"eps": "0.50000"}, force=True)
    lines = out.getvalue().splitlines()
    assert "steps/s" not in lines[0]  # nothing timed yet
    assert lines[1].endswith("eps 0.50000 [5 steps/s, ETA 0:16]"), lines[1]
    assert lines[2].endswith("[5 steps/s, ETA 0:14]"), lines[2]


def test_a_delta_not_below_one_over_n_is_a_warning():
    config = load_config(None, ["privacy.delta=0.001", "privacy.allow_large_delta=true"])
    (warning,) = release.privacy_warnings(config, num_train=1437)
    assert "privacy.delta = 0.001 is not below 1/n" in warning and "NOT" in warning
    assert release.privacy_warnings(load_config(None), num_train=1437) == []
    assert release.privacy_warnings(config, num_train=999) == []  # 0.001 < 1/999


def test_exit_decisions_read_released_numbers_only():
    """``run_failures`` takes the report alone (its released numbers); the exact
    overflow count's judgement goes to ``private/diagnostics.json`` only."""
    import inspect

    report = {"steps": 3, "config": {"training": {"expected_batch_size": 512}}}
    report["audit"] = {"ok": True}
    assert list(inspect.signature(release.run_failures).parameters) == ["report"]
    assert release.run_failures(report) == []  # no count was released
    (diagnosis,) = release.overflow_diagnosis(1500, 1530)
    assert diagnosis.startswith("most of the examples overflowed")
    assert "1500" not in diagnosis and "1530" not in diagnosis
    assert release.overflow_diagnosis(700, 1530) == []
    report["overflow"] = {"noised_count_total": 900.0}  # a released, noised count
    (failure,) = release.run_failures(report)
    assert "noised count 900" in failure


def test_an_audit_that_could_not_check_the_step_fails_closed():
    assert release.audit_warnings({"ok": True}) == []
    for audit in ({"ok": None, "error": "TypeError: boom"}, {"ok": None}, {}):
        (warning,) = release.audit_warnings(audit)
        assert "not reported differentially private" in warning
    (failure,) = release.run_failures(
        {"steps": 1, "config": {"training": {"expected_batch_size": 8}}, "audit": {"ok": None}}
    )
    assert "could not check" in failure
