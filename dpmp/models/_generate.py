"""Text from a next-token model: greedy decoding or sampling at a temperature.

``generate(model, params, prompt, max_new_tokens=n)`` extends the token ids
``prompt`` one token at a time::

    for each new token:
        logits = model.predict(params, tokens)[last position]
        next = argmax(logits)                            temperature 0
        next = categorical(key_i, logits / temperature)  temperature > 0
        stop after next if it is one of stop_tokens

The tokens live in one buffer of ``len(prompt) + max_new_tokens`` positions
and the forward pass is compiled once for it: in a causal model the logits at
a position depend on the tokens up to it only, so what fills the positions
after it changes nothing. ``generate_text`` does the same from and to text
with a loaded checkpoint's tokenizer, stopping at its end-of-sequence tokens
(a ``Decoder``'s ``generation.eos_token_ids``, from its ``generation_config.json``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dpmp.models._model import Model

__all__ = ["generate", "generate_text"]

# model -> its compiled "logits at position i", kept while the model lives
_LOGITS_AT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _logits_at(model: Model):
    if model not in _LOGITS_AT:
        predict = model.predict  # not the model itself: the cache must not keep it alive

        def logits_at(params, tokens, i):
            return predict(params, tokens)[0, i].astype(jnp.float32)

        _LOGITS_AT[model] = jax.jit(logits_at)
    return _LOGITS_AT[model]


def generate(
    model: Model,
    params: Any,
    prompt,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    key: jax.Array | None = None,
    stop_tokens: Sequence[int] = (),
) -> np.ndarray:
    """The ``prompt`` token ids (int ``[n]``, ``n >= 1``) followed by
    ``max_new_tokens`` generated ones (int32 ``[n + max_new_tokens]``), or fewer
    if one of ``stop_tokens`` is generated: the output ends with it.

    Args:
      model: a causal next-token model (``predict(params, tokens [1, T])`` gives
        logits ``[1, T, vocab]``).
      params: its parameters.
      prompt: the token ids to start from.
      max_new_tokens: how many tokens to add.
      temperature: 0 picks the most likely token (greedy); above 0 draws from
        ``softmax(logits / temperature)``.
      key: a PRNG key, needed when ``temperature > 0``; draw ``i`` uses
        ``jax.random.fold_in(key, i)``.
      stop_tokens: token ids that end the sequence (an end-of-sequence token).

    Raises:
      ValueError: an empty prompt, a negative ``max_new_tokens`` or
        ``temperature``, or sampling without a ``key``.
    """
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    if prompt.size == 0:
        raise ValueError("prompt: needs at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
        raise ValueError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature!r}")
    if temperature > 0 and key is None:
        raise ValueError("key: sampling at a temperature above 0 needs a PRNG key")
    n = prompt.size
    tokens = np.zeros((1, n + max_new_tokens), np.int32)
    tokens[0, :n] = prompt
    logits_at = _logits_at(model)
    stop = {int(t) for t in stop_tokens}
    for i in range(n, n + max_new_tokens):
        logits = logits_at(params, tokens, i - 1)
        if temperature > 0:
            draw = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
        else:
            draw = jnp.argmax(logits)
        tokens[0, i] = int(draw)
        if tokens[0, i] in stop:
            return tokens[0, : i + 1]
    return tokens[0]


def generate_text(
    loaded,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    key: jax.Array | None = None,
) -> str:
    """``prompt`` and its continuation, as text: ``generate`` over a loaded
    checkpoint (``load_gpt2``'s ``GPT2``: ``model``, ``params``, ``tokenizer``;
    ``load_decoder``'s ``Decoder`` also ``generation``, whose
    ``eos_token_ids`` end the continuation).

    Raises:
      ValueError: the checkpoint has no tokenizer, or as ``generate``.
    """
    if loaded.tokenizer is None:
        raise ValueError("generate_text: the checkpoint has no tokenizer.json")
    ids = loaded.tokenizer.encode(prompt).ids
    out = generate(
        loaded.model,
        loaded.params,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        key=key,
        stop_tokens=getattr(getattr(loaded, "generation", None), "eos_token_ids", ()),
    )
    return loaded.tokenizer.decode([int(i) for i in out])
