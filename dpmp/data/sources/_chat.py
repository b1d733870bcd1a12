"""``chat``: a user's ``.jsonl`` of conversations, one ``{"messages": [...]}`` per line,
rendered by the tokenizer's ``chat_template`` with the loss on the assistant's
tokens only (``dpmp.data._chat``).

It is private data only (``data.dataset = "chat"``); it needs a tokenizer: a
checkpoint's own (``model.checkpoint``) or ``data.tokenizer``, with the
``tokenizer_config.json`` that holds its template beside it.
"""

from __future__ import annotations

from dpmp.data._chat import chat_dataset, read_chat_file
from dpmp.data._dataset import Dataset
from dpmp.data.sources._base import (
    SourceOptions,
    TextSource,
    register_source,
    with_jsonl_users,
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

    def load(self, options: SourceOptions) -> Dataset:
        conversations, source = self.corpus.records(options.path, "data.path")
        data = chat_dataset(
            conversations,
            source,
            tokenizer=options.tokenizer,
            seq_len=options.seq_len,
            test_fraction=options.test_fraction,
            seed=options.seed,
        )
        return with_jsonl_users(data, options, self.name)


register_source(ChatSource(ChatFile()))
