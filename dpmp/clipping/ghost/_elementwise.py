"""Biases and norm scales: a parameter added to, or multiplied with, a layer's values.

Their per-example gradients are as small as the parameter (a bias of a dense
layer is N numbers against its T N output gradient), so no ghost norm is
kept: each is formed inside the backward pass and normed like any other
(``dpmp.clipping.ghost._rule.PerExampleRule``). Layer norm and RMS norm
scales and offsets take these rules.
"""

from __future__ import annotations

from dpmp.clipping.ghost._rule import PerExampleRule

__all__ = ["BIAS", "SCALE"]

BIAS = PerExampleRule(primitives=("add", "sub"), kind="bias", described="bias")
SCALE = PerExampleRule(primitives=("mul",), kind="scale", described="norm scale")
