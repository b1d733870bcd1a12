"""A deterministic stand-in for ``os.urandom``, so that runs with secret keys can be
compared bit for bit: ``install(monkeypatch, seed)`` makes ``dpmp.noise._entropy``
read a stream seeded by ``seed`` (a different seed: different keys)."""

import numpy as np


class FakeEntropy:
    """``os.urandom``-like: ``n`` bytes at a time from one seeded stream."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng([0xD9, seed])
        self.calls = 0

    def __call__(self, n: int) -> bytes:
        self.calls += 1
        return self.rng.bytes(n)


def install(monkeypatch, seed: int) -> FakeEntropy:
    from dpmp.noise import _entropy as entropy

    fake = FakeEntropy(seed)
    monkeypatch.setattr(entropy, "_urandom", fake)
    return fake
