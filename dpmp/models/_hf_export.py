"""Trained parameters written in the layouts Hugging Face reads: merged weights
in the checkpoint's own files, or a PEFT LoRA adapter.

Two layouts of a checkpoint folder are known (``layout(config)``):

* Llama, Qwen2 and Gemma (``dpmp.models._hf_checkpoint``): linear weights
  stored ``[out, in]`` (the transpose of dpmp's ``kernel``), tensors named
  ``model.layers.{i}.self_attn.q_proj.weight`` (with or without ``model.``)
  and ``lm_head.weight``; the modules are ``nn.Linear``;
* GPT-2 (``dpmp.models._gpt2_checkpoint``): ``Conv1D`` weights stored ``[in,
  out]`` as dpmp holds them, named ``h.{i}.attn.c_attn.weight`` (with or
  without ``transformer.``).

``write_merged(source, dest, params, layout)`` writes the weight files of
``source`` again into ``dest`` with every tensor dpmp trained replaced by its
trained value: the same files (one, or the same shards and
``model.safetensors.index.json``), the same tensor names, each in the dtype
``source`` stores it in. Tensors dpmp does not read are copied (rotary
buffers, GPT-2's mask buffers) or, for a stored copy of a tied head, set to
the trained embedding.

``peft_adapter(adapters, alpha, layout)`` gives PEFT's ``adapter_config.json``
fields and ``adapter_model.safetensors`` tensors for dpmp's LoRA adapters
(``dpmp.models._lora``). dpmp adapts a kernel ``W [in, out]`` as ``W + s A B``
with ``A [in, r]``, ``B [r, out]``, ``s = alpha / r``; PEFT adapts a linear
layer's ``W [out, in]`` as ``W + s B' A'`` with ``lora_A.weight`` ``A' [r,
in]``, ``lora_B.weight`` ``B' [out, r]`` and ``s = lora_alpha / r``. So
``A' = A^T``, ``B' = B^T`` and ``lora_alpha = alpha``: the same update,
transposed. GPT-2's ``Conv1D`` layers are adapted by PEFT with
``fan_in_fan_out``, whose ``lora_A``/``lora_B`` have the same shapes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dpmp.data._dataset import DataError
from dpmp.models._gpt2_checkpoint import _gpt2_name
from dpmp.models._hf_checkpoint import INDEX, WEIGHTS, _hf_name
from dpmp.models._params_file import param_names
from dpmp.models.families._decoder import DecoderConfig
from dpmp.models.families._gpt2 import GPT2Config

__all__ = ["Layout", "layout", "peft_adapter", "write_merged"]

PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one family's checkpoint folder names and orients dpmp's parameters.

    Attributes:
      published: a parameter's name (``layers.0.self_attn.q_proj.kernel``) ->
        its full tensor name in the loaded Hugging Face model
        (``model.layers.0.self_attn.q_proj.weight``).
      canonical: a stored tensor key -> its full name (the prefix added if the
        file leaves it out).
      transposed: linear weights are stored ``[out, in]``, dpmp's kernels transposed.
      tied_head: ``(stored head, embedding)``: the full names of a tied head's
        stored copy and of the embedding it copies; None: the head is untied.
    """

    published: Callable[[str], str]
    canonical: Callable[[str], str]
    transposed: bool
    tied_head: tuple[str, str] | None


def _decoder_layout(config: DecoderConfig) -> Layout:
    def canonical(key: str) -> str:
        return key if key.startswith("model.") or key == "lm_head.weight" else "model." + key

    tied = ("lm_head.weight", "model.embed_tokens.weight") if config.tie_word_embeddings else None
    return Layout(_hf_name, canonical, transposed=True, tied_head=tied)


def _gpt2_layout(config: GPT2Config) -> Layout:
    del config  # GPT-2's head is always the token embedding

    def canonical(key: str) -> str:
        return (
            key
            if key.startswith("transformer.") or key == "lm_head.weight"
            else ("transformer." + key)
        )

    return Layout(
        lambda name: "transformer." + _gpt2_name(name),
        canonical,
        transposed=False,
        tied_head=("lm_head.weight", "transformer.wte.weight"),
    )


_LAYOUTS: dict[type, Callable[[Any], Layout]] = {
    DecoderConfig: _decoder_layout,
    GPT2Config: _gpt2_layout,
}


