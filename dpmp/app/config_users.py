"""Checks of the config's user-level keys: ``privacy.unit``, ``privacy.user_records``
and ``data.user_field``.

``check_unit`` is called by ``PrivacyConfig`` and ``check_user_field`` by
``DataConfig`` when a config is made. Whether the data carries users is known
only once it is read: ``privacy.unit = "user"`` on data without users is
refused when the step is built (``dpmp.app.trainer.step``), before anything
is trained.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNITS", "check_unit", "check_user_field"]

# privacy.unit: what the guarantee protects.
UNITS = ("record", "user")
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
    if privacy.unit != "user":
        return
    if privacy.sampling != "poisson":
        raise error(
            f'privacy.sampling: {privacy.sampling!r} with privacy.unit = "user": users are '
            'Poisson-sampled; use "poisson"'
        )


def check_user_field(field: Any, error: type[Exception]) -> None:
    """``data.user_field`` is unset or a non-empty string."""
    if field is not None and not (isinstance(field, str) and field):
        raise error(f"data.user_field: must be a field name (a string), got {field!r}")
