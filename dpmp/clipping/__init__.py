"""Per-example clipped gradients in half precision: ``private_grad`` (vmap and
ghost paths, float64 sums of known sensitivity) and the private dynamic loss scale.

``_private_grad`` builds the function from a ``_setup.Setup``; ``_chooser`` picks
per-example gradients (``_vmap``) or ghost clipping (the ``ghost`` package, one
rule per layer family, extended with ``ghost.register_rule``) per argument
shapes; ``_grad_fn`` bounds the sum's sensitivity; ``_rounding`` and
``_weighted`` hold the certified reductions both paths share; ``_replay``
re-emits a traced per-example function under ``vmap``.
"""

from dpmp.clipping._private_grad import PrivateGrad as PrivateGrad
from dpmp.clipping._private_grad import PrivateGradFn as PrivateGradFn
from dpmp.clipping._private_grad import PrivateGradStats as PrivateGradStats
from dpmp.clipping._private_grad import private_grad as private_grad
from dpmp.clipping._private_loss_scale import PrivateDynamicLossScale as PrivateDynamicLossScale

__all__ = [
    "PrivateGrad",
    "PrivateGradFn",
    "PrivateGradStats",
    "private_grad",
    "PrivateDynamicLossScale",
]
