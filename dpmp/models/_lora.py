"""Low-rank adapters (LoRA): train a few parameters, keep the model frozen.

``lora_model(model, base, rank=r, alpha=a)`` is a ``Model`` whose parameters
are the adapters alone; the frozen ``base`` parameters are held by the model
and never change. Every weight matrix of ``base`` (a leaf named ``kernel``,
flax's, or ``weight``, Equinox's, of two or more axes) is used as::

    W + alpha / r * (A @ B).reshape(W.shape)     A [fan_in, r], B [r, fan_out]

with ``A`` drawn from N(0, 1 / fan_in) and ``B`` zero, so the adapted model
starts as the base model (Hu et al. 2021, "LoRA", arXiv:2106.09685). Biases,
norms and position embeddings stay as they are. A kernel of more than two
axes is seen as the matrix of its axes split where the two sides are closest
in size (attention's ``[dim, heads, head_dim]`` query kernel as
``dim x dim``). ``targets`` (``model.lora_targets``) narrows the adapted
matrices to the modules named, as PEFT's ``target_modules``: a target
(``"q_proj"``, ``"self_attn.q_proj"``) names every weight whose module path
ends with it; an empty ``targets`` adapts every weight matrix.

Because the private step differentiates the adapters only, per-example
clipping, the noise, its sensitivity, the accounting and the audit cover
exactly the trainable leaves, and the frozen ones come out of training bit
for bit as they went in. The adapters are merged into the weights before the
forward pass (``merge``), one weight at a time, in float32 at full precision:
the model then computes in its own policy as it would without adapters.

The base is the model's ``frozen`` field (``dpmp.models._model.Model``):
``loss_fn(adapters, batch, base)`` takes it as an argument, so a compiled
step receives it as one, in the dtype it is stored in (a bfloat16 base stays
bfloat16 in memory), and its program does not grow with the base.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from dpmp.models._lora_apply import merged_weight, unmerged
from dpmp.models._model import Model, count_params

__all__ = ["adapted", "init_adapters", "lora_model", "merge", "names"]

# Names of the weight matrices that get adapters (flax, Equinox).
WEIGHT_NAMES = ("kernel", "weight")


def _name(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:  # pragma: no cover - every jax key type has one of the three
            parts.append(str(key))
    return "/".join(parts)


def _is_weight(path, leaf, targets: tuple[str, ...] = ()) -> bool:
    last = _name(path[-1:]) if path else ""
    if last not in WEIGHT_NAMES or getattr(leaf, "ndim", 0) < 2:
        return False
    return not targets or any(_names_module(_name(path[:-1]), t) for t in targets)


def _parts(name: str) -> list[str]:
    return [p for p in name.replace(".", "/").split("/") if p]


def _names_module(module: str, target: str) -> bool:
    """``target`` (parts joined by ``.`` or ``/``) is the end of the ``module`` path."""
    want, have = _parts(target), _parts(module)
    return bool(want) and have[len(have) - len(want) :] == want


def _check_targets(base: Any, targets: tuple[str, ...]) -> None:
    """A ``ValueError`` naming a target that names no weight matrix of ``base``."""
    modules = [
        _name(path[:-1])
        for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]
        if _is_weight(path, leaf)
    ]
    for target in targets:
        if not any(_names_module(m, target) for m in modules):
            known = sorted({_parts(m)[-1] for m in modules if _parts(m)})
            raise ValueError(
                f"model.lora_targets: {target!r} names no weight matrix of the model "
                f"(its modules end in: {', '.join(known)})"
            )


def _split(shape: tuple[int, ...]) -> int:
    """The axis where ``shape`` splits into the most nearly square matrix."""
    return min(
        range(1, len(shape)),
        key=lambda k: abs(math.log(math.prod(shape[:k]) / math.prod(shape[k:]))),
    )


def adapted(base: Any, targets: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the weight matrices of ``base`` that get adapters (those of
    the modules ``targets`` names, or all)."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(base)[0]:
        if _is_weight(path, leaf, targets):
            found[_name(path)] = tuple(leaf.shape)
    return found


def init_adapters(
    base: Any, rank: int, key: jax.Array, targets: tuple[str, ...] = ()
) -> dict[str, dict[str, jax.Array]]:
    """``{name: {"a": A, "b": B}}`` for every weight matrix of ``base`` (of the modules
    ``targets`` names, if any), in float32.

    Raises:
      ValueError: ``rank`` is not a positive integer, ``base`` has no weight matrix,
        or a target names none.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"model.lora_rank: must be an integer > 0, got {rank!r}")
    _check_targets(base, targets)
    shapes = adapted(base, targets)
    if not shapes:
        raise ValueError(
            "model.lora_rank: the model has no weight matrix to adapt (no leaf named "
            f"{' or '.join(WEIGHT_NAMES)} with two or more axes)"
        )
    out = {}
    keys = jax.random.split(key, len(shapes))
    for k, (name, shape) in zip(keys, sorted(shapes.items())):
        cut = _split(shape)
        fan_in, fan_out = math.prod(shape[:cut]), math.prod(shape[cut:])
        a = jax.random.normal(k, (fan_in, rank), jnp.float32) / math.sqrt(fan_in)
        out[name] = {"a": a, "b": jnp.zeros((rank, fan_out), jnp.float32)}
    return out


