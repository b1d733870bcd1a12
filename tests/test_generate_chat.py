"""``dpmp generate --chat`` (``generate_from_run(..., chat=True)``): a run trained on
chat records is prompted as they were rendered and answers with its reply alone.

The prompt's reference is the checkpoint's template rendered with the generation
prompt and tokenized whole without added special tokens, and, where
``transformers`` is installed, its ``apply_chat_template(...,
add_generation_prompt=True)``. Where the reply stops is checked on a scripted
model whose next token is a lookup table of the last one: it writes two words,
then the template's end of turn (or the checkpoint's end-of-sequence token),
then more words that must not be printed. The checkpoints are tiny random Llama
folders with the byte-level tokenizer and templates of ``tests/test_chat.py``.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import processors

from dpmp.app import cli
from dpmp.app import generate as app_generate
from dpmp.app.checkpoint import save_checkpoint
from dpmp.app.config import load_config
from dpmp.app.release import config_dict
from dpmp.data._chat import load_chat_template
from dpmp.models import generate
from dpmp.models._hf_checkpoint import GenerationDefaults, load_decoder, save_decoder
from dpmp.models.families._decoder import decoder_config_from_json, decoder_init
from tests.test_chat import TEMPLATES, _folder, _tokenizer
from tests.test_decoder import CONFIGS
from tests.test_decoder_app import TINY

SYSTEM, USER = "You are a cat.", "hello there, how are you today?"


def _checkpoint(folder, template, generation=None):
    """A random tiny Llama folder: weights, tokenizer.json, tokenizer_config.json
    (with ``template`` unless None) and ``generation``'s generation_config.json.
    Its tokenizer adds ``<|begin_of_text|>`` when asked for special tokens, as Llama
    3's does: a chat prompt must not (the template writes what it wants)."""
    tokenizer = _tokenizer()
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(
                single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
            ),
        ]
    )
    config = decoder_config_from_json(
        CONFIGS["llama"] | TINY | {"vocab_size": tokenizer.get_vocab_size()}
    )
    params = decoder_init(config, jax.random.key(0))
    save_decoder(folder, params, config, tokenizer, generation=generation)
    return _folder(folder, template, tokenizer)


def _run(tmp_path, folder, dataset="chat"):
    """A finished run of ``folder``'s model, full fine-tuning, on ``dataset``: its
    report.json's config and a checkpoint holding the folder's own weights (the
    trainer's float32 masters)."""
    run = tmp_path / "run"
    run.mkdir()
    data = tmp_path / ("chats.jsonl" if dataset == "chat" else "records.txt")
    overrides = ["model.kind=llama", f'model.checkpoint="{folder}"']
    overrides += [f"data.dataset={dataset}", f'data.path="{data}"']
    config = config_dict(load_config(None, overrides))
    (run / "report.json").write_text(json.dumps({"config": config}))
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), load_decoder(folder).params)
    count = len(jax.tree.leaves(params))
    save_checkpoint(run / "checkpoints", step=1, state=params, meta={"params_leaves": [0, count]})
    return run


def _messages(system):
    return ([{"role": "system", "content": SYSTEM}] if system else []) + [
        {"role": "user", "content": USER}
    ]


def _expected_prompt(folder, tokenizer, style, system) -> list[int]:
    """The template's rendering with the generation prompt, tokenized whole without
    added special tokens; equal to ``transformers``' where it is installed."""
    template = load_chat_template(folder)
    text = template.render(_messages(system), add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    try:
        import transformers
    except ImportError:
        return ids
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>"
    )
    theirs.chat_template = TEMPLATES[style][0]
    got = theirs.apply_chat_template(_messages(system), tokenize=True, add_generation_prompt=True)
    got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
    assert list(got) == ids, style
    return ids


def _ask(capsys, run, *extra):
    status = cli.main(["generate", str(run), "--prompt", USER, *extra])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("system", [False, True])
def test_the_reply_follows_the_templates_rendering_and_is_printed_alone(
    tmp_path, capsys, style, system
):
    """The real tiny model: what ``--chat`` prints is the greedy continuation of the
    reference prompt ids, cut at the end of turn or end of sequence, decoded alone."""
    folder = _checkpoint(tmp_path / "ckpt", TEMPLATES[style][0])
    run = _run(tmp_path, folder)
    loaded = load_decoder(folder)
    tokenizer = loaded.tokenizer
    ids = _expected_prompt(folder, tokenizer, style, system)
    ends = {tokenizer.token_to_id(TEMPLATES[style][1]), tokenizer.token_to_id("<|endoftext|>")}
    new = 6
    out = generate(loaded.model, loaded.params, ids, max_new_tokens=new, stop_tokens=sorted(ends))
    assert list(out[: len(ids)]) == ids
    reply = [int(t) for t in out[len(ids) :] if int(t) not in ends]
    extra = ["--chat", "--max-new-tokens", str(new)] + (["--system", SYSTEM] if system else [])
    status, printed, err = _ask(capsys, run, *extra)
    assert status == 0, err
    assert printed == tokenizer.decode(reply, skip_special_tokens=True) + "\n"
    assert err == ""  # no hint: --chat was given
    # the library's answer is the same
    got = app_generate.generate_from_run(
        run, USER, max_new_tokens=new, chat=True, system=SYSTEM if system else None
    )
    assert got + "\n" == printed


