"""Reading a flat jaxpr: where each of its values is used."""

from __future__ import annotations

from typing import Any

from jax.extend import core as jax_core

__all__ = ["uses"]


def uses(jaxpr) -> tuple[dict[Any, list[tuple[int, int]]], set[Any]]:
    """``(readers, outs)``: for each variable of ``jaxpr`` (a ``Jaxpr``), the
    ``(equation index, operand position)`` of every equation that reads it, in
    equation order; and the variables the jaxpr returns. Literals are in neither."""
    readers: dict[Any, list[tuple[int, int]]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for pos, v in enumerate(eqn.invars):
            if not isinstance(v, jax_core.Literal):
                readers.setdefault(v, []).append((i, pos))
    outs = {v for v in jaxpr.outvars if not isinstance(v, jax_core.Literal)}
    return readers, outs
