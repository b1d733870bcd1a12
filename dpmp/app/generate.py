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
the command line is ``dpmp generate RUN_DIR --prompt TEXT``. Generation
reads only released parameters: it spends no epsilon.
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
from dpmp.models import generate_text, init_adapters, merge

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
    if checkpoint is None and not Path(m.checkpoint).is_dir():
        raise ConfigError(
            f"model.checkpoint: report.json names the checkpoint folder {m.checkpoint!r} "
            "without its path (it publishes none of your folders): give the folder with "
            "--checkpoint DIR"
        )
    field = "model.checkpoint" if checkpoint is None else "checkpoint"
    folder = checkpoint_folder(m.checkpoint if checkpoint is None else checkpoint, field)
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
) -> str:
    """``prompt`` and ``max_new_tokens`` tokens generated after it by the run's
    trained model (greedy at temperature 0; else sampled with ``seed``).

    Raises:
      ValueError: as ``load_trained``, an empty prompt, or a prompt and
        ``max_new_tokens`` longer than the model's ``n_positions``.
    """
    trained = load_trained(run_dir, checkpoint)
    return _continue(trained, prompt, max_new_tokens, temperature, seed)


def _continue(trained: Any, prompt: str, max_new_tokens: int, temperature: float, seed: int):
    n = len(trained.tokenizer.encode(prompt).ids)
    if n == 0:
        raise ValueError(f"prompt: {prompt!r} has no tokens")
    most = trained.config.n_positions
    if n + max_new_tokens > most:
        raise ValueError(
            f"max_new_tokens: the prompt's {n} tokens and {max_new_tokens} new ones are more "
            f"than the model's n_positions {most}; at most {max(most - n, 0)} new ones"
        )
    key: Any = jax.random.key(seed) if temperature > 0 else None
    return generate_text(
        trained, prompt, max_new_tokens=max_new_tokens, temperature=temperature, key=key
    )
