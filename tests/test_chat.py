"""Chat records (``data.dataset = "chat"``): conversations rendered by the tokenizer's
``chat_template``, labels on the assistant's tokens only, one conversation one example.

References are independent of ``dpmp.data._chat``'s search for the assistant's
tokens: each assistant content tokenized alone and found in the sequence,
followed by the template's end-of-turn token; and, where ``transformers`` is
installed, its ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on
the same templates with ``{% generation %}`` around the assistant's content and
end of turn. The tokenizer is byte-level BPE (as Llama 3's and Qwen2's are),
trained here on a few sentences, with the templates' special tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from dpmp.app import cli
from dpmp.app.trainer.batches import gather
from dpmp.data import DataError, PoissonSampler
from dpmp.data._chat import ChatEncoder, load_chat_template, read_chat_file
from dpmp.data._tokens import IGNORE
from dpmp.data.sources import load_dataset

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>"]
SPECIAL += ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CORPUS = [
    "the cat sat on the mat and the dog ran far away",
    "You are a helpful assistant. What is two plus two? It is four.",
    "system user assistant hello there, how are you today? fine, thanks!",
    "déjà vu: naïve café — 猫 and 🐈 in one line\n\nwith two lines",
]

# Qwen2's published template (ChatML with a default system message).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Meta-Llama-3-8B-Instruct's published template (the content trimmed).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# The same two with transformers' {% generation %} markers around what the
# assistant writes: its content and the end-of-turn token.
CHATML_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n'}}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_MARKED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>")}
MARKED = {"chatml": CHATML_MARKED, "llama3": LLAMA3_MARKED}

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
    ],
    [
        {"role": "system", "content": "You are a cat."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "the cat sat on the mat"},
        {"role": "user", "content": "how are you today?"},
        {"role": "assistant", "content": "fine, thanks!\n\nwith two lines"},
    ],
    [
        {"role": "user", "content": "déjà vu?"},
        {"role": "assistant", "content": "naïve café — 猫 and 🐈"},
    ],
    [
        {"role": "user", "content": " the dog "},
        {"role": "assistant", "content": " ran far away "},  # Llama 3's template trims it
    ],
]


def _tokenizer() -> Tokenizer:
    """Byte-level BPE of ~400 ids with ``SPECIAL`` as special tokens; its
    post-processor trims offsets, as GPT-2's does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _folder(path, template: str | None, tokenizer: Tokenizer | None = None):
    """A tokenizer folder: ``tokenizer.json`` and a ``tokenizer_config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    (tokenizer or _tokenizer()).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|endoftext|>"}}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _chats(path, conversations) -> str:
    path.write_text("\n".join(json.dumps({"messages": c}) for c in conversations) + "\n")
    return str(path)


def _expected_mask(tokenizer: Tokenizer, ids: list[int], conversation, end: str) -> np.ndarray:
    """The assistant's positions found independently: each assistant content (as the
    template writes it: Llama 3's trimmed) tokenized alone, found in ``ids`` after the
    previous one, and the end-of-turn token right after it."""
    mask = np.zeros(len(ids), bool)
    end_id, at = tokenizer.token_to_id(end), 0
    for message in conversation:
        if message["role"] != "assistant":
            continue
        content = message["content"]
        alone = tokenizer.encode(content, add_special_tokens=False).ids
        if not _find(ids, alone + [end_id], at) >= 0:
            alone = tokenizer.encode(content.strip(), add_special_tokens=False).ids
        start = _find(ids, alone + [end_id], at)
        assert start >= 0, (content, ids)
        at = start + len(alone) + 1
        mask[start:at] = True
    return mask


def _find(seq: list[int], sub: list[int], at: int) -> int:
    return next((i for i in range(at, len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub), -1)


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_the_labels_are_the_assistant_contents_and_end_of_turn(tmp_path, style):
    template, end = TEMPLATES[style]
    tokenizer = _tokenizer()
    folder = _folder(tmp_path / "tok", template, tokenizer)
    encode = ChatEncoder(tokenizer, load_chat_template(folder))
    for conversation in CONVERSATIONS:
        ids, assistant = encode(conversation)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        default_system = style == "chatml" and conversation[0]["role"] != "system"
        assert text.count(end) == len(conversation) + default_system  # the text is whole
        np.testing.assert_array_equal(
            assistant, _expected_mask(tokenizer, ids, conversation, end), err_msg=text
        )


@pytest.mark.parametrize("style", sorted(MARKED))
def test_the_assistant_tokens_are_transformers_assistant_mask(tmp_path, style):
    transformers = pytest.importorskip("transformers")
    tokenizer = _tokenizer()
    ours = ChatEncoder(tokenizer, load_chat_template(_folder(tmp_path / "a", TEMPLATES[style][0])))
    marked = ChatEncoder(tokenizer, load_chat_template(_folder(tmp_path / "b", MARKED[style])))
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>"
    )
    theirs.chat_template = MARKED[style]
    for conversation in CONVERSATIONS:
        got = theirs.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        for encode in (ours, marked):  # the markers change nothing in the text
            ids, assistant = encode(conversation)
            assert ids == list(got["input_ids"])
            np.testing.assert_array_equal(assistant, np.asarray(got["assistant_masks"], bool))


def test_one_conversation_is_one_example_labelled_on_the_assistant_only(tmp_path):
    tokenizer = _tokenizer()
    folder = _folder(tmp_path / "tok", CHATML, tokenizer)
    # conversation i's assistant says "the cat" i times: no two rows are alike
    chats = [
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "cat " * i}]
        for i in range(1, 15)
    ]
    seq_len = 80  # holds every conversation whole
    data = load_dataset(
        "chat", path=_chats(tmp_path / "c.jsonl", chats), tokenizer=str(folder / "tokenizer.json"),
        seq_len=seq_len,
    )  # fmt: skip
    assert data.num_train + data.num_test == len(chats) and data.input_shape == (seq_len,)
    assert data.num_classes == tokenizer.get_vocab_size(with_added_tokens=True)
    encode = ChatEncoder(tokenizer, load_chat_template(folder))
    rows = {}
    for c in chats:
        ids, mask = encode(c)
        x = np.zeros(seq_len, np.int32)
        x[: min(len(ids), seq_len)] = ids[:seq_len]
        y = np.where(mask[1:], ids[1:], IGNORE)[:seq_len]
        rows[tuple(x)] = np.pad(y, (0, seq_len - len(y)), constant_values=IGNORE)
    assert len(rows) == len(chats) and sum(data.records_cut) == 0
    sampler = PoissonSampler(data.num_train, 6, padded_batch_size=14, seed=1, num_steps=3)
    for step in range(3):
        batch, pad = gather(data, sampler.batch(step))
        for x, y in zip(batch["x"][~pad], batch["y"][~pad], strict=True):
            np.testing.assert_array_equal(y, rows[tuple(x)])  # each row one whole record


def test_a_conversation_cut_before_its_answer_is_one_example_with_no_label(tmp_path):
    folder = _folder(tmp_path / "tok", LLAMA3)
    long = [{"role": "user", "content": "the cat sat on the mat " * 20}]
    chats = [long + [{"role": "assistant", "content": "four"}]] * 3
    chats += [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "four"}]] * 9
    data = load_dataset(
        "chat", path=_chats(tmp_path / "c.jsonl", chats), tokenizer=str(folder / "tokenizer.json"),
        seq_len=32, test_fraction=0.25,
    )  # fmt: skip
    encode = ChatEncoder(_tokenizer(), load_chat_template(folder))
    assert len(encode(chats[-1])[0]) <= 33 < len(encode(chats[0])[0])  # the first 3 are cut
    y = np.concatenate([data.y_train, data.y_test])
    assert data.cut_to == "33 tokens" and sum(data.records_cut) == 3
    assert ((y >= 0).sum(1) == 0).sum() == 3 and len(y) == len(chats)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", ":2: not a JSON object"),
        ('{"text": "hi"}', ':2: expected an object with a "messages" list'),
        ('{"messages": []}', ":2: an empty conversation"),
        (
            '{"messages": [{"role": "robot", "content": "x"}]}',
            ":2: message 0: unknown role 'robot'",
        ),
        ('{"messages": [{"role": "user"}]}', ":2: message 0: expected"),
        ('{"messages": [{"role": "user", "content": "x"}]}', ":2: no assistant message"),
    ],
)
def test_a_bad_line_is_named(tmp_path, line, message):
    good = json.dumps({"messages": CONVERSATIONS[0]})
    (tmp_path / "c.jsonl").write_text(f"{good}\n{line}\n")
    with pytest.raises(DataError, match=r"c\.jsonl" + message.replace("[", r"\[")):
        read_chat_file(str(tmp_path / "c.jsonl"))


def test_a_missing_or_other_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"^data\.path: no such file .*nope\.jsonl"):
        read_chat_file(str(tmp_path / "nope.jsonl"))
    (tmp_path / "c.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"^data\.path: c\.txt: expected a \.jsonl file"):
        read_chat_file(str(tmp_path / "c.txt"))


def test_a_folder_without_a_template_says_what_to_do(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer_config\.json: no chat_template; .* add"):
        load_chat_template(_folder(tmp_path / "plain", None))
    with pytest.raises(DataError, match=r"tokenizer_config\.json: no such file"):
        load_chat_template(tmp_path)
    raising = "{{ raise_exception('System role not supported') }}"
    template = load_chat_template(_folder(tmp_path / "gemma", raising))
    with pytest.raises(DataError, match="chat_template: System role not supported"):
        template.render(CONVERSATIONS[0])


def test_the_template_file_beside_the_tokenizer_wins(tmp_path):
    folder = _folder(tmp_path / "tok", LLAMA3)
    (folder / "chat_template.jinja").write_text(CHATML)
    assert load_chat_template(folder).source == CHATML


def _argv(tmp_path, *sets):
    argv = ["train", "--quiet", "--out", str(tmp_path / "run")]
    for s in sets:
        argv += ["--set", s]
    return argv


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "c.jsonl:13: not a JSON object"),
        ('{"messages": [{"role": "tool", "content": "x"}]}', "unknown role 'tool'"),
    ],
)
def test_a_bad_chat_file_exits_2_with_one_line(tmp_path, capsys, line, message):
    folder = _folder(tmp_path / "tok", CHATML)
    path = _chats(tmp_path / "c.jsonl", CONVERSATIONS * 3)
    with open(path, "a") as f:
        f.write(line + "\n")
    sets = ["data.dataset=chat", f"data.path={json.dumps(path)}", "model.kind=lm"]
    sets += [f"data.tokenizer={json.dumps(str(folder / 'tokenizer.json'))}"]
    assert cli.main(_argv(tmp_path, *sets)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_chat_records_without_a_tokenizer_exit_2(tmp_path, capsys):
    path = _chats(tmp_path / "c.jsonl", CONVERSATIONS * 3)
    sets = ["data.dataset=chat", f"data.path={json.dumps(path)}", "model.kind=lm"]
    assert cli.main(_argv(tmp_path, *sets)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "data.tokenizer: chat records need" in err, err


@pytest.mark.slow  # a private LoRA run of a tiny Qwen2 checkpoint through the CLI, ~20 s
def test_a_qwen2_checkpoint_fine_tunes_privately_on_chat_records(tmp_path):
    import jax

    from dpmp.models._hf_checkpoint import save_decoder
    from dpmp.models.families._decoder import decoder_config_from_json, decoder_init
    from tests.test_decoder import CONFIGS
    from tests.test_decoder_app import TINY, _items

    tokenizer = _tokenizer()
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = decoder_config_from_json(CONFIGS["qwen2"] | TINY | {"vocab_size": size})
    folder = save_decoder(tmp_path / "ckpt", decoder_init(config, jax.random.key(0)), config,
                          tokenizer)  # fmt: skip
    _folder(folder, CHATML, tokenizer)
    path = _chats(tmp_path / "c.jsonl", CONVERSATIONS * 5)
    sets = ["model.kind=qwen2", f"model.checkpoint={json.dumps(str(folder))}"]
    sets += ["data.dataset=chat", f"data.path={json.dumps(path)}", "data.seq_len=64"]
    sets += ["training.steps=2", "training.expected_batch_size=8", "training.eval_every=0"]
    sets += ["privacy.target_epsilon=8", "privacy.noise_multiplier=5.0", "model.lora_rank=2"]
    assert cli.main(_argv(tmp_path, *sets)) == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    text = json.dumps(report)
    assert "loss on the assistant's tokens only" in text  # the data it trained on
    assert report["test_loss"] > 0  # held-out assistant tokens, whole at 64 tokens
    eps = [v for k, v in _items(report) if k == "epsilon" and isinstance(v, int | float)]
    assert eps and 0 < min(eps) and max(eps) <= 8 * (1 + 1e-9)
    assert str(tmp_path) not in text  # the report names no private folder
