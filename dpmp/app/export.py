"""The end of a run's secrets: its parameters alone, exported, and its checkpoints deleted.

A checkpoint holds the parameters and, beside them, the run's secret state:
the noise keys, the sampler's seed and a fingerprint of the data. With a
leaked checkpoint, anyone holding the released parameters can rerun the last
steps under each hypothesis about the data and compare. So a finished run's
parameters are published on their own:

* ``export_params(run_dir)`` writes ``run_dir/params.npz``: the newest
  checkpoint's parameters alone, in the checkpoint format (``dpmp.load_params``
  reads it like a run directory), with the step they are from and nothing of
  the secret state;
* ``delete_secrets(run_dir)`` deletes ``run_dir/checkpoints/`` once the run
  has finished (it has a ``report.json``), with the run directory locked. The
  run can no longer be resumed; ``private/`` (exact statistics, not keys) is
  left for debugging.

The command line: ``dpmp export RUN_DIR [--delete-secrets]``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from dpmp.app.checkpoint import FORMAT_VERSION, CheckpointError, _newest_readable
from dpmp.app.run_dir import REPORT_FILE, _fsync_dir, locked, naming

__all__ = ["PARAMS_FILE", "CHECKPOINTS_DIR", "delete_secrets", "export_params"]

PARAMS_FILE = "params.npz"
CHECKPOINTS_DIR = "checkpoints"
CONTENT_NOTE = "the trained parameters alone: no noise key, no sampler seed, no data fingerprint"


def export_params(run_dir: str | Path, dest: str | Path | None = None) -> Path:
    """Writes the run's newest parameters alone to ``dest`` (default
    ``run_dir/params.npz``) and returns its path.

    The file holds the parameter leaves of the newest readable checkpoint (as
    stored: bfloat16 as its bits) and a ``__meta__`` giving the step and each
    leaf's dtype and shape; ``dpmp.load_params(dest, like)`` reads it. The
    parameters are the private step's output: as private as the run
    (``report.json``'s ``private``).

    Raises:
      CheckpointError: the run has no readable checkpoint (the message points
        at ``run_dir/params.npz`` when that is why: its checkpoints were
        deleted after an export), or it does not say where its parameters are.
    """
    run_dir = Path(run_dir)
    exported = run_dir / PARAMS_FILE
    if not (run_dir / CHECKPOINTS_DIR).exists() and exported.is_file():
        raise CheckpointError(
            f"{run_dir}: its checkpoints were deleted (--delete-secrets); the parameters "
            f"are already exported: {exported}"
        )
    meta, leaves, path = _newest_readable(run_dir / CHECKPOINTS_DIR)
    span = meta.get("params_leaves")
    if span is None:
        raise CheckpointError(f"{path}: does not say where its parameters are")
    start, count = span
    arrays = {f"leaf_{i:05d}": leaves[start + i] for i in range(count)}
    out_meta = {
        "format_version": FORMAT_VERSION,
        "step": meta["step"],
        "leaves": meta["leaves"][start : start + count],
        "params_leaves": [0, count],
        "content": CONTENT_NOTE,
    }
    arrays["__meta__"] = np.array(json.dumps(out_meta, allow_nan=False))
    dest = run_dir / PARAMS_FILE if dest is None else Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    with naming(dest, "the parameters", tmp=tmp):  # a read-only folder, a full disk
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    _fsync_dir(dest.parent)
    return dest


def delete_secrets(run_dir: str | Path) -> list[Path]:
    """Deletes the finished run's ``checkpoints/`` (its noise keys, sampler seed
    and data fingerprint); returns what was deleted (empty: nothing was there).

    Export the parameters first (``export_params``): the checkpoints hold
    their only other copy. The run can no longer be resumed.

    Raises:
      CheckpointError: the run has not finished (no ``report.json``): deleting
        its checkpoints would lose its progress.
      RunDirError: another run is writing to ``run_dir``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / REPORT_FILE).is_file():
        raise CheckpointError(
            f"{run_dir}: has no {REPORT_FILE} (the run has not finished); its checkpoints "
            "are kept so that it can resume"
        )
    with locked(run_dir):
        folder = run_dir / CHECKPOINTS_DIR
        if not folder.is_dir():
            return []
        shutil.rmtree(folder)
        _fsync_dir(run_dir)
        return [folder]
