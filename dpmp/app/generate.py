"""Text from a finished run of a checkpoint's model: its trained parameters over
its checkpoint folder.

``load_trained(run_dir)`` reads what a run of ``model.kind = "gpt2"`` (or
another family read from a checkpoint: ``"llama"``, ``"qwen2"``, ``"gemma"``)
released and returns the family's loaded checkpoint (a ``dpmp.models.GPT2``,
a ``Decoder``) holding the trained parameters:

* the run's config, from ``report.json`` (a finished run);
* the model and its pre-trained parameters, from the folder of
  ``model.checkpoint`` (or the one given instead, if it has moved);
* the trained parameters: ``params.npz`` (``dpmp export``) if the run has one,
  so that its secret ``checkpoints/`` are never read, else the newest
  checkpoint's parameters. With ``model.lora_rank > 0`` these are the
  adapters, merged into the checkpoint's weights (``dpmp.models.merge``);
* the tokenizer: the checkpoint's ``tokenizer.json`` (or ``data.tokenizer``,
  of the same vocabulary, when the folder has none).

``generate_from_run`` continues a prompt with it (``dpmp.models.generate_text``);
the command line is ``dpmp generate RUN_DIR --prompt TEXT``. With ``chat=True``
(``--chat``) the prompt is a user's message instead, prompted as the run's chat
records were rendered (``data.dataset = "chat"``, ``dpmp.data._chat``): by the
chat template beside the tokenizer, with the assistant's header after it,
tokenized without added special tokens; the reply stops at the template's end
of turn or the checkpoint's end-of-sequence tokens, and is returned alone.
Generation reads only released parameters: it spends no epsilon.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.app.checkpoint import CheckpointError, load_params
from dpmp.app.config import Config, ConfigError
from dpmp.app.config_checkpoint import CHECKPOINT_KINDS
from dpmp.app.export import CHECKPOINTS_DIR, PARAMS_FILE
from dpmp.app.published import checkpoint_folder, load_checkpoint
from dpmp.app.run_dir import REPORT_FILE
from dpmp.data import DataError
from dpmp.data._chat import ChatEncoder, ChatTemplate, NoChatTemplate, load_chat_template
from dpmp.models import generate, generate_text, init_adapters, merge

__all__ = ["generate_from_run", "load_trained", "run_config"]


def run_config(run_dir: str | Path) -> Config:
    """The config of the finished run in ``run_dir`` (its ``report.json``).

    Raises:
      CheckpointError: no such run, not finished, or a report without a config.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointError(f"run directory: no such folder {str(run_dir)!r}")
    path = run / REPORT_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found (the run has not finished)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))["config"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{path}: not a dpmp report (it holds no config)") from None
    return Config.from_dict(raw)


def load_trained(run_dir: str | Path, checkpoint: str | Path | None = None) -> Any:
    """The model of the run in ``run_dir`` with its trained parameters (see the
    module docstring); ``checkpoint``: its checkpoint folder, if not where
    ``model.checkpoint`` says.

    Raises:
      ConfigError: the run is not of a checkpoint's model, or there is no tokenizer.
      CheckpointError: no finished run, or no parameters (``params.npz`` or
        ``checkpoints/``), or parameters of another model.
      DataError: a bad checkpoint folder (named).
    """
    config = run_config(run_dir)
    m = config.model
    if m.kind not in CHECKPOINT_KINDS:
        raise ConfigError(
            f"model.kind: the run trained {m.kind!r}; generation needs a run of "
            f"model.kind = {', '.join(map(repr, CHECKPOINT_KINDS))}"
        )
    folder, field = _folder(config, checkpoint)
    loaded = load_checkpoint(m.kind, folder, config.precision)
    key = jax.random.key(0)
    like = jax.eval_shape(loaded.model.init, key)  # the trainer's float32 masters
    base = jax.tree.map(lambda a, b: jnp.asarray(a, b.dtype), loaded.params, like)
    if m.lora_rank:
        like = jax.eval_shape(lambda k: init_adapters(base, m.lora_rank, k, m.lora_targets), key)
    trained = load_params(_params_source(Path(run_dir)), like)
    params = merge(base, trained, m.lora_alpha, targets=m.lora_targets) if m.lora_rank else trained
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        if config.data.tokenizer is None:
            raise ConfigError(f"{field}: {str(folder)!r} has no tokenizer.json")
        from dpmp.data._tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.data.tokenizer)
    return loaded._replace(params=params, tokenizer=tokenizer)


def _folder(config: Config, checkpoint: str | Path | None) -> tuple[Path, str]:
    """The run's checkpoint folder (``checkpoint``, else ``model.checkpoint``) and
    the field that named it."""
    m = config.model
    if checkpoint is None and not Path(m.checkpoint).is_dir():
        raise ConfigError(
            f"model.checkpoint: report.json names the checkpoint folder {m.checkpoint!r} "
            "without its path (it publishes none of your folders): give the folder with "
            "--checkpoint DIR"
        )
    field = "model.checkpoint" if checkpoint is None else "checkpoint"
    return checkpoint_folder(m.checkpoint if checkpoint is None else checkpoint, field), field