def _scripted(loaded, prompt_end: int, script: list[int], seen: list):
    """``loaded`` with a model whose next token after ``prompt_end`` is ``script[0]``,
    after ``script[k]`` is ``script[k + 1]`` (the last repeats), as a one-hot logit
    of 10 over the vocabulary; every token buffer it reads is appended to ``seen``."""
    vocab = loaded.config.vocab_size
    table = np.arange(vocab, dtype=np.int32)  # any other token: itself
    chain = [prompt_end, *script]
    assert len(set(chain)) == len(chain)  # a chain, no cycle before its end
    for a, b in zip(chain, script, strict=False):
        table[a] = b
    table[script[-1]] = script[-1]
    table = jnp.asarray(table)

    def predict(params, tokens):
        jax.debug.callback(lambda t: seen.append(np.asarray(t)[0].tolist()), tokens)
        return 10.0 * jax.nn.one_hot(table[tokens], vocab)

    return loaded._replace(model=dataclasses.replace(loaded.model, predict=predict))


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("stop", ["end of turn", "generation_config eos"])
def test_the_reply_stops_at_the_end_of_turn_or_eos(tmp_path, capsys, monkeypatch, style, stop):
    tokenizer = _tokenizer()
    eos = tokenizer.token_to_id("<|start_header_id|>" if style == "chatml" else "<|im_start|>")
    generation = GenerationDefaults(eos_token_ids=(eos,))  # a token no template writes
    folder = _checkpoint(tmp_path / "ckpt", TEMPLATES[style][0], generation)
    run = _run(tmp_path, folder)
    ids = _expected_prompt(folder, tokenizer, style, system=False)
    words = tokenizer.encode(" cat sat", add_special_tokens=False).ids
    more = tokenizer.encode(" dog", add_special_tokens=False).ids
    assert len(words) == 2 and len(more) == 1 and ids[-1] not in words + more
    end = tokenizer.token_to_id(TEMPLATES[style][1]) if stop == "end of turn" else eos
    script = [*words, end, *more]
    seen: list = []
    real = app_generate.load_trained
    monkeypatch.setattr(
        app_generate,
        "load_trained",
        lambda *a, **k: _scripted(real(*a, **k), ids[-1], script, seen),
    )
    status, printed, err = _ask(capsys, run, "--chat", "--max-new-tokens", "8")
    assert status == 0, err
    # the model read the prompt, then wrote the two words and the end: three reads
    assert len(seen) == 3 and all(buffer[: len(ids)] == ids for buffer in seen)
    assert [b[len(ids) : len(ids) + k] for k, b in enumerate(seen)] == [[], words[:1], words]
    assert printed == tokenizer.decode(words, skip_special_tokens=True) + "\n"
    assert USER not in printed and printed.strip() == "cat sat"
    # without --chat: the prompt as raw text, printed with its continuation, and a hint
    seen.clear()
    status, printed, err = _ask(capsys, run, "--max-new-tokens", "2")
    assert status == 0 and printed.startswith(USER)
    assert seen and seen[0][: len(ids)] != ids
    assert err.startswith("dpmp generate: note: the run was trained on chat records; --chat")


def test_a_text_run_gets_no_hint(tmp_path, capsys):
    folder = _checkpoint(tmp_path / "ckpt", TEMPLATES["chatml"][0])
    run = _run(tmp_path, folder, dataset="text")
    status, printed, err = _ask(capsys, run, "--max-new-tokens", "1")
    assert status == 0 and printed.startswith(USER) and err == ""


def _refused(capsys, argv, *needles):
    assert cli.main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dpmp generate: error: "), err
    for needle in needles:
        assert needle in err, err


def test_chat_without_a_template_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    folder = _checkpoint(tmp_path / "ckpt", None)
    run = _run(tmp_path, folder)
    loads = []
    monkeypatch.setattr(app_generate, "load_trained", lambda *a, **k: loads.append(a))
    argv = [str(run), "--prompt", USER, "--chat"]
    _refused(capsys, argv, f"chat: {str(folder)!r} has no chat template", "leave out --chat")
    (folder / "tokenizer_config.json").unlink()  # no tokenizer_config.json at all
    _refused(capsys, argv, f"chat: {str(folder)!r} has no chat template")
    assert loads == []  # refused before the model is read
    _refused(capsys, [str(run), "--prompt", USER, "--system", SYSTEM], "--system", "--chat")
    with pytest.raises(ValueError, match="needs chat"):
        app_generate.generate_from_run(run, USER, system=SYSTEM)


def test_a_template_that_fails_is_one_line_exit_2(tmp_path, capsys):
    refuses = "{{ raise_exception('System role not supported') }}"
    folder = _checkpoint(tmp_path / "ckpt", refuses)
    run = _run(tmp_path, folder)
    argv = [str(run), "--prompt", USER, "--chat"]
    _refused(capsys, argv, "tokenizer_config.json: chat_template: System role not supported")
