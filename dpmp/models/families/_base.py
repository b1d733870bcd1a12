"""Built-in model families: what a family is, their registry, and ``build_model``.

A family is a small object (``ModelFamily``) with a ``name`` (the value
of the config's ``model.kind``), the ``task`` of the data it fits
(``"classify"`` or ``"next_token"``, as ``Dataset.task``), the ``[model]``
keys that set its size, whether it is read from a published ``checkpoint``
folder, and ``build(architecture, input_shape, num_classes, policy) ->
Model``. A new family is one file that defines it and registers it::

    class Wide:
        name = "wide"
        task = "classify"
        sizes = ("hidden",)
        checkpoint = None

        def build(self, architecture, input_shape, num_classes, policy) -> Model:
            ...

    register_family(Wide())

A family read from a checkpoint folder (``checkpoint`` set) is also a
``CheckpointFamily``: it declares the ``config.json`` ``model_type`` values it
reads and ``load``s its folder.

Your own model does not need a family: ``dpmp.models.as_model`` adapts a
flax, Equinox or plain-JAX model.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dpmp._registry import Registry, members
from dpmp.data.sources import SOURCES
from dpmp.models._model import Model
from dpmp.precision._policy import Policy

__all__ = [
    "FAMILIES",
    "Architecture",
    "CheckpointFamily",
    "ModelFamily",
    "build_model",
    "family_reading",
    "register_family",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    """The sizes of a built-in model; each family reads the ones it has.

    Attributes:
      hidden: hidden layer widths of the MLPs (``linear`` with none: softmax regression).
      patch: ViT patch size in pixels; must divide the image side.
      dim: ViT and LM width.
      depth: number of ViT or LM blocks.
      heads: ViT and LM attention heads (dividing ``dim``).
    """

    hidden: tuple[int, ...] = (256,)
    patch: int = 2
    dim: int = 64
    depth: int = 2
    heads: int = 4

    def widths(self, input_shape: tuple[int, ...], num_classes: int) -> list[int]:
        """The MLP's layer widths: flattened input, ``hidden``, classes."""
        return [math.prod(input_shape), *self.hidden, num_classes]


@runtime_checkable
class ModelFamily(Protocol):
    """A named built-in model.

    Attributes:
      name: the name it is registered and configured by (``model.kind``).
      task: the ``Dataset.task`` it fits: ``"classify"`` or ``"next_token"``.
      sizes: the ``Architecture`` fields (``[model]`` keys) that set its
        number of parameters, which a model too large for the machine is
        named by (``("hidden",)``); empty when none does.
      checkpoint: what its published folder holds (``"a GPT-2 checkpoint
        folder"``) when the model, its sizes and its parameters are read from
        ``model.checkpoint`` rather than built from the ``[model]`` sizes; None
        for a family ``build`` makes.
    """

    name: str
    task: str
    sizes: tuple[str, ...]
    checkpoint: str | None

    def build(
        self,
        architecture: Architecture,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        """The model for examples of ``input_shape`` and ``num_classes`` classes (or
        the vocabulary); the forward pass in ``policy.compute``.

        Raises:
          ValueError: the family does not fit the input.
        """
        ...


@runtime_checkable
class CheckpointFamily(ModelFamily, Protocol):
    """A family whose model, sizes and parameters are read from a checkpoint folder.

    Attributes:
      model_types: the ``config.json`` ``model_type`` values it reads (``("gpt2",)``).
    """

    model_types: tuple[str, ...]

    def load(self, folder: Path, policy: Policy) -> Any:
        """The checkpoint in ``folder``, its forward pass in ``policy``: a record
        with ``model`` (a ``Model``), ``params`` (in the stored dtype),
        ``tokenizer`` (a ``tokenizers.Tokenizer`` or None) and ``config`` (its
        sizes, with ``vocab_size`` and ``n_positions``, the longest sequence;
        what saves the folder again).

        Raises:
          DataError: a bad folder, or one of a ``model_type`` it does not read (named).
        """
        ...


# ``model.kind``: the built-in families.
FAMILIES: Registry[ModelFamily] = Registry("model family", protocol=ModelFamily)


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Makes ``family.name`` a valid ``model.kind``; returns ``family``.

    Raises:
      TypeError: ``family`` lacks a member of ``ModelFamily``, or of
        ``CheckpointFamily`` when its ``checkpoint`` is set (named).
      ValueError: the name is taken and ``replace`` is false.
    """
    if getattr(family, "checkpoint", None) is not None:
        missing = [m for m in members(CheckpointFamily) if not hasattr(family, m)]
        if missing:
            raise TypeError(
                f"model family {getattr(family, 'name', None)!r} is read from a checkpoint "
                f"and lacks {', '.join(missing)} (see CheckpointFamily)"
            )
    return FAMILIES.register(family, replace=replace)


def family_reading(model_type: Any) -> ModelFamily | None:
    """The registered family that reads checkpoints of ``model_type`` (a
    ``config.json`` ``model_type``), or None."""
    for family in FAMILIES:
        if model_type in getattr(family, "model_types", ()):
            return family
    return None


def build_model(
    kind: str,
    data_info: Any,
    policy: Policy | str,
    architecture: Architecture | None = None,
) -> Model:
    """Builds the family registered as ``kind`` for data with ``data_info.input_shape``,
    ``data_info.num_classes`` and ``data_info.task`` (a ``dpmp.Dataset`` works).

    Raises:
      ValueError: no such family, or it does not fit the data (a language model
        on class labels, a classifier on text, a ViT on flat features).
    """
    family = FAMILIES.get(kind)
    architecture = Architecture() if architecture is None else architecture
    policy = Policy.parse(policy)
    input_shape = tuple(int(d) for d in data_info.input_shape)
    task = getattr(data_info, "task", "classify")
    if family.task != task:
        raise ValueError(_mismatch(kind, family.task, task))
    return family.build(architecture, input_shape, int(data_info.num_classes), policy)


def _mismatch(kind: str, wanted: str, task: str) -> str:
    def fitting(registry: Registry) -> str:
        return " or ".join(repr(v.name) for v in registry if v.task == wanted)

    if wanted == "next_token":
        return f"model.kind = {kind!r} needs a text dataset (data.dataset = {fitting(SOURCES)})"
    if task == "next_token":
        texts = " or ".join(repr(f.name) for f in FAMILIES if f.task == task)
        return f"model.kind = {kind!r} classifies; text data needs model.kind = {texts}"
    return f"model.kind = {kind!r} fits {wanted} data, not {task} data"
