"""Per-example clipped gradients in half precision: ``private_grad`` (vmap and
ghost paths, float64 sums of known sensitivity) and the private dynamic loss scale.
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
