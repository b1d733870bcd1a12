"""The private step, built from objects: a clipped-sum function, an optimizer,
the noise, and optionally a data-parallel mesh and physical chunks. It knows no
run and no config file; the loop is the caller's (``PrivateStepFn`` shows one).
"""

from dpmp.step._mesh import DataParallelMesh as DataParallelMesh
from dpmp.step._step import Chunked as Chunked
from dpmp.step._step import PrivateStepFn as PrivateStepFn
from dpmp.step._step import StepState as StepState
from dpmp.step._step import WithFrozen as WithFrozen
from dpmp.step._step import physical_chunks as physical_chunks
from dpmp.step._step import private_step as private_step

__all__ = [
    "Chunked",
    "DataParallelMesh",
    "PrivateStepFn",
    "StepState",
    "WithFrozen",
    "physical_chunks",
    "private_step",
]
