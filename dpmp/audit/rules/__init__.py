"""Rules of the precision audit, one module per primitive family.

The walker (``dpmp.audit._jaxpr``) looks each equation's primitive up in
``RULES``; ``dpmp.audit.rules._registry`` says what the stages of a
``Rule`` do and in which order they run. Each family module registers
its rules when imported:

================ ============================================================
module           primitives
================ ============================================================
_layout          transpose, broadcast_in_dim, reshape, squeeze, expand_dims
_reductions      reduce_*, argmax/argmin, cumulative sums and products
_contractions    dot_general, conv_general_dilated
_norms           squares, sums of squares, square roots, the clip
_noise           random bits, Gaussian draws (and dpmp's sampler calls)
_correlated      a correlated stream's stages (calls): ring buffers, combinations
_adds            add, add_any, sub: noise addition, parameter update
_casts           convert_element_type of protected values
_collectives     psum and the other cross-device sums
_control_flow    scan, while, cond
================ ============================================================

A new rule is a new module here that calls ``register``, and its import
line below.
"""

from dpmp.audit.rules import _adds as _adds
from dpmp.audit.rules import _casts as _casts
from dpmp.audit.rules import _collectives as _collectives
from dpmp.audit.rules import _contractions as _contractions
from dpmp.audit.rules import _control_flow as _control_flow
from dpmp.audit.rules import _correlated as _correlated
from dpmp.audit.rules import _layout as _layout
from dpmp.audit.rules import _noise as _noise
from dpmp.audit.rules import _norms as _norms
from dpmp.audit.rules import _reductions as _reductions
from dpmp.audit.rules._registry import RULES as RULES
from dpmp.audit.rules._registry import Rule as Rule
from dpmp.audit.rules._registry import Step as Step
from dpmp.audit.rules._registry import register as register
from dpmp.audit.rules._registry import rule_for as rule_for

__all__ = ["RULES", "Rule", "Step", "register", "rule_for"]
