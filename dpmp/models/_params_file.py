"""Parameters in files: a ``.safetensors`` file or an orbax checkpoint directory.

A parameter's name is its path in the params pytree joined by ``.``: the
kernel of a linen model's first dense layer is ``Dense_0.kernel``, the third
entry of a list ``layers.2``. ``save_params_file`` writes a pytree under those
names, ``read_params_file`` gives ``{name: array}`` back, and ``load_params_file(path,
like)`` puts them in the structure of ``like`` (a model's parameters or
``jax.eval_shape`` of its ``init``), refusing a missing, unexpected or
mis-shaped one by name. Every array keeps the dtype it is stored in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dpmp.data._dataset import DataError

__all__ = [
    "arrange",
    "load_params_file",
    "nest",
    "param_names",
    "read_params_file",
    "save_params_file",
]

SUFFIX = ".safetensors"


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)  # pragma: no cover - every jax key type has one of the three


def param_names(params: Any) -> dict[str, Any]:
    """``{name: leaf}`` of ``params``, names as paths joined by ``.``, in leaf order."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in flat}


def save_params_file(path: str | os.PathLike, params: Any) -> Path:
    """Writes ``params`` to ``path``: a safetensors file if it ends in
    ``.safetensors``, else an orbax checkpoint directory (replaced if there);
    returns the path."""
    path = Path(path).absolute()
    flat = {name: np.ascontiguousarray(np.asarray(a)) for name, a in param_names(params).items()}
    if path.suffix == SUFFIX:
        from safetensors.numpy import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(flat, str(path))
        return path
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, nest(flat), force=True)  # orbax joins nested keys by "."
        checkpointer.wait_until_finished()
    return path


def read_params_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{name: array}`` stored at ``path`` (see ``save_params_file``).

    Raises:
      DataError: no such file or directory, or neither format.
    """
    path = Path(path).absolute()
    if not path.exists():
        raise DataError(f"init_params: {path} not found")
    if path.is_file() and path.suffix == SUFFIX:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise DataError(f"init_params: {path} is not a safetensors file ({e})") from None
    if not (path / "_CHECKPOINT_METADATA").is_file():
        raise DataError(
            f"init_params: {path} is neither a {SUFFIX} file nor an orbax checkpoint directory"
        )
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path)
    return {name: np.asarray(a) for name, a in param_names(restored).items()}


def arrange(flat: dict[str, Any], like: Any, where: str = "init_params") -> Any:
    """``flat`` (``{name: array}``) in the structure of ``like``, by name.

    Raises:
      DataError: a name of ``like`` missing from ``flat``, one of ``flat`` not in
        ``like``, or an array of another shape (named; ``where`` says whose).
    """
    wanted = param_names(like)
    missing = [n for n in wanted if n not in flat]
    if missing:
        raise DataError(f"{where}: no parameter {missing[0]!r} ({len(missing)} missing)")
    unexpected = [n for n in flat if n not in wanted]
    if unexpected:
        raise DataError(
            f"{where}: unexpected parameter {unexpected[0]!r} ({len(unexpected)} in all); "
            f"the model has {', '.join(map(repr, list(wanted)[:4]))}"
            + (", ..." if len(wanted) > 4 else "")
        )
    for name, leaf in wanted.items():
        got, want = tuple(np.shape(flat[name])), tuple(leaf.shape)
        if got != want:
            raise DataError(f"{where}: parameter {name!r} has shape {got}, the model's {want}")
    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, [flat[n] for n in wanted])


def load_params_file(path: str | os.PathLike, like: Any = None) -> Any:
    """The parameters stored at ``path``: in the structure of ``like`` (see
    ``arrange``), or without it as nested dicts (``{"a": {"b": x}}`` for
    ``a.b``), in their stored dtypes.

    Raises:
      DataError: as ``read_params_file`` and ``arrange`` say.
    """
    flat = read_params_file(path)
    if like is not None:
        return arrange(flat, like, f"init_params {Path(path).name}")
    return nest(flat)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": x}`` as ``{"a": {"b": {"c": x}}}``."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = name.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out
