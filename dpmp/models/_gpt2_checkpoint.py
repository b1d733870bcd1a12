"""GPT-2 checkpoint folders in the layout their publishers use.

A folder holds:

* ``config.json``: ``model_type`` ``"gpt2"``, ``vocab_size``, ``n_positions``,
  ``n_embd``, ``n_layer``, ``n_head``, ``layer_norm_epsilon`` (default 1e-5)
  and ``activation_function`` (``"gelu_new"``, the default); other keys are
  not read;
* ``model.safetensors``: GPT-2's tensor names (``wte.weight``,
  ``wpe.weight``, ``h.{i}.ln_1.weight``, ``h.{i}.attn.c_attn.weight``
  ``[n_embd, 3 n_embd]`` used as ``x @ W + b``, ..., ``ln_f.bias``), with or
  without a ``transformer.`` prefix. The causal-mask buffers
  ``h.{i}.attn.bias`` and ``h.{i}.attn.masked_bias`` and a stored copy of the
  tied head, ``lm_head.weight``, are not read;
* ``tokenizer.json``: the ``tokenizers`` library's format (optional).

``load_gpt2(folder)`` gives the model, its parameters in the dtype they are
stored in (a bfloat16 checkpoint stays bfloat16; the policy's compute dtype
is used in the forward pass) and the tokenizer; ``save_gpt2`` writes such a
folder. A missing, unexpected or mis-shaped tensor, another ``model_type``
or a tokenizer of more tokens than the embedding has rows is a ``DataError``
naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from dpmp.data._dataset import DataError
from dpmp.data._tokenizer import TOKENIZER, checkpoint_tokenizer, pad_token_id
from dpmp.models._model import Model
from dpmp.models._params_file import nest, param_names
from dpmp.models.families._gpt2 import GPT2Config, Params, gpt2_model
from dpmp.precision._policy import Policy

__all__ = ["GPT2", "encode_text", "load_gpt2", "load_tokenizer", "read_config", "save_gpt2"]

CONFIG, WEIGHTS = "config.json", "model.safetensors"
# PyTorch's pickled weights: never read (unpickling runs code), their conversion named
_TORCH_WEIGHTS = "pytorch_model.bin"
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
# stored by some writers, never read: causal-mask buffers and the tied head's copy
_BUFFERS = ("attn.bias", "attn.masked_bias")
_TIED_HEAD = "lm_head.weight"


class GPT2(NamedTuple):
    """A loaded checkpoint: ``model`` (a ``dpmp.models.Model``), ``params``
    (in the stored dtype), ``tokenizer`` (a ``tokenizers.Tokenizer`` or None)
    and ``config`` (its ``GPT2Config``)."""

    model: Model
    params: Params
    tokenizer: Any
    config: GPT2Config


def read_config(folder: str | Path) -> GPT2Config:
    """The ``GPT2Config`` of ``folder/config.json``.

    Raises:
      DataError: no such file, not JSON, not a GPT-2 (``model_type``,
        ``architectures``, ``activation_function``) or a size missing or invalid.
    """
    path = Path(folder) / CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"checkpoint: {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"checkpoint: {path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise DataError(f"checkpoint: {path} must hold a JSON object")
    kind = raw.get("model_type")
    if kind != "gpt2":
        raise DataError(f"{path}: model_type {kind!r} is not supported; allowed: 'gpt2'")
    unknown = [a for a in raw.get("architectures") or () if a not in _ARCHITECTURES]
    if unknown:
        raise DataError(
            f"{path}: architecture {unknown[0]!r} is not supported; "
            f"allowed: {', '.join(map(repr, _ARCHITECTURES))}"
        )
    activation = raw.get("activation_function", "gelu_new")
    if activation != "gelu_new":
        raise DataError(f"{path}: activation_function {activation!r}; allowed: 'gelu_new'")
    missing = [k for k in _SIZES if k not in raw]
    if missing:
        raise DataError(f"{path}: no {missing[0]!r}")
    sizes = {k: raw[k] for k in _SIZES}
    try:
        return GPT2Config(**sizes, layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5))
    except ValueError as e:
        raise DataError(f"{path}: {e}") from None


def _gpt2_name(name: str) -> str:
    """GPT-2's tensor name of the parameter ``name`` (``h.0.ln_1.scale`` ->
    ``h.0.ln_1.weight``)."""
    stem, _, leaf = name.rpartition(".")
    return f"{stem}.{'bias' if leaf == 'bias' else 'weight'}"


def _ignored(name: str) -> bool:
    return name == _TIED_HEAD or (name.startswith("h.") and name.endswith(_BUFFERS))


def read_weights(folder: str | Path, config: GPT2Config) -> Params:
    """The parameters in ``folder/model.safetensors``, in their stored dtypes.

    Raises:
      DataError: no such file, or a tensor missing, unexpected, of another shape
        or not floating point (named).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / WEIGHTS
    if not path.is_file() and (Path(folder) / _TORCH_WEIGHTS).is_file():
        raise DataError(
            f"checkpoint: {path} not found, only {_TORCH_WEIGHTS} (PyTorch's pickle format, "
            "not read); convert it with transformers: AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(DIR, safe_serialization=True) writes model.safetensors"
        )
    if not path.is_file():
        raise DataError(f"checkpoint: {path} not found")
    wanted = {_gpt2_name(n): (n, s) for n, s in config.shapes().items()}
    try:
        with safe_open(str(path), framework="numpy") as f:
            stored = {k.removeprefix("transformer."): k for k in f.keys()}
            _check_names(path, stored, wanted)
            flat = {}
            for name, (param, shape) in wanted.items():
                got = tuple(f.get_slice(stored[name]).get_shape())
                if got != shape:
                    raise DataError(
                        f"{path}: tensor {name!r} has shape {got}, expected {shape} "
                        f"(n_embd {config.n_embd}, vocab_size {config.vocab_size}, "
                        f"n_positions {config.n_positions})"
                    )
                flat[param] = f.get_tensor(stored[name])
                if not jnp.issubdtype(flat[param].dtype, jnp.floating):
                    raise DataError(f"{path}: tensor {name!r} is {flat[param].dtype}, not floating")
    except (SafetensorError, OSError) as e:
        raise DataError(f"checkpoint: {path} is not a safetensors file ({e})") from None
    return nest(flat)


