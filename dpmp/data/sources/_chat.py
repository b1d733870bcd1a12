"""``chat``: a user's ``.jsonl`` of conversations, one ``{"messages": [...]}`` per line,
rendered by the tokenizer's ``chat_template`` with the loss on the assistant's
tokens only (``dpmp.data._chat``).

It is private data only (``data.dataset = "chat"``); it needs a tokenizer: a
checkpoint's own (``model.checkpoint``) or ``data.tokenizer``, with the
``tokenizer_config.json`` that holds its template beside it.
"""

from __future__ import annotations

from dpmp.data._chat import chat_dataset, read_chat_file
from dpmp.data.sources._base import (
    TextSource,
    register_source,
)


class ChatFile:
    """The conversations of the chat file at ``path``."""

    name = "chat"
    needs_path = True

    def records(self, path: str | None, field: str) -> tuple[list, str]:
        return read_chat_file(path, field)


class ChatSource(TextSource):
    """Chat records as a next-token data source: text encoded by a tokenizer (so a
    ``TextSource``: ``data.tokenizer`` and a checkpoint's tokenizer apply), one
    conversation per example, labels on the assistant's tokens."""

    dataset = staticmethod(chat_dataset)
    renders_chat = True


register_source(ChatSource(ChatFile()))
