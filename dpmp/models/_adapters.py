"""Your own model, as the trainer sees it: flax linen, flax nnx, Equinox or functions.

``as_model(obj, input_shape, num_classes, policy)`` turns a user model into a
``dpmp.models._model.Model`` (``init``, ``loss_fn``, ``predict``, ``metrics``):

=====================  ==============================================================
form                   how it is used
=====================  ==============================================================
flax linen module      ``params = module.init(key, zeros[1, *input_shape])["params"]``,
                       ``module.apply({"params": params}, x)``
flax nnx module        ``graphdef, params, rest = nnx.split(module, nnx.Param, ...)``;
                       only the ``nnx.Param`` leaves train; ``nnx.merge`` per call
Equinox module         ``params, static = eqx.partition(module, eqx.is_inexact_array)``;
                       called on ONE example (Equinox's convention), ``jax.vmap``-ed
``(init, apply)``      ``params = init(key)``, ``apply(params, x) -> outputs``
=====================  ==============================================================

An nnx or Equinox module arrives initialised by its own keys, so
``training.seed`` does not re-initialise it. Every form is called with its
floating parameters and inputs cast to ``policy.compute`` (as jmp does: the
gradients flow back to float32 master parameters) and its outputs cast to
``policy.output``; ``loss(outputs, labels)`` (default: softmax cross-entropy
on integer labels) gives one loss per example, in float32.

Per-example clipping needs each example's gradient to depend on that example
alone: a model with batch statistics (BatchNorm's ``batch_stats``, nnx
``BatchStat``) is refused with a message saying so.

Models are called with no dropout randomness and no train flag, so dropout is
off, and the model's ``name`` and ``description`` say so, naming the dropout
layers ("dropout off"). An nnx module's ``nnx.Dropout`` layers are made
deterministic (one that holds ``rngs`` would otherwise apply the same stored
mask at every step) and an Equinox module is put in inference mode
(``eqx.nn.inference_mode``); a linen module cannot be switched, so one that
needs a ``"dropout"`` random stream is refused (a random mask per example would
need its own privacy analysis).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.models._model import Model, count_params, wrap_forward
from dpmp.precision._casting import cast_tree
from dpmp.precision._policy import Policy

__all__ = ["as_model", "model_signature"]

_BATCH_STATS = (
    "per-example clipping needs each example's gradient to depend on that example "
    "alone: use LayerNorm or GroupNorm instead of BatchNorm"
)


def as_model(
    obj: Any,
    input_shape: tuple[int, ...],
    num_classes: int,
    policy: Policy | str,
    *,
    loss: Callable | None = None,
    input_dtype: Any = jnp.float32,
) -> Model:
    """A ``Model`` of a flax linen or nnx module, an Equinox module, an ``(init,
    apply)`` pair or a ``Model`` (returned as it is; ``loss`` must then be None).

    ``input_dtype`` is what the inputs are: float32 features, or integer token
    ids (a linen module is initialised on them); a language model on token ids
    must give logits ``[B, T, V]`` with ``V`` at least the vocabulary
    ``num_classes``, and a linen ``nn.Embed`` applied to the token ids must
    have as many rows.

    Raises:
      TypeError: ``obj`` is none of these forms.
      ValueError: the model keeps batch statistics, or its logits (or its
        linen token embedding) are fewer than the vocabulary.
    """
    policy = Policy.parse(policy)
    input_shape = tuple(int(d) for d in input_shape)
    if isinstance(obj, Model):
        if loss is not None:
            raise ValueError("loss: a dpmp Model carries its own loss; pass loss=None")
        if jnp.issubdtype(input_dtype, jnp.integer):  # a loaded GPT-2, say
            _check_vocabulary(obj.init, obj.predict, input_shape, num_classes)
        return obj
    framework, init, forward, dropout = _form(obj, input_shape, jnp.dtype(input_dtype))

    def forward_in_compute(params, x):
        return forward(cast_tree(params, policy.compute), x)

    loss_fn, predict, metrics = wrap_forward(forward_in_compute, policy, loss)
    name = type(obj).__name__ if framework != "jax" else getattr(obj[1], "__name__", "apply")
    if jnp.issubdtype(input_dtype, jnp.integer):
        linen = forward if framework == "flax.linen" else None
        _check_vocabulary(init, predict, input_shape, num_classes, linen_forward=linen)
    return Model(
        kind="custom",
        framework=framework,
        name=f"{framework} {name}" + (" (dropout off)" if dropout else ""),
        init=init,
        loss_fn=loss_fn,
        predict=predict,
        metrics=metrics,
        description=(
            f"user model {name} ({framework}) on inputs {input_shape}, {num_classes} classes"
            + ("" if loss is None else f", loss {getattr(loss, '__name__', 'user')}")
            + dropout
        ),
    )


def _form(obj: Any, input_shape: tuple[int, ...], dtype) -> tuple[str, Callable, Callable, str]:
    """``(framework, init(key) -> params, forward(params, x) -> outputs, dropout)`` for
    inputs of ``dtype``; ``dropout`` is ``", dropout off (...)"`` naming the dropout
    layers, or ``""``."""
    import equinox as eqx
    import flax.linen as nn
    from flax import nnx

    if isinstance(obj, nn.Module):
        init, forward = _linen(obj, input_shape, dtype)
        return "flax.linen", init, forward, _linen_dropout(init, forward, input_shape, dtype)
    if isinstance(obj, nnx.Module):
        obj, dropout = _nnx_without_dropout(obj)
        return ("flax.nnx", *_nnx(obj), dropout)
    if isinstance(obj, eqx.Module):
        obj, dropout = _eqx_without_dropout(obj)
        return ("equinox", *_eqx(obj), dropout)
    if isinstance(obj, tuple | list) and len(obj) == 2 and all(map(callable, obj)):
        return "jax", obj[0], obj[1], ""
    raise TypeError(
        f"model: expected a flax linen or nnx module, an Equinox module or an (init, apply) "
        f"pair of functions, got {type(obj).__name__}"
    )


def _linen(module, input_shape, dtype):
    example = jnp.zeros((1, *input_shape), dtype)
    collections = set(jax.eval_shape(module.init, jax.random.key(0), example))
    if collections - {"params"}:
        raise ValueError(
            f"model: the linen module keeps the collections {sorted(collections - {'params'})} "
            f"besides 'params'; {_BATCH_STATS}"
        )

    def init(key):
        return module.init(key, example)["params"]

    def forward(params, x):
        return module.apply({"params": params}, x)

    return init, forward


def _linen_dropout(init, forward, input_shape, dtype) -> str:
    """``", dropout off (...)"`` naming the module's dropout layers, or ``""``.

    Raises:
      ValueError: a dropout layer asks for a ``"dropout"`` random stream.
    """
    import flax.errors
    import flax.linen as nn

    found: list[str] = []

    def spy(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Dropout) and context.method_name == "__call__":
            found.append(str(context.module.name))
        return next_fun(*args, **kwargs)

    params = jax.eval_shape(init, jax.random.key(0))
    example = jax.ShapeDtypeStruct((1, *input_shape), dtype)
    try:
        with nn.intercept_methods(spy):
            jax.eval_shape(forward, params, example)
    except flax.errors.InvalidRngError as e:
        raise ValueError(
            f"model: {', '.join(found) or 'a dropout layer'} asks for a 'dropout' random "
            "stream; dpmp calls models with none (a random mask per example would need its "
            "own privacy analysis): make it deterministic or remove it"
        ) from e
    return _dropout_off(found)


def _dropout_off(names: list[str]) -> str:
    if not names:
        return ""
    return f", dropout off ({', '.join(sorted(set(names)))}: no dropout randomness is passed)"


def _nnx_without_dropout(module):
    """A copy of ``module`` with every ``nnx.Dropout`` deterministic, and the words."""
    from flax import nnx

    module = nnx.clone(module)
    found = []
    for path, sub in nnx.iter_modules(module):
        if isinstance(sub, nnx.Dropout):
            sub.deterministic = True
            found.append(".".join(map(str, path)) or type(sub).__name__)
    return module, _dropout_off(found)


def _eqx_without_dropout(module):
    """``module`` in inference mode if it holds an ``eqx.nn.Dropout``, and the words."""
    import equinox as eqx

    def is_dropout(x):
        return isinstance(x, eqx.nn.Dropout)

    leaves = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_dropout)[0]
    found = [jax.tree_util.keystr(path).lstrip(".") for path, x in leaves if is_dropout(x)]
    if found:
        module = eqx.nn.inference_mode(module, True)
    return module, _dropout_off(found)


def _check_vocabulary(init, predict, input_shape, vocab: int, *, linen_forward=None) -> None:
    """A language model on token ids gives logits ``[1, T, V]`` with ``V >= vocab``, and
    (linen) every ``nn.Embed`` that reads the token ids themselves has ``vocab`` rows."""
    params = jax.eval_shape(init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, *input_shape), jnp.int32)
    shape = tuple(jax.eval_shape(predict, params, tokens).shape)
    if len(shape) != 3 or shape[:2] != (1, *input_shape):
        raise ValueError(
            f"model: on token ids [B, {', '.join(map(str, input_shape))}] it must give logits "
            f"[B, T, vocab], got shape {shape} for B = 1"
        )
    if shape[2] < int(vocab):
        raise ValueError(
            f"model: gives {shape[2]} logits per token, fewer than the data's vocabulary of "
            f"{int(vocab)} token ids (the tokenizer's is larger than the model's embedding)"
        )
    if linen_forward is not None:
        for name, rows in _linen_token_embeddings(linen_forward, params, input_shape):
            if rows < int(vocab):
                raise ValueError(
                    f"model: its embedding {name} has {rows} rows, fewer than the data's "
                    f"vocabulary of {int(vocab)} token ids (the tokenizer's is larger than "
                    "the model's embedding)"
                )


def _linen_token_embeddings(forward, params, input_shape) -> list[tuple[str, int]]:
    """``(name, rows)`` of each linen ``nn.Embed`` called on the model's input itself."""
    import flax.linen as nn

    found: list[tuple[str, int]] = []

    def run(p, tokens):
        def spy(next_fun, args, kwargs, context):
            module = context.module
            if isinstance(module, nn.Embed) and context.method_name == "__call__":
                if args and args[0] is tokens:  # not positions or other derived ids
                    found.append((str(module.name), int(module.num_embeddings)))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(spy):
            return forward(p, tokens)

    jax.eval_shape(run, params, jax.ShapeDtypeStruct((1, *input_shape), jnp.int32))
    return found


def _nnx(module):
    from flax import nnx

    if nnx.state(module, nnx.BatchStat):
        raise ValueError(f"model: the nnx module keeps nnx.BatchStat variables; {_BATCH_STATS}")
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def init(key):
        del key  # an nnx module arrives initialised
        return params

    def forward(p, x):
        return nnx.merge(graphdef, p, rest)(x)

    return init, forward


def _eqx(module):
    import equinox as eqx

    params, static = eqx.partition(module, eqx.is_inexact_array)
    if any(map(_is_norm, jax.tree.leaves(module, is_leaf=_is_norm))):
        raise ValueError(f"model: the Equinox module holds a BatchNorm; {_BATCH_STATS}")

    def init(key):
        del key  # an Equinox module arrives initialised
        return params

    def forward(p, x):
        return jax.vmap(eqx.combine(p, static))(x)  # Equinox models take one example

    return init, forward


def _is_norm(x) -> bool:
    return type(x).__name__ == "BatchNorm"


def model_signature(params: Any) -> str:
    """sha256 (hex) of the parameters' paths, shapes and dtypes (not their values)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype};".encode())
    h.update(str(count_params(params)).encode())
    return h.hexdigest()
