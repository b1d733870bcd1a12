"""Llama, Qwen2 and Gemma checkpoint folders in the layout Hugging Face publishes.

A folder holds:

* ``config.json``: ``model_type`` (``"llama"``, ``"qwen2"`` or ``"gemma"``)
  and the sizes ``DecoderConfig`` reads (``dpmp.models.families._decoder``);
  other keys are not read;
* the weights: ``model.safetensors``, or shards ``model-0000k-of-0000n.safetensors``
  listed by ``model.safetensors.index.json`` (its ``weight_map``: tensor ->
  file). The tensor names are the published ones, with or without the
  ``model.`` prefix (``model.embed_tokens.weight``,
  ``model.layers.{i}.self_attn.q_proj.weight`` ``[out, in]``, ...,
  ``model.norm.weight``, ``lm_head.weight``). A tied model's
  ``lm_head.weight``, if stored, and the rotary ``inv_freq`` buffers are not read;
* ``tokenizer.json``: the ``tokenizers`` library's format (optional);
* ``generation_config.json`` (optional): its ``bos_token_id``, ``eos_token_id``
  (one id or a list), ``pad_token_id`` and ``max_length`` are read
  (``GenerationDefaults``); generation stops at an end-of-sequence token.

``load_decoder(folder)`` gives the model, its parameters in the dtype they are
stored in (a bfloat16 checkpoint stays bfloat16; linear weights transposed to
``[in, out]``), the tokenizer, the config and the generation defaults;
``save_decoder`` writes such a folder, sharded when asked. A missing, unexpected
or mis-shaped tensor is a ``DataError`` naming the tensor and its file, and so is
a shard index that lists a tensor in a file that does not hold it, or a shard
holding a tensor its index does not list there.
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
from dpmp.models.families._decoder import (
    DecoderConfig,
    Params,
    decoder_config_from_json,
    decoder_model,
)
from dpmp.precision._policy import Policy

__all__ = [
    "Decoder",
    "GenerationDefaults",
    "load_decoder",
    "read_decoder_config",
    "read_decoder_weights",
    "read_generation_defaults",
    "save_decoder",
]

CONFIG, WEIGHTS = "config.json", "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"
_PREFIX, _HEAD = "model.", "lm_head.weight"


class GenerationDefaults(NamedTuple):
    """What a checkpoint's ``generation_config.json`` says of its special tokens
    and length (each None, or ``()``, where it says nothing).

    Attributes:
      bos_token_id: the token a sequence starts with.
      eos_token_ids: the tokens that end a sequence (generation stops after one).
      pad_token_id: the padding token.
      max_length: the longest sequence to generate, prompt included.
    """

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    max_length: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``generation_config.json`` keys that ``read_generation_defaults`` reads back."""
        eos = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        raw = {"bos_token_id": self.bos_token_id, "eos_token_id": eos or None}
        raw |= {"pad_token_id": self.pad_token_id, "max_length": self.max_length}
        return {k: v for k, v in raw.items() if v is not None}


class Decoder(NamedTuple):
    """A loaded checkpoint: ``model`` (a ``dpmp.models.Model``), ``params`` (in
    the stored dtype), ``tokenizer`` (a ``tokenizers.Tokenizer`` or None),
    ``config`` (its ``DecoderConfig``) and ``generation`` (its
    ``GenerationDefaults``, all None without a ``generation_config.json``)."""

    model: Model
    params: Params
    tokenizer: Any
    config: DecoderConfig
    generation: GenerationDefaults = GenerationDefaults()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"checkpoint: {path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"checkpoint: {path} is not readable JSON ({e})") from None