def _params_source(run: Path) -> Path:
    """``params.npz`` if the run was exported, else the run (its newest checkpoint)."""
    if (run / PARAMS_FILE).is_file():
        return run / PARAMS_FILE
    if not (run / CHECKPOINTS_DIR).is_dir():
        raise CheckpointError(
            f"{run}: has neither {PARAMS_FILE} (dpmp export) nor {CHECKPOINTS_DIR}/: "
            "no trained parameters"
        )
    return run


def generate_from_run(
    run_dir: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 20,
    temperature: float = 0.0,
    seed: int = 0,
    checkpoint: str | Path | None = None,
    chat: bool = False,
    system: str | None = None,
) -> str:
    """Text generated by the run's trained model (greedy at temperature 0; else
    sampled with ``seed``), at most ``max_new_tokens`` tokens.

    Args:
      run_dir: a finished run of a checkpoint's model (``load_trained``).
      prompt: without ``chat``, the text to continue: returned followed by its
        continuation. With ``chat``, a user's message: rendered as the run's
        chat records were (module docstring), the assistant's reply returned
        alone (its special tokens skipped).
      max_new_tokens: the most tokens to add; generation stops earlier at an
        end-of-sequence token of the checkpoint (``generation_config.json``)
        and, with ``chat``, at the template's end of turn.
      temperature: 0 for the most likely token each time, else sampled from
        ``softmax(logits / temperature)``.
      seed: seeds the sampling.
      checkpoint: the run's checkpoint folder, if not where ``model.checkpoint`` says.
      chat: prompt with the checkpoint's chat template (``chat_template.jinja``
        or ``tokenizer_config.json``'s ``chat_template`` beside its tokenizer).
      system: with ``chat``, a system message before the user's.

    Raises:
      ValueError: as ``load_trained``, ``system`` without ``chat``, an empty
        prompt (without ``chat``), a prompt and ``max_new_tokens`` longer than
        the model's ``n_positions``, or with ``chat`` a folder without a chat
        template (named) or a template that fails.
    """
    if system is not None and not chat:
        raise ValueError("system: a system message is a chat message; it needs chat (--chat)")
    template = _chat_template(run_dir, checkpoint) if chat else None  # before the model
    trained = load_trained(run_dir, checkpoint)
    if template is None:
        return _continue(trained, prompt, max_new_tokens, temperature, seed)
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": prompt})
    return _reply(trained, template, messages, max_new_tokens, temperature, seed)


def _chat_template(run_dir: str | Path, checkpoint: str | Path | None) -> ChatTemplate:
    """The chat template beside the tokenizer ``load_trained`` reads: the checkpoint
    folder's, or ``data.tokenizer``'s folder's when the checkpoint has no
    ``tokenizer.json``."""
    config = run_config(run_dir)
    folder, _ = _folder(config, checkpoint)
    if not (folder / "tokenizer.json").is_file() and config.data.tokenizer is not None:
        folder = Path(config.data.tokenizer).parent
    try:
        return load_chat_template(folder)
    except NoChatTemplate:
        raise DataError(
            f"chat: {str(folder)!r} has no chat template (neither chat_template.jinja nor a "
            "chat_template in tokenizer_config.json): leave out --chat to continue the prompt "
            "as raw text"
        ) from None


def _check_length(trained: Any, n: int, max_new_tokens: int) -> None:
    most = trained.config.n_positions
    if n + max_new_tokens > most:
        raise ValueError(
            f"max_new_tokens: the prompt's {n} tokens and {max_new_tokens} new ones are more "
            f"than the model's n_positions {most}; at most {max(most - n, 0)} new ones"
        )


def _continue(trained: Any, prompt: str, max_new_tokens: int, temperature: float, seed: int):
    n = len(trained.tokenizer.encode(prompt).ids)
    if n == 0:
        raise ValueError(f"prompt: {prompt!r} has no tokens")
    _check_length(trained, n, max_new_tokens)
    key: Any = jax.random.key(seed) if temperature > 0 else None
    return generate_text(
        trained, prompt, max_new_tokens=max_new_tokens, temperature=temperature, key=key
    )


def _reply(
    trained: Any,
    template: ChatTemplate,
    messages: list[dict[str, str]],
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> str:
    """The assistant's reply to ``messages``: generated after their rendering with
    the generation prompt, up to the end of turn or an end-of-sequence token."""
    encoder = ChatEncoder(trained.tokenizer, template)
    ids = encoder.prompt(messages)
    _check_length(trained, len(ids), max_new_tokens)
    stop = set(getattr(getattr(trained, "generation", None), "eos_token_ids", ()))
    stop.add(encoder.end_of_turn(messages))
    stop.add(trained.tokenizer.token_to_id(template.tokens.get("eos_token", "")))
    stop.discard(None)
    key: Any = jax.random.key(seed) if temperature > 0 else None
    out = generate(
        trained.model,
        trained.params,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        key=key,
        stop_tokens=sorted(stop),
    )
    new = [int(i) for i in out[len(ids) :]]
    if new and new[-1] in stop:
        new = new[:-1]
    return trained.tokenizer.decode(new, skip_special_tokens=True)
