"""Chat records: conversations rendered by a checkpoint's ``chat_template``, the loss
on the assistant's tokens only.

A chat file is JSONL, one conversation per line::

    {"messages": [{"role": "system", "content": "..."},
                  {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

One line is one record, one example, the privacy unit (as a line of text is).
``read_chat_file`` reads and checks it; ``load_chat_template`` reads the
template beside a ``tokenizer.json``; a ``ChatEncoder`` renders a conversation
and tokenizes it, marking the tokens the assistant wrote (and, for generation,
gives the ids of a conversation followed by the assistant's header and the token
that ends its reply); ``chat_dataset``
makes the next-token ``Dataset`` of per-token labels (``dpmp.data._tokens``):
``y[i, t]`` is the token after ``x[i, t]`` where that token is the
assistant's, else ``IGNORE`` (no loss).

The template, as ``transformers`` renders it: the ``chat_template`` of
``tokenizer_config.json`` (or of ``chat_template.jinja`` beside it, which
``transformers`` writes since 4.43 and prefers), compiled in Jinja's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``tojson`` that does not escape HTML,
``raise_exception(message)``, the ``{% generation %}`` tag (rendered as its
body), ``messages``, ``add_generation_prompt`` and the special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``unk_token``,
``pad_token``). No clock: ``strftime_now`` is undefined, so a template that
asks ``strftime_now is defined`` (Llama 3.1 and later) writes its own fixed
date and the rendering is a function of the record alone. The text is
tokenized whole, without the tokenizer's added special tokens
(``add_special_tokens=False``, as ``apply_chat_template`` does): the template
writes ``bos_token`` itself where the model wants it.

Which tokens are the assistant's: for each assistant message ``k``, the
conversation is rendered up to it with the generation prompt
(``messages[:k]``, ``add_generation_prompt=True``: everything before the
assistant's first word) and through it (``messages[:k + 1]``); each must be a
prefix of the next and of the whole conversation, else the template is refused.
Between the two lies the assistant's turn, in which the message's content is
found as written (or stripped, for templates that trim it). Its tokens are
those whose characters (the tokenizer's offsets, without post-processor
trimming) overlap the content, and the tokens after it up to and including
the first special token of the turn: the template's end of turn
(``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, an ``eos_token``), so
that the model learns to stop. The header before the content (``<|im_start|>
assistant``) and whatever the template writes after the end-of-turn token (a
newline) are not the assistant's; nor is any other message.

Truncation: a conversation of more than ``seq_len + 1`` tokens keeps its first
``seq_len + 1`` and drops the rest, as text does. A conversation whose
assistant tokens all lie past that is still one example, with no label (zero
loss and zero gradient); how many records were cut is a statistic of the
private data, kept in ``Dataset.records_cut`` (the run writes it to
``private/`` only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpmp.data._dataset import DataError, Dataset, split_positions
from dpmp.data._tokenizer import load_tokenizer, vocab_size
from dpmp.data._tokens import IGNORE, encode_token_records, split_token_records

__all__ = [
    "ROLES",
    "TEMPLATE_FILE",
    "TOKENIZER_CONFIG",
    "ChatEncoder",
    "ChatTemplate",
    "NoChatTemplate",
    "chat_dataset",
    "load_chat_template",
    "read_chat_file",
]

ROLES = ("system", "user", "assistant")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# The special tokens a template may write, as tokenizer_config.json names them.
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")

Message = dict[str, Any]


def read_chat_file(path: str | None, field: str = "data.path") -> tuple[list[list[Message]], str]:
    """``(conversations, description)`` of a ``.jsonl`` file of ``{"messages": [...]}``
    objects, one per non-empty line; each message an object with a ``role`` of
    ``ROLES`` and a string ``content`` (other keys are passed to the template).

    Raises:
      DataError: no such file, not ``.jsonl``, not UTF-8, or a line that is not
        JSON, has no ``messages`` list, an empty one, a message without a string
        ``role`` and ``content``, an unknown role, or no assistant message; one
        line naming the file and line.
    """
    file = Path(str(path))
    if not file.is_file():
        what = "is not a regular file" if file.exists() else "no such file"
        raise DataError(f"{field}: {what} {str(file)!r}")
    if file.suffix != ".jsonl":
        raise DataError(f'{field}: {file.name}: expected a .jsonl file of {{"messages": [...]}}')
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text: {e}") from None
    conversations = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            conversations.append(_conversation(line, f"{file}:{number}"))
    return conversations, f"{file.name} (one conversation per JSON line)"


def _conversation(line: str, where: str) -> list[Message]:
    """The ``messages`` of one JSON line, checked; errors start with ``where``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a JSON object: {e.msg}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        raise DataError(f'{where}: expected an object with a "messages" list')
    messages = obj["messages"]
    if not messages:
        raise DataError(f'{where}: an empty conversation ("messages": [])')
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not all(
            isinstance(message.get(k), str) for k in ("role", "content")
        ):
            raise DataError(
                f'{where}: message {j}: expected {{"role": ..., "content": ...}} with strings'
            )
        if message["role"] not in ROLES:
            raise DataError(
                f"{where}: message {j}: unknown role {message['role']!r} "
                f"(allowed: {', '.join(ROLES)})"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (the loss is on assistant tokens only)")
    return [dict(m) for m in messages]


class NoChatTemplate(DataError):
    """A tokenizer folder without a chat template: no ``tokenizer_config.json``, or
    neither ``chat_template.jinja`` nor a ``chat_template`` in it."""


class ChatTemplate:
    """A compiled ``chat_template`` and the special tokens it may write.

    Attributes:
      source: the template's Jinja text.
      tokens: ``bos_token``, ``eos_token``, ... as strings (those the file sets).
      where: the file it came from, for messages.
    """

    def __init__(self, source: str, tokens: dict[str, str], where: str):
        self.source, self.tokens, self.where = source, dict(tokens), where
        self._template = _compile(source, where)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The text of ``messages`` (with the assistant's header after them when
        ``add_generation_prompt``).

        Raises:
          DataError: the template failed (its ``raise_exception`` message, or
            Jinja's), naming the template's file.
        """
        import jinja2

        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.tokens
            )
        except jinja2.TemplateError as e:
            reason = e.message or type(e).__name__
            raise DataError(f"{self.where}: chat_template: {reason}") from None


def _compile(source: str, where: str) -> Any:
    """``source`` compiled as ``transformers`` compiles a chat template (module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: its body, unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    if _version(jinja2.__version__) < (3, 1, 6):  # chat templates are the checkpoint's code
        raise DataError(
            f"{where}: jinja2 {jinja2.__version__} has known sandbox escapes; chat templates "
            "need jinja2 >= 3.1.6 (pip install -U jinja2)"
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(
            f"{where}: chat_template is not a Jinja template: {e.message} (line {e.lineno})"
        ) from None


def _version(text: str) -> tuple[int, ...]:
    """``"3.1.6"`` as ``(3, 1, 6)`` (a part's leading digits; ``"0rc1"`` is 0)."""
    parts = []
    for part in text.split(".")[:3]:
        digits = part[: len(part) - len(part.lstrip("0123456789"))] or "0"
        parts.append(int(digits))
    return tuple(parts)


def load_chat_template(folder: str | Path) -> ChatTemplate:
    """The chat template of the tokenizer in ``folder``: ``chat_template.jinja`` if
    there is one, else ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of ``{"name", "template"}`` of which the one named ``"default"``), with
    the special tokens ``tokenizer_config.json`` names.

    Raises:
      NoChatTemplate: no ``tokenizer_config.json``, or no template in it (one line
        naming the file and what to do).
      DataError: not a JSON object, or a template Jinja cannot parse.
    """
    folder = Path(folder)
    file = folder / TOKENIZER_CONFIG
    if not file.is_file():
        raise NoChatTemplate(
            f"{file}: no such file; chat records are rendered by the chat_template of the "
            f"tokenizer's {TOKENIZER_CONFIG}: use the folder of a chat (instruct) model"
        )
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{file}: not a JSON object ({e})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{file}: not a JSON object")
    tokens = {k: _token_text(raw[k]) for k in _SPECIAL if _token_text(raw.get(k)) is not None}
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), tokens, str(jinja_file))
    source = raw.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source.strip():
        raise NoChatTemplate(
            f"{file}: no chat_template; chat records are rendered by it (as the model's "
            f'serving stack renders them): add your model\'s template, or use data.dataset = "text"'
        )
    return ChatTemplate(source, tokens, str(file))


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it (a string, or an
    ``AddedToken`` object with ``content``), as text; None when unset."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatEncoder:
    """Renders conversations by ``template`` and tokenizes them by ``tokenizer`` (a
    ``tokenizers.Tokenizer``), marking the assistant's tokens (module docstring)."""

    def __init__(self, tokenizer: Any, template: ChatTemplate):
        from tokenizers import Tokenizer

        # A copy without the post-processor: the same ids without added special
        # tokens, and offsets that cover every character (a byte-level
        # post-processor trims spaces off them).
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.post_processor = None
        self.template = template
        self.special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    def __call__(self, messages: Sequence[Message]) -> tuple[list[int], np.ndarray]:
        """``(ids, assistant)``: the token ids of the rendered conversation and a bool
        mask ``[len(ids)]`` of the assistant's tokens.

        Raises:
          DataError: the template fails, does not render prefix by prefix, or does
            not write an assistant message's content as given.
        """
        text = self.template.render(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets
        assistant = np.zeros(len(ids), bool)
        for start, end, turn_end in _assistant_spans(self.template, messages, text):
            inside = [
                j
                for j, (a, b) in enumerate(offsets)
                if (a < end and b > start) or (a == b and start <= a < end)
            ]
            assistant[inside] = True
            after = inside[-1] + 1 if inside else _first_at(offsets, start)
            for j in range(after, len(ids)):  # up to the turn's first special token
                if offsets[j][0] >= turn_end:
                    break
                if ids[j] in self.special:
                    assistant[after : j + 1] = True
                    break
        return list(ids), assistant

    def prompt(self, messages: Sequence[Message]) -> list[int]:
        """The token ids of ``messages`` rendered with the generation prompt (the
        assistant's header after them) and tokenized as ``__call__`` tokenizes: what
        a model trained on such records reads before it writes the next reply.

        Raises:
          DataError: the template fails.
        """
        text = self.template.render(messages, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def end_of_turn(self, messages: Sequence[Message]) -> int | None:
        """The special token that ends an assistant's reply after ``messages`` (the
        last of a reply's tokens ``__call__`` marks: ``<|im_end|>``, ``<|eot_id|>``,
        ``<end_of_turn>``), found by rendering a reply to them; None if the
        template writes no special token after a reply.

        Raises:
          DataError: as ``__call__``.
        """
        ids, assistant = self([*messages, {"role": "assistant", "content": "ok"}])
        marked = np.flatnonzero(assistant)
        if marked.size and ids[marked[-1]] in self.special:
            return int(ids[marked[-1]])
        return None


def _first_at(offsets: Sequence[tuple[int, int]], start: int) -> int:
    """The first token that begins at or after character ``start``."""
    return next((j for j, (a, _) in enumerate(offsets) if a >= start), len(offsets))


def _assistant_spans(
    template: ChatTemplate, messages: Sequence[Message], text: str
) -> list[tuple[int, int, int]]:
    """``(start, end, turn_end)`` characters of each assistant message's content in
    ``text`` (the whole conversation rendered), and where its turn ends."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = template.render(messages[:k], add_generation_prompt=True)
        turn = template.render(messages[: k + 1])
        if not (turn.startswith(head) and text.startswith(turn)):
            raise DataError(
                f"{template.where}: chat_template does not render a conversation prefix by "
                f"prefix (message {k}, the assistant's, changes the text before it)"
            )
        written = turn[len(head) :]
        content = message["content"]
        at = written.find(content)
        if at < 0:
            content = content.strip()
            at = written.find(content)
        if at < 0:
            raise DataError(
                f"{template.where}: chat_template does not write message {k}'s content as "
                "given (the assistant's tokens cannot be found)"
            )
        start = len(head) + at
        spans.append((start, start + len(content), len(turn)))
    return spans


def chat_dataset(
    conversations: list[list[Message]],
    source: str,
    *,
    tokenizer: str | None,
    seq_len: int,
    test_fraction: float,
    seed: int,
    field: str = "data.tokenizer",
) -> Dataset:
    """A next-token ``Dataset`` of ``conversations``, rendered by the chat template
    beside the ``tokenizer.json`` at ``tokenizer`` and tokenized by it, one example
    per conversation, labels on the assistant's tokens only, split by
    ``split_positions``; at most ``seq_len + 1`` tokens each (module docstring).

    Raises:
      DataError: no tokenizer, a tokenizer or template that cannot be used (named),
        or too few conversations.
    """
    if tokenizer is None:
        raise DataError(
            f"{field}: chat records need a tokenizer.json with a {TOKENIZER_CONFIG} (its "
            "chat_template) beside it: set model.checkpoint to a chat model's folder, or "
            f"{field} to its tokenizer.json"
        )
    encoder = load_tokenizer(tokenizer, field)
    template = load_chat_template(Path(str(tokenizer)).parent)
    train, test = split_positions(len(conversations), test_fraction, seed)
    encode = ChatEncoder(encoder, template)
    encoded = []
    for number, conversation in enumerate(conversations, start=1):
        try:
            encoded.append(encode(conversation))
        except DataError as e:
            raise DataError(f"{e} (conversation {number})") from None
    x, y = encode_token_records([ids for ids, _ in encoded], seq_len)
    for i, (_, assistant) in enumerate(encoded):
        labelled = np.zeros(seq_len, bool)  # y[i, t] predicts token t + 1
        kept = assistant[1 : seq_len + 1]
        labelled[: len(kept)] = kept
        y[i, ~labelled] = IGNORE
    vocab = vocab_size(encoder)
    description = (
        f"{source}: {len(train)} train / {len(test)} test conversations, rendered by "
        f"{Path(template.where).name}'s chat_template and tokenized by "
        f"{Path(str(tokenizer)).name} ({vocab} token ids), {seq_len} predicted tokens per "
        f"record, loss on the assistant's tokens only (longer ones cut; split "
        f"test_fraction={test_fraction}, seed={seed})"
    )
    ids = [ids for ids, _ in encoded]
    return split_token_records(x, y, ids, train, test, vocab=vocab, description=description)