def layout(config: Any) -> Layout:
    """The ``Layout`` of a loaded checkpoint's config (a ``DecoderConfig`` or ``GPT2Config``).

    Raises:
      ValueError: a config of another kind (no Hugging Face layout is known).
    """
    make = _LAYOUTS.get(type(config))
    if make is None:
        raise ValueError(f"{type(config).__name__}: no Hugging Face layout is known for it")
    return make(config)


def _stored_value(name: str, value: Any, hf: Layout) -> np.ndarray:
    value = np.asarray(value)
    if hf.transposed and name.endswith(".kernel"):
        value = value.T
    return np.ascontiguousarray(value)


def write_merged(source: str | Path, dest: str | Path, params: Any, hf: Layout) -> list[str]:
    """Writes ``source``'s weight files into ``dest`` with the trained ``params``
    in place of the stored tensors (see the module docstring); returns the
    names of the files written.

    Raises:
      DataError: a weight file of ``source`` is missing or not safetensors, or a
        parameter has no stored tensor (the folder is not the run's checkpoint).
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import save_file

    source, dest = Path(source), Path(dest)
    trained = {hf.published(n): (n, v) for n, v in param_names(params).items()}
    index = source / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [WEIGHTS]
    written, found = [], set()
    for file in files:
        out = {}
        try:
            with safe_open(str(source / file), framework="numpy") as f:
                metadata = f.metadata()
                for key in f.keys():
                    full = hf.canonical(key)
                    if hf.tied_head and full == hf.tied_head[0]:
                        full = hf.tied_head[1]
                    stored = f.get_tensor(key)
                    if full in trained:
                        name, value = trained[full]
                        stored = _stored_value(name, value, hf).astype(stored.dtype)
                        found.add(full)
                    out[key] = stored
        except (SafetensorError, OSError) as e:
            raise DataError(f"checkpoint: {source / file} is not readable ({e})") from None
        save_file(out, str(dest / file), metadata=metadata)
        written.append(file)
    missing = sorted(set(trained) - found)
    if missing:
        raise DataError(f"{source}: holds no tensor {missing[0]!r} ({len(missing)} missing)")
    if index.is_file():
        shutil.copyfile(index, dest / INDEX)
        written.append(INDEX)
    return written


def _module(name: str, hf: Layout) -> str:
    """The Hugging Face module of the weight parameter ``name``
    (``layers.0.self_attn.q_proj.kernel`` -> ``model.layers.0.self_attn.q_proj``)."""
    return hf.published(name).removesuffix(".weight")


def peft_adapter(
    adapters: Mapping[str, Mapping[str, Any]], alpha: float, hf: Layout, weights: Any
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """PEFT's ``adapter_config.json`` fields (less the base model's name) and its
    tensors for dpmp's LoRA ``adapters`` (``{name: {"a": A [in, r], "b": B [r, out]}}``,
    names as ``dpmp.models._lora`` gives them) at scale ``alpha / r``.

    ``target_modules`` are the adapted modules' short names
    (``["k_proj", "q_proj", ...]``) when dpmp adapted every module of the
    model's ``weights`` so named, else their full names.

    Raises:
      ValueError: an adapter of a weight that is not a matrix, or adapters of
        different ranks.
    """
    tensors, modules, ranks = {}, [], set()
    for slashed, ab in sorted(adapters.items()):
        name = slashed.replace("/", ".")
        a, b = np.asarray(ab["a"]), np.asarray(ab["b"])
        if a.ndim != 2 or b.ndim != 2:
            raise ValueError(f"adapter {name!r}: A and B must be matrices")
        module = _module(name, hf)
        modules.append(module)
        ranks.add(a.shape[1])
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T)
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T)
    if len(ranks) != 1:
        raise ValueError(f"adapters of ranks {sorted(ranks)}: PEFT's r is one rank")
    short = sorted({m.rpartition(".")[2] for m in modules})
    every = {
        _module(n, hf)
        for n, leaf in param_names(weights).items()
        if n.endswith(".kernel") and np.ndim(leaf) == 2
    }
    same_named = {m for m in every if m.rpartition(".")[2] in short}
    targets = short if same_named == set(modules) else sorted(modules)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": ranks.pop(),
        "lora_alpha": alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": not hf.transposed,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    return config, tensors
