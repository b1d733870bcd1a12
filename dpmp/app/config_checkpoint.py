"""Checks of the config's published-checkpoint keys: ``model.kind = "gpt2"`` and
``model.checkpoint``.

``CHECKPOINT_KINDS`` are the model kinds read from a checkpoint folder rather
than built from the ``[model]`` sizes: the registered model families whose
``checkpoint`` says what their folder holds, read when asked (a family
registered after the first config counts). ``check_checkpoint`` is called by
``ModelConfig`` when a config is made. It checks the value only: the folder is
read, and its errors raised, when the run starts
(``dpmp.app.published.start_from_checkpoint``), before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["CHECKPOINT_KINDS", "check_checkpoint"]


class _CheckpointKinds(Mapping[str, str]):
    """``model.kind`` -> what its folder holds, for each registered family read
    from a checkpoint folder (its ``checkpoint``), in registration order."""

    def _kinds(self) -> dict[str, str]:
        from dpmp.models.families import FAMILIES  # imports JAX: when a value is checked

        return {f.name: f.checkpoint for f in FAMILIES if f.checkpoint is not None}

    def __getitem__(self, kind: str) -> str:
        return self._kinds()[kind]

    def __contains__(self, kind: object) -> bool:
        return isinstance(kind, str) and kind in self._kinds()

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())


CHECKPOINT_KINDS: Mapping[str, str] = _CheckpointKinds()


def check_checkpoint(kind: Any, checkpoint: Any) -> None:
    """``model.checkpoint`` is set exactly when ``model.kind`` is read from one.

    Raises:
      ConfigError: it is not a non-empty string, it is missing for a checkpoint
        kind, or it is given for another kind (it would be ignored).
    """
    from dpmp.app.config import ConfigError

    if checkpoint is not None and (not isinstance(checkpoint, str) or not checkpoint):
        raise ConfigError(f"model.checkpoint: must be the path of a folder, got {checkpoint!r}")
    if kind in CHECKPOINT_KINDS and checkpoint is None:
        raise ConfigError(
            f"model.checkpoint: required when model.kind = {kind!r} "
            f"({CHECKPOINT_KINDS[kind]}: config.json, model.safetensors, tokenizer.json)"
        )
    if kind not in CHECKPOINT_KINDS and checkpoint is not None:
        kinds = ", ".join(repr(k) for k in CHECKPOINT_KINDS)
        raise ConfigError(
            f"model.checkpoint: read only when model.kind is {kinds}, got model.kind = {kind!r}"
        )
