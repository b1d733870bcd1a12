"""Checks of the config's user-level keys: ``privacy.unit``, ``privacy.user_records``,
``privacy.user_sampling`` and ``data.user_field``.

With ``privacy.unit = "user"`` the guarantee protects all of one user's records
(``data.user_field`` names whose each record is), in one of two ways (Charles
et al., SaTML 2025):

* ``user_sampling = "users"`` (ULS, default): users are Poisson-sampled
  (``training.expected_batch_size`` counts users), each sampled user gives at
  most ``user_records`` (k) of its records, chosen at random, and the clip
  bounds the norm of the sum of their gradients (ghost norms over the user's
  records, or vmap);
* ``user_sampling = "records"`` (ELS): each user keeps at most k records, chosen
  at random; the kept records are Poisson-sampled and clipped on their own
  (``training.expected_batch_size`` counts records), and the accountant
  composes one user's up to k sampled records (the binomial mixture of
  Gaussians, ``dpmp.accounting._groups``).

``check_unit`` is called by ``PrivacyConfig`` and ``check_user_field`` by
``DataConfig`` when a config is made. Whether the data carries users is known
only once it is read: ``privacy.unit = "user"`` on data without users is
refused when the step is built (``dpmp.app.trainer.step``), before anything
is trained.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNITS", "USER_SAMPLINGS", "check_unit", "check_user_field", "records_per_unit"]

# privacy.unit: what the guarantee protects.
UNITS = ("record", "user")
# privacy.user_sampling: users sampled whole (ULS), or their records on their own (ELS).
USER_SAMPLINGS = ("users", "records")
# privacy.user_records: larger is a typo (each user's block is that many rows).
MAX_USER_RECORDS = 65536


def check_unit(privacy: Any, error: type[Exception]) -> None:
    """``privacy.unit`` is a unit, ``privacy.user_records`` an integer in [1, 65536],
    and a user-level run does not shuffle (the user-level accounting is of Poisson
    sampling over users). Every ``privacy.clip_method`` works per user
    (``dpmp.clipping._users``: ghost norms over a user's records).

    Raises:
      error: the first key that is wrong, named, in one line.
    """
    if privacy.unit not in UNITS:
        raise error(f"privacy.unit: {privacy.unit!r} is not allowed; allowed: {', '.join(UNITS)}")
    k = privacy.user_records
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_USER_RECORDS:
        raise error(
            f"privacy.user_records: must be an integer in [1, {MAX_USER_RECORDS}] (the most "
            f"records one sampled user gives a step), got {k!r}"
        )
    if privacy.user_sampling not in USER_SAMPLINGS:
        raise error(
            f"privacy.user_sampling: {privacy.user_sampling!r} is not allowed; allowed: "
            f"{', '.join(USER_SAMPLINGS)}"
        )
    if privacy.unit != "user":
        return
    if privacy.user_sampling == "records":
        _check_records_sampling(privacy, error)
    if privacy.sampling != "poisson":
        raise error(
            f'privacy.sampling: {privacy.sampling!r} with privacy.unit = "user": users are '
            'Poisson-sampled; use "poisson"'
        )


def check_user_field(field: Any, error: type[Exception]) -> None:
    """``data.user_field`` is unset or a non-empty string."""
    if field is not None and not (isinstance(field, str) and field):
        raise error(f"data.user_field: must be a field name (a string), got {field!r}")


def _check_records_sampling(privacy: Any, error: type[Exception]) -> None:
    """Example-level sampling of users is accounted for DP-SGD steps on Poisson
    samples under add or remove (``dpmp.accounting._groups``)."""
    if getattr(privacy, "mechanism", "dpsgd") != "dpsgd":
        raise error(
            f'privacy.user_sampling: "records" is accounted for DP-SGD steps, not for '
            f'privacy.mechanism = {privacy.mechanism!r}; use user_sampling = "users"'
        )


def records_per_unit(privacy: Any) -> int:
    """The records of one user a step's Poisson sample may hold, each sampled on its
    own: ``user_records`` under example-level sampling of users, else 1."""
    if privacy.unit == "user" and privacy.user_sampling == "records":
        return privacy.user_records
    return 1
