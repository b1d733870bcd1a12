"""Atomic checkpoints of a training state: numpy ``.npz`` leaves plus JSON metadata.

A checkpoint is one file ``checkpoint_<step>.npz`` holding

* ``leaf_<i>``: the leaves of the state pytree, flattened with
  ``jax.tree_util`` (params, optimizer state with the noise privatizer's PRNG
  key, the loss scale with its key), as numpy arrays. Typed PRNG keys are
  stored as ``jax.random.key_data``; half-precision leaves as their bits;
* ``__meta__``: a JSON string (step, config, sampler and budget-tracker state,
  metric totals, and a description of every leaf).

A trainer's checkpoint holds its secret randomness (the noise keys, the
sampler's seed) and a fingerprint of the data: keep checkpoints as secret as
the data itself. Their folder is created 0700 and each file 0600 (readable by
its owner only).

Restoring needs a *template*: the same pytree built from a fresh ``init``
(linen dicts and nnx ``State`` alike). The stored leaves are checked against
the template's shapes and dtypes and put back into its structure.

Atomicity: the file is written to a temporary name in the same directory,
flushed and fsynced, then ``os.replace``d over its final name (atomic on
POSIX), and the directory is fsynced. Older checkpoints are deleted only
after the new one is complete (the newest ``keep`` are kept), so a process
killed at any moment leaves at least one complete checkpoint; a leftover
temporary file is ignored (and removed by the next save). If the newest
checkpoint cannot be read, ``restore_latest`` falls back to the previous one.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.app.run_dir import _create, _fsync_dir, naming, secret_dir, to_jsonable

__all__ = [
    "CheckpointError",
    "list_checkpoints",
    "latest_checkpoint",
    "latest_meta",
    "load_checkpoint",
    "restore_latest",
    "save_checkpoint",
]

_NAME = re.compile(r"^checkpoint_(\d+)\.npz$")
_TMP_PREFIX = ".checkpoint_"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit the state it is restored into."""


