"""The names a private step's stages carry in compiled programs and profiles.

Each stage runs under ``jax.named_scope(STAGES[stage])``, so its operations'
``op_name`` metadata (HLO text, ``jax.profiler`` traces, TensorBoard, Perfetto)
says which part of the step they belong to: a profile of ``dpmp.private_step``
reads as forward and backward passes, clipping norms, clipped sum, noise and
optimizer (``benchmarks/step_profile.py`` adds the time of each). The scopes
change names only, never the computation.
"""

from __future__ import annotations

__all__ = ["STAGES", "stage_of"]

STAGES = {
    "forward_backward": "dpmp_forward_backward",  # the loss's passes that clipping reads
    "norms": "dpmp_clip_norms",  # per-example norms and clip factors
    "clipped_sum": "dpmp_clipped_sum",  # the clip-weighted sum over examples, rounded
    "optimizer": "dpmp_optimizer",  # noise, 1/B, the optimizer, the parameters updated
    "noise": "dpmp_noise",  # the noise's draw and addition (inside the optimizer)
}
_BY_SCOPE = {scope: stage for stage, scope in STAGES.items()}


def stage_of(op_name: str) -> str | None:
    """The stage of an ``op_name`` (its innermost stage scope), or None outside all."""
    found = None
    for part in op_name.split("/"):
        found = _BY_SCOPE.get(part, found)
    return found
