"""Checks of the config's text keys: ``data.tokenizer``.

``check_tokenizer`` is called by ``DataConfig`` when a config is made (it
imports the data sources only when the key is set, so that a config without
it is checked before JAX is imported); the file itself is read, and its
errors raised, when the data is loaded (``dpmp.data._tokenizer.load_tokenizer``),
before anything is written.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_tokenizer"]


def check_tokenizer(dataset: str, tokenizer: Any) -> None:
    """``data.tokenizer`` is unset, or a path given with a text ``data.dataset``.

    Raises:
      ConfigError: it is not a string, or the data set is not text.
    """
    if tokenizer is None:
        return
    from dpmp.app.config import ConfigError
    from dpmp.data.sources import SOURCES, TextSource  # JAX only when a tokenizer is set

    if not isinstance(tokenizer, str) or not tokenizer:
        raise ConfigError(
            f"data.tokenizer: must be the path of a tokenizer.json, got {tokenizer!r}"
        )
    if not isinstance(SOURCES.get(dataset), TextSource):
        texts = ", ".join(repr(s.name) for s in SOURCES if isinstance(s, TextSource))
        raise ConfigError(
            f"data.tokenizer: encodes text; data.dataset = {dataset!r} is not text (text: {texts})"
        )
