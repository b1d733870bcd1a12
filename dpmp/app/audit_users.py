"""Canary users for the run audit of a user-level config (``privacy.unit = "user"``).

A user-level guarantee protects all of one user's records together, so its
audit inserts whole users: canary user ``i`` is ``k = privacy.user_records``
copies of one canary record (a random +-1 input with a random label,
``dpmp.app.audit_run.make_canaries``), all in or all out by one secret coin.
Identical records push the model the same way: the user the clip must hold
(its summed gradient is k times a record's before clipping). The canary
users join the base data's users as users of their own; a user that is out
is zeroed out whole (every slot of its records made padding), the
zero-out-of-a-user neighbours the accountant covers:

* ``privacy.user_sampling = "users"`` (ULS): users are Poisson-sampled, the
  claim is the Poisson-subsampled Gaussian over users, as at record level;
* ``"records"`` (ELS): the k records of a canary user are sampled on their
  own and clipped on their own, so a user in moves a step by up to ``k C``:
  the claim is the binomial mixture of k records (``records_per_unit``), and
  the audit shows what a record-level claim would miss.

The score of a canary user is that of its one record (loss at the initial
minus the final parameters).
"""

from __future__ import annotations

import numpy as np

from dpmp.data._dataset import Dataset
from dpmp.data._user_sampling import UserBatch

__all__ = ["record_out", "with_canary_users", "zero_out_users"]


def with_canary_users(base: Dataset, x: np.ndarray, y: np.ndarray, k: int) -> Dataset:
    """``base`` (with its users) and ``len(y)`` canary users of ``k`` copies of one
    canary record each, appended to the training split: canary user ``i`` holds
    the records ``n + i k .. n + i k + k - 1``."""
    m = len(y)
    x_train = np.concatenate([np.asarray(base.x_train, np.float32), np.repeat(x, k, axis=0)])
    y_train = np.concatenate([base.y_train, np.repeat(y, k)])
    users = np.concatenate(
        [np.asarray(base.users_train, np.int64), base.num_users + np.repeat(np.arange(m), k)]
    )
    return Dataset.from_arrays(
        (x_train, y_train),
        (base.x_test, base.y_test),
        description=f"{base.description}; + {m} canary users of {k} records",
        users=users,
    )


def record_out(num_train: int, member: np.ndarray, k: int) -> np.ndarray:
    """bool ``[num_train + m k]``: True at the records of the canary users that are out."""
    out = np.zeros(num_train + len(member) * k, bool)
    out[num_train:] = np.repeat(~member, k)
    return out


def zero_out_users(sampled, out: np.ndarray):
    """A step's batch with the records of users that are out (``out[record]``) made
    padding: a record batch slot by slot, a user batch user by user (a row whose
    records are out becomes a padding user with no records)."""
    if not isinstance(sampled, UserBatch):
        pad = np.asarray(sampled.is_padding_example, bool)
        idx = np.where(pad, 0, np.asarray(sampled.indices))
        return sampled._replace(is_padding_example=pad | out[idx])
    records = np.asarray(sampled.is_padding_record, bool)
    idx = np.where(records, 0, np.asarray(sampled.indices))
    row_out = (out[idx] & ~records).any(axis=1)  # a user's records are all in or all out
    return sampled._replace(
        is_padding_example=np.asarray(sampled.is_padding_example, bool) | row_out,
        is_padding_record=records | row_out[:, None],
    )
