"""What a run's config builds: its data set and its model.

The library below the application knows no config: data sources and model
families are registries (``dpmp.data.sources``, ``dpmp.models.families``)
called with explicit arguments. These functions translate the config's
``[data]`` and ``[model]`` sections into those calls, and load a user's model
named as ``model.kind = "package.module:factory"``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from dpmp.app.config import ConfigError, DataConfig, ModelConfig
from dpmp.app.config_checkpoint import CHECKPOINT_KINDS
from dpmp.data._dataset import Dataset
from dpmp.data.sources import load_dataset
from dpmp.models._adapters import as_model
from dpmp.models._model import Model
from dpmp.models.families import Architecture, build_model
from dpmp.precision._policy import Policy

__all__ = ["architecture", "load_data", "load_factory", "model_from_config"]


def load_data(config: DataConfig | None = None, seed: int = 0) -> Dataset:
    """Loads, validates and splits the configured data (no standardisation).

    Args:
      config: a ``DataConfig`` (default: the digits data).
      seed: seeds the train/test split when the data has no test split.

    Raises:
      DataError: the source's data cannot be used (the message names the
        array or file and what is wrong).
    """
    config = DataConfig() if config is None else config
    return load_dataset(
        config.dataset,
        path=config.path,
        test_fraction=config.test_fraction,
        seq_len=config.seq_len,
        seed=seed,
        tokenizer=config.tokenizer,
        features=config.features,
        user_field=config.user_field,
    )


def architecture(config: ModelConfig) -> Architecture:
    """The sizes of a built-in model, from the ``[model]`` section."""
    return Architecture(
        hidden=config.hidden,
        patch=config.patch,
        dim=config.dim,
        depth=config.depth,
        heads=config.heads,
    )


def model_from_config(config: ModelConfig, data_info: Any, policy: Policy | str) -> Model:
    """The configured model for data with ``input_shape`` and ``num_classes``: a
    built-in family, a checkpoint's (``model.kind = "gpt2"``, ``"llama"``, ...), or
    ``factory(input_shape, num_classes)`` of ``"module:factory"``."""
    if config.kind in CHECKPOINT_KINDS:  # its sizes are the checkpoint's
        from dpmp.app.published import checkpoint_folder, load_checkpoint

        folder = checkpoint_folder(config.checkpoint)
        return load_checkpoint(config.kind, folder, Policy.parse(policy)).model
    if ":" not in config.kind:
        return build_model(config.kind, data_info, policy, architecture(config))
    shape = tuple(int(d) for d in data_info.input_shape)
    made = load_factory(config.kind)(shape, int(data_info.num_classes))
    try:
        tokens = getattr(data_info, "task", "classify") == "next_token"
        dtype = np.int32 if tokens else np.float32
        model = as_model(made, shape, data_info.num_classes, policy, input_dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.kind: {config.kind} returned an unusable model: {e}") from None
    return dataclasses.replace(
        model, kind=config.kind, description=f"{model.description}, from {config.kind}"
    )


def load_factory(kind: str) -> Callable:
    """The ``factory`` of ``"package.module:factory"``; a ``ConfigError`` names what failed."""
    module_name, _, attr = kind.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"model.kind: cannot import {module_name!r} ({e}); put the folder that holds it "
            "on PYTHONPATH"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.kind: {module_name!r} has no function {attr!r}")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without one: called as it is
        return factory
    try:
        signature.bind((1,), 2)
    except TypeError:
        raise ConfigError(
            f"model.kind: {kind} takes {signature}; a model factory takes "
            "(input_shape, num_classes) and returns the model"
        ) from None
    return factory