def _check_names(path: Path, stored: dict[str, str], wanted: dict[str, Any]) -> None:
    missing = [n for n in wanted if n not in stored]
    if missing:
        raise DataError(f"{path}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = [stored[n] for n in stored if n not in wanted and not _ignored(n)]
    if unexpected:
        raise DataError(f"{path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all)")


def load_tokenizer(folder: str | Path, vocab_size: int | None = None):
    """``folder/tokenizer.json`` as a ``tokenizers.Tokenizer``; None without one.

    Raises:
      DataError: not a tokenizer file, or it has more tokens than ``vocab_size``
        (the rows of the model's embedding).
    """
    return checkpoint_tokenizer(folder, vocab_size, "wte.weight")


def load_gpt2(
    folder: str | Path, policy: Policy | str = "f32", *, pad_id: int | None = None
) -> GPT2:
    """The GPT-2 checkpoint in ``folder`` (see the module docstring).

    Args:
      folder: holds ``config.json``, ``model.safetensors`` and optionally
        ``tokenizer.json``.
      policy: the forward pass's dtypes (``policy.compute``, ``policy.output``);
        the parameters stay in the dtype they are stored in.
      pad_id: a token id that is never a target of the loss (see
        ``gpt2_model``); default: the tokenizer's ``<pad>`` or ``[PAD]`` if it
        has one, else none.

    Raises:
      DataError: a bad file (named), as ``read_config``, ``read_weights`` and
        ``load_tokenizer`` say.
    """
    config = read_config(folder)
    params = read_weights(folder, config)
    tokenizer = load_tokenizer(folder, config.vocab_size)
    if pad_id is None and tokenizer is not None:
        pad_id = pad_token_id(tokenizer)
    return GPT2(gpt2_model(config, policy, pad_id=pad_id), params, tokenizer, config)


def save_gpt2(folder: str | Path, params: Params, config: GPT2Config, tokenizer=None) -> Path:
    """Writes ``params`` (in their own dtypes, GPT-2's tensor names), ``config``
    and, if given, ``tokenizer`` as a checkpoint folder ``load_gpt2`` reads;
    returns the folder."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    raw |= {k: getattr(config, k) for k in _SIZES}
    raw |= {"layer_norm_epsilon": config.layer_norm_epsilon, "activation_function": "gelu_new"}
    (folder / CONFIG).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    flat = {
        _gpt2_name(name): np.ascontiguousarray(np.asarray(leaf))
        for name, leaf in param_names(params).items()
    }
    save_file(flat, str(folder / WEIGHTS))
    if tokenizer is not None:
        tokenizer.save(str(folder / TOKENIZER))
    return folder


def encode_text(tokenizer, text: str) -> np.ndarray:
    """The token ids of ``text`` (int32 ``[n]``)."""
    return np.asarray(tokenizer.encode(text).ids, np.int32)