def names(base: Any, targets: tuple[str, ...] = ()) -> list[str | None]:
    """The adapter name of each leaf of ``base`` (None for a leaf without adapters)."""
    leaves = jax.tree_util.tree_flatten_with_path(base)[0]
    return [_name(path) if _is_weight(path, leaf, targets) else None for path, leaf in leaves]


def _check_names(base: Any, adapters: dict, targets: tuple[str, ...] = ()) -> None:
    """A ``ValueError`` when ``adapters`` does not match the weight matrices of ``base``
    (those ``targets`` names)."""
    expected = adapted(base, targets)
    if set(adapters) != set(expected):
        missing, extra = set(expected) - set(adapters), set(adapters) - set(expected)
        raise ValueError(
            f"adapters do not match the model's weight matrices: missing {sorted(missing)}, "
            f"unexpected {sorted(extra)}"
        )


def merge(
    base: Any,
    adapters: dict[str, dict[str, jax.Array]],
    alpha: float,
    *,
    wide: bool = False,
    targets: tuple[str, ...] = (),
) -> Any:
    """``base`` with ``W + alpha / r * A @ B`` for every adapted weight matrix ``W``.

    The sum is computed in float32 (or the weight's wider dtype) and rounded
    to the weight's own dtype, or with ``wide`` to at least float32 (so that a
    half-precision weight does not round away an update smaller than its
    spacing); the leaves without adapters are ``base``'s own.

    Raises:
      ValueError: ``adapters`` does not match the weight matrices of ``base`` (those
        ``targets`` names: the ``targets`` they were made with).
    """
    _check_names(base, adapters, targets)

    def one(path, w):
        name = _name(path)
        if name not in adapters:
            return w
        total = merged_weight(w, adapters[name], alpha)
        return total if wide else total.astype(w.dtype)

    return jax.tree_util.tree_map_with_path(one, base)


def lora_model(
    model: Model, base: Any, *, rank: int, alpha: float, targets: tuple[str, ...] = ()
) -> Model:
    """``model`` with ``base`` frozen and low-rank adapters as its only parameters.

    ``init(key)`` draws the adapters; ``loss_fn``, ``predict`` and ``metrics``
    take the adapters and, as their last argument, the frozen base (default:
    ``base``, the returned model's ``frozen``), and run ``model`` as on
    ``merge(base, adapters, alpha)``: a dense layer's adapters beside its weight,
    ``x W + s (x A) B`` in the layer's own dtypes, any other adapted weight
    merged in float32 (``dpmp.models._lora_apply``). ``base`` keeps its dtypes.
    ``targets``: the modules adapted (all weight matrices if empty).
    """
    base = jax.tree.map(jnp.asarray, base)
    targets = tuple(targets)
    # the shapes, and the errors before any work
    shapes = jax.eval_shape(
        lambda b, k: init_adapters(b, rank, k, targets), base, jax.random.key(0)
    )
    trainable = count_params(shapes)

    def init(key):
        return init_adapters(base, rank, key, targets)

    def adapter_names(tree):
        return names(tree, targets)

    def applied(fn):  # fn(base, x) -> fn(adapters, x, frozen=base)
        run = unmerged(fn, alpha, adapter_names)

        def adapted_fn(adapters, x, frozen=None):
            frozen = base if frozen is None else frozen
            _check_names(frozen, adapters, targets)
            return run(frozen, adapters, x)

        return adapted_fn

    return dataclasses.replace(
        model,
        name=f"{model.name} + LoRA rank {rank}",
        init=init,
        loss_fn=applied(model.loss_fn),
        predict=applied(model.predict),
        metrics=applied(model.metrics),
        description=(
            f"{model.description}; LoRA: rank {rank} adapters (alpha {alpha:g}) on its "
            f"{len(adapted(base, targets))} weight matrices train {trainable:,} parameters, its "
            f"{count_params(base):,} parameters are frozen"
        ),
        frozen=base,
    )
