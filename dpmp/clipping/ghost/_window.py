"""A parameter used through a static slice: its window, the view the layer sees, and
the gradient padded back.

GPT-2's learned positions ``wpe [n_positions, D]`` enter a sequence of ``T``
tokens as ``wpe[:T]``, a ``slice`` of the parameter. Each entry of a static slice
(``slice``, or ``dynamic_slice`` with literal start indices) is one entry of the
parameter, taken once, so one example's gradient of the parameter is that of the
slice (the "view") inside the window and exactly zero outside it: its norm is
the view's, and the clipped sum is the view's sum padded with zeros (the
transpose of the slice, which adds nothing and rounds nothing). The plan
therefore treats the view as the parameter: every rule norms and sums the view's
gradient as it would a parameter of that shape, with the same bounds, and
``from_view`` pads the sum back once per step.

The window is the chain of equations from the parameter leaf to its last
slice; every one of them must keep each entry at most once (layout operations
that are bijective, and slices), or the view's gradient would not be the
parameter's (a slice of a broadcast adds several views' entries into one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from dpmp.clipping._replay import replay_bind
from dpmp.clipping.ghost._rule import Unsupported

__all__ = ["from_view", "is_window", "split_window", "to_view", "view_shape"]


def is_window(eqn) -> bool:
    """Whether ``eqn`` takes a static window of its first operand: a ``slice``, or a
    ``dynamic_slice`` whose start indices are literals (known when traced)."""
    name = eqn.primitive.name
    if name == "slice":
        return True
    return name == "dynamic_slice" and all(isinstance(v, jax_core.Literal) for v in eqn.invars[1:])


def split_window(eqns, chain, injective, path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(window, rest)``: ``chain`` (equation indices from a parameter leaf to its
    layer) cut after its last static slice; ``window`` is empty where it has none.

    Raises ``Unsupported`` naming ``path`` where an equation of the window
    other than a slice is not in ``injective`` (the names of layout operations
    that keep every entry once).
    """
    cuts = [k for k, i in enumerate(chain) if is_window(eqns[i])]
    if not cuts:
        return (), tuple(chain)
    window = tuple(chain[: cuts[-1] + 1])
    for i in window:
        name = eqns[i].primitive.name
        if not is_window(eqns[i]) and name not in injective:
            raise Unsupported(f"parameter {path}: sliced after {name!r}, which repeats entries")
    return window, tuple(chain[cuts[-1] + 1 :])


def to_view(eqns, window, p):
    """The window's equations replayed on the leaf ``p``, casts skipped (``p``'s dtype
    stays): the value the rest of the chain and the layer see."""
    for i in window:
        e = eqns[i]
        if e.primitive.name != "convert_element_type":
            (p,) = replay_bind(e, [p, *(v.val for v in e.invars[1:])])
    return p


def view_shape(eqns, window, shape) -> tuple[int, ...]:
    """The shape of the view of a leaf of ``shape`` (``shape`` itself without a window)."""
    return tuple(eqns[window[-1]].outvars[0].aval.shape) if window else tuple(shape)


def from_view(eqns, window, shape, grad):
    """A gradient of the view laid out as the leaf of ``shape``: zero outside the
    window (the transpose of ``to_view``, exact)."""
    if not window:
        return grad
    _, pull = jax.vjp(lambda q: to_view(eqns, window, q), jnp.zeros(shape, grad.dtype))
    return pull(grad)[0]
