"""``scatter_cnn``: Tramer and Boneh's CNN on ScatterNet features (tanh).

"Differentially Private Learning Needs Better Features (or Much More Data)",
ICLR 2021, repository ``ftramer/Handcrafted-DP``, ``models.py``,
``MNIST_CNN`` with 81 input channels and ``input_norm="GroupNorm"``: ::

    GroupNorm, 27 groups, no scale or bias      7x7x81 -> 7x7x81   (each example alone)
    conv 16 filters 3x3, stride 2, padding 1           -> 4x4x16    tanh
    conv 32 filters 3x3, stride 1, padding 1           -> 4x4x32    tanh
    dense 32                                      512  -> 32        tanh
    dense 10                                           -> 10

33,066 parameters for the 7 x 7 x 81 scattering features of 28 x 28 grey
images (``data.features = "scattering"``): (3*3*81 + 1) * 16 + (3*3*16 + 1) * 32
+ (512 + 1) * 32 + (32 + 1) * 10. Flax linen, NHWC, the forward pass in
``policy.compute``, float32 parameters initialised as PyTorch does.
"""

from __future__ import annotations

from dpmp.models._model import Model
from dpmp.models.families._base import Architecture, register_family
from dpmp.models.families._cnn import linen_model, tanh_cnn
from dpmp.models.families._scatter_linear import GROUPS, group_norm
from dpmp.precision._policy import Policy

__all__ = ["ON_FEATURES", "ScatterCNNFamily"]

ON_FEATURES = ((16, 3, 2, 1), (32, 3, 1, 1))


class ScatterCNNFamily:
    name = "scatter_cnn"
    task = "classify"
    sizes = ()
    checkpoint = None

    def build(
        self,
        architecture: Architecture,
        input_shape: tuple[int, ...],
        num_classes: int,
        policy: Policy,
    ) -> Model:
        norm = group_norm(input_shape, self.name, policy.compute)
        module = tanh_cnn(ON_FEATURES, 32, num_classes, policy.compute, norm=norm)
        return linen_model(
            module,
            self.name,
            "ScatterNet + CNN",
            input_shape,
            policy,
            f"flax linen GroupNorm ({GROUPS} groups) + CNN (conv 16 3x3/2, conv 32 3x3/1, "
            "dense 32, tanh) on scattering features (Tramer & Boneh, ICLR 2021)",
        )


register_family(ScatterCNNFamily())