def read_decoder_config(folder: str | Path) -> DecoderConfig:
    """The ``DecoderConfig`` of ``folder/config.json``.

    Raises:
      DataError: no such file, not JSON, an unsupported ``model_type`` or
        ``rope_type`` (named, with the supported ones), or a size missing or invalid.
    """
    path = Path(folder) / CONFIG
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise DataError(f"checkpoint: {path} must hold a JSON object")
    try:
        return decoder_config_from_json(raw)
    except (ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: {e}") from None


def read_generation_defaults(folder: str | Path) -> GenerationDefaults:
    """The ``GenerationDefaults`` of ``folder/generation_config.json``; all None
    if there is no such file.

    Raises:
      DataError: the file is not a JSON object, or a token id or ``max_length``
        is not a non-negative integer (named).
    """
    path = Path(folder) / GENERATION
    if not path.is_file():
        return GenerationDefaults()
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise DataError(f"checkpoint: {path} must hold a JSON object")
    eos = raw.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    given = ("bos_token_id", "pad_token_id", "max_length")
    fields = {k: [raw[k]] for k in given if raw.get(k) is not None}
    for key, values in (fields | {"eos_token_id": eos}).items():
        bad = [v for v in values if not _count(v)]
        if bad:
            raise DataError(f"{path}: {key} must be an integer >= 0, got {bad[0]!r}")
    return GenerationDefaults(
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        pad_token_id=raw.get("pad_token_id"),
        max_length=raw.get("max_length"),
    )


def _count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 0


def _hf_name(name: str) -> str:
    """The published tensor name of the parameter ``name``
    (``layers.0.input_layernorm.scale`` -> ``model.layers.0.input_layernorm.weight``)."""
    stem, _, leaf = name.rpartition(".")
    full = f"{stem}.{'bias' if leaf == 'bias' else 'weight'}"
    return full if full == _HEAD else _PREFIX + full


def _weight_files(folder: Path) -> tuple[dict[str, Path], dict[str, str] | None]:
    """``{file name: path}`` of the weight files (the index's shards, or the one
    file) and the index's ``weight_map`` (tensor -> file name; None without an index)."""
    index = folder / INDEX
    if index.is_file():
        raw = _read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise DataError(f"checkpoint: {index} has no 'weight_map' object of file names")
        return {f: folder / f for f in sorted(set(weight_map.values()))}, weight_map
    if not (folder / WEIGHTS).is_file():
        raise DataError(f"checkpoint: {folder / WEIGHTS} not found (nor {INDEX})")
    return {WEIGHTS: folder / WEIGHTS}, None


def _check_index(path: Path, keys: list[str], weight_map: dict[str, str]) -> None:
    """The shard ``path`` holds exactly the tensors ``weight_map`` lists in it."""
    index = path.parent / INDEX
    unlisted = [k for k in keys if weight_map.get(k) != path.name]
    if unlisted:
        key = unlisted[0]
        where = f"lists it in {weight_map[key]}" if key in weight_map else "does not list it"
        raise DataError(f"{path}: holds tensor {key!r}; {index} {where}")
    held = set(keys)
    absent = [k for k, f in weight_map.items() if f == path.name and k not in held]
    if absent:
        raise DataError(
            f"{index}: lists tensor {absent[0]!r} in {path.name}, which does not hold it"
        )


def _ignored(name: str, config: DecoderConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (name == _HEAD and config.tie_word_embeddings)


def _stored_names(
    files: dict[str, Path], weight_map: dict[str, str] | None, config: DecoderConfig
) -> dict[str, tuple[Path, str]]:
    """``{published name: (file, key)}`` of every tensor the files hold, less
    those not read; keys with or without the ``model.`` prefix. Each shard is
    checked against the index (``_check_index``)."""
    from safetensors import SafetensorError, safe_open

    stored = {}
    for path in files.values():
        if not path.is_file():
            raise DataError(f"checkpoint: {path} not found (listed in {INDEX})")
        try:
            with safe_open(str(path), framework="numpy") as f:
                keys = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise DataError(f"checkpoint: {path} is not a safetensors file ({e})") from None
        if weight_map is not None:
            _check_index(path, keys, weight_map)
        for key in keys:
            name = key if key.startswith(_PREFIX) or key == _HEAD else _PREFIX + key
            if not _ignored(name, config):
                stored[name] = (path, key)
    return stored


def read_decoder_weights(folder: str | Path, config: DecoderConfig) -> Params:
    """The parameters in ``folder``'s weight files, in their stored dtypes, linear
    weights transposed to ``[in, out]``.

    Raises:
      DataError: no weight file, or a tensor missing, unexpected, of another shape
        or not floating point (named, with its file).
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    files, weight_map = _weight_files(folder)
    stored = _stored_names(files, weight_map, config)
    wanted = {_hf_name(n): (n, s) for n, s in config.shapes().items()}
    missing = [n for n in wanted if n not in stored]
    if missing:
        where = ", ".join(files)
        raise DataError(
            f"{folder}: missing tensor {missing[0]!r} ({len(missing)} missing; in {where})"
        )
    unexpected = [n for n in stored if n not in wanted]
    if unexpected:
        path, key = stored[unexpected[0]]
        raise DataError(f"{path}: unexpected tensor {key!r} ({len(unexpected)} in all)")
    flat = {}
    for path in files.values():  # each file opened once, its tensors in the order wanted
        here = [(name, spec) for name, spec in wanted.items() if stored[name][0] == path]
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name, (param, shape) in here:
                    flat[param] = _tensor(f, path, stored[name][1], param, shape)
        except (SafetensorError, OSError) as e:
            raise DataError(f"checkpoint: {path} is not a safetensors file ({e})") from None
    return nest(flat)


def _tensor(f, path: Path, key: str, param: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``key`` of the open file ``f``, checked against the parameter's
    ``shape`` (a linear weight's ``[out, in]`` transposed to the kernel's ``[in, out]``)."""
    kernel = param.endswith(".kernel")
    hf_shape = shape[::-1] if kernel else shape
    got = tuple(f.get_slice(key).get_shape())
    if got != hf_shape:
        raise DataError(f"{path}: tensor {key!r} has shape {got}, expected {hf_shape}")
    value = f.get_tensor(key)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise DataError(f"{path}: tensor {key!r} is {value.dtype}, not floating")
    return np.ascontiguousarray(value.T) if kernel else value


def load_decoder(
    folder: str | Path,
    policy: Policy | str = "f32",
    *,
    pad_id: int | None = None,
    config: DecoderConfig | None = None,
) -> Decoder:
    """The Llama, Qwen2 or Gemma checkpoint in ``folder`` (see the module docstring).

    Args:
      folder: holds ``config.json``, the weights and optionally ``tokenizer.json``
        and ``generation_config.json``.
      policy: the forward pass's dtypes; the parameters stay in their stored dtype.
      pad_id: a token id that is never a target of the loss; default: the
        tokenizer's ``<pad>`` or ``[PAD]`` if it has one, else none.
      config: ``read_decoder_config(folder)`` if the caller has read it already
        (``config.json`` is then not read again).

    Raises:
      DataError: a bad file (named), as ``read_decoder_config``,
        ``read_decoder_weights`` and ``read_generation_defaults`` say, or a
        tokenizer of more tokens than the embedding has rows.
    """
    config = read_decoder_config(folder) if config is None else config
    params = read_decoder_weights(folder, config)
    tokenizer = checkpoint_tokenizer(folder, config.vocab_size, "embed_tokens.weight")
    if pad_id is None and tokenizer is not None:
        pad_id = pad_token_id(tokenizer)
    model = decoder_model(config, policy, pad_id=pad_id)
    return Decoder(model, params, tokenizer, config, read_generation_defaults(folder))


def save_decoder(
    folder: str | Path,
    params: Params,
    config: DecoderConfig,
    tokenizer=None,
    *,
    shard_bytes: int | None = None,
    generation: GenerationDefaults | None = None,
) -> Path:
    """Writes ``params`` (in their own dtypes, the published names and ``[out,
    in]`` orientation), ``config.json`` and, if given, ``tokenizer`` and
    ``generation`` as a folder ``load_decoder`` reads; returns the folder.

    Args:
      shard_bytes: if given, the tensors go to shards
        ``model-0000k-of-0000n.safetensors`` of at most this many bytes each (a
        larger tensor alone in its shard), listed by ``model.safetensors.index.json``.
      generation: written as ``generation_config.json`` (a ``Decoder``'s own, to
        keep its special tokens).
    """
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config.to_json(), indent=2) + "\n"
    (folder / CONFIG).write_text(text, encoding="utf-8")
    flat = {}
    for name, leaf in param_names(params).items():
        value = np.asarray(leaf)
        flat[_hf_name(name)] = np.ascontiguousarray(value.T if name.endswith(".kernel") else value)
    if shard_bytes is None:
        save_file(flat, str(folder / WEIGHTS), metadata={"format": "pt"})
    else:
        _save_shards(folder, flat, shard_bytes)
    if tokenizer is not None:
        tokenizer.save(str(folder / TOKENIZER))
    if generation is not None:
        text = json.dumps(generation.to_json(), indent=2) + "\n"
        (folder / GENERATION).write_text(text, encoding="utf-8")
    return folder


def _save_shards(folder: Path, flat: dict[str, np.ndarray], shard_bytes: int) -> None:
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in flat.items():
        if shards[-1] and size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    n, weight_map = len(shards), {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(v.nbytes for v in flat.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
