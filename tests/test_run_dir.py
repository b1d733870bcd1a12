"""The run directory: private and secret files readable by their owner only, the lock."""

import os
import stat

import pytest

from dpmp.app import release
from dpmp.app.run_dir import RunDir, RunDirError, locked


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def loose_umask():
    previous = os.umask(0o022)  # folders 0755, files 0644 unless asked otherwise
    yield
    os.umask(previous)


def test_private_folder_and_files_are_owner_only(tmp_path, loose_umask):
    run = RunDir(tmp_path, echo=False, private_readme=release.PRIVATE_README)
    (tmp_path / "private").mkdir(mode=0o755)  # an older run's folder
    run.append_private_metrics({"step": 1, "loss": 0.5})
    run.append_private_metrics({"step": 2, "loss": 0.4})
    run.write_private_diagnostics({"wall_time_s": 1.0})
    run.truncate_metrics(1)  # rewritten: still owner-only
    assert _mode(tmp_path / "private") == 0o700
    for name in ("metrics.jsonl", "diagnostics.json", "README.txt"):
        assert _mode(tmp_path / "private" / name) == 0o600, name
    run.append_metrics({"step": 1, "epsilon": 0.1})  # public files are left as they were
    assert _mode(tmp_path / "metrics.jsonl") == 0o644
    assert "0700" in release.PRIVATE_README


def test_lock_is_held_while_writing_and_gone_after(tmp_path):
    with locked(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    assert not (tmp_path / ".lock").exists()
    with locked(tmp_path):  # taken again afterwards
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_lock_removed_by_its_holder_as_it_was_opened_is_not_taken(tmp_path, monkeypatch):
    """The lock file is unlinked on release: a run that opened the old file just
    before must not think it holds the directory."""
    from dpmp.app import run_dir

    monkeypatch.setattr(run_dir, "_same_file", lambda handle, path: False)
    with pytest.raises(RunDirError, match="start again"):
        with locked(tmp_path):
            pass