def _is_key(leaf) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _to_numpy(leaf) -> tuple[np.ndarray, dict[str, Any]]:
    if _is_key(leaf):
        data = np.asarray(jax.random.key_data(leaf))
        return data, {"kind": "prng_key", "impl": str(jax.random.key_impl(leaf))}
    arr = np.asarray(leaf)
    info = {"kind": "array", "dtype": arr.dtype.name}
    if arr.dtype.kind not in "biufc":
        # bfloat16 and other ml_dtypes: store the bits
        arr = arr.view(np.dtype(f"uint{arr.dtype.itemsize * 8}"))
    return arr, info


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory``, oldest first, as ``(step, path)``."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(
    directory: str | Path, *, step: int, state: Any, meta: dict[str, Any], keep: int = 2
) -> Path:
    """Writes ``state`` (a pytree) and ``meta`` (JSON-able) atomically; returns the path.

    The newest ``keep`` (>= 1) checkpoints are kept; older ones are deleted
    after the new file is in place.
    """
    directory = secret_dir(directory)
    leaves = jax.tree_util.tree_leaves(state)
    arrays, infos = {}, []
    for i, leaf in enumerate(leaves):
        arr, info = _to_numpy(leaf)
        info["shape"] = list(np.shape(leaf))
        arrays[f"leaf_{i:05d}"] = arr
        infos.append(info)
    full_meta = dict(to_jsonable(meta))
    full_meta.update(format_version=FORMAT_VERSION, step=int(step), leaves=infos)
    arrays["__meta__"] = np.array(json.dumps(full_meta, allow_nan=False))

    final = directory / f"checkpoint_{int(step):08d}.npz"
    for stale in directory.glob(f"{_TMP_PREFIX}*"):
        stale.unlink(missing_ok=True)  # a temp file left by a killed save
    tmp = directory / f"{_TMP_PREFIX}{int(step):08d}.npz.tmp-{os.getpid()}"
    with naming(final, "the checkpoint", tmp=tmp):  # a full disk: no half-written file
        with os.fdopen(_create(tmp, os.O_TRUNC, True), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    _fsync_dir(directory)
    for _, old in list_checkpoints(directory)[: -max(int(keep), 1)]:
        old.unlink(missing_ok=True)
    return final


def _read(path: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as npz:
            meta = json.loads(str(npz["__meta__"]))
            n = len(meta["leaves"])
            leaves = [npz[f"leaf_{i:05d}"] for i in range(n)]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unknown format version {meta.get('format_version')!r}")
    return meta, leaves


def latest_meta(directory: str | Path) -> tuple[dict[str, Any], Path] | None:
    """Metadata of the newest readable checkpoint in ``directory``, and its path."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            meta, _ = _read(path)
        except CheckpointError:
            continue
        return meta, path
    return None


def load_checkpoint(path: str | Path, template: Any) -> tuple[Any, dict[str, Any]]:
    """Reads a checkpoint into the structure of ``template``; returns ``(state, meta)``."""
    path = Path(path)
    meta, stored = _read(path)
    tmpl_leaves, treedef = jax.tree_util.tree_flatten(template)
    if len(stored) != len(tmpl_leaves):
        raise CheckpointError(
            f"{path}: holds {len(stored)} arrays, but the state has {len(tmpl_leaves)} "
            "(a different model or optimizer?)"
        )
    restored = []
    for i, (arr, info, ref) in enumerate(zip(stored, meta["leaves"], tmpl_leaves)):
        if _is_key(ref):
            if info.get("kind") != "prng_key":
                raise CheckpointError(f"{path}: leaf {i} should be a PRNG key")
            impl = str(jax.random.key_impl(ref))
            if info.get("impl") != impl or arr.shape != jax.random.key_data(ref).shape:
                raise CheckpointError(
                    f"{path}: leaf {i} is a {info.get('impl')} key of {arr.size} words, the "
                    f"state expects a {impl} key (a checkpoint of an older dpmp: start afresh)"
                )
            value = jax.random.wrap_key_data(jnp.asarray(arr), impl=jax.random.key_impl(ref))
        else:
            want = np.dtype(ref.dtype) if hasattr(ref, "dtype") else np.asarray(ref).dtype
            if info.get("dtype") != want.name:
                raise CheckpointError(
                    f"{path}: leaf {i} has dtype {info.get('dtype')}, the state expects {want}"
                )
            value = jnp.asarray(_decoded(arr, info))
        _check_shape(path, f"leaf {i}", value, ref, "the state")
        restored.append(value)
    return jax.tree_util.tree_unflatten(treedef, restored), meta


def _decoded(arr: np.ndarray, info: dict[str, Any]) -> np.ndarray:
    """A stored array in the dtype it was saved in (bfloat16 and other ml_dtypes are
    stored as their bits, see ``_to_numpy``)."""
    saved = np.dtype(info["dtype"])
    return arr if arr.dtype == saved else arr.view(saved)


def _check_shape(path: Path, what: str, value, ref, whose: str) -> None:
    if tuple(np.shape(value)) != tuple(np.shape(ref)):
        raise CheckpointError(
            f"{path}: {what} has shape {tuple(np.shape(value))}, {whose} expects "
            f"{tuple(np.shape(ref))}"
        )


def restore_latest(
    directory: str | Path, template: Any, *, on_skip=None
) -> tuple[Any, dict[str, Any], Path] | None:
    """The newest readable checkpoint in ``directory`` (or None if there is none).

    A checkpoint that cannot be read (a torn file from a crash outside the
    atomic protocol, a truncated copy) is skipped in favour of the previous
    one; ``on_skip(path, error)`` is told. A checkpoint that is readable but
    does not fit ``template`` is an error, not skipped.
    """
    for _, path in reversed(list_checkpoints(directory)):
        try:
            meta, _ = _read(path)
        except CheckpointError as e:
            if on_skip is not None:
                on_skip(path, e)
            continue
        state, meta = load_checkpoint(path, template)
        return state, meta, path
    return None


def _newest_readable(directory: Path) -> tuple[dict[str, Any], list[np.ndarray], Path]:
    """The newest checkpoint in ``directory`` that can be read (a torn file is
    skipped for the previous one, as ``restore_latest`` does)."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            meta, stored = _read(path)
        except CheckpointError:
            continue
        return meta, stored, path
    raise CheckpointError(f"{directory}: no checkpoint (has the run started?)")


def load_params(out_dir: str | Path, like: Any) -> Any:
    """The trained parameters of the run in ``out_dir`` (its newest checkpoint), in
    the structure of ``like`` (the model's parameters: a linen params dict, the
    ``nnx.Param`` state, the arrays of ``eqx.partition``, an ``init(key)``
    result). The parameters are the private step's output: differentially
    private, unlike the rest of a checkpoint (keys and sampler seed).

    ``out_dir`` may also be a file ``dpmp.app.export.export_params`` wrote
    (``params.npz``: the parameters alone).
    """
    if Path(out_dir).is_file():
        meta, stored = _read(Path(out_dir))
        path = Path(out_dir)
    else:
        meta, stored, path = _newest_readable(Path(out_dir) / "checkpoints")
    span = meta.get("params_leaves")
    if span is None:
        raise CheckpointError(f"{path}: does not say where its parameters are")
    start, count = span
    ref_leaves, treedef = jax.tree_util.tree_flatten(like)
    if len(ref_leaves) != count:
        raise CheckpointError(
            f"{path}: holds {count} parameter arrays, `like` has {len(ref_leaves)} "
            "(a different model?)"
        )
    out = []
    for i, (arr, info, ref) in enumerate(
        zip(stored[start : start + count], meta["leaves"][start : start + count], ref_leaves)
    ):
        # saved in another dtype than ``like``'s: converted from its values, not its bits
        value = _decoded(arr, info).astype(np.dtype(ref.dtype), copy=False)
        _check_shape(path, f"parameter {i}", value, ref, "`like`")
        out.append(jnp.asarray(value))
    return jax.tree_util.tree_unflatten(treedef, out)
