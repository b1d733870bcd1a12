"""A private trainer that reports epsilon next to overflow statistics.

Its modules follow a run's stages:

* ``pretrain`` -- optional non-private pre-training on public text (no
  epsilon), whose parameters the private run fine-tunes or adapts (LoRA);
* ``plan``     -- the secret keys, the noise multiplier and the budget;
* ``batches``  -- Poisson sampling and reading a batch (arrays in memory,
  memory-mapped ``.npy`` files, random-access sources), physical chunks;
* ``mesh``     -- the run's devices (``training.devices``) and the glue of
  several processes;
* ``step``     -- the private step of the config (``dpmp.step.private_step``
  built from the config's objects) and its precision and privacy audits;
* ``evaluate`` -- held-out (public) and training (private) loss and accuracy;
* ``resume``   -- which checkpoint a run may continue;
* ``actions``  -- what runs between steps: the budget stop, evaluation, logs,
  progress, checkpoints; ``writers`` -- where public and private numbers go;
* ``interrupts`` -- Ctrl-C and SIGTERM: the step in progress ends, a
  checkpoint is saved, one line says how to resume;
* ``loop``     -- ``train``: step, account, the actions, report.

Secret randomness (``plan.run_keys``): the gradient-noise key, the
overflow-count key, the Poisson sampler's seed and the standardisation
noise's seed come from ``os.urandom``; ``training.seed`` drives only the
initialisation and the train/test split. ``privacy.reproducible_noise = true``
derives them from the seed instead, and the run then says it is NOT
differentially private.
"""

from dpmp.app.trainer.loop import train
from dpmp.app.trainer.plan import RunKeys, run_keys
from dpmp.app.trainer.step import (
    AUDIT_EXPECT,
    PrivateStep,
    audit_step,
    build_private_step,
    privacy_audit_step,
)

__all__ = [
    "AUDIT_EXPECT",
    "PrivateStep",
    "RunKeys",
    "audit_step",
    "build_private_step",
    "privacy_audit_step",
    "run_keys",
    "train",
]
