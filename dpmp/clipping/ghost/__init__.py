"""Per-example clipping without per-example gradients ("ghost" clipping).

For a layer ``y = x W`` the gradient of one example's loss with respect to
``W`` is ``x_i^T g_i``, where ``g_i = dL_i/dy_i`` is the layer's output
gradient. Its norm needs neither ``x_i^T g_i`` nor any other per-example
gradient (Goodfellow 2015, "Efficient per-example gradient computations";
Li et al. 2022, "Large language models can be strong differentially private
learners"):

* flat input (one token):  ``||x_i^T g_i||^2 = ||x_i||^2 ||g_i||^2``;
* T tokens:                ``||X_i^T G_i||_F^2 = <X_i X_i^T, G_i G_i^T>`` (two
  T x T Gram matrices);
* embedding rows:          ``sum_{t,s} [id_t = id_s] <g_t, g_s>``;
* convolutions: the same Gram form on image patches.

Per layer, whichever is smaller is used (Bu et al. 2022, "Scalable and
efficient training of large convolutional neural networks with differential
privacy", mixed ghost clipping): the ghost norm above, which keeps ``x_i`` and
``g_i`` (``T (K + N)`` numbers per example), or the layer's own per-example
gradient (``K N`` numbers), which is formed inside the backward pass where the
non-private step forms the batch gradient, so that this layer's ``x_i`` and
``g_i`` are never kept. Biases, norm scales and most convolution kernels take
the second route; wide dense layers and embeddings the first.

The package, bottom to top:

* ``_rule``: the extension point, one ``GhostRule`` per layer family,
  registered by primitive name (``register_rule``);
* ``_gram``: certified ghost norms (the Gram form with a bound on its
  rounding, the floor against cancellation);
* the families: ``_dense`` (``dot_general``: dense layers, attention, einsum),
  ``_conv`` (``conv_general_dilated``), ``_embedding`` (``gather``),
  ``_elementwise`` (``add``/``sub``: biases, ``mul``: norm scales);
* ``_window``: a parameter used through a static slice (GPT-2's ``wpe[:T]``):
  the layer's rule sees the slice as the parameter, its sum is padded back;
* ``_tied``: a table tied between an embedding and an output projection
  (GPT-2's ``wte``): both layers' norms and their cross term, certified;
* ``_plan``: the walker that finds each parameter's layer (``plan_ghost``);
* ``_layers``: the per-example forward pass with its layers tapped;
* ``_clipped_sum``: the driver, ``ghost_clipped_sum``.

Precision. The forward pass and the output gradients stay in the compute
dtype; the activations and output gradients are cast to the clip dtype and
the loss scale is divided out (in float32) BEFORE any norm; Gram matrices,
norms and clip factors are computed in the clip dtype, the layers' squared
norms added up in ``norm_dtype`` and the clip-weighted contractions
accumulated in ``sum_dtype`` (both float64 by default, see
``dpmp.private_grad``'s ``accumulation``), with ``Precision.HIGHEST`` (no TF32
on GPUs). A float64 contraction of float32 values is within
``gamma_(B T) sum_i c_i sum_t |x_t| |g_t|`` of the exact sum, whatever order it
adds in; ``GhostPlan.sum_rounding`` gives the ``T`` and the factor by which
``sum_t |x_t| |g_t|`` may exceed the norm that clipped it, from which
``PrivateGradFn.sensitivity`` bounds the rounding of the whole sum.

Certified norms. A per-example gradient that is formed (the vmap path, and
every ``per-example`` layer here) is normed and summed from one tensor, and
its sum of squares made an upper bound of the exact one
(``dpmp.clipping._rounding.certified_sum_of_squares``), so its clipped
contribution is bounded by construction. A ghost norm is a formula instead,
which can cancel over several tokens: each rule returns its value plus a
bound on its rounding error, and the clip factor reads it with a floor
against cancellation (``dpmp.clipping.ghost._gram``). The stats' norms are
these certified upper bounds.
"""

from dpmp.clipping.ghost._clipped_sum import ghost_clipped_sum as ghost_clipped_sum
from dpmp.clipping.ghost._conv import ConvRule
from dpmp.clipping.ghost._dense import DenseRule
from dpmp.clipping.ghost._elementwise import BIAS, SCALE
from dpmp.clipping.ghost._embedding import EmbeddingRule
from dpmp.clipping.ghost._plan import GhostPlan as GhostPlan
from dpmp.clipping.ghost._plan import plan_ghost as plan_ghost
from dpmp.clipping.ghost._rule import GhostRule as GhostRule
from dpmp.clipping.ghost._rule import PerExampleRule as PerExampleRule
from dpmp.clipping.ghost._rule import Unsupported as Unsupported
from dpmp.clipping.ghost._rule import register_rule as register_rule
from dpmp.clipping.ghost._rule import registered_rules as registered_rules

__all__ = [
    "GhostPlan",
    "GhostRule",
    "PerExampleRule",
    "Unsupported",
    "ghost_clipped_sum",
    "plan_ghost",
    "register_rule",
    "registered_rules",
]

# The built-in layer families, in the order the message naming them lists them.
register_rule(DenseRule())
register_rule(ConvRule())
register_rule(EmbeddingRule())
register_rule(BIAS)
register_rule(SCALE)
