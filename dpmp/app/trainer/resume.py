"""Resuming: a checkpoint is continued only by the config and data that made it.

A resumed run replays the saved secret keys. On other data, or under another
privacy plan, that would reuse noise and break the accounting: refused with
the differences listed. Only the periods of evaluation, logging and
checkpointing, and where the public records go (``training.writers``), may
change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpmp.app import release
from dpmp.app.checkpoint import CheckpointError
from dpmp.app.config import Config

__all__ = ["START_OVER", "check_config", "check_data", "check_model", "check_start"]

# Config fields that may change between a run and its resumption.
_RESUMABLE_CHANGES = {
    ("training", "eval_every"),
    ("training", "log_every"),
    ("training", "checkpoint_every"),
    ("training", "writers"),
}


def _config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    diffs = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section), current.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if (section, key) in _RESUMABLE_CHANGES:
                    continue
                if a.get(key) != b.get(key):
                    diffs.append(
                        f"{section}.{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}"
                    )
        elif a != b:
            diffs.append(f"{section}: checkpoint {a!r}, config {b!r}")
    return diffs


START_OVER = "use resume=False (or another out_dir) to start a new run"


def check_config(meta: dict[str, Any], config: Config, path: Path) -> None:
    diffs = _config_diff(meta["config"], release.config_dict(config))
    if diffs:
        raise CheckpointError(
            f"{path}: made by a different config; {START_OVER}. Differences: " + "; ".join(diffs)
        )


def check_data(meta: dict[str, Any], data_fingerprint: str, path: Path) -> None:
    """Resuming on other data would replay the saved noise on it: refused."""
    if meta.get("data_fingerprint") != data_fingerprint:
        raise CheckpointError(
            f"{path}: made on different training data (the sha256 fingerprint of the "
            f"train and test arrays differs); {START_OVER}"
        )


def check_model(meta: dict[str, Any], signature: str, path: Path) -> None:
    """A model given in Python is not in the config: its parameters' names, shapes
    and dtypes (``dpmp.models._adapters.model_signature``) must match instead."""
    saved = meta.get("model_signature")
    if saved is not None and saved != signature:
        raise CheckpointError(
            f"{path}: made by a different model (the names, shapes or dtypes of the "
            f"parameters differ); {START_OVER}"
        )


def check_start(meta: dict[str, Any], start: dict[str, Any] | None, path: Path) -> None:
    """A run started from (or adapting, with LoRA) given parameters continues only
    from the same ones (``params_sha256``)."""
    saved = (meta.get("starting_point") or {}).get("params_sha256")
    current = (start or {}).get("params_sha256")
    if saved != current:
        raise CheckpointError(
            f"{path}: made from other starting parameters (pre-trained or given: their "
            f"sha256 differs); {START_OVER}"
        )
