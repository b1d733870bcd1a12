"""Correlated-noise rules: the stages of a stream that correlates noise across steps.

A mechanism that correlates the noise of successive steps (banded matrix
factorization, ``dpmp.noise._banded_mf``) keeps vectors the size of the
parameters from one step to the next and combines them with the step's own:
the kept clipped sums, combined into the release query ``a_t = (C' X)_t``, and
the kept decoded outputs, combined with the release ``y_t`` into the decoding.
Each combination runs, one parameter leaf at a time, in a named jit the stream
declares (``dpmp.noise._banded_mf.STREAM_STAGES``); a call of it on a gradient
is two sites of the stage's kind:

* its ring buffer (the call's second input), checked against the policy's
  ``accumulate`` (kept sums) or ``noise`` (kept outputs) dtype: a half-precision
  buffer rounds every kept vector;
* its result, checked against float64 for the release query (the rounding
  bound in the noise's sensitivity factor is float64's) and against ``noise``
  for the decoding (post-processing: its precision is the decoding's accuracy).

The recognition is by the jit's name, as a sampler's draw is
(``dpmp.audit.rules._noise.sampler_call``); a mechanism with stages of its own
adds them to the stream's declaration.
"""

from __future__ import annotations

import functools

import numpy as np

from dpmp.audit._values import GRAD, dtype_of
from dpmp.audit.rules._registry import Step


@functools.lru_cache(maxsize=1)
def _stages() -> dict:
    """jit name -> ``StreamStage`` of every declared correlated-stream stage."""
    from dpmp.noise._banded_mf import STREAM_STAGES

    return {stage.jit_name: stage for stage in STREAM_STAGES}


def _required(s: Step, role: str):
    """A policy role's dtype (``"accumulate"``, ``"noise"``), or a dtype by name."""
    return getattr(s.policy, role) if role in ("accumulate", "noise") else np.dtype(role)


def stream_stage_call(s: Step) -> None:
    """Records the sites of a correlated stream's stage when the call equation of
    ``s`` is one, applied to a gradient (its ring buffer, its result)."""
    stage = _stages().get(s.eqn.params.get("name"))
    if stage is None or len(s.eqn.invars) < 2 or not s.ins[0].has(GRAD):
        return
    site = functools.partial(s.walker.record, primitive=stage.jit_name, location=s.site)
    site(
        (stage.kind, s.loc, "ring"),
        stage.kind,
        in_dtype=dtype_of(s.eqn.invars[1]),
        acc_dtype=None,
        out_dtype=None,
        required=_required(s, stage.ring_role),
        message=stage.ring,
    )
    site(  # the vector's own dtype is its own site's (the clipped sum, the release)
        (stage.kind, s.loc, "result"),
        stage.kind,
        in_dtype=None,
        acc_dtype=None,
        out_dtype=s.out_dtype,
        required=_required(s, stage.result_dtype),
        message=f"{stage.result}, from {stage.vector}",
    )
